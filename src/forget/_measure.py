"""An exact memory ledger: peak, saved-for-backward and end bytes of a call.

NOTE [the ledger]: `measure` watches a call with a dispatch mode that sees every
aten op (forward, backward, recomputation, optimizer step). Each op output's
storage is registered once, with a ``weakref.finalize`` that sees it freed; the
storage's ``nbytes()`` is added to the live total when it appears and taken off
when it is freed. Counting storages, not tensors, deduplicates views. A storage
first seen as an op *input* was made before the call (a parameter, an input, a
buffer) and is external: it is never counted, nor are views of it (``aten.t(w)``
shares ``w``'s storage). So the figures are byte counts of what the call
allocated, identical from run to run and machine to machine.

NOTE [end of forward]: ``saved_bytes`` is the live total just before the first op
that runs under an autograd graph task (``torch._C._current_graph_task_id()`` is
not -1), i.e. when the engine starts the first backward of the call. Everything
the forward left alive counts: tensors saved for backward, the inputs a
rematerialized region keeps, the forward's outputs (the loss), and the seed
gradient ``backward()`` makes before the engine starts (``ones_like(loss)``, 4
bytes for a float32 scalar). `saved` lists those tensors one by one.

NOTE [the two probes]: ``probe="profiler"`` reads the allocator's own record
(``torch.profiler.profile(profile_memory=True)``: one event per allocation and
free, with its size; the peak is the maximum of their running sum). On torch
2.13 CPU it agrees with the ledger to the byte on ``saved_bytes`` and
``end_bytes`` of an MLP, a conv+BatchNorm net and an attention block, and on the
MLP's peak. Peaks differ where one probe sees what the other cannot:

* Memory a kernel allocates for itself is no op output, so the ledger misses
  it: oneDNN/conv workspaces and weight reorders, BatchNorm's per-thread
  buffers, the 8- and 4-byte tensors a Python scalar becomes in ``x * 2``. On
  the conv+BatchNorm test net the profiler's peak is 24,576 bytes (13%) higher.
* Any dispatch mode changes one thing in the program it watches:
  ``at::isTensorSubclassLike`` is true while a mode is active, so autograd sums
  the gradients of a tensor used by several ops out of place instead of into
  the first one (and ``AccumulateGrad`` adds into an existing ``.grad`` out of
  place). That costs extra transient buffers: the ledger's peak of the
  attention test block is 600 bytes (1.2%) higher than the plain run's. forget
  itself runs a dispatch mode in its regions, so this is no worse there.
* The profiler also counts frees of memory made before the call (a
  ``zero_grad(set_to_none=True)`` inside it), as negative bytes; the ledger
  ignores memory it did not see made.
* The CUDA caching allocator (``probe="cuda"`` and the profiler on CUDA)
  rounds each block up to a multiple of 512 bytes; the ledger counts ``nbytes``.

A ``resize_`` of a storage the call made is followed (the storage counts at its
new size; the brief moment when old and new buffers coexist is not); an external
storage grown in place counts by its growth. Sparse tensors and tensor
subclasses without a plain storage are skipped (their dense parts, when made by
ops, are counted).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "MemoryReport",
    "RegionStats",
    "SavedReport",
    "SavedTensor",
    "measure",
    "region",
    "saved",
]

PROBES = ("ledger", "profiler", "cuda")

# Ops whose input is a tensor made outside the dispatcher (``torch.tensor([...])``
# builds it in C++, then lifts it): their input is new memory, not external.
_LIFTS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})


def _empty() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True)
class RegionStats:
    """Memory seen inside a `region` (all its entries together), in bytes.

    Attributes:
        name: the region's name.
        entries: how many times the region was entered.
        peak_bytes: the highest live total of the call reached while the region
            was open (the whole call's live memory, not only the region's own).
        allocated_bytes: bytes of storages created while the region was open.
        kept_bytes: bytes of those still alive when the region closed (in a
            forward: what the region leaves for backward and its outputs).
    """

    name: str
    entries: int
    peak_bytes: int
    allocated_bytes: int
    kept_bytes: int


@dataclass(frozen=True)
class MemoryReport:
    """What a call allocated, in bytes of tensor storage (deduplicated by storage).

    Only storages created inside the call count; parameters, inputs and views of
    them do not.

    Attributes:
        peak_bytes: the highest live total during the call.
        saved_bytes: the live total when the first backward of the call started
            (NOTE [end of forward]), or at the end of the call when no backward ran;
            ``None`` where the probe cannot tell (``probe="cuda"``).
        end_bytes: the live total when the call returned (its result included).
        forward_peak_bytes: the peak over ops run outside backward (forward, and
            anything after backward such as an optimizer step); ``None`` where the
            probe cannot tell.
        backward_peak_bytes: the peak over ops run by the autograd engine
            (recomputation included); 0 when no backward ran, ``None`` where the
            probe cannot tell.
        device_peak_bytes: device type (``"cpu"``, ``"cuda"``) -> peak of that
            device's live total (each device's own peak).
        device_saved_bytes: device type -> its share of ``saved_bytes``.
        device_end_bytes: device type -> its share of ``end_bytes``.
        regions: region name -> `RegionStats` (ledger probe only).
        backward_ran: whether the autograd engine ran during the call.
        probe: which probe measured: ``"ledger"``, ``"profiler"`` or ``"cuda"``.
        result: what the callable returned.
    """

    peak_bytes: int
    saved_bytes: int | None
    end_bytes: int
    forward_peak_bytes: int | None
    backward_peak_bytes: int | None
    device_peak_bytes: Mapping[str, int] = field(default_factory=_empty)
    device_saved_bytes: Mapping[str, int] = field(default_factory=_empty)
    device_end_bytes: Mapping[str, int] = field(default_factory=_empty)
    regions: Mapping[str, RegionStats] = field(default_factory=dict)
    backward_ran: bool = False
    probe: str = "ledger"
    result: Any = field(default=None, repr=False, compare=False)

    def __str__(self) -> str:
        def fmt(v: int | None) -> str:
            return "-" if v is None else f"{v:,}"

        rows = [
            ("peak_bytes", fmt(self.peak_bytes)),
            ("saved_bytes", fmt(self.saved_bytes)),
            ("end_bytes", fmt(self.end_bytes)),
            ("forward_peak_bytes", fmt(self.forward_peak_bytes)),
            ("backward_peak_bytes", fmt(self.backward_peak_bytes)),
        ]
        for dev, v in sorted(self.device_peak_bytes.items()):
            rows.append((f"peak_bytes[{dev}]", fmt(v)))
        width = max(len(k) for k, _ in rows)
        vwidth = max(len(v) for _, v in rows)
        lines = [f"MemoryReport (probe={self.probe})"]
        lines += [f"  {k:<{width}}  {v:>{vwidth}}" for k, v in rows]
        if self.regions:
            lines.append("  regions (entries, peak, allocated, kept bytes):")
            for r in self.regions.values():
                lines.append(
                    f"    {r.name}: {r.entries}, {r.peak_bytes:,}, {r.allocated_bytes:,}, "
                    f"{r.kept_bytes:,}"
                )
        return "\n".join(lines)


# -- the ledger (dispatch-mode probe) ------------------------------------------


class _Entry:
    """One open entry of a region: bytes created during it, and freed since."""

    __slots__ = ("allocated", "freed", "name", "open", "peak")

    def __init__(self, name: str, live: int) -> None:
        self.name = name
        self.allocated = 0
        self.freed = 0
        self.peak = live
        self.open = True


class _Record:
    """A storage the ledger has seen: its counted bytes and how to forget it."""

    __slots__ = (
        "base",
        "counted",
        "device",
        "dtype",
        "entries",
        "finalizer",
        "op",
        "shape",
        "where",
    )

    def __init__(
        self,
        base: int,
        device: str,
        op: str,
        entries: tuple[_Entry, ...],
        shape: tuple[int, ...] = (),
        dtype: torch.dtype = torch.uint8,
    ) -> None:
        self.base = base  # bytes it had before the call (0 if made in it)
        self.counted = 0
        self.device = device
        self.op = op  # the op that made it, or "" if external
        self.entries = entries
        self.shape = shape  # of the first tensor seen on it
        self.dtype = dtype
        self.where = device  # the full device ("cuda:0"), set for storages made in the call
        self.finalizer: weakref.finalize[..., Any] | None = None


class _Active(threading.local):
    ledgers: list[_Ledger]

    def __init__(self) -> None:
        self.ledgers = []


_active = _Active()


def _storage(t: Any) -> torch.UntypedStorage | None:
    """The storage of a dense tensor, or ``None`` (sparse, meta, storage-less subclass)."""
    if isinstance(t, torch.UntypedStorage):
        return None if t.device.type == "meta" else t
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _Ledger(TorchDispatchMode):
    """The dispatch mode behind `measure` and `saved` (NOTE [the ledger])."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()
        self._records: dict[int, _Record] = {}
        self.live = 0
        self.peak = 0
        self.live_by_device: dict[str, int] = {}
        self.peak_by_device: dict[str, int] = {}
        self.forward_peak = 0
        self.backward_peak = 0
        self.saved: int | None = None
        self.saved_by_device: dict[str, int] = {}
        self.backward_ran = False
        self._entries: list[_Entry] = []
        self.regions: dict[str, list[int]] = {}  # name -> [entries, peak, allocated, kept]

    # -- bookkeeping ---------------------------------------------------------
    def _see_input(self, s: torch.UntypedStorage) -> None:
        key = id(s)
        if key not in self._records:
            rec = _Record(s.nbytes(), s.device.type, "", ())
            self._records[key] = rec
            rec.finalizer = self._finalize(s, key)

    def _see_output(self, t: Any, s: torch.UntypedStorage, op: str, backward: bool) -> None:
        key = id(s)
        rec = self._records.get(key)
        if rec is None:
            shape, dtype = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ((), None)
            rec = _Record(0, s.device.type, op, tuple(self._entries), shape, dtype or torch.uint8)
            rec.where = str(s.device)
            self._records[key] = rec
            rec.finalizer = self._finalize(s, key)
        counted = max(0, s.nbytes() - rec.base)
        if counted != rec.counted:
            self._add(rec, counted - rec.counted, backward)

    def _finalize(self, s: torch.UntypedStorage, key: int) -> weakref.finalize[..., Any]:
        f = weakref.finalize(s, self._freed, key)
        f.atexit = False
        return f

    def _add(self, rec: _Record, delta: int, backward: bool) -> None:
        rec.counted += delta
        self.live += delta
        dev = rec.device
        self.live_by_device[dev] = self.live_by_device.get(dev, 0) + delta
        for e in rec.entries:
            if e.open:
                e.allocated += delta
        if delta <= 0:
            return
        live = self.live
        self.peak = max(self.peak, live)
        if self.live_by_device[dev] > self.peak_by_device.get(dev, 0):
            self.peak_by_device[dev] = self.live_by_device[dev]
        if backward:
            self.backward_peak = max(self.backward_peak, live)
        else:
            self.forward_peak = max(self.forward_peak, live)
        for e in self._entries:
            e.peak = max(e.peak, live)

    def _freed(self, key: int) -> None:
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is None or not rec.counted:
                return
            self.live -= rec.counted
            self.live_by_device[rec.device] -= rec.counted
            for e in rec.entries:
                if e.open:
                    e.freed += rec.counted

    def records(self) -> dict[int, _Record]:
        """id of each live storage seen -> its record (a copy of the table)."""
        with self._lock:
            return dict(self._records)

    def close(self) -> None:
        """Stop watching frees (the call is over); keep the figures."""
        with self._lock:
            for rec in list(self._records.values()):
                if rec.finalizer is not None:
                    rec.finalizer.detach()
            self._records.clear()

    # -- regions -------------------------------------------------------------
    def enter(self, name: str) -> _Entry:
        with self._lock:
            entry = _Entry(name, self.live)
            self._entries.append(entry)
            return entry

    def exit(self, entry: _Entry) -> None:
        with self._lock:
            if entry in self._entries:
                self._entries.remove(entry)
            entry.open = False
            stats = self.regions.setdefault(entry.name, [0, 0, 0, 0])
            stats[0] += 1
            stats[1] = max(stats[1], entry.peak)
            stats[2] += entry.allocated
            stats[3] += entry.allocated - entry.freed

    # -- the mode ------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        backward = torch._C._current_graph_task_id() != -1
        with self._lock:
            if backward and not self.backward_ran:
                self.backward_ran = True
                self.saved = self.live
                self.saved_by_device = dict(self.live_by_device)
            if func._schema.name.split("::")[-1] not in _LIFTS:
                for leaf in pytree.tree_leaves((args, kwargs)):
                    s = _storage(leaf)
                    if s is not None:
                        self._see_input(s)
        out = func(*args, **kwargs)
        with self._lock:
            name = _op_name(func)
            for leaf in pytree.tree_leaves(out):
                s = _storage(leaf)
                if s is not None:
                    self._see_output(leaf, s, name, backward)
        return out


