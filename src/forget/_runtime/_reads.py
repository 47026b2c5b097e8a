"""What a cap on CPU learns from the allocator's own record of a step.

NOTE [what the count misses]: on CPU the cap counts tensor storages (NOTE [the
cap's count]); what a kernel allocates for itself (oneDNN's convolutions) is no
tensor, and the count misses it. CUDA's counters are free at every step; on CPU
the allocator's one record is torch's profiler (`forget._memory.AllocatorRecord`),
which costs time, so only some steps are read: the first capped step, each
larger than any read before, the next of a size whose read passed the cap, and
the second capped step of shapes that may go in part (NOTE [partial at shapes
seen]). Each span's peak, between marks at the forward's end, each region's
first backward node and backward's end, less the model's figure for it, is what
the count missed: added per region to that region's term, so a kernel's buffers
weigh where they arise, and outside regions to every figure; learned per input
size, scaled (softly: it evicts, never refuses) above the largest read. The
record stops on its thread, outside autograd's engine, at the next forward,
optimizer step, report read or probe; where the user's profiler runs already,
the step is not read. Figures: benchmarks/measured.md, "What the count misses".

NOTE [forward reaches]: a read step also marks each boundary of its forward and
notes the count there; the allocator's peak from that mark to the next, less
that count, is how far the forward reached past the boundary (the next region's
activations, temporaries and what the count misses, at once). A later capped
step of the same key (NOTE [steps of known shapes]), its regions so far run in
the same order, reserves that reach instead of the reserve made for a step that
knows nothing, which kept a layer too few (benchmarks/measured.md, "Forward
reaches"). The reach is the allocator's own figure at those very shapes, never
scaled. It takes the same shapes to run the same regions, so a model that skips
layers at random (LayerDrop) wants ``repeat_known_shapes=False``, which learns
no reach. CUDA steps read no record and keep the reserve.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._memory import AllocatorReading, AllocatorRecord
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
        self._on_stop: Callable[[AllocatorReading], None] | None = None
        # input elements -> bytes the count missed: outside the regions, per region.
        self._flat: dict[int, int] = {}
        self._regions: defaultdict[str, dict[int, int]] = defaultdict(dict)
        # A step's key -> boundary -> how far the forward reached past it (NOTE
        # [forward reaches]).
        self._reaches: dict[tuple[Any, ...], dict[int, int]] = {}
        self._most = 0  # the most input elements a record has read
        self._over: set[int] = set()  # input sizes whose latest read passed its cap

    def start(
        self, target: _Target, on_stop: Callable[[AllocatorReading], None], again: bool = False
    ) -> AllocatorRecord | None:
        """Open a record for the step ``target`` where it is to be read; the record, or None.

        ``again``: the step's shapes were seen and never read (NOTE [partial
        evictions]). A step repeating a decision (NOTE [steps of known shapes])
        comes here only where every step is read.
        """
        elements = target.input_elements
        if target.cuda is not None or self.when == "never" or self.record is not None:
            return None
        larger = elements > self._most or elements in self._over
        if self.when == "largest" and not larger and not again:
            return None
        # The record and the optimizer's hook reach this object weakly: a record left
        # open by a cap no longer used holds neither it nor its step's graph.
        link = _Link(self)
        record = AllocatorRecord(link.stopped)
        try:
            started = record.start()
        except (AttributeError, TypeError):  # pragma: no cover - another torch
            return None
        if not started:
            return None  # a profiler runs already (the user's): nothing is read
        self.record, self._thread, self._on_stop = record, threading.get_ident(), on_stop
        self._most = max(self._most, elements)
        link.hook = register_optimizer_step_pre_hook(link.optimizer_step)
        return record

    def stop(self, *, ended_only: bool = False) -> None:
        """Stop the open record (only where its backward has ended, with ``ended_only``)."""
        record = self.record
        if record is None or (ended_only and "end" not in record.marks):
            return
        if threading.get_ident() == self._thread:  # torch's profiler runs per thread
            record.stop()  # `stopped` hears it, through the link

    def stopped(self, reading: AllocatorReading) -> None:
        """The open record stopped (here or by another probe on its thread): tell the cap."""
        on_stop, self._on_stop, self.record = self._on_stop, None, None
        if on_stop is not None:
            on_stop(reading)

    def apply(self, step: Step) -> None:
        """Give ``step`` what the records taught, for its input size and its shapes."""
        if step.key is not None:
            step.reaches = self._reaches.get(step.key, {})
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
        starts = sorted((t, name) for name, t in marks.items() if name.isdigit())
        first = starts[0][0] if starts else end
        # Up to the first region's backward, backward holds what that region's term counts.
        head = step.terms.get(int(starts[0][1]), 0) if starts else step.outside_term
        flat = max(
            reading.peak(until=forward) - step.forward_term,
            reading.peak(forward, first) - max(head, step.outside_term, step.before_term),
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
        if step.key is not None:  # NOTE [forward reaches]
            reaches = self._reaches.setdefault(step.key, {})
            for boundary, counted in step.counts.items():
                mark = marks.get(f"b{boundary}")
                if mark is None:
                    continue  # the record stopped before it (another probe's)
                reach = reading.peak(mark, marks.get(f"b{boundary + 1}", forward)) - counted
                reaches[boundary] = max(reaches.get(boundary, reach), reach)
        peak = reading.peak(until=end)
        if peak > step.budget_bytes:
            self._over.add(elements)
        else:
            self._over.discard(elements)
        return peak


class _Link:
    """What a record and the optimizer's hook hold of `Reads`: a weak reference."""

    def __init__(self, reads: Reads) -> None:
        self.reads = weakref.ref(reads)
        self.hook: Any = None

    def optimizer_step(self, *_: Any) -> None:
        reads = self.reads()
        if reads is not None:
            reads.stop(ended_only=True)

    def stopped(self, reading: AllocatorReading) -> None:
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        reads = self.reads()
        if reads is not None:
            reads.stopped(reading)


def _scaled(table: dict[int, int], elements: int) -> tuple[int, int]:
    """What ``table`` (input elements -> bytes) says for ``elements``: (read, scaled beyond)."""
    if not table:
        return 0, 0
    above = [nbytes for e, nbytes in table.items() if e >= elements]
    if above:
        return max(above), 0
    most = max(table)
    return table[most], table[most] * (elements - most) // most
