"""Run a measured step under a memory guard: a step that would pass the budget is stopped.

NOTE [guarded steps]: the planner exists for the step that does not fit, so no
step it runs may take the process past the budget, even one predicted to fit.
Each measured step runs under a guard with the budget as its limit. On CPU the
guard is a ledger (NOTE [the ledger]) that raises `Overrun` from inside the op
whose output passes the limit; the step unwinds, its tensors are freed with the
exception, and the caller restores the model (`untouched`). The ledger sees
storages, not kernel workspaces, so the allocator may pass the limit by one
op's workspace (NOTE [tree figures]: the planner learns those per module). On
CUDA the caching allocator itself is bounded
(``set_per_process_memory_fraction``) and its ``OutOfMemoryError`` is the
overrun. A stopped step is a measured miss; one that runs through has its
ledger peak (`Peak.ledger_bytes`) with no second run.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._memory import Ledger, allocator_peak, measure, watch

__all__ = ["Overrun", "Peak", "guard", "guarded_peak", "peak_bytes"]


class Overrun(Exception):
    """A guarded step allocated more than its limit (NOTE [guarded steps])."""

    def __init__(self, limit_bytes: int, live_bytes: int) -> None:
        super().__init__(f"the step passed {limit_bytes:,} B ({live_bytes:,} B live)")
        self.limit_bytes = limit_bytes
        self.live_bytes = live_bytes


@dataclass(frozen=True)
class Peak:
    """A guarded step's peak: exact, or (``stopped``) a lower bound past the limit.

    ``ledger_bytes`` is the same step's peak by the guard's ledger (CPU, not
    stopped), else None.
    """

    bytes: int
    stopped: bool = False
    ledger_bytes: int | None = None


class _GuardLedger(Ledger):
    """A ledger that raises `Overrun` as soon as the live bytes pass ``limit_bytes``."""

    def __init__(self, limit_bytes: int) -> None:
        super().__init__()
        self.limit_bytes = limit_bytes

    def _add(self, rec: Any, delta: int, backward: bool) -> None:
        super()._add(rec, delta, backward)
        if delta > 0 and self.live > self.limit_bytes:
            raise Overrun(self.limit_bytes, self.live)


@contextlib.contextmanager
def _cpu_guard(limit_bytes: int) -> Iterator[Ledger]:
    ledger = _GuardLedger(limit_bytes)
    try:
        with watch(ledger):
            yield ledger
    finally:
        ledger.close()


@contextlib.contextmanager
def _cuda_guard(limit_bytes: int) -> Iterator[None]:
    device = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    # A fraction the user set stays the bound where it is the tighter (torch < 2.5 has
    # no getter: then none is assumed).
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = 1.0 if getter is None else float(getter(device))
    torch.cuda.empty_cache()  # the bound is on what the cache reserves: start from in use
    fraction = min(before, (torch.cuda.memory_allocated(device) + limit_bytes) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise Overrun(limit_bytes, limit_bytes + 1) from None
    finally:
        torch.cuda.set_per_process_memory_fraction(before, device)


@contextlib.contextmanager
def guard(limit_bytes: int | None, probe: str) -> Iterator[Ledger | None]:
    """Stop what runs inside once it allocates past ``limit_bytes`` (`Overrun`); None: no guard.

    ``probe`` says which memory counts: ``"cuda"`` the caching allocator's,
    any other the CPU storages the ledger sees (NOTE [guarded steps]). Yields
    that ledger (its figures are the block's), or None.
    """
    if limit_bytes is None:
        yield None
        return
    if probe == "cuda":
        with _cuda_guard(limit_bytes):
            yield None
        return
    with _cpu_guard(limit_bytes) as ledger:
        yield ledger


def peak_bytes(run: Callable[[], object], probe: str) -> int:
    """The peak of ``run()`` by ``probe``; the CPU allocator's by its events alone.

    The planner reads a step's peak alone, never its phases: NOTE [allocations
    alone] in `forget._memory`.
    """
    if probe == "profiler":
        return allocator_peak(run)
    return measure(run, probe=probe).peak_bytes


def guarded_peak(run: Callable[[], object], probe: str, limit_bytes: int | None) -> Peak:
    """The peak of ``run()`` by ``probe``, stopped once it passes ``limit_bytes``.

    ``limit_bytes`` None runs unguarded. The caller restores the model after a
    stopped step (`untouched`); everything the step made is freed here. On
    CPU the result carries the guard's ledger peak too (`Peak`).
    """
    if limit_bytes is None:
        return Peak(peak_bytes(run, probe))
    try:
        with guard(limit_bytes, probe) as ledger:
            peak = peak_bytes(run, probe)
        return Peak(peak, ledger_bytes=None if ledger is None else ledger.peak)
    except Overrun as exc:
        stopped = Overrun(exc.limit_bytes, exc.live_bytes)  # not exc: its frames hold the step
    gc.collect()  # the step's reference cycles (autograd graph, regions) go with it
    if probe == "cuda":
        torch.cuda.empty_cache()
    return Peak(max(stopped.live_bytes, limit_bytes + 1), stopped=True)
