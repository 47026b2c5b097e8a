"""A candidate region as a cap's step counts it, and what its state says."""

from __future__ import annotations

import weakref
from typing import Any

from .._engine import DroppableRegion, StorageKey
from ._orders import PART

__all__ = [
    "Entry",
    "evicted_in_part",
    "evicted_whole",
    "find_released",
    "may_go_in_part",
    "worth_a_part",
]


class Entry:
    """One candidate region run in the step's forward."""

    __slots__ = (
        "children",
        "cost_s",
        "done",
        "end",
        "grad_fn",
        "index",
        "inputs",
        "keys",
        "largest",
        "last",
        "leaf",
        "name",
        "out",
        "parent",
        "part",
        "part_in_slots",
        "rebuilt",
        "ref",
        "released",
        "size",
    )

    def __init__(self, name: str, parent: Entry | None) -> None:
        self.name = name
        self.parent = parent
        self.children: list[Entry] = []
        self.ref: weakref.ref[DroppableRegion] | None = None
        self.keys: dict[StorageKey, int] = {}  # held storages -> bytes
        self.cost_s = 0.0
        self.size = 0
        self.leaf = True
        self.end = 0
        self.index = self.last = 0
        self.largest = self.out = 0
        self.done = False
        self.grad_fn: Any = None  # what backward runs first of it (its output's grad_fn)
        # Storage key -> how often it is among the region's tensor inputs.
        self.inputs: dict[StorageKey, int] = {}
        # What its re-run makes: its held bytes less its inputs (read, not made again).
        self.rebuilt = 0
        # What its policy keeps, less its inputs: held through a partial eviction.
        self.part: dict[StorageKey, int] = {}
        self.part_in_slots = 0  # of which a slot holds
        # Held storages that are only inner regions' inputs -> the first such region.
        self.released: dict[StorageKey, int] = {}

    def region(self) -> DroppableRegion | None:
        """Its region, while it lives (``None`` before it returned, or once collected)."""
        return None if self.ref is None else self.ref()


def find_released(entry: Entry, region: DroppableRegion) -> None:
    """Mark the held storages that backward lets go with an inner region, not with ``entry``.

    NOTE [the cap's count]: an inner region's inputs go through the enclosing
    region's pack (NOTE [nesting]); the slots that holds are kept by the inner
    region, so they go once backward is through it. Only a storage every slot of
    which is such an input is marked (an op of ``entry``'s own may save it too).
    """
    for key, slots in region.held_slots.items():
        inner = [child for child in entry.children if key in child.inputs]
        if inner and sum(child.inputs[key] for child in inner) == slots:
            entry.released[key] = min(child.index for child in inner)


def evicted_whole(entry: Entry) -> bool:
    region = entry.region()
    return region is None or region.dropped


def may_go_in_part(entry: Entry) -> bool:
    """Whether ``entry`` may be evicted in part (NOTE [partial evictions]): its policy
    keeps something of its own, and no more than `PART` of what it holds."""
    return worth_a_part(sum(entry.part.values()), entry.size)


def worth_a_part(part: int, size: int) -> bool:
    """Whether a region that keeps ``part`` of its ``size`` bytes through a partial
    eviction may go in part: it keeps something, and at most `PART` of it."""
    return 0 < part <= PART * size


def evicted_in_part(entry: Entry) -> bool:
    region = entry.region()
    return region is not None and region.partly_dropped
