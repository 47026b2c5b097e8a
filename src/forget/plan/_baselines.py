"""Baseline schedules: store all, forget each stage, uniform segments, sqrt(n) segments."""

from __future__ import annotations

import math

from ._schedule import Item, Keep, Region

__all__ = ["forget_each_items", "sqrt_segments", "store_all_items", "uniform_items"]


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
