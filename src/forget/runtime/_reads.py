"""What a cap on CPU learns from the allocator's own record of a step.

NOTE [what the count misses]: on CPU the cap counts tensor storages (NOTE [the
cap's count]); what a kernel allocates for itself is no tensor an op returns
or autograd saves, and the count misses it. oneDNN's convolutions are the large
case: timm's ConvNeXt-Atto at 64 px, batch 4, peaks at 33,818,168 B by the
allocator and 21,093,704 B by the ledger, and a cap at 75 % of its plain peak
passed itself by 34 % with nothing evicted (benchmarks/measured.md). CUDA's
counters are read at every step for free; on CPU the one record of the
allocator is torch's profiler (`forget.memory.AllocatorRecord`), which costs
a step's time, so the cap reads it on some steps only (``read_allocator``):
by default the first capped step, each capped step with more input elements
than any read before (a read step's excess covers every smaller step) and the
next capped step of a size whose read passed the cap (until one holds), or on
every step, or never. A read step runs from its model's forward to the end of
its backward with the record open; marks note the forward's end, the start of
each region's backward (a hook on its output's gradient) and backward's end.
Each span's allocator peak, set against the model's own figure for it (the
forward's estimate; past the last region; each region's term in backward,
NOTE [the cap's count]), gives what the count missed there: per region, added
to its term from then on, so that a kernel's buffers weigh where they arise
(set against the whole step's peak instead, a ConvNeXt at batch 8 with every
region evicted was refused at 75 %, needing 34 MB where the plan fits 26 MB);
outside the regions, added to every figure. Each is learned per input size:
a step no larger than one read takes the largest excess read at or above its
size; a larger one the excess of the largest read, scaled by the sizes' ratio.
The scaled part is soft: it makes the step evict, but a step is refused (the
cap cannot hold) only on what was read, and a larger step is read anyway.

The record must stop on its thread and outside autograd's engine (which puts
the profiler's state back after each hook and callback): it stops at the
model's next forward, at the next optimizer step (a hook on every optimizer's
step), when the handle's reports are read, at `Cap.remove`, or at forget's next
allocator probe on the thread. Until then torch's profiler is busy on that
thread: start your own after one of those, or pass ``read_allocator="never"``.
Where a profiler runs already (yours), the cap reads nothing.

What it leaves: the first step of a cap, with nothing read yet, counts tensors
alone and may pass the cap by what its kernels allocate (ConvNeXt-Atto: 1.04
of a 75 % cap), as a CUDA cap's first step may.
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..memory import AllocatorReading, AllocatorRecord
from ._steps import Step

__all__ = ["READ_ALLOCATOR", "Reads"]

#: Which steps on CPU read the allocator's own record (NOTE [what the count misses]).
READ_ALLOCATOR = ("largest", "every", "never")


class _Target(Protocol):
    cuda: Any
    input_elements: int


class Reads:
    """The allocator's record of a cap's steps: the one open, and what they taught.

    Args:
        when: which steps are read, one of `READ_ALLOCATOR`.
    """

    def __init__(self, when: str) -> None:
        self.when = when
        self.record: AllocatorRecord | None = None
        self._thread = 0
        self._hook: Any = None
        # input elements -> bytes the count missed: outside the regions, per region.
        self._flat: dict[int, int] = {}
        self._regions: defaultdict[str, dict[int, int]] = defaultdict(dict)
        self._most = 0  # the most input elements a record has read
        self._over: set[int] = set()  # input sizes whose latest read passed its cap

    def start(
        self, target: _Target, on_stop: Callable[[AllocatorReading], None], repeated: bool
    ) -> AllocatorRecord | None:
        """Open a record for the step ``target`` where it is to be read; the record, or None."""
        elements = target.input_elements
        if target.cuda is not None or self.when == "never" or self.record is not None:
            return None
        if self.when == "largest" and (
            repeated or (elements <= self._most and elements not in self._over)
        ):
            return None
        record = AllocatorRecord(functools.partial(self._stopped, on_stop))
        try:
            started = record.start()
        except (AttributeError, TypeError):  # pragma: no cover - another torch
            return None
        if not started:
            return None  # a profiler runs already (the user's): nothing is read
        self.record, self._thread = record, threading.get_ident()
        self._most = max(self._most, elements)
        self._hook = register_optimizer_step_pre_hook(self._optimizer_step)
        return record

    def _optimizer_step(self, *_: Any) -> None:
        self.stop(ended_only=True)

    def stop(self, *, ended_only: bool = False) -> None:
        """Stop the open record (only where its backward has ended, with ``ended_only``)."""
        record = self.record
        if record is None or (ended_only and "end" not in record.marks):
            return
        if threading.get_ident() == self._thread:  # torch's profiler runs per thread
            record.stop()  # `_stopped` hears it

    def _stopped(self, on_stop: Callable[[AllocatorReading], None], reading: Any) -> None:
        self.record = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        on_stop(reading)

    def apply(self, step: Step) -> None:
        """Give ``step`` what the records taught, for its input size."""
        if not self._flat:
            return
        elements = step.input_elements
        hard, soft = _scaled(self._flat, elements)
        step.extra_bytes, step.soft_bytes = hard + soft, soft
        step.workspace = {name: _scaled(t, elements) for name, t in self._regions.items()}

    def learn(self, step: Step, reading: AllocatorReading) -> int | None:
        """Learn from a read step; its allocator peak to backward's end (None: none came)."""
        marks = reading.marks
        end, forward = marks.get("end"), marks.get("forward")
        if end is None or forward is None:
            return None
        elements = step.input_elements
        starts = sorted((t, name) for name, t in marks.items() if name not in ("end", "forward"))
        first = starts[0][0] if starts else end
        # Up to the first region's backward, backward holds what that region's term counts.
        head = step.terms.get(int(starts[0][1]), 0) if starts else step.outside_term
        flat = max(
            reading.peak(until=forward) - step.forward_term,
            reading.peak(forward, first) - max(head, step.outside_term),
            0,
        )
        self._flat[elements] = max(self._flat.get(elements, 0), flat)
        bounds = [t for t, _ in starts[1:]] + [end]
        for (since, name), until in zip(starts, bounds, strict=True):
            index = int(name)
            term = step.terms.get(index)
            if term is not None:
                table = self._regions[step.entries[index].name]
                excess = reading.peak(since, until) - term
                table[elements] = max(table.get(elements, 0), excess, 0)
        peak = reading.peak(until=end)
        if peak > step.budget_bytes:
            self._over.add(elements)
        else:
            self._over.discard(elements)
        return peak


def _scaled(table: dict[int, int], elements: int) -> tuple[int, int]:
    """What ``table`` (input elements -> bytes) says for ``elements``: (read, scaled beyond)."""
    if not table:
        return 0, 0
    above = [nbytes for e, nbytes in table.items() if e >= elements]
    if above:
        return max(above), 0
    most = max(table)
    return table[most], table[most] * (elements - most) // most
