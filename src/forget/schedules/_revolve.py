"""Binomial checkpointing (revolve) for chains of equal stages.

Griewank and Walther (2000), "Algorithm 799: revolve: an implementation of
checkpointing for the reverse or adjoint mode of computational
differentiation", ACM TOMS 26(1). With ``c`` checkpoints the adjoint of
``l`` equal steps needs at least ``t(l, c) = r l - β(c + 1, r - 1)`` forward
steps beyond the taping ones, where ``β(c, r) = (c + r)! / (c! r!)`` and the
repetition number ``r`` is the unique integer with
``β(c, r - 1) < l <= β(c, r)``.

The schedule is built from the equivalent recurrence (Griewank 1992)
``T(l, c) = min_j  j + T(l - j, c - 1) + T(j, c)`` with ``T(1, c) = 0``: advance
``j`` steps without taping (a forget region over the first ``j`` stages,
whose input is the checkpoint), reverse the remaining ``l - j`` steps with
one checkpoint fewer, then reverse the region from its checkpoint with all
``c``. Revolve ignores stage sizes and times; it is a baseline here.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ._schedule import Item, Keep, Region

__all__ = ["revolve_forward_steps", "revolve_items"]


def _check_counts(steps: int, checkpoints: int) -> None:
    for name, value in (("steps", steps), ("checkpoints", checkpoints)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"forget: {name} must be an int, got {type(value).__name__}")
    if steps < 1:
        raise ValueError(f"forget: steps must be >= 1, got {steps}")
    if checkpoints < 0:
        raise ValueError(f"forget: checkpoints must be >= 0, got {checkpoints}")
    if checkpoints == 0 and steps > 1:
        raise ValueError(
            f"forget: {steps} steps cannot be reversed with 0 checkpoints; "
            "only a single step can (pass checkpoints >= 1)"
        )


def revolve_forward_steps(steps: int, checkpoints: int) -> int:
    """Return Griewank and Walther's minimal number of (untaped) forward steps.

    Reversing ``steps`` equal steps while storing at most ``checkpoints``
    states (the initial one included) costs ``steps`` taping forward steps,
    ``steps`` backward steps, and this many plain forward steps.

    Args:
        steps: the number of steps ``l`` (stages), at least 1.
        checkpoints: the number of checkpoints ``c``.

    Returns:
        ``r * l - β(c + 1, r - 1)`` (0 for a single step).

    Raises:
        ValueError: ``steps < 1``, or more than one step with no checkpoint.

    Example:
        >>> revolve_forward_steps(4, 2)
        4
    """
    _check_counts(steps, checkpoints)
    if steps == 1:
        return 0
    c = checkpoints
    r = 0
    while math.comb(c + r, c) < steps:
        r += 1
    return r * steps - math.comb(c + r, c + 1)


@functools.lru_cache(maxsize=8)
def _table(steps: int, checkpoints: int) -> tuple[np.ndarray, np.ndarray]:
    """T[l, c] and the best first advance j[l, c] for l <= steps, c <= checkpoints."""
    cost = np.full((steps + 1, checkpoints + 1), np.inf)
    split = np.zeros((steps + 1, checkpoints + 1), dtype=np.int64)
    cost[1, :] = 0.0
    for c in range(1, checkpoints + 1):
        for length in range(2, steps + 1):
            j = np.arange(1, length)
            total = j + cost[length - j, c - 1] + cost[j, c]
            best = int(np.argmin(total))
            cost[length, c] = total[best]
            split[length, c] = best + 1
    return cost, split


def revolve_items(start: int, stop: int, checkpoints: int) -> tuple[Item, ...]:
    """Return the binomial schedule over stages ``[start, stop)`` as nested regions.

    Args:
        start: first stage.
        stop: one past the last stage.
        checkpoints: the number of checkpoints ``c`` (capped at the useful maximum).

    Returns:
        Items whose no-grad forward ops number `revolve_forward_steps`.
    """
    steps = stop - start
    c = min(checkpoints, max(steps - 1, 0))
    _check_counts(steps, checkpoints)
    _, split = _table(steps, c)

    def build(s: int, t: int, c: int) -> tuple[Item, ...]:
        out: list[Item] = []
        while t - s > 1:
            j = int(split[t - s, c])
            out.append(Region(build(s, s + j, c)))
            s, c = s + j, c - 1
        out.append(Keep(s))
        return tuple(out)

    return build(start, stop, c)
