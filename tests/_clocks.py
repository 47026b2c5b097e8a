"""The wall clock made to run nothing, for tests that plan through `forget.plan`,
the command line or ``enable``, which take no clock (conftest.py's `fixed_clock`)."""

from __future__ import annotations

import pytest

from forget._planning import FixedClock, WallClock


def fixed_wall_clock(monkeypatch: pytest.MonkeyPatch) -> FixedClock:
    """Patch `WallClock`'s two reads to a `FixedClock`'s until ``monkeypatch`` undoes them.

    The library keeps no clock of its own (a planner takes one as a parameter),
    so this patches the class, as a test patches ``time.perf_counter``.
    """
    clock = FixedClock()
    monkeypatch.setattr(WallClock, "elapsed", lambda _, fn: clock.elapsed(fn))
    monkeypatch.setattr(WallClock, "spans", lambda _, fn, ms, sync: clock.spans(fn, ms, sync))
    return clock
