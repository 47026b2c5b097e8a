"""Budgeted planning on any module: its module tree profiled, solved exactly, then measured.

`forget.plan` hands every model to `TreePlanner` (a chain is a module tree whose
candidates are its children): the candidate modules (NOTE [tree candidates]) are
profiled into a `forget.schedules.Tree` (NOTE [tree figures]), whose exact
Pareto frontier (`forget.schedules.tree_frontier`) gives, for every budget the
cost model accepts, the assignment with the least extra time.

NOTE [tree plans measured]: no prediction is trusted: the cost model only
chooses which assignments to measure. A plan is judged by the allocator's peak
of the real step (the profiler's events on CPU, ``max_memory_allocated`` on
CUDA), not by the ledger, which misses kernel workspaces. Every assignment tried
is applied, its step measured once under the guard (NOTE [planning within the
budget]), and remembered. Per budget, the search walks the frontier from the
point predicted to fit (doubling steps up after a fit and down after a miss,
then halving) until a fit and a miss are within 1/128 of the plain peak (NOTE
[least on demand] where nothing fits). Every fitting assignment measured so far
is a candidate (NOTE [monotone in the budget]), except one whose choices hold
another fitting one's and more (it re-runs more, so it is not faster). Those
predicted within `_CLOSE` of the least predicted extra time, `_MAX_TIMED` at
most, are timed side by side (`fastest_of`): the cost model ranks well enough to
leave the rest untimed (benchmarks/measured.md, "Single measurements behind the
NOTEs"). The plan reports the chosen one's ledger peak too, and has
``measured_peak_bytes <= budget_bytes``, by the allocator, for the inputs it was
planned with.

NOTE [least on demand]: the least feasible budget is the lesser measured peak of
two assignments: the frontier's least-memory point and the baseline forgetting
every innermost candidate (every layer); the measured peak does not always
follow the frontier (the model does not see that forgetting the last layer
lowers the loss's backward). Both re-run the most of any assignment and are
costly to measure (benchmarks/measured.md, "Fewer steps in planning"), so they
are measured only where the least is wanted: where the search found no fit
(under the budget, then for the error under the predicted plain peak: NOTE [an
infeasible budget named]) or when asked (`TreePlanner.least`, ``--budgets min``);
then the search runs once more just below it, up to `_MAX_BELOW` times while it
finds a lower fit. A plan made without them says so (``least_searched``): its
``min_feasible_bytes`` is then a budget known to fit, not the least. `least`
asked by the user measures under the planner's own ``budget`` (or the predicted
plain peak), not the last budget planned.

NOTE [planning within the budget]: the user who needs a plan is the one whose
plain step does not fit, so planning never runs the plain step and never holds
more than the budget. The bytes come from a run on fake tensors (NOTE [tree
figures]); times, workspaces and options' figures from each kind of module
alone, on real inputs captured by a forward without grad that stops there (NOTE
[captures together]), so one module's work is live at once. A percentage budget
is of the predicted plain peak. Every untimed step on real tensors runs under
the guard (NOTE [guarded steps]) with the budget as its limit: a step predicted
to fit that does not is stopped, a measured miss, passing the budget by at most
the one allocation that stopped it. Only steps measured to fit are timed. The
one exception is a budget no plan fits (NOTE [an infeasible budget named]). The
budget is judged by the allocator's count, never by the process's resident
memory, which the C library's malloc keeps as it sees fit.

NOTE [an infeasible budget named]: an error that names a lower bound (where the
guard stopped) sends the user round a loop, each budget naming a larger one.
So a budget no plan fits names one at which planning works: the two least
points of NOTE [least on demand] are measured under the predicted plain peak
instead of the budget (`TreePlanner.infeasible`), and the error names the least
peak measured, or the forward without grad's ledger peak where that is higher
(planning at a budget runs that forward within it). Planning at the named
budget measures both points first where its search finds no fit, and the peaks
repeat exactly, so it works the first time. This holds more than the budget,
and only because the user asked for a plan that cannot exist: no plan fits, so
no plan's step was spared. The profile does the same where its forward without
grad passed the budget: it goes on under the fake run's ledger peak, and the
planner names the budget without searching. Naming the predicted least with a
margin would hold no less: it must be confirmed by the same steps.

NOTE [monotone in the budget]: one planner planning several budgets remembers
every assignment it measured, and a budget's candidates include each earlier
one whose measured peak fits it: a plan at a larger budget is chosen among a
superset of a smaller budget's, so it is not slower, up to timing noise.
`forget plan` plans its budgets from the smallest up for this reason.

NOTE [first and later steps]: a region's first call runs the exact path and
later calls the fast one (NOTE [fast path]), and with a policy the two need not
hold the same bytes: a later step can peak past a budget the first was measured
to fit (benchmarks/measured.md, "Single measurements behind the NOTEs"). So
every assignment with a policy region is measured twice, the second step right
after the first, and the larger peak counts (a forgotten region's two paths hold
the same bytes: its fast path only skips the watching; regenerate runs no region).

NOTE [default options]: a plan of whole modules forgets whole layers, and
layers alike cost alike, so on a transformer every such plan is some k layers
forgotten, transformers' own ``every_n_layers`` or first-k choice at best.
What pays is keeping part of a layer: its matmul and attention outputs
(``"selective"``, re-running norms, activations and sums from them) or
rebuilding its activations from what autograd keeps anyway (``"regenerate"``).
So `DEFAULT_OPTIONS` offers both on the innermost candidates unless ``options``
says otherwise; they cut a plan's overhead well below the best layer
baseline's, for a measurement per kind of layer (benchmarks/measured.md, "Tree
plans against transformers' layer checkpointing"). Offloading is no default: it
runs on CUDA only, and no GPU has measured it in a plan yet.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from ... import schedules as P
from ..._errors import BudgetInfeasibleError
from ..._memory import budget_bytes as read_budget
from ..._memory import frozen_heap
from ..._regions import ROOT, CandidateSpec, structure
from ...policies import DEFAULT_OPTIONS, Policy
from .._clock import WALL_CLOCK, Clock
from .._guard import Peak, guarded_peak
from .._targets import _check_options, untouched, zero_grads
from .._timing import fastest_of, time_calls
from .apply import applied
from .plan import Plan
from .profile import profile_tree
from .search import Key as _Key
from .search import choices_key as _key
from .search import drop_regions, search_frontier, tolerance_s
from .segments import chain_candidates, with_segments
from .step import TreeLossFn, TreeStep, check_same_calls, samples_step, signature_of, traced

__all__ = ["TreePlanner", "plan_tree"]

# Searches below the least measured, at most (NOTE [least on demand]).
_MAX_BELOW = 3
# Fitting assignments timed side by side: at most this many, of those predicted within
# `_CLOSE` times the least extra time.
_MAX_TIMED, _CLOSE = 3, 1.25
# Byte figures are pruned in units of the plain peak over this (NOTE [tree Pareto solver]).
_UNITS_PER_PEAK = 1 << 16


@frozen_heap()  # NOTE [frozen heap] in forget._measure
def plan_tree(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    budget: int | float | str | None,
    loss_fn: TreeLossFn | None = None,
    candidates: CandidateSpec | None = None,
    options: Mapping[str, Policy | bool] | None = None,
    repeats: int = 3,
    samples: Sequence[Any] | None = None,
    segments: bool = True,
) -> Plan:
    """`forget.plan`'s planning of one module: see `TreePlanner`."""
    planner = TreePlanner(
        model,
        args,
        kwargs,
        budget=budget,
        loss_fn=loss_fn,
        candidates=candidates,
        options=options,
        repeats=repeats,
        samples=samples,
        segments=segments,
    )
    return planner.plan(budget)


