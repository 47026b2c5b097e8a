"""The clock planning times with: a parameter, the wall clock unless a caller passes one.

Every time the planner and the profiler read (`_timing`, `_profile`) is a
clock's ``elapsed(fn)`` of a call: run ``fn``, return the seconds it took; or
its ``spans(fn, modules)`` of one: the seconds each module's call took within
it. The wall clock (`WallClock`, the default) does exactly that. The clock is
handed down as an argument (``TreePlanner(..., clock=...)``,
``time_calls(..., clock=...)``), never kept in a module: a test that checks
what planning does with bytes, schedules or gradients, not with times, passes a
`FixedClock`, which runs nothing and reports the same seconds for every call,
so profiling and the side-by-side timing cost no steps, and the times, hence
the choices made on them, repeat exactly. Only timing is skipped: every byte
figure still comes from a measured run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

import torch
from torch import nn


class Clock(Protocol):
    def elapsed(self, fn: Callable[[], object]) -> float:
        """The seconds ``fn()`` takes (a stand-in may report them without running it)."""
        ...

    def spans(
        self, fn: Callable[[], object], modules: Mapping[str, nn.Module], sync: bool
    ) -> dict[str, float]:
        """The seconds each of ``modules`` takes within one ``fn()``, by name (a
        stand-in may report them without running it); ``sync``: wait for CUDA at
        each read."""
        ...


class WallClock:
    """Runs ``fn`` between two reads of `time.perf_counter`."""

    def elapsed(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def spans(
        self, fn: Callable[[], object], modules: Mapping[str, nn.Module], sync: bool
    ) -> dict[str, float]:
        """Reads the clock in a hook before and after each module's call."""
        started: dict[str, float] = {}
        spent: dict[str, float] = {}

        def now() -> float:
            if sync:
                torch.cuda.synchronize()
            return time.perf_counter()

        def pre(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                started[name] = now()

            return hook

        def post(name: str) -> Callable[..., None]:
            def hook(*_: Any) -> None:
                spent[name] = spent.get(name, 0.0) + now() - started.pop(name)

            return hook

        handles = []
        try:
            for name, module in modules.items():
                handles.append(module.register_forward_pre_hook(pre(name)))
                handles.append(module.register_forward_hook(post(name)))
            fn()
        finally:
            for handle in handles:
                handle.remove()
        return spent


class FixedClock:
    """Runs nothing and reports ``seconds`` for every call; counts the calls it skipped."""

    def __init__(self, seconds: float = 1e-3) -> None:
        self.seconds = seconds
        self.calls = 0

    def elapsed(self, fn: Callable[[], object]) -> float:
        self.calls += 1
        return self.seconds

    def spans(
        self, fn: Callable[[], object], modules: Mapping[str, nn.Module], sync: bool
    ) -> dict[str, float]:
        self.calls += 1
        return dict.fromkeys(modules, self.seconds)


#: The wall clock, the default of every function that times (stateless: never replaced).
WALL_CLOCK: Final[Clock] = WallClock()
