"""What a cap knows of the step running now: its regions, the bytes they hold, evictions.

NOTE [the cap's count]: a cap bounds what a training step allocates beyond what
was allocated when it began, the figure `forget.measure` reports and a plan's
budget bounds (parameters and optimizer state are there before, so a ``"free"``
cap leaves room for them). At each region boundary of the forward the runtime
counts ``now``, the bytes the step holds: on CUDA ``memory_allocated`` less its
value at the step's start; on CPU, with no such counter, a running count of
storages, each once: those in the regions' droppable slots (NOTE [droppable
regions]), those the regions keep, and those autograd saves outside the regions
in the model's forward; never parameters, buffers or the step's inputs. The
estimate adds what the next region may add (the latest region's held bytes,
learned per candidate, or at shapes a record read what the forward reached
there: NOTE [forward reaches]), the largest storage once more, the largest
region output, and on CPU the outputs alive that no region holds yet; at the
forward's end it is backward's modelled peak (NOTE [backward in the cap]). While
the estimate passes the cap, regions are evicted (NOTE [eviction order], in
`._orders`); with none left, the step stops with a `ForgetError` naming the
estimate, the model's buffers put back.

NOTE [backward in the cap]: backward is modelled region by region in its order:
at a region with none inside it holds what the regions up to it hold and keep
(an evicted one while backward is inside it, rebuilt, beside what the evicted
regions around it rebuilt), two gradients of its largest tensor, and throughout
what no region holds, the parameters' gradients (NOTE [gradients as they come])
and the model's output once more (not where the model computed its own loss,
which the hook on its forward counted). A storage goes once backward is through
the first region that holds or keeps it, except the slots in which a region
holds its inner regions' inputs (NOTE [nesting]): those go with the first inner
region, and a re-run reads its inputs, so an evicted region's rebuilt bytes
leave them out (counting them with the outer region added a stem's output to
every term). The model is conservative; on CUDA the allocator's peak above a
step's estimate, read as its backward ends (not after the optimizer's step,
whose state is not the step's), joins the next steps' reserve. On CPU some steps
read the allocator's record instead (NOTE [what the count misses]). Figures:
benchmarks/measured.md, "forget.cap".

NOTE [the output's gradients]: backward reaches a region with its output's
gradient, which the op after it (a head's loss) makes beside a gradient of its
own: two of the output's size, before the region has made any parameter
gradient; inside the region come two gradients of its largest tensor, with its
parameters' gradients; and the output's gradient is still there as those come.
So the term at a region with none inside it is the largest of the three
moments, each with the gradients made by then. Counting the output's two
gradients beside the region's own parameter gradients (a head's logits beside
its weight's gradient) counted bytes no step holds at once, and named a least
above the one a plan measures.

NOTE [copies in the count]: a region keeps, for its re-runs, a copy of each
argument it may change (NOTE [arguments that change]): a key/value cache, with
every earlier layer's keys and values. The copy lives as long as the region,
evicted or not, so the count holds those tensors as the region's, as it holds
its inputs: evicting the layer that made them frees them only once no later
layer's copy holds them. A plan that forgets the module around the layers runs
no layer as a region and keeps no copy, so a cap's least can lie above a
plan's by those bytes; the cap's error says how many.
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._engine import (
    DroppableRegion,
    ModuleWalks,
    StorageKey,
    storage_key,
    storage_keys,
    storage_of,
)
from .._errors import ForgetError
from ..policies import Policy
from ._entries import (
    Entry,
    evicted_in_part,
    evicted_whole,
    find_released,
    may_go_in_part,
    worth_a_part,
)
from ._grads import gradients_by_entry
from ._orders import BOUND, EVICTIONS
from ._outputs import on_backward_end, tensor_bytes, tensors_in
from ._regions import BoundedKeep, Partial
from ._report import StepReport

__all__ = ["Step"]

# How many regions ahead the forward's reserve looks, in the last step's order.
_AHEAD = 3


class Step:
    """The bookkeeping of one step under a cap (NOTE [the cap's count]).

    Args:
        model: the capped model.
        budget_bytes: the cap.
        learned: per candidate name, its held bytes, the model's input elements
            when it last ran, and whether it ran no region inside (updated by the step).
        extra_bytes: a learned addition to the reserve (CUDA).
        order: the names of the regions the last step ran, in order.
        eviction: the name of the eviction order (`EVICTIONS`).
        inputs: the step's inputs (the model's arguments): made before the step,
            they are not counted; their elements scale learned sizes.
        walks: the model's last walk, kept from step to step (NOTE [cached walks]).
    """

    def __init__(
        self,
        model: nn.Module,
        budget_bytes: int,
        learned: dict[str, tuple[int, int, bool]],
        extra_bytes: int,
        inputs: Any,
        order: list[str],
        eviction: str = "largest",
        walks: ModuleWalks | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self._score = EVICTIONS[eviction]
        self.learned = learned
        # NOTE [partial evictions]: what the regions with none inside run with, and have
        # learned (None: none runs under a policy in this step); each one's bounded keep.
        self.keeping: Partial | None = None
        self._keeps: dict[str, BoundedKeep] = {}
        self.extra_bytes = extra_bytes
        given = tensors_in(inputs)
        self.input_elements = max(sum(t.numel() for t in given), 1)
        self.entries: list[Entry] = []
        self.running: list[Entry] = []
        self.evicted: list[str] = []
        self.partial: list[str] = []  # evicted in part (NOTE [partial evictions])
        self.evicted_forward_s = 0.0
        self.estimated_peak_bytes = 0
        self.closed = False
        self.rooted = False  # begun by the model's forward
        self.key: tuple[Any, ...] | None = None  # NOTE [steps of known shapes]
        self.finished = False  # the model's forward returned, the cap held throughout
        self.boundaries = 0
        # storage key -> [bytes, holders]; the count of ``now`` on CPU.
        self._live: dict[StorageKey, list[int]] = {}
        self._outside: dict[StorageKey, int] = {}
        self._copied: dict[StorageKey, int] = {}  # held by the regions' argument copies
        # storage key -> the regions holding or keeping it (NOTE [the cap's count]).
        self._holders: defaultdict[StorageKey, list[Entry]] = defaultdict(list)
        self.now_bytes = 0
        # The regions' outputs: alive until used, held by no region before that.
        self._outputs: list[weakref.ref[torch.Tensor]] = []
        self.model_output_bytes = 0
        # NOTE [regions heard]: the largest backward of a forgotten region the model ran
        # itself (a chunked head's slice).
        self.forgotten_bytes = 0
        self.before_term = 0  # its term, where there is one (NOTE [what the count misses])
        self.largest_bytes = 0
        self.largest_out = 0  # the largest output of a region so far
        self._peak_at = -1
        self.order = order
        self._in_order = True  # the regions so far ran as in ``order``
        # NOTE [forward reaches]: from each boundary of the forward to the next, how far
        # the allocator went above the count (read at these shapes); on a read step, the
        # count at each boundary.
        self.reaches: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        walks = walks or ModuleWalks()
        _, params, buffers = walks.walk([model])
        self._model = model
        # The parameters whose gradient the step makes (they had none), and its bytes.
        self._new_grads = [(p, p.nbytes) for p in params if p.requires_grad and p.grad is None]
        self.gradient_bytes = sum([nbytes for _, nbytes in self._new_grads])
        self._grads_by_entry: tuple[int, list[int]] | None = None
        self._external = walks.keys.keys([*params, *buffers]) | storage_keys(given)
        devices = dict.fromkeys([p.device for p in params])
        self.cuda = next((d for d in devices if d.type == "cuda"), None)
        self.cuda_start = torch.cuda.memory_allocated(self.cuda) if self.cuda is not None else 0
        # The allocator's peak when the backward ended (NOTE [the cap's count]); CUDA only.
        self.backward_peak_bytes: int | None = None
        # NOTE [what the count misses]: on CPU, the allocator's record's peak, what marks
        # instants in it, the model's own figures to set against it (its terms in
        # backward by entry, past the last region, and in the forward, each without
        # what the records taught), and what they taught: per region (hard, soft), and
        # of extra_bytes, the soft part (extrapolated to a shape no record read).
        self.allocator_peak_bytes: int | None = None
        self.mark: Callable[[str], None] | None = None
        self.terms: dict[int, int] = {}
        self.outside_term = self.forward_term = 0
        self.workspace: dict[str, tuple[int, int]] = {}
        self.soft_bytes = 0
        self._soft = True
        # NOTE [the cap's count]: buffers as they were, put back if the cap cannot hold.
        self._buffers = [(b, b.detach().clone()) for b in buffers]
        for _, copy in self._buffers:
            self._hold(copy)

    # -- the running count ----------------------------------------------------
    def _hold(self, t: torch.Tensor) -> None:
        s = storage_of(t)
        if s is None:
            return
        self._add(storage_key(t), s.nbytes())

    def _add(self, key: StorageKey, nbytes: int) -> None:
        self._add_all({key: nbytes})

    def _add_all(self, held: dict[StorageKey, int]) -> None:
        """Count each storage of ``held`` (key -> bytes) as held once more."""
        external, live = self._external, self._live
        for key, nbytes in held.items():
            if key in external:
                continue
            if key in live:
                live[key][1] += 1
            else:
                live[key] = [nbytes, 1]
                self.now_bytes += nbytes

    def _remove(self, key: StorageKey) -> None:
        record = self._live.get(key)
        if record is None:
            return
        record[1] -= 1
        if record[1] == 0:
            del self._live[key]
            self._holders.pop(key, None)
            self.now_bytes -= record[0]

    def forgotten_ran(self, region: Any) -> None:
        """Hear of a forgotten region the model ran outside the cap's (NOTE [regions heard])."""
        total, largest, grads = region.rebuilt_bytes()
        # Its rebuilt tensors, two gradients of the largest, and for what it reads that
        # requires grad, the gradient it makes beside the sum of those before it (a
        # weight every slice reads has its gradients summed as they arrive).
        self.forgotten_bytes = max(self.forgotten_bytes, total + 2 * largest + 2 * grads)

    def saved_outside(self, t: torch.Tensor) -> None:
        """Count a tensor autograd saves in the model's forward outside every region."""
        s = storage_of(t)
        if s is None:
            return
        key = storage_key(t)
        if key not in self._outside:
            self._outside[key] = s.nbytes()
            self._add(key, s.nbytes())

    # -- regions --------------------------------------------------------------
    def enter(self, name: str, inputs: list[torch.Tensor]) -> Entry:
        entry = Entry(name, self.running[-1] if self.running else None)
        self._grads_by_entry = None  # found again with this entry (NOTE [gradients as they come])
        for t in inputs:
            if storage_of(t) is not None:
                key = storage_key(t)
                entry.inputs[key] = entry.inputs.get(key, 0) + 1
        entry.index = len(self.entries)
        order = self.order
        self._in_order = self._in_order and entry.index < len(order) and order[entry.index] == name
        if entry.parent is not None:
            entry.parent.children.append(entry)
        self.entries.append(entry)
        self.running.append(entry)
        return entry

    def leave(self, entry: Entry, region: DroppableRegion | None, out: Any, cost_s: float) -> None:
        """Count a region that returned (``region`` None: it raised), then keep to the cap."""
        self.running.pop()
        if region is None:
            return  # it holds nothing; it stays, never done, so indices stay positions
        entry.ref = weakref.ref(region)
        entry.end = self.boundaries + 1  # the boundary `settle` counts below
        entry.cost_s = cost_s
        entry.done = True
        if (keep := self._keeps.pop(entry.name, None)) is not None:
            self._kept_too_much(entry, region, keep)
        # NOTE [partial evictions]: what its policy keeps is held too, in a slot or not.
        held = {**region.kept_output_bytes, **region.held_bytes}
        kept, holders = region.kept_bytes, self._holders
        copied = region.copied_bytes  # NOTE [arguments that change]: for its re-runs
        self._add_all(held)
        self._add_all(kept)  # inputs: they stay while the region lives
        self._add_all(copied)  # so do the copies: evicting the region that made them
        self._copied.update(copied)  # leaves them held (NOTE [copies in the count])
        for key in (*held, *kept, *copied):
            holders[key].append(entry)
        entry.keys = held
        entry.part = {k: n for k, n in region.kept_output_bytes.items() if k not in entry.inputs}
        entry.part_in_slots = sum([n for k, n in entry.part.items() if k in region.held_bytes])
        sizes = list(held.values())
        entry.size = sum(sizes)
        self._grads_by_entry = None
        inputs = entry.inputs
        # A re-run rebuilds what the slots held, not what only its policy kept.
        slots = region.held_bytes
        entry.rebuilt = sum([nbytes for key, nbytes in slots.items() if key not in inputs])
        if entry.children:
            find_released(entry, region)
        entry.leaf = not entry.children
        entry.last = len(self.entries) - 1
        entry.largest = max(sizes, default=0)
        entry.out = tensor_bytes(out)
        outputs = tensors_in(out)
        self._outputs += [weakref.ref(t) for t in outputs]
        if self.mark is not None:  # NOTE [what the count misses]; let go once marked
            entry.grad_fn = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
        self.largest_bytes = max(self.largest_bytes, entry.largest)
        self.largest_out = max(self.largest_out, entry.out)
        self.learned[entry.name] = (entry.size, self.input_elements, entry.leaf)
        # A region run without the model's forward: any boundary may be the last.
        self.settle(entry.name, last=not self.rooted)

    def policy_for(self, name: str) -> Policy | None:
        """What region ``name`` runs with (NOTE [partial evictions]): the partial keep,
        bounded to `BOUND` of the bytes it held when it last ran, scaled; or None."""
        partial = self.keeping
        if partial is None or not partial.runs(name):
            return None
        limit = int(BOUND * self._learned_bytes(name))
        if limit <= 0:
            return None
        keep = self._keeps[name] = BoundedKeep(partial.policy, limit)
        return keep.policy

    def _kept_too_much(self, entry: Entry, region: DroppableRegion, keep: BoundedKeep) -> None:
        """NOTE [partial evictions]: learn what a region under the policy keeps beyond
        its slots; where it kept too much to go in part (or its bound refused some), let
        that go at once (the region is then as if run without the policy)."""
        assert self.keeping is not None
        kept, slots = region.kept_output_bytes, region.held_bytes
        size = sum({**kept, **slots}.values())
        beyond = sum([n for k, n in kept.items() if k not in slots])
        part = sum([n for k, n in kept.items() if k not in entry.inputs])
        too_much = keep.refused or not worth_a_part(part, size)
        self.keeping.learn(entry.name, beyond / max(size, 1), too_much)
        if too_much:
            region.release_kept()

    def model_returned(self, out: Any) -> None:
        # NOTE [the cap's count]: a loss the model returns was counted as it ran.
        loss_inside = any(t.dim() == 0 and t.requires_grad for t in tensors_in(out))
        self.model_output_bytes = 0 if loss_inside else tensor_bytes(out)
        self.settle("the end of the model's forward", last=True)
        self.closed = True
        if self.mark is not None:  # NOTE [what the count misses]
            if self._new_grads and self.cuda is None:
                self._backward(self.now_bytes, refine=True)  # the terms to set against
            self.mark("forward")
            for entry in self.entries:
                if entry.leaf and entry.grad_fn is not None:  # where its backward begins
                    entry.grad_fn.register_prehook(
                        functools.partial(_mark_region, self.mark, entry.index)
                    )
            self.release_nodes()
        if self.cuda is not None or self.mark is not None:
            on_backward_end(out, self._backward_done)

    def release_nodes(self) -> None:
        """Let go of the regions' backward nodes: held here, they would hold the graph, in a
        cycle through its saved tensors' hooks that the garbage collector cannot see."""
        for entry in self.entries:
            entry.grad_fn = None

    def _backward_done(self) -> None:
        """Backward has ended (NOTE [the cap's count]): read the step's allocator peak."""
        if self.mark is not None:
            self.mark("end")
        if self.cuda is None:
            return
        peak = torch.cuda.max_memory_allocated(self.cuda) - self.cuda_start
        self.backward_peak_bytes = max(peak, self.backward_peak_bytes or 0)

    # -- the cap --------------------------------------------------------------
    def _forward_reserve(self) -> int:
        """What the next region's forward may add (NOTE [the cap's count]): its held
        bytes, the largest storage once more, made and not (yet) saved, and its output,
        which no region holds until the region after it saves it."""
        return self._next_bytes() + self.largest_bytes + self.largest_out + self._extra()

    def _extra(self) -> int:
        return self.extra_bytes - (0 if self._soft else self.soft_bytes)

    def _backward(self, now: int, refine: bool = False) -> tuple[int, int]:
        """Backward's estimated peak, and the entry (index) where it falls.

        NOTE [the cap's count]: backward meets the regions in reverse order and
        frees what each held once through it; at a region with none inside it holds
        what the regions up to it hold (the evicted ones around it rebuilt), its own
        working memory (two gradients of its largest tensor or output, of an op's
        output and input at once), and throughout what no
        region holds, all the gradients and the model's output once more.
        """
        entries = self.entries
        # Each storage is freed once backward is through the first region (in the
        # forward's order) that holds or keeps it.
        owned = [0] * len(entries)
        live = self._live
        for key, holders in self._holders.items():
            if holders and key in live:
                if len(holders) == 1:
                    first = holders[0].released.get(key, holders[0].index)
                else:
                    first = min([e.released.get(key, e.index) for e in holders])
                owned[first] += live[key][0]
        outside = max(0, now - sum(owned)) + self.model_output_bytes
        # Past the last region, backward holds every gradient (NOTE [gradients as they come]).
        self.outside_term = outside + self.gradient_bytes
        outside += self._extra()
        peak, where = outside + self.gradient_bytes, -1
        if refine:
            always, later = self._gradients_by_entry()
        else:
            always, later = self.gradient_bytes, [0] * len(entries)
        fixed = outside + always
        if self.forgotten_bytes:
            # NOTE [regions heard]: a forgotten region the model ran itself re-runs as
            # backward meets it; the one after every candidate (a head) meets it first,
            # where all they hold is held. Evicting any of them lowers that term.
            # The gradients made by the last region's backward are there by then (the
            # head's weight, used by its slices: NOTE [gradients as they come]).
            term = fixed + (later[-1] if later else 0) + sum(owned) + self.forgotten_bytes
            self.before_term = term - self._extra()  # NOTE [what the count misses]
            if term > peak:
                peak, where = term, len(entries)
        running = 0
        for i, entry in enumerate(entries):
            running += owned[i]
            if not entry.done:
                continue
            dropped = evicted_whole(entry)
            if not entry.leaf:
                continue
            if dropped:
                rebuilt = entry.rebuilt
            elif evicted_in_part(entry):  # NOTE [partial evictions]: its kept part is held
                rebuilt = entry.rebuilt - entry.part_in_slots
            else:
                rebuilt = 0
            outer = entry.parent
            while outer is not None:
                if outer.done and evicted_whole(outer):
                    # What the enclosing re-run rebuilt and backward has not yet let go.
                    rebuilt += sum(
                        nbytes
                        for key, nbytes in outer.keys.items()
                        if outer.released.get(key, i) <= i
                    )
                outer = outer.parent
            # NOTE [the output's gradients]: where they come, and with which gradients.
            after = later[i + 1] if i + 1 < len(later) else 0
            work = max(2 * entry.out + after, 2 * entry.largest + later[i], entry.out + later[i])
            term = fixed + running + rebuilt + work
            hard, soft = self.workspace.get(entry.name, (0, 0))
            self.terms[i] = term - self._extra()  # NOTE [what the count misses]
            term += hard + (soft if self._soft else 0)
            if term > peak:
                peak, where = term, i
        return peak, where

    def _next_bytes(self) -> int:
        """What the next regions' forward may hold: the latest region with none inside,
        or, where the last step ran regions in this order, the next few as learned
        then, scaled by the input size."""
        latest = next((e.size for e in reversed(self.entries) if e.done and e.leaf), 0)
        done = len(self.entries)
        for name in self.order[done : done + _AHEAD]:
            if self.learned.get(name, (0, 1, False))[2]:
                latest = max(latest, self._learned_bytes(name))
        return latest

    def _learned_bytes(self, name: str) -> int:
        """The bytes region ``name`` held when it last ran, scaled to this step's input."""
        size, elements, _ = self.learned.get(name, (0, 1, False))
        return size * self.input_elements // max(elements, 1)

    def estimate_bytes(self, last: bool) -> int:
        """The step's estimated peak from here on; at the forward's end, backward's."""
        if self.cuda is not None:
            now = torch.cuda.memory_allocated(self.cuda) - self.cuda_start
        else:
            now = self.now_bytes
        if not last:
            reach = self.reaches.get(self.boundaries) if self._in_order else None
            if reach is None:  # NOTE [forward reaches]: at shapes read, the allocator's
                reach = self._forward_reserve()
            return now + self._loose_bytes() + reach + self._kept_reserve()
        peak, self._peak_at = self._backward(now)
        if peak > self.budget_bytes and self._new_grads:
            # NOTE [gradients as they come]: worth the walk only where it may matter.
            peak, self._peak_at = self._backward(now, refine=True)
        return max(now, peak)

    def _kept_reserve(self) -> int:
        """NOTE [partial evictions]: the next region, where it runs under the policy,
        also holds what its policy keeps beyond its slots, which the reach (read with
        the region whole) did not: the share a region of its kind was seen to keep, or
        the most its bound lets it."""
        done, partial = len(self.entries), self.keeping
        name = self.order[done] if done < len(self.order) else None
        if partial is None or name is None or not partial.runs(name):
            return 0
        return int(partial.share(name) * self._learned_bytes(name))

    def _gradients_by_entry(self) -> tuple[int, list[int]]:
        """What `gradients_by_entry` finds, once per step (entries reset it)."""
        if self._grads_by_entry is None:
            self._grads_by_entry = gradients_by_entry(
                self._model, self.entries, self._new_grads, self._holders, self._outside
            )
        return self._grads_by_entry

    def _loose_bytes(self) -> int:
        """On CPU, the regions' outputs alive that ``now`` does not count (NOTE [the cap's
        count]): the activation the next region takes, a residual kept for later."""
        if self.cuda is not None:
            return 0  # the allocator's count has them
        alive = [t for ref in self._outputs if (t := ref()) is not None]
        self._outputs = [weakref.ref(t) for t in alive]
        loose: dict[StorageKey, int] = {}
        for t in alive:
            if (s := storage_of(t)) is not None:
                key = storage_key(t)
                if key not in self._live and key not in self._external:
                    loose[key] = s.nbytes()
        return sum(loose.values())

    def settle(self, where: str, *, last: bool) -> None:
        """Evict regions while the estimate passes the cap (NOTE [eviction order])."""
        self.boundaries += 1
        estimate = self.estimate_bytes(last)
        while estimate > self.budget_bytes:
            victim = self._pick(last)
            if victim is None and self._soft and (self.soft_bytes or self.workspace):
                self._soft = False  # NOTE [what the count misses]: refused on what was read
                fits = self.estimate_bytes(last) <= self.budget_bytes
                self._soft = True
                if fits:
                    break
            if victim is None:
                self._put_back_buffers()
                raise ForgetError(
                    f"forget: the cap of {self.budget_bytes:,} B cannot hold this step: at "
                    f"{where}, with every region it could evict evicted, the step needs at "
                    f"least {estimate:,} B (held now and kept in reserve for gradients and "
                    f"backward's re-runs, NOTE [the cap's count]).{self._copies_note()}"
                    f"{self._unread_note()} Raise the cap to at least {estimate:,} B "
                    "(handle.set_budget), or give the step smaller inputs. The model's "
                    "parameters and buffers are as they were before this step."
                )
            self._evict(*victim)
            estimate = self.estimate_bytes(last)
        self.estimated_peak_bytes = max(self.estimated_peak_bytes, estimate)
        if not last:  # NOTE [what the count misses]: what the forward expects to hold
            self.forward_term = max(self.forward_term, estimate - self._extra())
            if self.mark is not None:  # NOTE [forward reaches]
                self.counts[self.boundaries] = self.now_bytes + self._loose_bytes()
                self.mark(f"b{self.boundaries}")

    def _copies_note(self) -> str:
        """Why the cap needs more than a plan, where the regions' argument copies hold
        bytes (NOTE [copies in the count]); "" where they hold none."""
        copies = sum([n for key, n in self._copied.items() if key in self._live])
        if not copies:
            return ""
        return (
            f" Of that, {copies:,} B are tensors that regions keep, for their re-runs, in "
            "their copies of an argument they change (a key/value cache's earlier keys and "
            "values: NOTE [copies in the count]); a plan (forget.plan) that forgets the "
            "module around those regions keeps none, so it may fit in less, and a model "
            "run without its cache (use_cache=False) has none to keep."
        )

    def _unread_note(self) -> str:
        """On CPU, before any allocator record taught the count: what it cannot see."""
        if self.cuda is not None or self.extra_bytes or self.workspace:
            return ""
        return (
            " That is the count alone: kernels' workspaces, which it cannot see, are "
            "learned from the allocator's record of a step that runs (NOTE [what the count "
            "misses]), so a cap of exactly that may name a little more at its second step."
        )

    def _evictable(self) -> Iterator[tuple[Entry, DroppableRegion]]:
        for entry in self.entries:
            region = entry.region() if entry.done else None
            if region is None or region.dropped:
                continue
            if all(self._out_of_the_way(child) for child in entry.children):
                yield entry, region

    def _out_of_the_way(self, entry: Entry) -> bool:
        """Whether ``entry`` lets the region around it go (NOTE [regions that hold nothing]).

        NOTE [regions that hold nothing]: a region is evicted only once every region
        inside it is, or its own slots would still hold what the outer re-run
        rebuilds. A region that holds nothing the count has (an embedding, which
        saves only the step's integer ids) is never evicted, since that frees
        nothing; so it would keep the region around it (the whole decoder, whose
        eviction a plan makes the least) from ever going. It stands in no one's
        way: evicted or not, it holds nothing, and the outer re-run runs it again.
        """
        if evicted_whole(entry):
            return True
        live = self._live
        held = any(key in live for key in entry.keys)
        return not held and all(self._out_of_the_way(child) for child in entry.children)

    def _pick(self, last: bool) -> tuple[Entry, bool] | None:
        """The region to evict next, and whether in part (NOTE [partial evictions]):
        a region in part before any whole, each stage in the eviction order."""
        best: dict[bool, tuple[float, Entry]] = {}
        live = self._live
        for entry, region in self._evictable():
            partial = not region.partly_dropped and may_go_in_part(entry)
            keys = [k for k in entry.keys if k not in entry.part] if partial else entry.keys
            freed = sum(live[k][0] for k in keys if live.get(k, (0, 0))[1] == 1)
            # At the forward's end, evicting it must lower backward's peak: only what
            # backward meets before its span holds less (its span holds it rebuilt).
            if freed == 0 or (last and self._peak_at <= entry.last):
                continue
            staleness = self.boundaries - entry.end + 1
            score = self._score(freed, staleness, entry.cost_s, entry.index)
            if partial not in best or score > best[partial][0]:
                best[partial] = (score, entry)
        for partial in (True, False):
            if partial in best:
                return best[partial][1], partial
        return None

    def _evict(self, entry: Entry, partial: bool = False) -> None:
        region = entry.region()
        assert region is not None
        was_in_part = region.partly_dropped
        region.drop(partial=partial)
        gone = [k for k in entry.keys if k not in entry.part] if partial else list(entry.keys)
        for key in gone:
            self._remove(key)
            holders = self._holders.get(key)
            if holders is not None and entry in holders:
                holders.remove(entry)
        if partial:  # NOTE [partial evictions]
            entry.keys = {k: n for k, n in entry.keys.items() if k in entry.part}
            self.partial.append(entry.name)
            return
        if was_in_part:  # now whole
            self.partial.remove(entry.name)
        self.evicted.append(entry.name)
        self.evicted_forward_s += entry.cost_s

    def _put_back_buffers(self) -> None:
        with torch.no_grad():
            for buffer, copy in self._buffers:
                buffer.copy_(copy)

    def report(self) -> StepReport:
        return StepReport(
            regions=tuple(e.name for e in self.entries),
            evicted=tuple(self.evicted),
            partial=tuple(self.partial),
            estimated_peak_bytes=self.estimated_peak_bytes,
            budget_bytes=self.budget_bytes,
            evicted_forward_s=self.evicted_forward_s,
            allocator_peak_bytes=self.allocator_peak_bytes,
        )


def _mark_region(mark: Callable[[str], None], index: int, _: Any) -> None:
    mark(str(index))
