"""`saved`: which tensors a call keeps for backward, one by one."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._engine import storage_of
from ._ledger import Ledger, watch
from ._reports import SavedReport, SavedTensor


def _labels(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, str]:
    """id(storage) -> a name for the inputs, parameters and buffers of a call."""
    labels: dict[int, str] = {}

    def name(t: Any, label: str) -> None:
        s = storage_of(t)
        if s is not None:
            labels.setdefault(id(s), label)

    for i, a in enumerate(args):
        for leaf in pytree.tree_leaves(a):
            name(leaf, f"input {i}")
    for k, v in kwargs.items():
        for leaf in pytree.tree_leaves(v):
            name(leaf, f"input {k!r}")
    if isinstance(func, torch.nn.Module):
        for pname, p in func.named_parameters():
            name(p, f"parameter {pname}")
        for bname, b in func.named_buffers():
            name(b, f"buffer {bname}")
    return labels


def _forget_regions() -> list[Any]:
    """The forget regions alive now: they hold the inputs they keep (``Region.kept_arguments``)."""
    from .._engine import Region

    # type(), not isinstance: some lazy torch objects warn when asked their __class__.
    return [o for o in gc.get_objects() if type(o) is Region]


def saved(func: Callable[..., Any], /, *xs: Any, **kwargs: Any) -> SavedReport:
    """List the tensors ``func(*xs, **kwargs)`` keeps for backward, one per storage.

    In the spirit of JAX's ``print_saved_residuals``: run the forward once and
    say what stays alive for backward, what made it and how big it is, so a
    memory saving can be checked tensor by tensor. An outermost saved-tensor
    hook records every tensor autograd saves (and hands autograd a detached
    alias, so no reference cycle keeps the graph alive); the ledger names the op
    that made each storage. Inside a `forget.forget` region, forget's own hooks
    take over, so nothing saved there reaches this hook: forget keeps nothing but
    the region's inputs, which are listed with ``how="kept"``. So are the
    inputs of a ``torch.utils.checkpoint`` region when the call made them; those
    it got from outside are alive anyway and not listed. The forward's graph is
    dropped before returning.

    Args:
        func: the function (an ``nn.Module`` names its parameters and buffers).
        *xs: its positional inputs (``input 0``, ``input 1``, ...).
        **kwargs: its keyword inputs (``input 'name'``).

    Returns:
        A `SavedReport`; ``str(report)`` is a table, ``report.total_bytes`` the
        bytes made in the call that backward keeps.

    Raises:
        TypeError: ``func`` is not callable.

    Example:
        >>> import torch, forget
        >>> x = torch.ones(1000, requires_grad=True)
        >>> report = forget.saved(lambda a: a.exp().sum(), x)
        >>> [(t.source, t.nbytes) for t in report.tensors]
        [('aten.exp', 4000)]
    """
    if not callable(func):
        raise TypeError(
            f"forget: saved expects a callable, but got {type(func).__name__}; pass the "
            "function itself, e.g. forget.saved(block, x)."
        )
    labels = _labels(func, xs, kwargs)
    ledger = Ledger()
    # id(storage) -> [how, meta of the first tensor, saves, weak ref to the storage]
    rows: dict[int, list[Any]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        s = storage_of(t)
        if s is None:
            return
        row = rows.get(id(s))
        if row is None:
            rows[id(s)] = [how, (tuple(t.shape), t.dtype, str(t.device)), 0, weakref.ref(s)]
        if how == "saved":
            rows[id(s)][2] += 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t, "saved")
        return t.detach()

    before = {id(r) for r in _forget_regions()}
    try:
        with watch(ledger), torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            out = func(*xs, **kwargs)
        for r in _forget_regions():
            if id(r) not in before:
                for v in r.kept_arguments():
                    note(v, "kept")
        gc.collect()
        records = ledger.records()
        outputs = {id(s) for s in map(storage_of, pytree.tree_leaves(out)) if s is not None}
        result: list[SavedTensor] = []
        for key, (how, meta, count, ref) in rows.items():
            s = ref()
            if s is None:
                continue  # freed before the call returned: not kept
            rec = records.get(key)
            shape, dtype, device = meta
            if rec is not None and rec.op:
                source, external = rec.op, False
            else:
                source, external = labels.get(key, "external"), True
            result.append(
                SavedTensor(source, how, shape, dtype, device, s.nbytes(), count, external)
            )
        # Made in the call, alive, neither saved through the hook nor returned: kept by
        # something else (a checkpoint region's closure, a forget region's inputs).
        for key, rec in records.items():
            if rec.op and rec.counted and key not in rows and key not in outputs:
                result.append(
                    SavedTensor(
                        rec.op, "kept", rec.shape, rec.dtype, rec.where, rec.counted, 0, False
                    )
                )
        del out  # the graph, and what it saved, goes now
    finally:
        ledger.close()
    return SavedReport(tuple(result))


def _identity(x: Any) -> Any:
    return x
