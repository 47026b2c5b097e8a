"""Baseline schedules: store all, forget each stage, uniform segments, sqrt(n) segments."""

from __future__ import annotations

import math

from ._schedule import Item, Keep, Region

__all__ = [
    "forget_each_items",
    "on_sub_stages",
    "sqrt_segments",
    "store_all_items",
    "uniform_items",
]


def store_all_items(num_stages: int) -> tuple[Item, ...]:
    """Return the plain schedule: every stage kept (no recomputation, most memory)."""
    return tuple(Keep(i) for i in range(num_stages))


def forget_each_items(num_stages: int) -> tuple[Item, ...]:
    """Return every stage in its own forget region (one extra forward, inputs only kept)."""
    return tuple(Region((Keep(i),)) for i in range(num_stages))


def uniform_items(num_stages: int, segments: int) -> tuple[Item, ...]:
    """Return ``segments`` equal segments, as `torch.utils.checkpoint.checkpoint_sequential`.

    The stages are cut into segments of ``num_stages // segments`` stages;
    all but the last are forget regions and the last (which takes the
    remainder) runs with grad, since its backward comes first and
    recomputing it would buy no memory at the peak.

    Args:
        num_stages: the number of stages ``L``.
        segments: between 1 (store all) and ``L``.

    Raises:
        ValueError: ``segments`` outside ``1 .. L``.
    """
    if isinstance(segments, bool) or not isinstance(segments, int):
        raise TypeError(f"forget: segments must be an int, got {type(segments).__name__}")
    if not 1 <= segments <= num_stages:
        raise ValueError(
            f"forget: segments must be between 1 and the number of stages {num_stages}, "
            f"got {segments}"
        )
    size = num_stages // segments
    items: list[Item] = []
    start = 0
    for _ in range(segments - 1):
        items.append(Region(tuple(Keep(i) for i in range(start, start + size))))
        start += size
    items.extend(Keep(i) for i in range(start, num_stages))
    return tuple(items)


def sqrt_segments(num_stages: int) -> int:
    """Return Chen et al. (2016)'s segment count, ``round(sqrt(L))`` (at least 1).

    Chen, Xu, Zhang and Guestrin (2016), "Training deep nets with sublinear
    memory cost": ``sqrt(L)`` segments of ``sqrt(L)`` stages keep
    ``O(sqrt(L))`` activations for one extra forward.
    """
    return max(1, min(num_stages, round(math.sqrt(num_stages))))


def on_sub_stages(items: tuple[Item, ...], sizes: tuple[int, ...]) -> tuple[Item, ...]:
    """Map a schedule over blocks onto a chain that splits block ``i`` into ``sizes[i]`` stages.

    Block ``i``'s ``Keep`` becomes ``Keep``s of its stages, in order (an
    option, if any, is carried to each); regions keep their nesting. So a
    baseline written for the blocks (uniform segments, a region per block)
    runs the same on the finer chain: the same regions, cut at the same
    tensors.

    Args:
        items: a schedule's items over ``len(sizes)`` stages (one per block).
        sizes: how many stages each block has in the finer chain, each >= 1.

    Raises:
        ValueError: a size below 1, or an item naming a block outside ``sizes``.
    """
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"forget: every block has at least one stage, got sizes {sizes}")
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)

    def mapped(item: Item) -> list[Item]:
        if isinstance(item, Region):
            return [Region(tuple(x for child in item.items for x in mapped(child)))]
        if not 0 <= item.stage_index < len(sizes):
            raise ValueError(
                f"forget: the schedule names block {item.stage_index}, but there are "
                f"{len(sizes)} blocks"
            )
        first, stop = starts[item.stage_index], starts[item.stage_index + 1]
        return [Keep(j, option=item.option) for j in range(first, stop)]

    return tuple(x for item in items for x in mapped(item))
