"""`measure`: peak, saved-for-backward and end bytes of a call, by one of three probes.

A ``resize_`` of a storage the call made counts at its new size; an external
storage grown in place counts by its growth; sparse tensors and subclasses
without a plain storage are skipped.

NOTE [the two probes]: ``probe="profiler"`` reads the allocator's own record
(``torch.profiler.profile(profile_memory=True)``: an event per allocation and
free; the peak is the maximum of their running sum). It agrees with the ledger
to the byte on ``saved_bytes`` and ``end_bytes`` of the test nets; peaks differ
where one probe sees what the other cannot (figures: benchmarks/measured.md,
"Single measurements behind the NOTEs"):

* a kernel's own memory (oneDNN workspaces, BatchNorm's per-thread buffers, the
  tensors a Python scalar becomes) is no op output, so the ledger misses it;
* any dispatch mode makes autograd sum a reused tensor's gradients out of
  place (``at::isTensorSubclassLike``), so the ledger's run holds a few more
  transients than the plain one, as forget's own regions do anyway;
* frees of memory made before the call are dropped by both: the CPU allocator
  sizes an older block's free only by chance of address reuse, so the probe
  keeps only frees it matches by address to an allocation of this call;
* CUDA's caching allocator rounds blocks up to 512 bytes; the ledger counts
  ``nbytes``.
"""

from __future__ import annotations

import bisect
import gc
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any

import torch

from ._ledger import Ledger, region, watch
from ._reports import MemoryReport, RegionStats

__all__ = [
    "PROBES",
    "AllocatorReading",
    "AllocatorRecord",
    "allocator_peak",
    "frozen_heap",
    "measure",
    "stop_open_record",
]

PROBES = ("ledger", "profiler", "cuda")


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block (many measured calls).

    NOTE [frozen heap]: `measure` collects garbage in full after every call, so the
    cycles it leaves are freed before ``end_bytes`` is read. A full collection walks
    every tracked object, hundreds of thousands once torch's compiler modules are
    imported, which made it the larger part of planning a small model (figures:
    benchmarks/measured.md, "Planning's first collection"). Objects alive before the
    block are no garbage of its calls, so the block freezes them (``gc.freeze``): the
    collections inside walk only what the block made and find the same cycles, so
    every figure is the same; cycles among frozen objects wait for the block's end
    (``gc.unfreeze``). Before freezing only the young generations are collected (the
    caller's last garbage, a step's graph among it): old cycles wait for the end as
    the frozen ones do. A process that froze objects itself, and a nested block, are
    left as they are.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect(1)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _is_compiled(fn: Any) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable") or type(fn).__name__ == "OptimizedModule"


def _run_ledger(fn: Callable[..., Any], args: Any, kwargs: Any) -> MemoryReport:
    ledger = Ledger()
    try:
        with watch(ledger):
            result = fn(*args, **kwargs)
        # Frees that garbage collection owes the call (reference cycles) happen now,
        # while the ledger still listens, so end_bytes does not depend on GC timing.
        gc.collect()
        end, end_by_device = ledger.live, dict(ledger.live_by_device)
    finally:
        ledger.close()
    saved = ledger.saved if ledger.backward_ran else end
    saved_by_device = ledger.saved_by_device if ledger.backward_ran else end_by_device
    regions = {
        name: RegionStats(name, s[0], s[1], s[2], s[3]) for name, s in ledger.regions.items()
    }
    return MemoryReport(
        peak_bytes=ledger.peak,
        saved_bytes=saved,
        end_bytes=end,
        forward_peak_bytes=ledger.forward_peak,
        backward_peak_bytes=ledger.backward_peak,
        device_peak_bytes=MappingProxyType(dict(ledger.peak_by_device)),
        device_saved_bytes=MappingProxyType(_nonzero(saved_by_device)),
        device_end_bytes=MappingProxyType(_nonzero(end_by_device)),
        regions=MappingProxyType(regions),
        backward_ran=ledger.backward_ran,
        probe="ledger",
        result=result,
    )


