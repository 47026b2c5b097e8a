"""A region that keeps what it saves, in slots a runtime may empty (NOTE [droppable regions]).

NOTE [droppable regions]: a `DroppableRegion` runs its forward as any region
does (the same pack, the same fast path, the same record of RNG, autocast and
outside state), except that a saved tensor the region made is held in a
`DroppableSlot` instead of being let go: backward unpacks it as plain autograd
would, with no re-run. `DroppableRegion.drop` empties every slot at once (the
region is *evicted*): the memory goes, the inputs stay (they are kept as any
region keeps them, NOTE [nesting]), and the first unpack re-runs the region
exactly as a forgotten region re-runs (RNG replayed, module state once, early
stop). A held slot is checked against in-place writes as autograd checks
what it saves. Under ``create_graph`` every slot is rebuilt, as a policy's
kept tensors are (NOTE [double backward]).

NOTE [partial drops]: a droppable region may run with a policy
(`forget.policies`). The op outputs the policy keeps are held as any region
with that policy keeps them (the replay's kept outputs, and a slot where an op
saved one), and the rest in slots as above. ``drop(partial=True)`` empties
only the rest: the region is then a policy region, whose re-run replays the
kept outputs (the matmuls of a ``selective`` keep are not run again). A full
`drop` empties every slot and lets the kept outputs and draws go too; the
re-run then runs every op, drawing again from the RNG state the forward began
with, as a region with no policy does. `release_kept` lets the kept outputs
and draws go and keeps the slots: what a runtime does with a region whose
policy kept too much to be worth a partial drop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._arguments import tensors_in
from ._region import Region
from ._selective import _KeptDraw
from ._slots import DroppableSlot, KeptSlot, Slot
from ._state import detached, dispatch_modes
from ._storage import PLAIN_TYPES, StorageKey, storage_key, storage_of

__all__ = ["DroppableRegion"]


class DroppableRegion(Region):
    """A region whose saved tensors stay until `drop` (NOTE [droppable regions]).

    Attributes:
        held_bytes: bytes of each storage held in the region's slots, by storage key
            (the region made them; they go when the region is dropped and nothing
            else holds them).
        kept_bytes: bytes of each storage the region saved that no region made
            (its inputs), by storage key: they stay when it is dropped.
        held_slots: how many of the region's slots hold each storage of ``held_bytes``
            (a runtime tells the inputs of inner regions among them).
        kept_output_bytes: bytes of each storage its policy keeps (NOTE [partial
            drops]), in a slot or not: they stay through a partial drop.
        copied_bytes: bytes of each storage held by the copies of the arguments it
            may change, kept for its re-runs (NOTE [arguments that change]): a key/value
            cache's earlier keys and values; they stay while the region lives.
        dropped: whether a full `drop` ran.
        partly_dropped: whether a partial `drop` ran (and no full one).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        **options: Any,
    ) -> None:
        super().__init__(func, args, kwargs, **options)
        self.held_bytes: dict[StorageKey, int] = {}
        self.kept_bytes: dict[StorageKey, int] = {}
        self.held_slots: dict[StorageKey, int] = {}
        self.kept_output_bytes: dict[StorageKey, int] = {}
        self._kept_indices: set[int] = set()  # the slots holding a kept output
        self.copied_bytes: dict[StorageKey, int] = {}
        for i in self._changing:
            for t in tensors_in(self._flat[i]):
                if isinstance(t, torch.Tensor) and (s := storage_of(t)) is not None:
                    self.copied_bytes.setdefault(storage_key(t), s.nbytes())
        self.dropped = False
        self.partly_dropped = False
        self._released = False  # `release_kept` ran

    def _external_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> KeptSlot:
        if key not in self.kept_bytes and (s := _storage(t, storage)) is not None:
            self.kept_bytes[key] = s.nbytes()
        return super()._external_slot(t, index, key, storage)

    def _kept_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> Slot:
        # NOTE [partial drops]: a kept output's slot goes with a full drop only.
        self._kept_indices.add(index)
        return self._made_slot(t, index, key, storage)

    def _made_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> Slot:
        # Held here rather than re-run (`Region._pack` hands ``key`` and ``storage`` on).
        # `detached`, its common case (a fast forward: no dispatch mode on) inlined.
        value = t.detach() if type(t) in PLAIN_TYPES and not dispatch_modes() else detached(t)
        if t.requires_grad:
            # A nested region's input held here must behave as the tensor did when
            # that region re-runs from it (NOTE [nested grad]).
            value.requires_grad_()
        if key in self.held_bytes:
            self.held_slots[key] += 1
        elif (s := _storage(t, storage)) is not None:
            self.held_bytes[key] = s.nbytes()
            self.held_slots[key] = 1
        return DroppableSlot(self, index, value)

    def run_forward(self) -> Any:
        out = super().run_forward()
        if self.policy is not None:  # NOTE [partial drops]: what the policy keeps
            kept = self.kept_output_bytes
            for tensor in _kept_tensors(self._kept_ops):
                if (s := storage_of(tensor)) is not None:
                    kept.setdefault(storage_key(tensor), s.nbytes())
        return out

    def release_kept(self) -> None:
        """Let go what the policy kept beyond the slots: the region is then as if run
        without it, and only a full `drop` is left to it (NOTE [partial drops])."""
        if self.policy is None or self.dropped:
            return
        self._let_kept_go()
        self._released = True

    def drop(self, *, partial: bool = False) -> None:
        """Empty the slots: backward re-runs the region for what it needs.

        With ``partial``, the outputs its policy keeps stay, and the re-run replays
        them (NOTE [partial drops]); without, everything goes.
        """
        if partial and (self.policy is None or self._released):
            raise ValueError(
                "forget: a partial drop needs a region run with a policy that still holds "
                "what it kept (no `release_kept`)."
            )
        if partial and self.dropped:
            return  # emptied already
        if not partial:
            self.dropped, self.partly_dropped = True, False
            self._let_kept_go()
        else:
            self.partly_dropped = True
        kept = self._kept_indices if partial else ()
        for index, ref in self._live.items():
            slot = ref()
            if isinstance(slot, DroppableSlot) and index not in kept:
                slot.value = None

    def _let_kept_go(self) -> None:
        """Forget the policy's kept outputs and draws (NOTE [partial drops])."""
        self._kept_ops, self._draw_states = {}, {}
        self.kept_output_bytes = {}


def _kept_tensors(kept: dict[int, tuple[str, Any, Any]]) -> list[torch.Tensor]:
    """The tensors a policy's kept outputs hold (a kept draw's bits or values)."""
    found: list[torch.Tensor] = []
    for _, outputs, _ in kept.values():
        for value in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            if isinstance(value, torch.Tensor):
                found.append(value)
            elif isinstance(value, _KeptDraw):
                found += [t for t in (value.bits, value.values) if t is not None]
    return found


def _storage(t: torch.Tensor, read: torch.UntypedStorage | None) -> torch.UntypedStorage | None:
    """`storage_of`, from the storage the pack read where it read one (not a meta one)."""
    return read if read is not None and not t.is_meta else storage_of(t)