def _op_name(func: Any) -> str:
    """``aten.exp`` for ``aten.exp.default``; overloads other than default kept."""
    name = str(func)
    return name[: -len(".default")] if name.endswith(".default") else name


@contextmanager
def region(name: str) -> Iterator[None]:
    """Mark a named region of a measured call; its figures land in ``report.regions``.

    Outside `measure` it does nothing. Regions may nest and repeat (entries of
    one name are summed; their peak is the largest). Only ops run while the
    ``with`` block is open count, so a region around a forward block says what
    it allocated and kept; backward runs outside it.

    Args:
        name: the region's name in ``MemoryReport.regions``.

    Example:
        >>> import torch, forget
        >>> def step():
        ...     with forget.measure.region("make"):
        ...         return torch.ones(10)
        >>> forget.measure(step).regions["make"].kept_bytes
        40
    """
    ledgers = list(_active.ledgers)
    entries = [ledger.enter(name) for ledger in ledgers]
    try:
        yield
    finally:
        for ledger, entry in zip(ledgers, entries, strict=True):
            ledger.exit(entry)


@contextmanager
def _watch(ledger: _Ledger) -> Iterator[None]:
    _active.ledgers.append(ledger)
    try:
        with ledger:
            yield
    finally:
        _active.ledgers.remove(ledger)


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block (many measured calls).

    NOTE [frozen heap]: `measure` collects garbage in full after every call, so
    that the cycles the call leaves are freed before ``end_bytes`` is read. A
    full collection walks every object the collector tracks; with torch's
    compiler modules imported (the first dispatch mode imports them) that is
    some 185,000 objects, 0.07 to 0.12 s per call here, which was half the time
    of planning a small model. Objects alive before the block are not garbage
    the block's calls made, so the block freezes them (``gc.freeze``): the
    collections inside walk only what the block made, and find the same cycles,
    so every figure is the same. Cycles among the frozen objects wait for the
    block's end (``gc.unfreeze``), as they would wait for any late collection.
    A process that froze objects itself is left as it is (nothing is frozen or
    unfrozen here), and so is a block nested in another.
    """
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _is_compiled(fn: Any) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable") or type(fn).__name__ == "OptimizedModule"


def _run_ledger(fn: Callable[..., Any], args: Any, kwargs: Any) -> MemoryReport:
    ledger = _Ledger()
    try:
        with _watch(ledger):
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
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn(*args, **kwargs)
        gc.collect()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    memory: list[tuple[int, int, int, str]] = []
    spans: list[tuple[int, int]] = []
    for i, e in enumerate(events):
        name = e.name()
        if name == "[memory]":
            memory.append((e.start_ns(), i, e.nbytes(), _device_type(e.device_type())))
        elif name.startswith("autograd::engine::evaluate_function"):
            spans.append((e.start_ns(), e.end_ns()))
    memory.sort()
    spans = _merge(spans)
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


def _device_type(d: Any) -> str:
    name = str(d).rsplit(".", 1)[-1].lower()
    return "cuda" if name == "cuda" else name


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


# -- saved(): what a function keeps for backward ---------------------------------


@dataclass(frozen=True)
class SavedTensor:
    """One storage a function keeps for backward.

    Attributes:
        source: where its memory came from: the op that made it (``"aten.exp"``),
            ``"input 0"``, ``"input 'name'"``, ``"parameter fc.weight"``,
            ``"buffer bn.running_mean"``, or ``"external"`` (made before the call).
        how: ``"saved"`` (autograd saved it, through the outermost saved-tensor
            hook) or ``"kept"`` (alive at return though not saved that way: the
            inputs a `forget.forget` or ``torch.utils.checkpoint`` region keeps).
        shape: shape of the first tensor seen on this storage.
        dtype: its dtype.
        device: its device, as a string.
        nbytes: bytes of the storage.
        count: how many saved tensors share the storage (0 for kept ones).
        external: whether the memory predates the call (inputs, parameters).
    """

    source: str
    how: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    nbytes: int
    count: int
    external: bool


@dataclass(frozen=True)
class SavedReport:
    """What a function keeps for backward, one row per storage.

    Attributes:
        tensors: the rows, in the order first saved (kept ones last).
        total_bytes: bytes of the rows made inside the call (inputs and
            parameters excluded: they are alive anyway).
        external_bytes: bytes of the rows that predate the call.
    """

    tensors: tuple[SavedTensor, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if not t.external)

    @property
    def external_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.external)

    def __str__(self) -> str:
        header = ("source", "how", "shape", "dtype", "device", "bytes", "saves")
        rows = [
            (
                t.source,
                t.how,
                str(list(t.shape)),
                str(t.dtype).removeprefix("torch."),
                t.device,
                f"{t.nbytes:,}",
                str(t.count),
            )
            for t in self.tensors
        ]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        right = {5, 6}

        def line(r: tuple[str, ...]) -> str:
            cells = [
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            ]
            return "  ".join(cells).rstrip()

        out = [line(header), line(tuple("-" * w for w in widths))]
        out += [line(r) for r in rows]
        out.append(
            f"total {self.total_bytes:,} bytes made in the call "
            f"(+ {self.external_bytes:,} bytes of inputs and parameters)"
        )
        return "\n".join(out)


def _labels(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, str]:
    """id(storage) -> a name for the inputs, parameters and buffers of a call."""
    labels: dict[int, str] = {}

    def name(t: Any, label: str) -> None:
        s = _storage(t)
        if s is not None:
            labels.setdefault(id(s), label)

    for i, a in enumerate(args):
        for leaf in pytree.tree_leaves(a):
            name(leaf, f"input {i}")
    for k, v in kwargs.items():
        for leaf in pytree.tree_leaves(v):
            name(leaf, f"input {k!r}")
    if isinstance(func, torch.nn.Module):
        for pname, p in func.named_parameters():
            name(p, f"parameter {pname}")
        for bname, b in func.named_buffers():
            name(b, f"buffer {bname}")
    return labels


def _forget_regions() -> list[Any]:
    """The forget regions alive now: they hold the inputs they keep (``Region._flat``)."""
    from ._core import Region

    # type(), not isinstance: some lazy torch objects warn when asked their __class__.
    return [o for o in gc.get_objects() if type(o) is Region]


def saved(func: Callable[..., Any], /, *xs: Any, **kwargs: Any) -> SavedReport:
    """List the tensors ``func(*xs, **kwargs)`` keeps for backward, one per storage.

    In the spirit of JAX's ``print_saved_residuals``: run the forward once and
    say what stays alive for backward, what made it and how big it is, so a
    memory saving can be checked tensor by tensor. An outermost saved-tensor
    hook records every tensor autograd saves (and hands autograd a detached
    alias, so no reference cycle keeps the graph alive); the ledger names the op
    that made each storage. Inside a `forget.forget` region, forget's own hooks
    take over, so nothing saved there reaches this hook: forget keeps nothing but
    the region's inputs, which are listed with ``how="kept"``. So are the
    inputs of a ``torch.utils.checkpoint`` region when the call made them; those
    it got from outside are alive anyway and not listed. The forward's graph is
    dropped before returning.

    Args:
        func: the function (an ``nn.Module`` names its parameters and buffers).
        *xs: its positional inputs (``input 0``, ``input 1``, ...).
        **kwargs: its keyword inputs (``input 'name'``).

    Returns:
        A `SavedReport`; ``str(report)`` is a table, ``report.total_bytes`` the
        bytes made in the call that backward keeps.

    Raises:
        TypeError: ``func`` is not callable.

    Example:
        >>> import torch, forget
        >>> x = torch.ones(1000, requires_grad=True)
        >>> report = forget.saved(lambda a: a.exp().sum(), x)
        >>> [(t.source, t.nbytes) for t in report.tensors]
        [('aten.exp', 4000)]
    """
    if not callable(func):
        raise TypeError(
            f"forget: saved expects a callable, but got {type(func).__name__}; pass the "
            "function itself, e.g. forget.saved(block, x)."
        )
    labels = _labels(func, xs, kwargs)
    ledger = _Ledger()
    # id(storage) -> [how, meta of the first tensor, saves, weak ref to the storage]
    rows: dict[int, list[Any]] = {}

    def note(t: torch.Tensor, how: str) -> None:
        s = _storage(t)
        if s is None:
            return
        row = rows.get(id(s))
        if row is None:
            rows[id(s)] = [how, (tuple(t.shape), t.dtype, str(t.device)), 0, weakref.ref(s)]
        if how == "saved":
            rows[id(s)][2] += 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        note(t, "saved")
        return t.detach()

    before = {id(r) for r in _forget_regions()}
    try:
        with _watch(ledger), torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            out = func(*xs, **kwargs)
        for r in _forget_regions():
            if id(r) not in before:
                for v in r._flat:
                    if isinstance(v, torch.Tensor):
                        note(v, "kept")
        gc.collect()
        records = ledger.records()
        outputs = {id(s) for s in map(_storage, pytree.tree_leaves(out)) if s is not None}
        result: list[SavedTensor] = []
        for key, (how, meta, count, ref) in rows.items():
            s = ref()
            if s is None:
                continue  # freed before the call returned: not kept
            rec = records.get(key)
            shape, dtype, device = meta
            if rec is not None and rec.op:
                source, external = rec.op, False
            else:
                source, external = labels.get(key, "external"), True
            result.append(
                SavedTensor(source, how, shape, dtype, device, s.nbytes(), count, external)
            )
        # Made in the call, alive, neither saved through the hook nor returned: kept by
        # something else (a checkpoint region's closure, a forget region's inputs).
        for key, rec in records.items():
            if rec.op and rec.counted and key not in rows and key not in outputs:
                result.append(
                    SavedTensor(
                        rec.op, "kept", rec.shape, rec.dtype, rec.where, rec.counted, 0, False
                    )
                )
        del out  # the graph, and what it saved, goes now
    finally:
        ledger.close()
    return SavedReport(tuple(result))


def _meta_of(
    t: torch.Tensor, s: torch.UntypedStorage
) -> tuple[tuple[int, ...], torch.dtype, str, int]:
    return (tuple(t.shape), t.dtype, str(t.device), s.nbytes())


def _identity(x: Any) -> Any:
    return x
