"""The clock planning times with: the wall clock, or one a test puts in its place.

Every time the planner and the profiler read (`_timing`, `_profile`) is the
``elapsed(fn)`` of a call: run ``fn``, return the seconds it took. The wall
clock (`WallClock`, the default) does exactly that. A test that checks what
planning does with bytes, schedules or gradients, not with times, can put a
`FixedClock` in place (`using`): it runs nothing and reports the same seconds
for every call, so profiling and the planner's side-by-side timing cost no
steps, and the times, hence the choices made on them, repeat exactly. Only
timing is skipped: every byte figure still comes from a measured run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Protocol


class Clock(Protocol):
    def elapsed(self, fn: Callable[[], object]) -> float:
        """The seconds ``fn()`` takes (a stand-in may report them without running it)."""
        ...


class WallClock:
    """Runs ``fn`` between two reads of `time.perf_counter`."""

    def elapsed(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


class FixedClock:
    """Runs nothing and reports ``seconds`` for every call; counts the calls it skipped."""

    def __init__(self, seconds: float = 1e-3) -> None:
        self.seconds = seconds
        self.calls = 0

    def elapsed(self, fn: Callable[[], object]) -> float:
        self.calls += 1
        return self.seconds


_clock: Clock = WallClock()


def elapsed(fn: Callable[[], object]) -> float:
    """The seconds ``fn()`` takes, on the clock in use."""
    return _clock.elapsed(fn)


@contextlib.contextmanager
def using(clock: Clock) -> Iterator[Clock]:
    """Time with ``clock`` inside the block, then with the clock before it again."""
    global _clock
    before, _clock = _clock, clock
    try:
        yield clock
    finally:
        _clock = before
