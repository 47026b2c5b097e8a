"""The eviction orders a cap may take, by name (NOTE [eviction order])."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["EVICTIONS"]


def _dtr(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes * staleness / max(cost_s, 1e-9)


def _largest(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes


def _first_run(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return -index


def _cheapest_per_byte(freed_bytes: int, staleness: int, cost_s: float, index: int) -> float:
    return freed_bytes / max(cost_s, 1e-9)


#: Eviction orders by name (NOTE [eviction order]): each scores an evictable region
#: from the bytes evicting it frees, its staleness in region boundaries, its forward
#: time and its position in the forward; the highest score goes first, the earliest
#: region on a tie.
EVICTIONS: dict[str, Callable[[int, int, float, int], float]] = {
    "largest": _largest,
    "dtr": _dtr,
    "first_run": _first_run,
    "cheapest_per_byte": _cheapest_per_byte,
}