def _nonzero(d: Mapping[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


# -- the allocator probe (torch.profiler) ----------------------------------------


def _run_profiler(fn: Callable[..., Any], args: Any, kwargs: Any) -> MemoryReport:
    """Measure with the allocator's own record (NOTE [the two probes])."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    stop_open_record()
    thread = threading.get_ident()
    _WAITING[thread] = []  # NOTE [records within a measure]
    try:
        with profile(activities=activities, profile_memory=True) as prof:
            result = fn(*args, **kwargs)
            gc.collect()
    finally:
        waiting = _WAITING.pop(thread)
    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    memory, backward, marks = _read_tree(tree)
    if waiting:
        reading = AllocatorReading.of(memory, marks)
        for record in waiting:
            record.deliver(reading)
    # torch's profile object is a reference cycle (its actions are its bound methods):
    # its records, several MB for a model's step, would wait for the garbage collector,
    # alive through the caller's next step (a planner measures steps back to back).
    del tree
    prof.profiler = None
    spans = _merge(backward)
    first_backward = spans[0][0] if spans else None
    live = peak = forward_peak = backward_peak = 0
    live_by_device: dict[str, int] = {}
    peak_by_device: dict[str, int] = {}
    saved: int | None = None
    saved_by_device: dict[str, int] = {}
    span = 0
    for t, _, nbytes, dev in memory:
        if saved is None and first_backward is not None and t >= first_backward:
            saved, saved_by_device = live, dict(live_by_device)
        live += nbytes
        live_by_device[dev] = live_by_device.get(dev, 0) + nbytes
        if nbytes <= 0:
            continue
        while span < len(spans) and spans[span][1] < t:
            span += 1
        in_backward = span < len(spans) and spans[span][0] <= t
        peak = max(peak, live)
        peak_by_device[dev] = max(peak_by_device.get(dev, 0), live_by_device[dev])
        if in_backward:
            backward_peak = max(backward_peak, live)
        else:
            forward_peak = max(forward_peak, live)
    if saved is None:
        saved, saved_by_device = live, dict(live_by_device)
    return MemoryReport(
        peak_bytes=peak,
        saved_bytes=saved,
        end_bytes=live,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        device_peak_bytes=MappingProxyType(peak_by_device),
        device_saved_bytes=MappingProxyType(_nonzero(saved_by_device)),
        device_end_bytes=MappingProxyType(_nonzero(live_by_device)),
        regions=MappingProxyType({}),
        backward_ran=bool(spans),
        probe="profiler",
        result=result,
    )


def allocator_peak(fn: Callable[[], Any]) -> int:
    """The CPU allocator's peak bytes of ``fn()``, as ``measure(fn, probe="profiler")``'s.

    NOTE [allocations alone]: `measure`'s profiler records every op too (it
    splits the peak by phase, and reads the backward's spans from its events);
    a caller that wants the peak alone, a planner measuring step after step,
    pays for those records and for walking them. Here the profiler records
    only the allocator's events and autograd's backward functions (its
    ``RecordScope.BACKWARD_FUNCTION``; no op event): the same allocations, so
    the same peak (to the byte on the models of benchmarks/tree_targets.py and
    the probes' test models), with less of the profiler's work per op and fewer
    events to walk (benchmarks/measured.md). Where torch's profiler cannot be
    started that way, the full probe runs.
    """
    record = AllocatorRecord(lingers=False)
    try:
        started = record.start()
    except (AttributeError, TypeError):  # pragma: no cover - another torch
        return measure(fn, probe="profiler").peak_bytes
    if not started:
        raise RuntimeError(
            "forget: torch's profiler runs already on this thread, and the allocator's "
            "record needs it; stop that profiler first."
        )
    try:
        fn()
        gc.collect()
    finally:
        reading = record.stop()
    return reading.peak()


#: The prefix of an `AllocatorRecord`'s marks (``record_function`` scopes).
_MARK = "forget::mark "


class AllocatorRecord:
    """The CPU allocator's events from `start` to `stop`, as `allocator_peak` reads them.

    Between the two a caller may `mark` instants by name (from any code the thread
    runs, autograd's hooks and callbacks included); `stop` returns an
    `AllocatorReading`, which gives the peak between any two of them. Allocations
    alone are recorded (NOTE [allocations alone]), with the marks, which are
    ``torch.autograd.profiler.record_function`` scopes: a user's own scopes inside
    the record are recorded too, and walked past. torch's profiler runs once per
    thread: where one runs already `start` records nothing and says so, and `stop`
    must come on the thread `start` ran on, from no autograd hook or callback (the
    engine puts its thread's profiler state back after each). A record left open
    past its caller's code (``lingers``, as a cap's) is stopped by forget's next
    allocator probe on its thread (`stop_open_record`): ``on_stop`` hears the
    reading either way. One that does not linger (`allocator_peak`'s) is not:
    a probe inside it finds torch's profiler busy, as it would find a user's.

    NOTE [records within a measure]: a record started while ``measure(...,
    probe="profiler")`` runs on its thread cannot start a profiler of its own; one
    that lingers borrows `measure`'s, whose events and marks it is given when
    `measure` ends (its `stop` before then does nothing). So a capped step
    measured that way is read by its cap too, as it would be unmeasured.

    Args:
        on_stop: called with the reading when the record stops.
        lingers: whether forget's next allocator probe on the thread may stop it.
    """

    def __init__(
        self, on_stop: Callable[[AllocatorReading], None] | None = None, *, lingers: bool = True
    ) -> None:
        self.running = self.borrowed = False
        self.lingers = lingers
        self.marks: set[str] = set()
        self.on_stop = on_stop

    def start(self) -> bool:
        """Start recording; ``False`` (nothing started) where a profiler runs already.

        Raises:
            AttributeError, TypeError: torch's profiler cannot be started this way
                (another torch than the one forget was written against).
        """
        from torch._C._profiler import ProfilerActivity, RecordScope
        from torch.autograd import profiler as autograd_profiler

        stop_open_record()
        if self.running:
            return False
        waiting = _WAITING.get(threading.get_ident())
        if waiting is not None and self.lingers:  # NOTE [records within a measure]
            waiting.append(self)
            self.running = self.borrowed = True
            return True
        if torch._C._autograd._profiler_enabled():
            return False
        prof = autograd_profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
        try:
            config = prof.config(create_trace_id=False)
        except TypeError:  # torch < 2.6
            config = prof.config()
        activities = {ProfilerActivity.CPU}
        scopes = {RecordScope.BACKWARD_FUNCTION, RecordScope.USER_SCOPE}
        autograd_profiler._prepare_profiler(config, activities)
        autograd_profiler._enable_profiler(config, activities, scopes)  # type: ignore[call-arg]
        self.running = True
        _OPEN[threading.get_ident()] = self
        return True

    def mark(self, name: str) -> None:
        """Note this instant in the record as ``name``."""
        if self.running:
            with torch.autograd.profiler.record_function(_MARK + name):
                self.marks.add(name)

    def stop(self) -> AllocatorReading:
        """Stop, and read the record."""
        from torch.autograd import profiler as autograd_profiler

        if not self.running or self.borrowed:  # a borrowed record hears when `measure` ends
            return AllocatorReading([], {})
        _OPEN.pop(threading.get_ident(), None)
        results = autograd_profiler._disable_profiler()
        tree = results.experimental_event_tree()
        memory, _, marks = _read_tree(tree)
        reading = AllocatorReading.of(memory, marks)
        del tree, results
        self.deliver(reading)
        return reading

    def deliver(self, reading: AllocatorReading) -> None:
        """The record has stopped: ``reading`` is what it read."""
        self.running = False
        if self.on_stop is not None:
            self.on_stop(reading)


class AllocatorReading:
    """What an `AllocatorRecord` read: the bytes live after each allocation and free
    (above the record's start), and the time of each mark's first instant.

    Attributes:
        marks: mark name -> its first instant (ns, the profiler's clock).
    """

    def __init__(self, series: list[tuple[int, int]], marks: dict[str, int]) -> None:
        self._times = [t for t, _ in series]
        self._live = [live for _, live in series]
        self.marks = marks

    @classmethod
    def of(cls, memory: list[tuple[int, int, int, str]], marks: dict[str, int]) -> AllocatorReading:
        """The reading of a profiler's events (`_read_tree`'s memory and marks)."""
        live, series = 0, []
        for time_ns, _, nbytes, _ in memory:
            live += nbytes
            series.append((time_ns, live))
        return cls(series, marks)

    def peak(self, since: int | None = None, until: int | None = None) -> int:
        """The most bytes live from instant ``since`` to ``until`` (default: the start, the end)."""
        first = 0 if since is None else bisect.bisect_right(self._times, since)
        last = len(self._times) if until is None else bisect.bisect_right(self._times, until)
        held = self._live[first - 1] if first > 0 else 0  # live as the span begins
        return max([held, *self._live[first:last]])


#: The record open on each thread (`AllocatorRecord.start` to `stop`).
_OPEN: dict[int, AllocatorRecord] = {}

#: NOTE [records within a measure]: while `measure`'s profiler runs on a thread, the
#: records started there, which its reading is delivered to when it ends.
_WAITING: dict[int, list[AllocatorRecord]] = {}


def stop_open_record() -> None:
    """Stop the `AllocatorRecord` left open on this thread (one that lingers), if any:
    torch's profiler runs once per thread, and forget's probes need it."""
    record = _OPEN.get(threading.get_ident())
    if record is not None and record.lingers:
        record.stop()


def _read_tree(
    roots: list[Any],
) -> tuple[list[tuple[int, int, int, str]], list[tuple[int, int]], dict[str, int]]:
    """The profiled call's allocations and frees of those, its backward spans, its marks.

    Memory as ``(time_ns, order, nbytes, device type)`` in time order, frees
    negative; a free of a block the call did not make is dropped (NOTE [the two
    probes]). Spans as ``(start_ns, end_ns)`` of autograd's evaluate_function
    events, one per node backward ran. Marks (`AllocatorRecord.mark`) by name, the
    first instant of each.
    """
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, int, str, tuple[str, int, int]]] = []
    spans: list[tuple[int, int]] = []
    marks: dict[str, int] = {}
    stack = list(reversed(roots))
    while stack:  # depth first, in the tree's order: events of one instant stay in order
        node = stack.pop()
        stack.extend(reversed(node.children))
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            dev = f.device.type
            block = (dev, f.device.index or 0, f.ptr)
            events.append((node.start_time_ns, len(events), f.alloc_size, dev, block))
        elif node.name.startswith("autograd::engine::evaluate_function"):
            spans.append((node.start_time_ns, node.end_time_ns))
        elif node.name.startswith(_MARK):
            name = node.name[len(_MARK) :]
            marks[name] = min(marks.get(name, node.start_time_ns), node.start_time_ns)
    events.sort()
    made: dict[tuple[str, int, int], int] = {}
    memory: list[tuple[int, int, int, str]] = []
    for t, order, nbytes, dev, block in events:
        if nbytes > 0:
            made[block] = nbytes
        elif made.pop(block, None) is None:
            continue
        memory.append((t, order, nbytes, dev))
    return memory, spans, marks


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


# -- the CUDA caching allocator's counters ---------------------------------------


def _run_cuda(fn: Callable[..., Any], args: Any, kwargs: Any) -> MemoryReport:
    if not torch.cuda.is_available():
        raise ValueError(
            "forget: probe='cuda' needs a CUDA device, but torch.cuda.is_available() is "
            "False; use probe='ledger' (exact, any device) or probe='profiler'."
        )
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = fn(*args, **kwargs)
    gc.collect()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    end = torch.cuda.memory_allocated() - base
    return MemoryReport(
        peak_bytes=peak,
        saved_bytes=None,
        end_bytes=end,
        forward_peak_bytes=None,
        backward_peak_bytes=None,
        device_peak_bytes=MappingProxyType({"cuda": peak}),
        device_end_bytes=MappingProxyType(_nonzero({"cuda": end})),
        probe="cuda",
        result=result,
    )


class _Measure:
    """Run a callable and return an exact `MemoryReport` of the memory it allocated.

    Use it to compare rematerialization choices by what they cost in memory: a
    training step (forward + backward) under plain autograd, `forget.forget` and
    `torch.utils.checkpoint`, measured the same way. ``saved_bytes`` alone
    misleads (checkpointing every block of an MLP cuts it far more than the peak,
    which also holds parameter gradients and the block being recomputed), so the
    report gives the peak too, per phase and per device. The ledger adds Python
    work to every op (tens of microseconds), so measure a step, not a run.

    Probes:
        ``"ledger"`` (default): the dispatch-mode ledger (NOTE [the ledger]); exact
        and repeatable to the byte; composes with other dispatch modes (forget's
        own); sees tensors, not kernel workspaces, and makes autograd sum
        gradients out of place (NOTE [the two probes]). Never give it a
        ``torch.compile``d function: under a dispatch mode torch 2.13 runs the
        compiled function eagerly, and keeps doing so after; a compiled callable
        raises `ValueError` (one compiled deep inside ``fn`` cannot be detected).
        ``"profiler"``: the allocator's record from
        ``torch.profiler.profile(profile_memory=True)`` (NOTE [the two probes]);
        also sees kernel-internal allocations; the probe for compiled
        functions; no regions.
        ``"cuda"``: ``torch.cuda.max_memory_allocated`` minus the memory allocated
        before the call; counts the caching allocator's rounded blocks; no
        phases (``saved_bytes`` etc. are ``None``).

    Call it as ``measure(fn, *args, probe="ledger", **kwargs)``; ``fn`` gets
    ``*args`` and ``**kwargs`` (a keyword named ``probe`` is taken by measure).
    `region` (also ``measure.region``) names parts of the call.

    Example:
        >>> import torch, forget
        >>> forget.measure(lambda: torch.ones(1000, 1000)).peak_bytes
        4000000
    """

    region = staticmethod(region)

    def __call__(
        self, fn: Callable[..., Any], /, *args: Any, probe: str = "ledger", **kwargs: Any
    ) -> MemoryReport:
        """Run ``fn(*args, **kwargs)`` and return what it allocated, in bytes.

        Args:
            fn: the callable, typically a training step (forward and backward).
            *args: its positional arguments.
            probe: ``"ledger"``, ``"profiler"`` or ``"cuda"`` (see the class).
            **kwargs: its keyword arguments.

        Returns:
            A frozen `MemoryReport`; ``report.result`` is what ``fn`` returned.

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: an unknown probe; ``"cuda"`` without a CUDA device; a
                ``torch.compile``d ``fn`` under the ledger.
        """
        if not callable(fn):
            raise TypeError(
                f"forget: measure expects a callable, but got {type(fn).__name__}; pass the "
                "function itself, e.g. forget.measure(step, x)."
            )
        if probe == "ledger":
            if _is_compiled(fn):
                raise ValueError(
                    "forget: a torch.compile'd function cannot be measured with "
                    "probe='ledger', because under a dispatch mode torch runs it eagerly "
                    "(and keeps doing so); use probe='profiler'."
                )
            return _run_ledger(fn, args, kwargs)
        if probe == "profiler":
            return _run_profiler(fn, args, kwargs)
        if probe == "cuda":
            return _run_cuda(fn, args, kwargs)
        raise ValueError(
            f"forget: unknown probe {probe!r}; valid probes are {', '.join(map(repr, PROBES))}."
        )


measure = _Measure()
