"""The ledger: a dispatch mode that counts the bytes of every storage a call makes.

NOTE [the ledger]: `measure` watches a call with a dispatch mode that sees every
aten op (forward, backward, recomputation, optimizer step). Each op output's
storage is registered once, with a ``weakref.finalize`` that sees it freed; the
storage's ``nbytes()`` is added to the live total when it appears and taken off
when it is freed. Counting storages, not tensors, deduplicates views. A storage
first seen as an op *input* was made before the call (a parameter, an input, a
buffer) and is external: it is never counted, nor are views of it (``aten.t(w)``
shares ``w``'s storage). So the figures are byte counts of what the call
allocated, identical from run to run and machine to machine.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._engine import storage_of

# Ops whose input is a tensor made outside the dispatcher (``torch.tensor([...])``
# builds it in C++, then lifts it): their input is new memory, not external.
_LIFTS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})


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


class StorageRecord:
    """What the ledger knows of one storage it has seen (`Ledger.records`).

    Attributes:
        op: the aten op whose output it first was (``"aten.mm"``), or ``""`` for
            a storage made before the call (a parameter, an input: external,
            never counted).
        counted: the bytes it adds to the live total now (its ``nbytes()`` for
            a storage the call made; an external one's growth by ``resize_``).
        base: the bytes it had before the call (0 if the call made it).
        shape, dtype: those of the first tensor seen on it.
        device: the device type (``"cpu"``, ``"cuda"``); ``where`` the full
            device (``"cuda:0"``) of a storage the call made.
        regions: the names of the regions (`region`, a ledger entry) open when
            it was made, outermost first.
    """

    __slots__ = (
        "_entries",
        "base",
        "counted",
        "device",
        "dtype",
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
        self.base = base
        self.counted = 0
        self.device = device
        self.op = op
        self._entries = entries  # the open entries it counts in, for region figures
        self.shape = shape
        self.dtype = dtype
        self.where = device
        self.finalizer: weakref.finalize[..., Any] | None = None

    @property
    def regions(self) -> tuple[str, ...]:
        return tuple(e.name for e in self._entries)

    def __repr__(self) -> str:
        made = f"made by {self.op}" if self.op else "external"
        return f"StorageRecord({made}, {self.counted:,} B counted, {self.where})"


class _Active(threading.local):
    ledgers: list[Ledger]

    def __init__(self) -> None:
        self.ledgers = []


_active = _Active()


class Ledger(TorchDispatchMode):
    """The dispatch mode behind `measure` and `saved` (NOTE [the ledger]).

    Storages on the meta device (of fake tensors: torch's ``FakeTensorMode``)
    hold no memory and are not counted, unless ``fake``: a ledger counting a
    step run on fake tensors tells the bytes it would take on real ones
    (NOTE [tree figures] in `forget._planning`).
    """

    def __init__(self, fake: bool = False) -> None:
        super().__init__()
        self.fake = fake
        self._lock = threading.RLock()
        self._records: dict[int, StorageRecord] = {}
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
            rec = StorageRecord(s.nbytes(), s.device.type, "", ())
            self._records[key] = rec
            rec.finalizer = self._finalize(s, key)

    def _see_output(self, t: Any, s: torch.UntypedStorage, op: str, backward: bool) -> None:
        key = id(s)
        rec = self._records.get(key)
        if rec is None:
            shape, dtype = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else ((), None)
            rec = StorageRecord(
                0, s.device.type, op, tuple(self._entries), shape, dtype or torch.uint8
            )
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

    def _add(self, rec: StorageRecord, delta: int, backward: bool) -> None:
        rec.counted += delta
        self.live += delta
        dev = rec.device
        self.live_by_device[dev] = self.live_by_device.get(dev, 0) + delta
        for e in rec._entries:
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
            for e in rec._entries:
                if e.open:
                    e.freed += rec.counted

    def records(self) -> dict[int, StorageRecord]:
        """``id`` of each live storage seen -> its `StorageRecord` (a copy of the table).

        The records are the ledger's own, updated as the call goes on; read them,
        do not change them.
        """
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
                    s = storage_of(leaf)
                    if s is not None and (self.fake or s.device.type != "meta"):
                        self._see_input(s)
        out = func(*args, **kwargs)
        with self._lock:
            name = _op_name(func)
            for leaf in pytree.tree_leaves(out):
                s = storage_of(leaf)
                if s is not None and (self.fake or s.device.type != "meta"):
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
def watch(ledger: Ledger) -> Iterator[None]:
    _active.ledgers.append(ledger)
    try:
        with ledger:
            yield
    finally:
        _active.ledgers.remove(ledger)
