"""What the engine asks of an aten op, from its schema, once per op (NOTE [op info])."""

from __future__ import annotations

from typing import Any

import torch

# Legacy aten ops that write into arguments their schema does not mark as
# written (checked on torch 2.13: eager BatchNorm calls native_batch_norm,
# whose schema says ``Tensor? running_mean`` yet updates it, without even a
# version bump). A fact about aten, not a special case of a module.
_UNMARKED_WRITES: dict[str, tuple[tuple[int, str], ...]] = {
    name: ((3, "running_mean"), (4, "running_var"))
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
}


# NOTE [write-only statistics]: in training mode these ops compute their output
# from the batch alone; the running statistics (arguments 3 and 4) are only
# updated. So the re-run needs no pre-forward copy of them, and in the re-run we
# call the op without them: same outputs, bit for bit, and no write to undo.
_STATS_OPS = frozenset(
    {"native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm", "_native_batch_norm_legit"}
)
_TRAINING_ARG = 5


def _without_stats(op: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The same batch-norm call with its running statistics left out."""
    if op._schema.name == "aten::_native_batch_norm_legit":
        no_stats = torch.ops.aten._native_batch_norm_legit.no_stats
        return no_stats, (args[0], args[1], args[2], *args[_TRAINING_ARG:])
    return op, (*args[:3], None, None, *args[_TRAINING_ARG:])


# The questions below are asked once per op and cached in its `_OpInfo`.


def _written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """Positions and names of the arguments an op writes into."""
    schema = op._schema
    written = tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )
    if not written and schema.name.startswith("aten::"):
        written = _UNMARKED_WRITES.get(schema.name[len("aten::") :], ())
    return written


def _update_results(op: Any) -> int | None:
    """How many results an op returns when each is one of its written arguments.

    ``add_`` returns its ``self``: 1. ``None`` when some result is new memory or
    a view, or the op draws random numbers; the op is then no pure update.
    """
    schema = op._schema
    written = {
        frozenset(a.alias_info.before_set)
        for a in schema.arguments
        if a.alias_info is not None and a.alias_info.is_write
    }
    pure = not _is_seeded(op) and all(
        r.alias_info is not None
        and r.alias_info.is_write
        and frozenset(r.alias_info.before_set) in written
        for r in schema.returns
    )
    return len(schema.returns) if pure else None


def _returns_fresh(op: Any) -> bool:
    """Whether every output of an op is new memory, not a view or the written input.

    Views (``detach``, ``t``, ``view``) and in-place results alias an input; marking
    their storage as created would hide later writes into external state.
    """
    return all(r.alias_info is None for r in op._schema.returns)


# Ops that read only the shape, strides, dtype and device of their tensor input.
_LAYOUT_ONLY = frozenset(
    f"aten::{name}"
    for name in (
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
        "randint_like",
        "new_empty",
        "new_empty_strided",
        "new_zeros",
        "new_ones",
        "new_full",
    )
)


def _reads_no_data(op: Any) -> bool:
    """Whether an op reads no element of its inputs: views (``view``, ``t``, ``split``)
    and ``empty_like`` and its kin, which read only the layout.
    """
    schema = op._schema
    if schema.name in _LAYOUT_ONLY:
        return True
    views = bool(schema.returns) and all(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
    )
    return views and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _is_seeded(op: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def _draw_into(op: Any) -> int | None:
    """The argument an in-place random op fills and returns (``bernoulli_``: 0), else None.

    Ops that also make new memory or write elsewhere (``rrelu_with_noise``, ``out=``
    variants that return views) are not in-place draws; they are always re-drawn.
    """
    schema = op._schema
    written = [
        i
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    into = None
    if (
        len(written) == 1
        and len(schema.returns) == 1
        and not schema.arguments[written[0]].kwarg_only
    ):
        ret = schema.returns[0].alias_info
        arg = schema.arguments[written[0]].alias_info
        if ret is not None and arg is not None and ret.before_set == arg.before_set:
            into = written[0]
    return into


class _OpInfo:
    """What the tracker asks of an op on every call, worked out once per op.

    NOTE [op info]: the tracker sees every op of a region and asks each the same
    questions of its schema (what does it write, does it draw, is its output new
    memory). They are answered once per op and kept in one record, looked up by
    ``id``: an ``OpOverload`` hashes in Python, so a dict keyed by the op would
    cost a Python call per lookup. The record holds the op, so its ``id`` cannot
    be reused while cached.
    """

    __slots__ = (
        "draw_into",
        "fresh",
        "name",
        "no_data",
        "op",
        "seeded",
        "stats",
        "update_results",
        "written",
    )

    def __init__(self, op: Any) -> None:
        self.op = op
        self.name = str(op)
        self.seeded = _is_seeded(op)
        self.written = _written_args(op)
        schema_name: str = op._schema.name
        self.stats = schema_name.startswith("aten::") and schema_name[len("aten::") :] in _STATS_OPS
        self.update_results = _update_results(op) if self.written else None
        self.no_data = _reads_no_data(op)
        self.fresh = _returns_fresh(op)
        self.draw_into = _draw_into(op) if self.seeded else None


_INFO: dict[int, _OpInfo] = {}


def _op_info(op: Any) -> _OpInfo:
    info = _INFO.get(id(op))
    if info is None or info.op is not op:
        info = _INFO[id(op)] = _OpInfo(op)
    return info
