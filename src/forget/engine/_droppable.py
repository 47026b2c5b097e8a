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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ._region import Region
from ._slots import DroppableSlot, KeptSlot, Slot
from ._state import detached, dispatch_modes
from ._storage import PLAIN_TYPES, StorageKey, storage_of

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
        dropped: whether `drop` ran.
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
        self.dropped = False

    def _external_slot(
        self, t: torch.Tensor, index: int, key: StorageKey, storage: torch.UntypedStorage | None
    ) -> KeptSlot:
        if key not in self.kept_bytes and (s := _storage(t, storage)) is not None:
            self.kept_bytes[key] = s.nbytes()
        return super()._external_slot(t, index, key, storage)

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

    def drop(self) -> None:
        """Empty every slot: backward re-runs the region for what it needs."""
        self.dropped = True
        for ref in self._live.values():
            slot = ref()
            if isinstance(slot, DroppableSlot):
                slot.value = None


def _storage(t: torch.Tensor, read: torch.UntypedStorage | None) -> torch.UntypedStorage | None:
    """`storage_of`, from the storage the pack read where it read one (not a meta one)."""
    return read if read is not None and not t.is_meta else storage_of(t)