class TreePlanner:
    """Profile a model's step once, then plan it for several budgets (NOTE [tree plans measured]).

    Args:
        model: any ``nn.Module``.
        args, kwargs: the step's inputs, ``model(*args, **kwargs)``.
        loss_fn: output -> scalar loss; default ``output.loss``, or the sum of a
            tensor output (`step_loss`).
        candidates: which submodules may be regions (NOTE [tree candidates]).
        options: name -> policy, the leaf options of the innermost candidates
            (NOTE [tree figures]); default `DEFAULT_OPTIONS` (NOTE [default
            options]); ``{}`` plans with keep and forget alone.
        repeats: timing repeats per figure.
        samples: batches to plan for instead of ``args``/``kwargs``: the
            largest is measured (`samples_step`).
        budget: the least budget this planner will plan for, if known: the
            profile's runs on real tensors stay within it too (NOTE [planning
            within the budget]); a percentage of the fake run's ledger peak.
        clock: what the profile and the side-by-side timing read times on
            (`WallClock`); a test's `FixedClock` runs nothing and reports the
            same seconds for every call.
        segments: whether runs of a chain's children are candidates (NOTE
            [segments]); off where the plan applies to another module than
            the one planned (a ModuleList's blocks, planned as a Sequential).
    """

    @frozen_heap()  # NOTE [frozen heap] in forget._measure
    def __init__(
        self,
        model: nn.Module,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        loss_fn: TreeLossFn | None = None,
        candidates: CandidateSpec | None = None,
        options: Mapping[str, Policy | bool] | None = None,
        repeats: int = 3,
        samples: Sequence[Any] | None = None,
        budget: int | float | str | None = None,
        clock: Clock = WALL_CLOCK,
        segments: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"forget: TreePlanner plans an nn.Module, got {type(model).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"forget: loss_fn must be callable, got {type(loss_fn).__name__}")
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"forget: repeats must be an int >= 1, got {repeats!r}")
        step_args, step_kwargs, sizes = samples_step(
            tuple(args), dict(kwargs or {}), samples, signature_of(model)
        )
        self.step = TreeStep(model, step_args, step_kwargs, loss_fn)
        self.policies = _check_options(DEFAULT_OPTIONS if options is None else options)
        self.repeats = repeats
        self.clock = clock
        self.sizes = tuple({k: tuple(v) for k, v in s.items()} for s in sizes)
        self.structure = tuple(structure(model))
        if candidates is None and isinstance(model, nn.Sequential):
            candidates = chain_candidates(model)  # a chain's children are candidates
        self.profile = profile_tree(self.step, candidates, self.policies, repeats, budget, clock)
        # NOTE [segments]: a chain's runs of children are candidates too.
        self.tree = with_segments(self.profile.tree, model) if segments else self.profile.tree
        self.plain_peak = self.profile.plain_peak_bytes
        self.unit = max(1, self.plain_peak // _UNITS_PER_PEAK)
        self.frontier = P.tree_frontier(self.tree, unit_bytes=self.unit)
        # NOTE [close enough] in `.search`: the search's step in time, a share of the forward's.
        forward_s = sum(child.forward_s for child in self.tree.root.children)
        self.tolerance_s = tolerance_s(forward_s)
        # Every assignment measured, with its allocator peak (NOTE [tree plans measured]),
        # and those the guard stopped, with the bound they passed (NOTE [guarded steps]).
        self.measured: dict[_Key, tuple[dict[str, str], int]] = {}
        self.stopped: dict[_Key, tuple[dict[str, str], int]] = {}
        # The same steps' ledger peaks, where the guard was a ledger (NOTE [guarded steps]).
        self.ledger_peaks: dict[_Key, int] = {}
        # The guard's limit on every measured step: the budget being planned; before
        # any, the predicted plain peak (NOTE [planning within the budget]).
        self.limit_bytes = self.plain_peak
        # The most planning may hold when no budget is being planned (`least`).
        self.ceiling_bytes = (
            self.plain_peak
            if budget is None
            else read_budget(budget, self.plain_peak, self.profile.cuda)
        )
        self._scan: list[dict[str, str]] | None = None  # NOTE [least on demand]

    # ------------------------------------------------------------ measuring

    def choices_at(self, index: int) -> dict[str, str]:
        """The assignment of the frontier's ``index``-th point (peaks rising)."""
        peak = self.frontier[index][0]
        return P.solve_tree(self.tree, peak, unit_bytes=self.unit).choices

    def measure_peak(
        self, choices: Mapping[str, str], probe: str | None = None, limit_bytes: int | None = None
    ) -> int:
        """The step's peak under ``choices``, by ``probe`` (default: the allocator's).

        With ``limit_bytes`` the step runs under the guard (NOTE [guarded
        steps]): a step that passes it is stopped, and reads as a lower bound
        past the limit. The model is left as it was.

        Raises:
            ForgetError: the step's module calls differ from the profiled run's
                (NOTE [one structure per step]).
        """
        return self.guarded(choices, probe, limit_bytes).bytes

    def guarded(
        self, choices: Mapping[str, str], probe: str | None = None, limit_bytes: int | None = None
    ) -> Peak:
        """`measure_peak`, saying whether the guard stopped the step.

        Raises:
            ForgetError: the step's module calls differ from the profiled run's
                (NOTE [one structure per step]).
        """
        model, target = self.step.model, self.step.target()
        probe = probe or self.profile.probe
        with untouched(target), applied(model, choices, self.policies):
            with traced(model) as calls:
                zero_grads(target)
                peak = guarded_peak(self.step.run, probe, limit_bytes)
            if not peak.stopped and self._policy_regions(choices):  # NOTE [first and later steps]
                zero_grads(target)
                again = guarded_peak(self.step.run, probe, limit_bytes)
                if again.stopped:
                    peak = again
                elif peak.ledger_bytes is not None and again.ledger_bytes is not None:
                    ledger = max(peak.ledger_bytes, again.ledger_bytes)
                    peak = Peak(max(peak.bytes, again.bytes), ledger_bytes=ledger)
                else:
                    peak = again if again.bytes > peak.bytes else peak
        if not peak.stopped:  # a stopped step made only some of its calls
            where = ", ".join(choices) or "nothing"
            check_same_calls(model, self.profile.calls, calls, f"run with {where} not kept")
        return peak

    def _policy_regions(self, choices: Mapping[str, str]) -> bool:
        """Whether ``choices`` run a policy region (a partial keep other than regenerate)."""
        return any(
            (policy := self.policies.get(choice)) is not None and not policy.regenerate
            for choice in choices.values()
        )

    def peak(self, choices: Mapping[str, str]) -> int:
        """The allocator's peak under ``choices``, measured once per assignment.

        A step the guard stopped reads as its lower bound, past the limit it
        ran under; under a higher limit it is measured again.
        """
        key = _key(choices)
        if key in self.measured:
            return self.measured[key][1]
        if key in self.stopped and self.stopped[key][1] > self.limit_bytes:
            return self.stopped[key][1]
        peak = self.guarded(choices, limit_bytes=self.limit_bytes)
        (self.stopped if peak.stopped else self.measured)[key] = (dict(choices), peak.bytes)
        if not peak.stopped:
            self.stopped.pop(key, None)
            if peak.ledger_bytes is not None:
                self.ledger_peaks[key] = peak.ledger_bytes
        return peak.bytes

    def fitting(self, budget_bytes: int) -> list[tuple[dict[str, str], int]]:
        """Every assignment measured whose step fits ``budget_bytes``, with its peak."""
        return [(c, peak) for c, peak in self.measured.values() if peak <= budget_bytes]

    def tried(self) -> list[tuple[dict[str, str], int]]:
        """Every assignment run, with its peak, or the bound it passed where it was stopped."""
        return [*self.measured.values(), *self.stopped.values()]

    @frozen_heap()  # NOTE [frozen heap] in forget._measure
    def least(self) -> int:
        """The least allocator peak of any assignment measured, after measuring the two
        of least memory and searching below them (NOTE [least on demand]).

        Its steps run under the planner's ``budget``, or the predicted plain
        peak without one, whatever budget was planned last. Where every step
        tried passed that, the least feasible budget is not measured: it is then
        the cost model's least peak, or the least bound a stopped step passed
        where that is higher (NOTE [planning within the budget]).
        """
        limit = self.limit_bytes
        self.limit_bytes = max(limit, self.ceiling_bytes)
        try:
            return self._least()
        finally:
            self.limit_bytes = limit

    def _least(self) -> int:
        """`least` under the limit of the budget being planned."""
        for choices in self._least_points():
            self.peak(choices)  # once each, or again under a limit above the one it passed
        for _ in range(_MAX_BELOW):  # NOTE [least on demand]: a search below the least
            least = self._least_measured()
            if not self.measured or least > self.limit_bytes:
                break
            search_frontier(self, least - 1)
            drop_regions(self, least - 1)
            if self._least_measured() == least:
                break
        return self._least_measured()

    def _least_points(self) -> list[dict[str, str]]:
        """The frontier's least-memory point and the baseline (NOTE [least on demand])."""
        if self._scan is None:
            self._scan = [self.choices_at(0), self.baseline()]
        return self._scan

    def least_searched(self) -> bool:
        """Whether `least` has measured the least feasible budget (NOTE [least on demand])."""
        return all(_key(choices) in self.measured for choices in self._least_points())

    def infeasible(self, budget_bytes: int) -> BudgetInfeasibleError:
        """The error for a budget no plan fits, naming one at which planning works (NOTE [an
        infeasible budget named]); every infeasible budget's message is made here."""
        limit = self.limit_bytes
        # The budget is infeasible anyway: the least points are measured under the
        # predicted plain peak, not under the budget, which stopped them.
        self.limit_bytes = max(budget_bytes, self.plain_peak)
        try:
            for choices in self._least_points():
                self.peak(choices)
        finally:
            self.limit_bytes = limit
        least = self._least_measured()
        if not any(peak == least for _, peak in self.measured.values()):
            how = "an estimate: no step tried fits even the predicted plain peak"
        elif least < self.profile.forward_peak_bytes:
            # Planning at it runs the forward without grad within it (NOTE [an
            # infeasible budget named]).
            how = "measured, raised to what the forward without grad holds"
            least = self.profile.forward_peak_bytes
        else:
            how = "measured"
        return BudgetInfeasibleError(
            f"forget: the budget {budget_bytes:,} B is below the smallest feasible one, "
            f"{least:,} B (the least allocator peak of any plan, {how}; the plain step is "
            f"predicted to peak at {self.plain_peak:,} B); plan with a budget of "
            f"{least:,} B or more, or offer more candidates (candidates=) or options "
            "(options=)",
            budget_bytes=budget_bytes,
            min_feasible_bytes=max(least, budget_bytes + 1),
        )

    def _least_measured(self) -> int:
        """The least allocator peak measured so far, or (none measured) `least`'s estimate."""
        if self.measured:
            return min(peak for _, peak in self.measured.values())
        bounds = [bound for _, bound in self.stopped.values()]
        return max(self.frontier[0][0], min(bounds, default=0))

    def baseline(self) -> dict[str, str]:
        """Every innermost candidate forgotten (each layer, as transformers checkpoints)."""
        inner = [n for n in self._names() if not self.tree.node(n).children]
        return dict.fromkeys(inner, "forget")

    def _names(self) -> list[str]:
        out: list[str] = []

        def visit(node: P.TreeNode) -> None:
            if node.name != ROOT:
                out.append(node.name)
            for child in node.children:
                visit(child)

        visit(self.tree.root)
        return out

    def predicted_peak(self, choices: Mapping[str, str]) -> int:
        """The cost model's peak of ``choices`` (the measured one is `peak`)."""
        return P.tree_figures(self.tree, choices).peak_bytes

    def _fastest(self, fitting: list[tuple[dict[str, str], int]]) -> tuple[dict[str, str], int]:
        """The fitting assignment whose step is fastest, measured (`fastest_of`).

        An assignment whose choices hold another's and more is left out, and so is
        one predicted to add more than `_CLOSE` times the least predicted extra
        time (NOTE [tree plans measured]).
        """
        sets = [set(choices.items()) for choices, _ in fitting]
        fewest = [f for f, s in zip(fitting, sets, strict=True) if not any(o < s for o in sets)]
        ranked = sorted(fewest, key=lambda cp: (self.extra_s(cp[0]), cp[1]))
        least = self.extra_s(ranked[0][0])
        close = [cp for cp in ranked if self.extra_s(cp[0]) <= _CLOSE * least]
        candidates = close[:_MAX_TIMED]
        target = self.step.target()

        def time(indices: Sequence[int]) -> dict[int, list[float]]:
            calls = {i: functools.partial(self._run_under, candidates[i][0]) for i in indices}
            with untouched(target):
                # Every candidate ran when it was measured: its regions are warm.
                return time_calls(
                    calls,
                    self.repeats,
                    prepare=lambda _: zero_grads(target),
                    warm_up=False,
                    clock=self.clock,
                )

        return candidates[fastest_of(time, len(candidates))]

    def _without_idle(
        self, choices: dict[str, str], peak: int, budget_bytes: int
    ) -> tuple[dict[str, str], int]:
        """``choices`` less every region that frees nothing, measured to fit (NOTE [idle regions]).

        NOTE [idle regions]: a region whose choice frees no bytes in the cost
        model (an ``nn.Embedding`` forgotten holds its integer ids, kept it holds
        them too) can still be chosen: the baseline that forgets every innermost
        candidate forgets it, and where that baseline is the least peak measured
        it is the plan, re-running the region for nothing. So each region whose
        dropping raises neither the bytes held nor the peak in the cost model is
        dropped where the step without it measures within the budget: it re-runs
        less, so it is not slower. A region that frees bytes costs no measurement.
        """
        for name in list(choices):
            fewer = {k: v for k, v in choices.items() if k != name}
            now, then = P.tree_figures(self.tree, choices), P.tree_figures(self.tree, fewer)
            if then.held_bytes > now.held_bytes or then.peak_bytes > now.peak_bytes:
                continue  # it frees bytes, in the cost model
            fewer_peak = self.peak(fewer)
            if fewer_peak <= budget_bytes:
                choices, peak = fewer, fewer_peak
        return choices, peak

    def _ledger_peak(self, choices: Mapping[str, str]) -> int:
        """The ledger's peak of a step measured to fit: the guard's where it was a ledger."""
        known = self.ledger_peaks.get(_key(choices))
        return self.measure_peak(choices, "ledger", self.limit_bytes) if known is None else known

    def _run_under(self, choices: Mapping[str, str]) -> None:
        with applied(self.step.model, choices, self.policies):
            self.step.run()

    def extra_s(self, choices: Mapping[str, str]) -> float:
        """The cost model's seconds ``choices`` add to a step."""
        return P.tree_figures(self.tree, choices).extra_s

    # ------------------------------------------------------------ planning

    @frozen_heap()  # NOTE [frozen heap] in forget._measure
    def plan(self, budget: int | float | str | None = None) -> Plan:
        """Return the fastest measured plan whose allocator peak fits ``budget``.

        Args:
            budget: bytes, a size string (``"512MiB"``) or a share of the plain
                step's predicted allocator peak (``"60%"``, ``0.6``; the plain
                step never runs: NOTE [planning within the budget]); on CUDA
                ``"free"``, the default there (NOTE [free budget] in `forget._memory`).

        Raises:
            BudgetInfeasibleError: no assignment fits; ``min_feasible_bytes`` is
                a budget at which planning works (NOTE [an infeasible budget
                named]), or predicted where none fits the plain peak.
        """
        budget_bytes = read_budget(budget, self.plain_peak, self.profile.cuda)
        if budget_bytes < self.profile.infeasible_below_bytes:
            raise self.infeasible(budget_bytes)  # the forward without grad passed it
        self.limit_bytes = budget_bytes
        plain_fits = budget_bytes >= self.plain_peak and self.peak({}) <= budget_bytes
        if not plain_fits:
            search_frontier(self, budget_bytes)
            drop_regions(self, budget_bytes)
            if not self.fitting(budget_bytes):
                self._least()  # NOTE [least on demand], under this budget
        # NOTE [monotone in the budget]: every assignment measured so far; where the
        # plain step fits, it alone (nothing re-runs).
        fitting = [({}, self.peak({}))] if plain_fits else self.fitting(budget_bytes)
        if not fitting:
            raise self.infeasible(budget_bytes)
        min_feasible = self._least_measured()
        best, best_peak = self._without_idle(*self._fastest(fitting), budget_bytes)
        figures = P.tree_figures(self.tree, best)
        order = {name: i for i, name in enumerate(self._names())}
        return Plan(
            choices=dict(sorted(best.items(), key=lambda kv: order[kv[0]])),
            tree=self.tree,
            budget_bytes=budget_bytes,
            measured_peak_bytes=best_peak,
            ledger_peak_bytes=self._ledger_peak(best),
            plain_peak_bytes=self.plain_peak,
            plain_ledger_peak_bytes=self.profile.plain_ledger_peak_bytes,
            min_feasible_bytes=min_feasible,
            predicted_peak_bytes=figures.peak_bytes,
            predicted_extra_s=figures.extra_s,
            probe=self.profile.probe,
            structure=self.structure,
            input_sizes=self.sizes,
            option_names=tuple(self.policies),
            least_searched=self.least_searched(),
            policies=self.policies,
        )
