"""Buffers that a forward mutates in place, restored around recomputation.

NOTE [state tracking]: a forgotten region runs twice, so anything it
mutates in place that outlives it (BatchNorm's running statistics and
``num_batches_tracked``, spectral norm's power-iteration vector, a user's
counter) would be updated twice, and the second run would start from the
state the first one left. We watch the region with a dispatch mode: an op
that writes into a tensor the region did not create (its storage was not an
output of an op inside the region) writes into *external* state, so we copy
that tensor once, before its first write. Before recomputing we put the
pre-forward values back, so the re-run sees what the forward saw; after
it we put back the values the forward left, so the step leaves every module
exactly as a plain step does. Values are written through ``.data``, which
shares storage but not the version counter, so restoring is invisible to
autograd's in-place checks. This is general: it knows nothing of BatchNorm.
The same mode notes whether any op drew random numbers, so the RNG state is
kept only for regions that need it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["StateTracker", "StopRecomputation", "current_values", "restore"]


class StopRecomputation(Exception):
    """Raised inside a recomputation once every needed tensor is rebuilt."""


_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}

# Legacy aten ops that write into arguments their schema does not mark as
# written (checked on torch 2.13: eager BatchNorm calls native_batch_norm,
# whose schema says ``Tensor? running_mean`` yet updates it, without even a
# version bump). A fact about aten, not a special case of a module.
_UNMARKED_WRITES: dict[str, tuple[tuple[int, str], ...]] = {
    name: ((3, "running_mean"), (4, "running_var"))
    for name in ("native_batch_norm", "cudnn_batch_norm", "miopen_batch_norm")
}
_SEEDED: dict[Any, bool] = {}


def _written_args(op: Any) -> tuple[tuple[int, str], ...]:
    """Positions and names of the arguments an op writes into (cached per op)."""
    cached = _WRITES.get(op)
    if cached is None:
        schema = op._schema
        cached = tuple(
            (i, a.name)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        if not cached and schema.name.startswith("aten::"):
            cached = _UNMARKED_WRITES.get(schema.name[len("aten::") :], ())
        _WRITES[op] = cached
    return cached


_FRESH: dict[Any, bool] = {}


def _returns_fresh(op: Any) -> bool:
    """Whether every output of an op is new memory, not a view or the written input.

    Views (``detach``, ``t``, ``view``) and in-place results alias an input; marking
    their storage as created would hide later writes into external state.
    """
    cached = _FRESH.get(op)
    if cached is None:
        cached = all(r.alias_info is None for r in op._schema.returns)
        _FRESH[op] = cached
    return cached


def _is_seeded(op: Any) -> bool:
    cached = _SEEDED.get(op)
    if cached is None:
        cached = torch.Tag.nondeterministic_seeded in op.tags
        _SEEDED[op] = cached
    return cached


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


def _key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.device, t.data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


class StateTracker(TorchDispatchMode):
    """Record external tensors written in place, and whether RNG was drawn.

    Attributes:
        snapshots: (tensor, value before its first write) in order of first write.
        used_rng: True when an op tagged ``nondeterministic_seeded`` ran.
    """

    def __init__(self) -> None:
        super().__init__()
        self.snapshots: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.used_rng = False
        self._created: set[tuple[torch.device, int]] = set()
        self._seen: set[tuple[Any, ...]] = set()
        self._started = 0
        self._stop_at: int | None = None

    def stop_after_current_op(self) -> None:
        """Raise `StopRecomputation` when the op after the current one starts."""
        self._stop_at = self._started + 1

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._stop_at is not None and self._started >= self._stop_at:
            raise StopRecomputation
        self._started += 1
        if not self.used_rng and _is_seeded(func):
            self.used_rng = True
        written = _written_args(func)
        if written:
            for i, name in written:
                value = args[i] if i < len(args) else kwargs.get(name)
                for t in _tensors(value):
                    self._note_write(t)
        out = func(*args, **kwargs)
        if _returns_fresh(func):
            for t in _tensors(out):
                if t.numel():
                    self._created.add((t.device, t.untyped_storage().data_ptr()))
        return out

    def _note_write(self, t: torch.Tensor) -> None:
        if t.numel() == 0 or t.device.type == "meta":
            return
        if (t.device, t.untyped_storage().data_ptr()) in self._created:
            return
        key = _key(t)
        if key in self._seen:
            return
        self._seen.add(key)
        self.snapshots.append((t, t.detach().clone()))


def restore(snapshots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write snapshot values back, last-written first, without bumping versions."""
    with torch.no_grad():
        for t, value in reversed(snapshots):
            t.data.copy_(value)


def current_values(
    snapshots: list[tuple[torch.Tensor, torch.Tensor]],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy the present values of the tensors in ``snapshots``."""
    with torch.no_grad():
        return [(t, t.detach().clone()) for t, _ in snapshots]
