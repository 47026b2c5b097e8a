"""`cap`: keep every training step of a model under a memory cap, with no plan.

NOTE [a cap, not a plan]: a plan is fixed for the shapes it measured; a cap
decides at run time, step by step, from the shapes it sees. Every candidate
region (the model tree's, NOTE [tree candidates], with finer regions inside
a one-of-a-kind one, NOTE [finer regions]; or ``candidates=``) runs
as a `forget._engine.DroppableRegion` (NOTE [droppable regions]): its saved
tensors stay, as under plain autograd, until the runtime evicts it, and an
evicted region re-runs in backward exactly as a forgotten one does. The
runtime counts the step's memory at each region boundary and evicts while
the estimate passes the cap (NOTE [the cap's count], NOTE [eviction order]).
The model's own forward is wrapped too: it marks the step's start and end and
sees what autograd saves outside the regions. Like a plan, the cap
changes no class and adds no submodule, through the same wrapper (NOTE
[instance forward] in `forget._regions`); `Cap.remove` restores each forward
exactly.

NOTE [steps of known shapes]: a step whose shapes the cap has seen hold within
it repeats the decision made then, without counting: the regions evicted then
run forgotten from the start (`forget._engine.run_region`), every other
candidate plain, with no hook. The key is every tensor argument's shape, dtype
and device, the other arguments' values, every module's training flag and which
parameters require grad: the bytes a step holds follow from them. A repeated
step holds no more than the capped step it repeats (the same regions re-run,
and it never holds their activations). A decision is learned from a capped step
within the cap (from the key's second one where it evicted: the first evicts
more than it needs) and used while its estimate is within the cap and the cap
is no higher than the one it was made under. On CUDA a repeated step's allocator
peak above the estimate forgets the decision. A step whose memory depends on its
values (experts' routing, dropped padding) wants the handle's ``repeat_known_shapes`` set to False.
Figures: benchmarks/measured.md, "A cap never reached".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._engine import (
    DroppableRegion,
    ModuleWalks,
    forgotten_regions,
    in_recomputing,
    run_region,
)
from .._errors import ForgetError
from .._memory import AllocatorReading
from .._regions import HEAD, find_candidates, owner_of, unwrap_forward, wrap_forward
from ..policies import Policy
from ._orders import EVICTIONS
from ._outputs import on_backward_end, tensors_in
from ._reads import READ_ALLOCATOR, Reads
from ._regions import Partial, leaf_names, partial_policy, with_finer
from ._report import StepReport
from ._share import CapBudget
from ._steps import Step

__all__ = ["Cap", "cap"]

#: Reports kept by a handle (the most recent steps).
_HISTORY = 1000


def cap(
    model: nn.Module,
    budget: int | float | str,
    *,
    candidates: str | type | Iterable[str | type] | None = None,
) -> Cap:
    """Keep every training step of ``model`` under ``budget`` bytes, in place, with no plan.

    Regions keep their activations while they fit and are evicted, to be
    re-run exactly in backward, when the step's memory would pass the cap:
    memory is traded for recomputation only as far as each step's shapes
    need, decided at run time (NOTE [a cap, not a plan]). The cap bounds what
    a step allocates beyond what was allocated when it began, the figure
    `forget.measure` reports (NOTE [the cap's count]). Gradients are those of
    the plain step, bitwise on CPU; dropout is replayed and BatchNorm
    statistics are updated once. A step of shapes seen before repeats what the
    cap decided for them, with no count (NOTE [steps of known shapes]); from a
    shape's second step on, a region may go in part first, keeping its linear
    layers' and attention's outputs (NOTE [partial evictions]).

    Args:
        model: the module whose forward a training step calls.
        budget: what `forget.plan` takes (NOTE [one budget] in `forget._memory`):
            bytes (``int``), a size (``"512MiB"``, ``"2GB"``), a share of the
            plain step's peak (``"60%"``, ``0.6``), predicted for each shape the
            cap meets (NOTE [a share of the cap]), or on CUDA ``"free"`` (what
            the device has free now, less a margin).
        candidates: which submodules may be regions, as `forget.plan` takes
            them (a name pattern, a module type, or a list of them); default
            the repeated blocks and the modules around them (NOTE [tree
            candidates]), with the children of a one-of-a-kind one (a stem)
            as regions inside it (NOTE [finer regions]).

    Returns:
        A `Cap`; ``handle.remove()`` puts the model back as it was.

    Raises:
        TypeError: ``model`` is no ``nn.Module``; a budget of another type.
        ValueError: a budget that is no size; ``"free"`` off CUDA; a model with no
            candidate region.
        ForgetError: the model runs under a cap or a plan already. During a step:
            a cap that cannot hold, naming the least the step needs; a share
            whose plain peak cannot be predicted (a step that does not run on
            fake tensors).

    Example:
        >>> import torch, forget
        >>> from torch import nn
        >>> def block():
        ...     return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))
        >>> net = nn.Sequential(*[block() for _ in range(6)])
        >>> handle = forget.cap(net, "5MB")
        >>> for rows in (64, 256, 128):  # shapes vary; nothing planned
        ...     step = lambda: net(torch.randn(rows, 64)).sum().backward()
        ...     assert forget.measure(step).peak_bytes <= handle.budget_bytes
        >>> "5" in handle.last_step.evicted  # backward meets the last block first
        False
        >>> handle.remove()
        Sequential(...)
    """
    return _cap_with(model, budget, candidates=candidates)


# NOTE [the cap's defaults]: how a cap evicts (the largest region first), which
# CPU steps read the allocator (the largest shapes so far), whether a step of
# shapes seen repeats its decision (yes), and what a region evicted in part keeps
# (the selective keep) are fixed, not `cap`'s arguments: each was chosen by
# measuring the alternatives side by side, and the records are in
# benchmarks/measured.md (the eviction orders, the allocator's reads, steps of
# known shapes, partial evictions). `_cap_with` takes them for the benchmarks and
# tests that compare them; a handle's ``repeat_known_shapes`` may be set to
# False for a model whose memory depends on its values (NOTE [steps of known
# shapes]).
def _cap_with(
    model: nn.Module,
    budget: int | float | str,
    *,
    candidates: str | type | Iterable[str | type] | None = None,
    eviction: str = "largest",
    repeat_known_shapes: bool = True,
    read_allocator: str = "largest",
    partial: str | Policy | None = "selective",
) -> Cap:
    """`cap` with its defaults open (NOTE [the cap's defaults]): for benchmarks and tests.

    ``eviction``: an order of `EVICTIONS` (NOTE [eviction order]);
    ``repeat_known_shapes`` (NOTE [steps of known shapes]); ``read_allocator``:
    ``"largest"``, ``"every"`` or ``"never"`` (NOTE [what the count misses]);
    ``partial``: ``"selective"``, a policy that keeps op outputs, or ``None``
    for whole regions only (NOTE [partial evictions]).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"forget: cap takes an nn.Module, got {type(model).__name__}; pass the model "
            "whose forward the training step calls."
        )
    CapBudget(budget, _device_of(model))  # a budget that is none raises before any wrapping
    if eviction not in EVICTIONS:
        raise ValueError(
            f"forget: no eviction order named {eviction!r}; expected one of "
            f"{', '.join(map(repr, EVICTIONS))} (NOTE [eviction order])."
        )
    if read_allocator not in READ_ALLOCATOR:
        raise ValueError(
            f"forget: read_allocator={read_allocator!r} names no choice; expected one of "
            f"{', '.join(map(repr, READ_ALLOCATOR))} (NOTE [what the count misses])."
        )
    policy = partial_policy(partial)
    _refuse_wrapped(model)
    names = [
        name
        for name in find_candidates(model, candidates)
        if not isinstance(model.get_submodule(name), nn.ModuleList | nn.ModuleDict)
    ]
    if candidates is None:
        names = with_finer(model, names)
    if not names:
        raise ValueError(
            f"forget: {type(model).__name__} has no candidate region for a cap: no repeated "
            "blocks or modules around them (NOTE [tree candidates]); name the submodules "
            "that may be regions with candidates= (a name pattern such as '*.layers.*', a "
            "module type, or a list of them)."
        )
    return Cap(model, names, budget, eviction, repeat_known_shapes, read_allocator, policy)


class Cap:
    """A cap in force on a model (`cap`): its budget, what it did, and `remove`.

    Attributes:
        model: the capped model.
        names: the candidate regions, dotted names.
        eviction: the eviction order's name (NOTE [eviction order]).
        repeat_known_shapes: whether a step of shapes seen repeats its decision
            (NOTE [steps of known shapes]); set it to False for a model whose
            memory depends on its values, not its shapes.
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        budget: int | float | str,
        eviction: str = "largest",
        repeat_known_shapes: bool = True,
        read_allocator: str = "largest",
        partial: Policy | None = None,
    ) -> None:
        self.model = model
        self.names = tuple(names)
        # NOTE [partial evictions]: the regions with no candidate inside run with it.
        kinds = {name: type(model.get_submodule(name)) for name in leaf_names(names)}
        self._keeping = None if partial is None else Partial(partial, kinds)
        self.eviction = eviction
        self.repeat_known_shapes = repeat_known_shapes
        self._budget = CapBudget(budget, _device_of(model))  # NOTE [a share of the cap]
        self._budget_bytes = self._budget.bytes
        self._step: Step | None = None
        self._history: list[StepReport] = []
        # NOTE [steps of known shapes]: the decision for each key, and the keys run capped.
        self._known: dict[tuple[Any, ...], _Decision] = {}
        self._seen: set[tuple[Any, ...]] = set()
        self._repeat: _Repeat | None = None  # the step repeating a decision (or the last)
        self._order: list[str] = []  # the regions of the latest capped step, in order
        self._learned: dict[str, tuple[int, int, bool]] = {}
        self._extra_bytes = 0
        self._reads = Reads(read_allocator)  # NOTE [what the count misses]
        self._walks = ModuleWalks()  # NOTE [cached walks]
        self._install()

    @property
    def partial(self) -> Policy | None:
        """What a region evicted in part keeps (NOTE [partial evictions]); None: whole only."""
        return None if self._keeping is None else self._keeping.policy

    @property
    def budget_bytes(self) -> int:
        """The cap, in bytes; a share's, of the latest step's shapes (0 before the first)."""
        return self._budget_bytes

    @property
    def budget(self) -> int | float | str:
        """The budget as given to `cap` or `set_budget` (NOTE [one budget] in `forget._memory`)."""
        return self._budget.given

    def set_budget(self, budget: int | float | str) -> None:
        """Change the cap from the next step on (what `cap` takes as ``budget``)."""
        self._budget.set(budget)
        self._budget_bytes = self._budget.bytes

    @property
    def last_step(self) -> StepReport | None:
        """What the cap did in the latest step (its forward so far), or ``None``."""
        self._reads.stop(ended_only=True)
        if self._step is not None:
            return self._step.report()
        return self._history[-1] if self._history else None

    @property
    def steps(self) -> tuple[StepReport, ...]:
        """What it did in each step, oldest first (the latest 1000)."""
        self._reads.stop(ended_only=True)
        latest = () if self._step is None else (self._step.report(),)
        return (*self._history, *latest)

    def remove(self) -> nn.Module:
        """Put the model back exactly as it was before `cap`; return it."""
        self._reads.stop()
        for name in self.names:
            _unwrap(self.model.get_submodule(name))
        _unwrap(self.model)
        self._step = None
        return self.model

    def apply(self) -> nn.Module:
        """Put this cap in force again after `remove`, as it was; return the model.

        Its settings and what it had learned stay; the step in flight at `remove`
        was dropped, as `remove` drops it.

        Raises:
            ForgetError: the model runs under a cap or a plan now.
        """
        _refuse_wrapped(self.model)
        self._install()
        return self.model

    def _install(self) -> None:
        """Wrap the regions' forwards and the model's; none of them where one fails."""
        wrapped: list[nn.Module] = []
        try:
            for name in self.names:
                module = self.model.get_submodule(name)
                _wrap(module, functools.partial(self._region_forward, name))
                wrapped.append(module)
            _wrap(self.model, self._model_forward)
            wrapped.append(self.model)
        except BaseException:
            for module in wrapped:
                _unwrap(module)
            raise

    def __repr__(self) -> str:
        return f"<forget cap of {self._budget_bytes:,} B over {len(self.names)} regions>"

    # -- the wrapped forwards ---------------------------------------------------
    def _close_previous(self) -> None:
        """File the step before this one, and learn from it (NOTE [the cap's count])."""
        self._reads.stop()
        repeat, self._repeat = self._repeat, None
        if repeat is not None and (repeat.allocator_peak_bytes or 0) > repeat.decision.estimate:
            self._known.pop(repeat.key, None)  # NOTE [what the count misses]
        if repeat is not None and repeat.cuda is not None:
            # NOTE [steps of known shapes]: the allocator's peak of a repeated step.
            # Above its estimate, the shapes run capped again, whose own peak then
            # teaches the reserve (a fixed estimate would add the excess every step).
            reached = torch.cuda.max_memory_allocated(repeat.cuda) - repeat.start
            if reached > repeat.decision.estimate:
                self._known.pop(repeat.key, None)
        previous, self._step = self._step, None
        if previous is None:
            return
        self._history = [*self._history, previous.report()][-_HISTORY:]
        self._order = [e.name for e in previous.entries]
        if previous.cuda is not None:
            # NOTE [the cap's count]: the allocator's peak teaches the reserve, as
            # it was when the backward ended.
            peak = previous.backward_peak_bytes
            if peak is None:
                peak = torch.cuda.max_memory_allocated(previous.cuda) - previous.cuda_start
            self._extra_bytes += max(0, peak - previous.estimated_peak_bytes)
        read = previous.allocator_peak_bytes  # NOTE [what the count misses]
        key = previous.key
        # A step that raised (a cap that cannot hold) decided nothing.
        held = previous.finished and previous.estimated_peak_bytes <= previous.budget_bytes
        held = held and (read is None or read <= previous.budget_bytes)
        if key is not None and held:
            evicted = previous.evicted or previous.partial  # NOTE [partial evictions]
            # NOTE [steps of known shapes]; a read of shapes seen decides at the next.
            deferred = previous.mark is not None and self._unread(previous)
            if not evicted or (key in self._seen and not deferred):
                self._known[key] = _Decision(self._history[-1])
            self._seen.add(key)

    def _begin(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], key: tuple[Any, ...] | None = None
    ) -> Step:
        self._close_previous()
        step = Step(
            self.model,
            self._budget_bytes,
            self._learned,
            self._extra_bytes,
            (args, kwargs),
            self._order,
            self.eviction,
            self._walks,
        )
        step.key = key  # NOTE [forward reaches]: the reaches read at these shapes
        if step.cuda is not None:
            torch.cuda.reset_peak_memory_stats(step.cuda)
        else:
            self._reads.apply(step)  # NOTE [what the count misses]
        # NOTE [partial evictions]: at shapes seen, and on CPU read, the policy.
        if key is not None and key in self._seen and (step.cuda is not None or step.reaches):
            step.keeping = self._keeping
        self._step = step
        return step

    # -- the allocator's record (NOTE [what the count misses]) -------------------
    def _start_record(self, target: Step | _Repeat) -> None:
        on_stop = functools.partial(self._recorded, target)
        # NOTE [partial evictions]: shapes seen and never read are read once.
        again = isinstance(target, Step) and self._unread(target)
        record = self._reads.start(target, on_stop, again)
        if record is not None and isinstance(target, Step):
            target.mark = record.mark

    def _recorded(self, target: Step | _Repeat, reading: AllocatorReading) -> None:
        """The record of ``target`` stopped, here or by another probe on its thread."""
        if isinstance(target, Step):
            peak = target.allocator_peak_bytes = self._reads.learn(target, reading)
            if peak is not None and peak > target.estimated_peak_bytes:
                self._known.clear()  # decided with less in reserve than they needed
            return
        end = reading.marks.get("end")
        target.allocator_peak_bytes = peak = None if end is None else reading.peak(until=end)
        if self._history and self._history[-1] is target.report:
            self._history[-1] = target.report = dataclasses.replace(
                target.report, allocator_peak_bytes=peak
            )

    def _model_forward(
        self, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        step, repeat = self._step, self._repeat
        if self._budget.predicting:  # NOTE [a share of the cap]: the fake plain step
            return original(*args, **kwargs)
        if (step and not step.closed) or (repeat and not repeat.closed) or in_recomputing():
            return original(*args, **kwargs)  # the model called inside its own step
        if not torch.is_grad_enabled():
            self._reads.stop()  # NOTE [what the count misses]: the step before is over
            return original(*args, **kwargs)
        self._close_previous()  # what it teaches counts for this step
        shapes = self._key(args, kwargs)
        if self._budget.share is not None:  # NOTE [a share of the cap]
            self._budget_bytes = self._budget.for_step(self.model, args, kwargs, shapes)
        key = shapes if self.repeat_known_shapes else None
        known = self._known.get(key) if key is not None else None
        if key is not None and known is not None and known.holds(self._budget_bytes):
            return self._run_repeated(original, args, kwargs, key, known)
        step = self._begin(args, kwargs, key)
        step.rooted = True
        self._start_record(step)

        def pack(t: torch.Tensor) -> torch.Tensor:
            step.saved_outside(t)
            return t.detach()

        try:
            with (
                torch.autograd.graph.saved_tensors_hooks(pack, _identity),
                forgotten_regions(step.forgotten_ran),
            ):
                out = original(*args, **kwargs)
            step.model_returned(out)
            step.finished = True
        except BaseException:
            step.release_nodes()
            self._reads.stop()  # no backward comes: it teaches nothing
            raise
        finally:
            step.closed = True
        return out

    def _region_forward(
        self,
        name: str,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        if not torch.is_grad_enabled() or self._budget.predicting:
            return original(*args, **kwargs)
        repeat = self._repeat
        if repeat is not None and not repeat.closed:  # NOTE [steps of known shapes]
            if name in repeat.decision.evicted:
                return run_region(original, args, kwargs)
            if name in repeat.decision.partial:  # NOTE [partial evictions]
                return run_region(original, args, kwargs, policy=self.partial)
            return original(*args, **kwargs)
        if in_recomputing() or torch.compiler.is_compiling():
            # NOTE [eviction order]: a re-run's regions keep nothing.
            return run_region(original, args, kwargs)
        step = self._step
        if step is None or step.closed:  # a region run without the model's forward
            self._budget.check_predicted(f"region {name!r} ran without the model's forward")
            step = self._begin(args, kwargs)
        region = DroppableRegion(original, args, kwargs, policy=step.policy_for(name))
        entry = step.enter(name, region.forward_inputs())
        start = time.perf_counter()
        try:
            out = region.run_forward()
        except BaseException:
            step.leave(entry, None, None, 0.0)
            raise
        step.leave(entry, region, out, time.perf_counter() - start)
        return out

    def _unread(self, step: Step) -> bool:
        """Whether ``step`` runs at shapes seen and never read, where regions may go in
        part once read (NOTE [partial evictions])."""
        seen = step.key is not None and step.key in self._seen
        return seen and self._keeping is not None and step.cuda is None and not step.reaches

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
        """What a step's bytes follow from (NOTE [steps of known shapes]); ``None``: no key."""
        # NOTE [cached walks]: the modules and parameters, walked only when they change.
        modules, parameters, _ = self._walks.walk([self.model])
        parts: list[Any] = [tuple(map(_training, modules)), tuple(map(_requires_grad, parameters))]
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                parts.append((tuple(leaf.shape), leaf.dtype, leaf.device, leaf.requires_grad))
            elif leaf is None or isinstance(leaf, bool | int | float | str):
                parts.append(leaf)
            else:
                return None  # an argument the key cannot compare: the step runs capped
        return tuple(parts)

    def _run_repeated(
        self,
        original: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[Any, ...],
        decision: _Decision,
    ) -> Any:
        """The step as the decision for its shapes has it (NOTE [steps of known shapes])."""
        repeat = _Repeat(key, decision, _device_of(self.model))
        self._repeat = repeat
        report = dataclasses.replace(decision.report, budget_bytes=self._budget_bytes)
        repeat.report = dataclasses.replace(report, repeated=True, allocator_peak_bytes=None)
        self._history = [*self._history, repeat.report][-_HISTORY:]
        if self._reads.when == "every":  # NOTE [what the count misses]
            repeat.input_elements = sum([t.numel() for t in tensors_in((args, kwargs))])
            self._start_record(repeat)
        try:
            out = original(*args, **kwargs)
        except BaseException:
            self._reads.stop()
            raise
        finally:
            repeat.closed = True
        record = self._reads.record
        if record is not None and repeat.allocator_peak_bytes is None:
            on_backward_end(out, functools.partial(record.mark, "end"))
        return out


class _Decision:
    """What a capped step of some shapes did (NOTE [steps of known shapes])."""

    __slots__ = ("estimate", "evicted", "partial", "report", "under")

    def __init__(self, report: StepReport) -> None:
        self.report, self.evicted = report, frozenset(report.evicted)
        self.partial = frozenset(report.partial)
        self.estimate, self.under = report.estimated_peak_bytes, report.budget_bytes

    def holds(self, budget_bytes: int) -> bool:
        """Whether it holds under ``budget_bytes``, and no higher cap would evict less."""
        evicted = self.evicted or self.partial
        return self.estimate <= budget_bytes and (not evicted or budget_bytes <= self.under)


class _Repeat:
    """A step repeating a decision: its key, its report and, on CUDA, where it began."""

    __slots__ = (
        "allocator_peak_bytes",
        "closed",
        "cuda",
        "decision",
        "input_elements",
        "key",
        "report",
        "start",
    )

    def __init__(self, key: tuple[Any, ...], decision: _Decision, device: torch.device) -> None:
        self.key, self.decision, self.report = key, decision, decision.report
        self.closed = False
        self.allocator_peak_bytes: int | None = None
        self.input_elements = 0  # counted where the step may be read
        self.cuda = device if device.type == "cuda" else None
        self.start = 0
        if self.cuda is not None:
            self.start = torch.cuda.memory_allocated(self.cuda)
            torch.cuda.reset_peak_memory_stats(self.cuda)


_training = operator.attrgetter("training")
_requires_grad = operator.attrgetter("requires_grad")


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


#: The owner a cap's wrappers carry (`forget._regions.RegionForward.owner`).
_CAP = "cap"


def _wrap(module: nn.Module, call: Callable[..., Any]) -> None:
    wrap_forward(module, call, _CAP, "cap")


def _unwrap(module: nn.Module) -> None:
    unwrap_forward(module, _CAP)


def _refuse_wrapped(model: nn.Module) -> None:
    for name, module in model.named_modules():
        where = f"{type(model).__name__}.{name}" if name else type(model).__name__
        owner = owner_of(module)
        if owner == _CAP:
            raise ForgetError(
                f"forget: {where} runs under a cap already; one cap per model. Call "
                "handle.remove() on the first (or handle.set_budget to change it) before "
                "capping again."
            )
        if owner not in (None, HEAD):
            raise ForgetError(
                f"forget: {where} runs under a forget plan, and a cap decides what the plan "
                "fixed; remove the plan first (plan.remove(model)), then cap the model."
            )


def _device_of(model: nn.Module) -> torch.device:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if first is None else first.device
