"""Session set-up shared by every test module."""

from __future__ import annotations

import gc
import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread and a quiet profiler, here and in the commands the tests start.

    The tests check bytes, schedules and bits on tensors of a few KiB, where a
    second intra-op thread buys nothing and costs its hand-offs; and where the
    2 cores are shared, torch's threads wait for each other spinning: two test
    files took 171 and 197 s at two threads against 37 and 34 s at one, side by
    side at load 5 (benchmarks/measured.md, "The suite at one torch thread").
    Both sides of every differential test run alike, so nothing is left out. A
    thread count given in the environment is kept. The profiler's log lines go
    as the command line sends them (NOTE [kineto's log] in `forget._cli`).
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # NOTE [kineto's log] in forget._cli
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the objects that imports made, once every test module is imported.

    `forget.measure` collects garbage in full after every call, so that the
    cycles a call leaves are freed before its end bytes are read. A full
    collection walks every object the collector tracks, and with torch,
    transformers and hypothesis imported that is some 185,000 objects, 0.07 to
    0.12 s per call on a 2-core machine, the larger part of the planning tests'
    time (the suite took 594 s without this, 373 s with it, side by side).
    Frozen objects are never walked (nor freed: nothing imported is garbage).
    Objects the tests make are not frozen, so the leak tests see them as before.
    torch imports its compiler (and sympy) on the first dispatch mode, so that
    is imported here too, to be frozen with the rest.
    """
    import torch._dynamo  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _freeze_what_earlier_tests_left():
    """Before each test, collect garbage and freeze what is still alive.

    The freeze at collection covers imports, but what tests leave alive after it
    (module fixtures, caches, and the modules transformers and torch's compiler
    import lazily on first use) stayed in the collector's view, and every full
    collection `forget.measure` makes walked it again: late in the suite a small
    plan took ten times as long as alone (2.9 s against 0.3 s). Refcounting still
    frees frozen objects; only the cycles among them are never collected. Objects
    a test makes are not frozen while it runs, so what it leaks is seen as before;
    test_leaks.py unfreezes for its own tests, to see what earlier ones leaked too.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture
def fixed_clock(request, monkeypatch):
    """The wall clock made to run nothing and report 1 ms per call, for this test.

    The library keeps no clock of its own: a planner takes one as a parameter
    (``TreePlanner(..., clock=FixedClock())``), and a test of a planner passes
    it so. `forget.plan`, the command line and ``enable`` take none and time on
    a `WallClock`; a test through them that checks what planning does with
    bytes, schedules and gradients, not with times, asks for this fixture, which
    patches `WallClock`'s two reads for the test alone (as a test patches
    ``time.perf_counter``): profiling and the side-by-side timing run no steps
    (every byte figure is still measured), and the times repeat exactly. A
    test that asks for `wall_clock` too (in a module that uses this one) keeps
    the wall clock.
    """
    from _clocks import fixed_wall_clock
    from forget._planning import FixedClock

    if "wall_clock" in request.fixturenames:
        return FixedClock()
    return fixed_wall_clock(monkeypatch)


@pytest.fixture
def wall_clock():
    """The wall clock, unpatched, in a module that uses `fixed_clock`."""
    from forget._planning import WallClock

    return WallClock()
