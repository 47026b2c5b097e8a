"""`chunked`: a function run on slices of its inputs, each slice a forgotten region.

NOTE [chunked regions]: a region's re-run in backward holds all of its
intermediates at once, so a function whose intermediates dwarf its inputs (a
language model's head, whose logits are tokens x vocabulary beside hidden states
of tokens x width) costs, under `forget`, its whole intermediate size once more
in backward. Split along a dimension its work does not mix (tokens, for a head
and its loss or for a token-wise MLP), it becomes several regions, and backward
re-runs one at a time: autograd takes the ready node of the highest sequence
number first, so the last slice's graph is done, and its rebuilt tensors freed,
before an earlier slice's region re-runs. Each slice is a region of the engine
(RNG replayed, module state once, nesting, double backward), so nothing here
differs from `forget` but the cut. The slices are views of the inputs: no copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ._forget import _as_input, _check_output, run_region
from ._slots import ordinal

__all__ = ["chunked"]


def chunked(func: Callable[..., Any], *xs: Any, chunks: int, dim: int = 0) -> Any:
    """Call ``func`` on ``chunks`` slices of its tensor inputs, each slice forgotten.

    Every tensor in ``xs`` is split along ``dim`` into ``chunks`` slices of nearly
    equal size (as `torch.tensor_split` splits); the other arguments, and
    ``func``'s closure and parameters, go to every slice whole. Each slice runs
    as a region of `forget.forget`, and backward re-runs one slice at a time, so
    at most one slice's intermediates are alive at once: the peak of a function
    whose intermediates dwarf its inputs (a head's logits) falls by about
    ``chunks``, for the same one extra forward that `forget.forget` costs.
    ``chunks=1`` is `forget.forget`, bit for bit.

    Args:
        func: a callable returning a Tensor or a tuple of Tensors, whose work
            does not mix positions along ``dim`` (a token-wise head and its
            summed loss, a token-wise MLP).
        *xs: its positional inputs; every tensor among them is split, and all
            must agree in size along ``dim`` (pass a tensor that must stay
            whole, a teacher's weight say, through ``func``'s closure).
        chunks: the number of slices, a whole number of at least 1; more than
            the size along ``dim`` gives one slice per position.
        dim: the dimension split, of the inputs and of the outputs.

    Returns:
        What ``func`` returns, joined over the slices: a tensor of one or more
        dimensions concatenated along ``dim``, a 0-dim tensor (a loss) summed, a
        tuple element by element. A summed loss is the sum of the slices'
        losses: a mean must divide by the whole count itself (docs/head.md).

    Raises:
        TypeError: ``func`` is not callable, an input is an integer numpy
            array, or ``func`` returns something other than a Tensor or tuple
            of Tensors, or slices return different structures.
        ValueError: ``chunks`` is not a whole number of at least 1, no input is
            a tensor, or the tensors disagree in size along ``dim``.

    Example:
        >>> import torch, forget
        >>> head = torch.nn.Linear(8, 100)
        >>> h = torch.randn(64, 8, requires_grad=True)
        >>> labels = torch.randint(0, 100, (64,))
        >>> loss_of = lambda h, y: torch.nn.functional.cross_entropy(head(h), y, reduction="sum")
        >>> loss = forget.chunked(loss_of, h, labels, chunks=4) / labels.numel()
        >>> loss.backward()  # each quarter's logits rebuilt, used and freed in turn
        >>> plain = torch.nn.functional.cross_entropy(head(h), labels)
        >>> torch.allclose(loss, plain)
        True
    """
    if not callable(func):
        raise TypeError(
            f"forget: func must be callable, but got {type(func).__name__}; pass the "
            "function itself, e.g. forget.chunked(head_and_loss, hidden, labels, chunks=8)."
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(
            f"forget: chunks must be a whole number of at least 1 (1 runs func as one "
            f"forgotten region, as forget.forget does), got {chunks!r}."
        )
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"forget: dim must be an int, got {type(dim).__name__}.")
    inputs = tuple(_as_input(x, i + 1) for i, x in enumerate(xs))
    size = _common_size(inputs, dim)
    if chunks == 1:
        out = run_region(func, inputs, {})
        _check_output(out)
        return out
    parts = min(chunks, max(size, 1))
    split = [x.tensor_split(parts, dim) if isinstance(x, torch.Tensor) else None for x in inputs]
    outs = []
    for j in range(parts):
        args = tuple(x if s is None else s[j] for x, s in zip(inputs, split, strict=True))
        out = run_region(func, args, {})
        _check_output(out)
        outs.append(out)
    return _joined(outs, dim)


def _common_size(inputs: tuple[Any, ...], dim: int) -> int:
    """The size every tensor input has along ``dim``; a `ValueError` naming them where not."""
    sizes: list[tuple[int, int]] = []
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            continue
        if x.dim() == 0 or not -x.dim() <= dim < x.dim():
            raise ValueError(
                f"forget: the {ordinal(i + 1)} input has {x.dim()} dimension(s) and cannot be "
                f"split along dim {dim}; every tensor in xs is split, so pass one that must "
                "stay whole through func's closure instead."
            )
        sizes.append((i, x.shape[dim]))
    if not sizes:
        raise ValueError(
            "forget: chunked splits its tensor inputs, and none of xs is a tensor; pass the "
            "tensors to split (hidden states, labels) as arguments, not through the closure."
        )
    if len({n for _, n in sizes}) > 1:
        named = ", ".join(f"{n} ({ordinal(i + 1)} input)" for i, n in sizes)
        raise ValueError(
            f"forget: every tensor in xs is split along dim {dim} into the same slices, so "
            f"they must agree in size there, but got {named}. Pass a tensor that must stay "
            "whole through func's closure."
        )
    return sizes[0][1]


def _joined(outs: list[Any], dim: int) -> Any:
    """The slices' outputs as one: tuples element by element, 0-dim summed, others concatenated."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TypeError(
                "forget: func returned a Tensor for the 1st slice but a tuple for another; "
                "every slice must return the same structure."
            )
        return _joined_tensors(outs, dim, "output")
    width = len(first)
    if not all(isinstance(o, tuple) and len(o) == width for o in outs):
        raise TypeError(
            f"forget: func returned a tuple of {width} for the 1st slice and something else "
            "for another; every slice must return the same structure."
        )
    return tuple(
        _joined_tensors([o[e] for o in outs], dim, f"{ordinal(e + 1)} output") for e in range(width)
    )


def _joined_tensors(parts: list[torch.Tensor], dim: int, what: str) -> torch.Tensor:
    if all(p.dim() == 0 for p in parts):
        return functools.reduce(torch.add, parts)
    if any(p.dim() == 0 for p in parts) or not -parts[0].dim() <= dim < parts[0].dim():
        raise ValueError(
            f"forget: the {what} of func is joined over the slices by concatenating along "
            f"dim {dim} (or summing, where it is 0-dim), but the slices gave shapes "
            f"{sorted({tuple(p.shape) for p in parts})}."
        )
    return torch.cat(parts, dim)
