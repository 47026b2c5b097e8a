"""The entry points: `forget` (the seed's primitive), `run_region`, `compiled_region`;
`forgotten_regions`, which tells a runtime of the regions run (NOTE [regions heard])."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ..policies import Policy
from ._local import _watchers
from ._region import Region
from ._slots import ordinal


def run_region(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = True,
    check: bool = True,
    recompute_context: Callable[[], Any] | None = None,
    policy: Policy | None = None,
    early_stop: bool = True,
    debug: bool = False,
) -> Any:
    """Run ``func(*args, **kwargs)`` as a forgotten region and return what it returns.

    Under ``torch.no_grad()`` (or inference mode) nothing is saved for backward,
    so ``func`` just runs, once. Under `policies.save_everything` nothing is
    recomputed: ``func`` runs once as plain autograd, which keeps exactly what
    backward reads (replaying every op output would keep more: views and
    in-place updates re-run and need their bases). ``early_stop`` and ``debug``
    are `Region`'s (NOTE [early stop], NOTE [debug trace]).
    """
    if not torch.is_grad_enabled() or (policy is not None and policy.saves_everything):
        return func(*args, **kwargs)
    if torch.compiler.is_compiling():
        return compiled_region(
            func, args, kwargs, preserve_rng_state=preserve_rng_state, early_stop=early_stop
        )
    region = Region(
        func,
        args,
        kwargs,
        preserve_rng_state=preserve_rng_state,
        check=check,
        recompute_context=recompute_context,
        policy=policy,
        early_stop=early_stop,
        debug=debug,
    )
    out = region.run_forward()
    for call in _watchers.calls:  # NOTE [regions heard]
        call(region)
    return out


@contextlib.contextmanager
def forgotten_regions(call: Callable[[Region], None]) -> Iterator[None]:
    """Call ``call(region)`` after each forgotten region's forward in this thread, in the block.

    NOTE [regions heard]: a runtime that counts a step's memory (`forget.cap`)
    sees the regions it runs itself, but not those the model runs on its own (a
    chunked head, `forget.chunked`; a user's `forget.forget`): each holds nothing
    after its forward, and rebuilds its saved tensors when backward meets it
    (`Region.rebuilt_bytes`). Hearing of them, the runtime reserves that re-run.
    Outside such a block the engine pays one check of an empty list per region.
    """
    _watchers.calls.append(call)
    try:
        yield
    finally:
        _watchers.calls.remove(call)


def compiled_region(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    preserve_rng_state: bool = True,
    determinism_check: str = "default",
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    early_stop: bool = True,
) -> Any:
    """Run a region that ``torch.compile`` is tracing: as torch's non-reentrant checkpoint.

    NOTE [compile]: dynamo cannot trace forget's engine (saved-tensor hooks whose
    pack returns Python objects, a TorchDispatchMode, RNG state capture), so while
    ``torch.compiler.is_compiling()`` a region is handed to
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``, which dynamo turns
    into a recomputed subgraph. Lost there (docs/compile.md): policies (everything
    is recomputed), the restoring of mutated buffers (BatchNorm running statistics)
    and ``forget.in_recomputing()``; ``debug`` is torch's (its global flag). Eager
    runs never come here.
    """
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    return torch_checkpoint(
        func,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        determinism_check=determinism_check,
        early_stop=early_stop,
        **extra,
        **kwargs,
    )


def _as_input(x: Any, position: int) -> Any:
    if isinstance(x, np.ndarray):
        if not np.issubdtype(x.dtype, np.floating):
            raise TypeError(
                f"forget: the {ordinal(position)} input is a numpy array of dtype {x.dtype}; "
                "only floating-point arrays can become tensors that require grad. Pass "
                "torch.from_numpy(x).float() (a float tensor) if it should get a gradient, "
                "or torch.from_numpy(x) if it should not (an integer tensor never does)."
            )
        return torch.from_numpy(x).requires_grad_(True)
    return x


def _check_output(out: Any) -> None:
    if isinstance(out, torch.Tensor):
        return
    if isinstance(out, tuple):
        for i, o in enumerate(out):
            if not isinstance(o, torch.Tensor):
                raise TypeError(
                    f"forget: the {ordinal(i + 1)} element of the returned tuple is not a "
                    f"Tensor, but {type(o).__name__}; forget.forget expects func to return a "
                    "Tensor or a tuple of Tensors (use forget.checkpoint for other outputs)."
                )
        return
    raise TypeError(
        "forget: a Tensor or a tuple of Tensors is expected from func, but "
        f"{type(out).__name__} was returned (use forget.checkpoint for other outputs)."
    )


def forget(func: Callable[..., Any], *xs: Any) -> Any:
    """Call ``func(*xs)`` without storing its intermediate results; recompute them in backward.

    The forward keeps only the inputs (and the RNG state, when ``func`` draws
    random numbers, and the pre-forward values of buffers it mutates). The first
    time backward needs an activation of the region, ``func`` runs again, once,
    with ``forget.in_recomputing()`` true and the same random numbers. Memory of
    the intermediates is saved at the cost of about one more forward of ``func``.
    Gradients are those of the plain run, bitwise on CPU.

    Args:
        func: a callable returning a Tensor or a tuple of Tensors.
        *xs: its positional inputs: tensors, floating numpy arrays (they become
            tensors that require grad), or other objects passed as constants.

    Returns:
        What ``func`` returns: a Tensor, or a tuple of Tensors (a 1-tuple stays one).

    Raises:
        TypeError: ``func`` is not callable, an input is an integer numpy array,
            or ``func`` returns something other than a Tensor or tuple of Tensors.
        ForgetError: in backward, an input was modified in place after the forward,
            or the recomputation did not rebuild what the forward saved.

    Example:
        >>> import torch, forget
        >>> x = torch.ones(3, requires_grad=True)
        >>> y = forget.forget(lambda a: (a.sin() * a).sum(), x)
        >>> y.backward()
        >>> torch.allclose(x.grad, torch.ones(3).sin() + torch.ones(3).cos())
        True
    """
    if not callable(func):
        raise TypeError(
            f"forget: func must be callable, but got {type(func).__name__}; pass the "
            "function itself, e.g. forget.forget(layer, x)."
        )
    inputs = tuple(_as_input(x, i + 1) for i, x in enumerate(xs))
    out = run_region(func, inputs, {})
    _check_output(out)
    return out
