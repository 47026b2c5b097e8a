"""Profile a model's step into a `forget.schedules.Tree`: bytes per module, times per region.

NOTE [tree figures]: the cost model (NOTE [tree cost model]) asks of each
candidate ``v`` its own bytes ``a`` (saved by its ops, not inside a candidate
below it) and its inputs' bytes ``in``. One forward and backward under the
ledger on fake tensors (``FakeTensorMode``: shapes only, nothing allocated, each
storage still seen) gives both: hooks on every candidate open and close a ledger
entry, and each storage alive when the loss is computed is charged to one node.
A storage some candidates take as input goes to the innermost of them (their
nearest common ancestor for several: an attention mask every layer reads), in
its ``a`` and ``in`` alike, since it is held whether that node is kept or
forgotten; any other goes to the innermost candidate that made it, and up to
its parent while it is that candidate's output (a region returns its outputs).
``in(v)`` leaves out parameters, the step's inputs and what a candidate above
holds. The plain step never runs: its peak is the keep-all plan's, or the fake
run's ledger peak where higher. A model that reads its data may take another
path on fake tensors, so the prediction is never trusted (NOTE [tree plans
measured]); one that cannot run on fake tensors is profiled on real ones, with
a warning.

NOTE [options on the innermost]: a node's ``forward_s`` is its call within
whole forwards without grad (NOTE [forwards timed whole]) plus the fixed cost of
a region (NOTE [time of a region]). A leaf option's figures (bytes spared, extra
time, peak: NOTE [options' peaks]) are measured on the module alone, once per
kind, on captured inputs. Options are offered on the innermost candidates only:
an option fixes its node's whole subtree, which the children's options nearly
compose, while timing it costs a run of the whole subtree. An option that saves
nothing over keeping is not offered, nor a policy region that keeps no more
than a forgotten one (forgetting does as well, on the faster path).

NOTE [backward work]: the backward allocates beyond the saved bytes: parameter
gradients so far, the gradient flowing, each op's temporaries, kernel
workspaces. One figure for the whole step, taken at the plain peak, was wrong
both ways: a language model's plain peak is its loss's backward, which then
stood beside every forgotten layer's re-run too, while a ResNet's gradients at
the end went unseen (benchmarks/measured.md, "The backward's work in the cost
model"). So the fake run's backward is cut where each candidate's begins (a
pre-hook on its outputs' backward nodes), and each segment's ``w`` is its ledger
peak less the saved bytes still held when it began. Own ops between two children
fall in the segment of the child before them; a candidate's own ops after its
last child are its tail (``t``: their saved bytes, freed before any child's
backward: the loss's log-probabilities). A kernel's workspace, by the allocator
beyond the ledger in an innermost candidate's step alone, is added to its ``w``.

NOTE [options' peaks]: a leaf option's peak was its node's kept peak (plus its
inputs, for a policy region that re-runs on them). But regenerate peaks lower
(it rebuilds activations one use at a time) and a selective region can peak
higher (its re-run's outputs beside the kept ones), enough for the planner to
miss a faster plan (benchmarks/measured.md, "Single measurements behind the
NOTEs"). So each option's step alone is measured at its peak too
(`_Alone.step_peak_bytes`), and its peak in the tree is the kept one plus what
it peaked above keeping alone (less, where lower). Left over: where a layer's
input is a LayerNorm's output, regenerating the layer rebuilds that input too,
which its step alone on captured inputs cannot show; it is still counted held
(NOTE [regenerate]).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ... import schedules as P
from ..._engine import storage_of
from ..._errors import BudgetInfeasibleError, ForgetError
from ..._memory import Ledger, StorageRecord, watch
from ..._memory import budget_bytes as read_budget
from ..._memory import faked as fake_inputs
from ..._regions import ROOT, CandidateSpec, ancestors, find_candidates, parents
from ...policies import Policy
from .._clock import WALL_CLOCK, Clock
from .._targets import untouched, zero_grads
from .alone import Layout as _Layout
from .alone import RealRuns
from .apply import is_wrapped
from .step import (
    Call,
    TreeStep,
    check_same_calls,
    positional_batch,
    step_loss,
    traced,
    warn_eval_mode,
)


@dataclass(frozen=True)
class TreeProfile:
    """A step's candidate tree, its figures, and the plain step's predicted peaks.

    The plain step never runs (NOTE [tree figures]): its ledger peak is the
    fake run's, and its allocator peak the keep-all plan's in the cost model,
    workspaces included (NOTE [backward work]), or that ledger peak if higher.
    """

    tree: P.Tree
    plain_peak_bytes: int  # by the allocator (``probe``), predicted
    plain_ledger_peak_bytes: int  # the fake run's
    probe: str
    calls: tuple[Call, ...]  # the step's module calls (NOTE [one structure per step])
    # The ledger's peak of the forward without grad on real tensors (CPU; 0 on CUDA):
    # no budget below it lets planning run (NOTE [an infeasible budget named]).
    forward_peak_bytes: int = 0
    # Every budget below this is infeasible: the forward without grad passed it (0: none).
    infeasible_below_bytes: int = 0

    @property
    def cuda(self) -> torch.device | None:
        """The CUDA device a ``"free"`` budget reads (NOTE [free budget]); None off CUDA."""
        return _cuda(self.probe)


def allocator_probe(step: TreeStep) -> str:
    """The probe whose peak counts: CUDA's allocator on CUDA, the CPU allocator's events else."""
    tensors = [*step.model.parameters(), *step.target().inputs]
    return "cuda" if any(t.device.type == "cuda" for t in tensors) else "profiler"


def _cuda(probe: str) -> torch.device | None:
    return torch.device("cuda") if probe == "cuda" else None


def profile_tree(
    step: TreeStep,
    candidates: CandidateSpec | None,
    policies: Mapping[str, Policy],
    repeats: int,
    budget: int | float | str | None = None,
    clock: Clock = WALL_CLOCK,
) -> TreeProfile:
    """Measure ``step`` into a `TreeProfile` (NOTE [tree figures]); the model is left as it was.

    Times are read on ``clock`` (the wall clock; a test's `FixedClock` runs nothing).

    Raises:
        ValueError: no named candidate called exactly once; a model that runs
            a forget region of a plan applied before.
        TypeError: the step's output has no loss (`step_loss`).
        ForgetError: the step's module calls differ between its runs (NOTE
            [one structure per step]).
        BudgetInfeasibleError: with ``budget``, the forward without grad
            passed it.
    """
    model = step.model
    wrapped = [name for name, m in model.named_modules() if is_wrapped(m)]
    if wrapped:
        raise ValueError(
            f"forget: {wrapped[0] or type(model).__name__!r} runs as a forget region already; "
            "plan the model as it is without a plan (plan.remove(model)), then apply the new one"
        )
    names = find_candidates(model, candidates)
    target = step.target()
    probe = allocator_probe(step)
    warn_eval_mode(model)  # NOTE [the step as given]
    with untouched(target):
        try:
            with faked(step) as fake:
                first, names, layouts, counted = _bytes(
                    fake, names, candidates is not None, "on fake tensors"
                )
                floor = _gradient_bytes(fake.state.values())
        except ForgetError:
            raise
        except Exception as exc:  # the step's first call
            if (batch := positional_batch(model, step.args, step.kwargs, exc)) is not None:
                raise batch from exc  # NOTE [a batch passed positionally]
            if not isinstance(exc, RuntimeError):
                raise
            # An op fake tensors cannot run: data-dependent, say.
            warnings.warn(
                f"forget: {type(model).__name__}'s step does not run on fake tensors "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}), so "
                "its figures come from a plain step on real tensors, which needs the plain "
                "step's memory (NOTE [tree figures])",
                UserWarning,
                stacklevel=3,
            )
            zero_grads(target)  # backward accumulates into .grad: untouched restores the objects
            first, names, layouts, counted = _bytes(
                step, names, candidates is not None, "on real tensors"
            )
            floor = _gradient_bytes(model.parameters())
        parent = parents(names)
        rep_of = _alike(model, names, layouts)
        ledger_peak = counted.ledger_peak
        zero_grads(target)
        # NOTE [planning within the budget]: the runs on real tensors that are not timed
        # run under the guard; a share of the plain peak is taken of the fake run's
        # ledger peak here, no more than of the predicted plain peak it plans with.
        known = budget is not None or probe == "cuda"  # None: "free" on CUDA
        limit = read_budget(budget, max(1, ledger_peak), _cuda(probe)) if known else None
        real = RealRuns(step, names, rep_of, layouts, parent, policies, repeats, probe, clock)
        infeasible_below = 0
        if real.run(limit, ledger_peak, first) is not None:
            # NOTE [an infeasible budget named] in `.planner`: no plan fits the budget;
            # the profile goes on under the fake run's ledger peak, for the error to
            # name a budget at which planning works.
            infeasible_below = (limit or 0) + 1  # a run passed it: it is no None
            passed = real.run(max(1, ledger_peak), ledger_peak, first)
            if passed is not None:
                raise BudgetInfeasibleError(
                    f"forget: the budget {infeasible_below - 1:,} B is below the smallest "
                    "feasible one: "
                    f"{type(model).__name__}'s forward without grad, which keeps no "
                    "activation, needs more, more even than the plain step is predicted to "
                    f"peak at on fake tensors ({passed:,} B and counting); raise the budget",
                    budget_bytes=infeasible_below - 1,
                    min_feasible_bytes=passed,
                )
        times, workspace, figures = real.times, real.workspace, real.figures
        # NOTE [backward work]: a kernel's workspace counts in its module's work.
        for name in names:
            counted.work[name] = counted.work.get(name, 0) + workspace.get(rep_of[name], 0)
        options = _options(names, rep_of, figures, policies, counted, parent)
    children: dict[str, list[str]] = {ROOT: [], **{n: [] for n in names}}
    for name in names:
        children[parent[name]].append(name)

    def node(name: str) -> P.TreeNode:
        return P.TreeNode(
            name,
            tuple(node(c) for c in children[name]),
            own_bytes=counted.own[name],
            input_bytes=counted.inputs.get(name, 0),
            forward_s=times.get(name, 0.0),
            options=options.get(name, ()),
            can_forget=name != ROOT,
            work_bytes=counted.work.get(name, 0),
            tail_bytes=counted.tail[name],
        )

    root = node(ROOT)
    # NOTE [backward work]: what the model misses of the ledger's peak (a forward's
    # transients) is held everywhere.
    predicted = P.tree_figures(P.Tree(root), {}).peak_bytes
    plain_peak = max(predicted, ledger_peak)
    tree = P.Tree(root, base_bytes=plain_peak - predicted, floor_bytes=floor)
    return TreeProfile(
        tree,
        plain_peak,
        ledger_peak,
        probe,
        tuple(real.calls),
        forward_peak_bytes=real.forward_peak_bytes,
        infeasible_below_bytes=infeasible_below,
    )


def _bytes(
    step: _FakeStep | TreeStep, names: list[str], named: bool, where: str
) -> tuple[list[Call], list[str], dict[str, _Layout], _Bytes]:
    """The step's calls, its candidates, their inputs' layouts, and their bytes."""
    model = step.model
    with traced(model) as first:
        calls, layouts = _count(step, names)
    names = _called_once(names, calls, named=named)
    parent = parents(names)
    with traced(model) as again:
        figures = _attribute(step, names, parent)
    check_same_calls(model, first, again, f"second run (under the ledger, {where})")
    return first, names, layouts, figures


def _gradient_bytes(parameters: Iterable[Tensor]) -> int:
    """Bytes of the gradients a step made: all held at backward's end, whatever the plan
    (``Tree.floor_bytes``, NOTE [tree cost model]); a parameter the step did not use has none."""
    return sum(t.numel() * t.element_size() for t in parameters if t.grad is not None)


# ------------------------------------------------------------------ passes


class _FakeStep:
    """The step on fake tensors: parameters, buffers and inputs with no memory behind them."""

    def __init__(self, step: TreeStep, state: dict[str, Tensor], args: Any, kwargs: Any) -> None:
        self.model = step.model
        self.loss_fn = step.loss_fn
        self.state, self.args, self.kwargs = state, args, kwargs

    def loss(self) -> Tensor:
        output = functional_call(self.model, self.state, self.args, self.kwargs)
        return step_loss(output, self.loss_fn)


@contextlib.contextmanager
def faked(step: TreeStep) -> Iterator[_FakeStep]:
    """``step`` on fake tensors (`forget._memory.faked`, NOTE [tree figures])."""
    with fake_inputs(step.model, step.args, step.kwargs) as (state, args, kwargs):
        yield _FakeStep(step, state, args, kwargs)


def _layout(value: Any) -> _Layout:
    return tuple(
        (tuple(t.shape), t.dtype, t.requires_grad)
        for t in pytree.tree_leaves(value)
        if isinstance(t, Tensor)
    )


def _count(
    step: _FakeStep | TreeStep, names: list[str]
) -> tuple[dict[str, int], dict[str, _Layout]]:
    """One forward: how often each candidate runs, in what order, and its first inputs' layout."""
    calls: dict[str, int] = {}
    layouts: dict[str, _Layout] = {}

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[name] = calls.get(name, 0) + 1
            layouts.setdefault(name, _layout((args, kwargs)))

        return hook

    handles = [
        step.model.get_submodule(n).register_forward_pre_hook(pre(n), with_kwargs=True)
        for n in names
    ]
    try:
        step.loss()
    finally:
        for handle in handles:
            handle.remove()
    return calls, layouts


def _alike(model: nn.Module, names: list[str], layouts: Mapping[str, _Layout]) -> dict[str, str]:
    """Each candidate's representative: the first alike one (NOTE [alike stages])."""
    first: dict[tuple[Any, ...], str] = {}
    return {
        name: first.setdefault(_signature(model.get_submodule(name), layouts[name]), name)
        for name in names
    }


def _called_once(names: list[str], calls: Mapping[str, int], named: bool) -> list[str]:
    """The candidates run once per step, in call order (NOTE [tree candidates]).

    A module never called (an ``nn.ModuleList``, a branch the step skips) or
    called more than once (a shared block) is no candidate; a ``candidates=``
    whose every match is one of those raises.
    """
    once = set(names)
    kept = [name for name in calls if name in once and calls[name] == 1]
    if named and not kept:
        runs = ", ".join(f"{name!r} {calls.get(name, 0)}" for name in names[:4])
        raise ValueError(
            f"forget: no module candidates= matches runs exactly once in a step (runs: {runs}); "
            "a region wraps the module's forward, and the cost model describes one run per "
            "step; name modules the step calls once"
        )
    return kept


class _Work:
    """Each candidate's backward work: what its segment of backward allocates beyond the
    saved bytes still held when it begins (NOTE [backward work])."""

    def __init__(self, ledger: Ledger, parent: Mapping[str, str]) -> None:
        self.ledger, self.parent = ledger, parent
        self.work: dict[str, int] = {}
        self.begun: set[str] = set()
        self.saved: dict[int, StorageRecord] = {}
        self.segment: tuple[str, Any, int] | None = None  # name, ledger entry, saved at start

    def start(self, saved: dict[int, StorageRecord]) -> None:
        """The loss is made: ``saved`` (storage id -> record) is alive now, held for
        backward; the root's segment begins."""
        self.saved = saved
        self._open(ROOT)

    def mark(self, name: str) -> Callable[..., None]:
        """A prehook on a candidate's output's backward node: its segment begins there."""

        def hook(*_: Any) -> None:
            if name not in self.begun:  # not begun, nor any candidate inside it
                self._close()
                self._open(name)

        return hook

    def stop(self) -> None:
        self._close()

    def _open(self, name: str) -> None:
        self.begun.update((name, *ancestors(name, self.parent)) if name != ROOT else (ROOT,))
        records = self.ledger.records()
        held = sum(rec.counted for k, rec in self.saved.items() if records.get(k) is rec)
        self.segment = (name, self.ledger.enter(f"backward {name}"), held)

    def _close(self) -> None:
        if self.segment is not None:
            name, entry, held = self.segment
            self.ledger.exit(entry)
            self.work[name] = max(self.work.get(name, 0), entry.peak - held)
            self.segment = None


@dataclass(frozen=True)
class _Bytes:
    """Per candidate: own, input, work and tail bytes; and the plain step's ledger peak."""

    own: dict[str, int]
    inputs: dict[str, int]
    work: dict[str, int]
    tail: dict[str, int]
    ledger_peak: int


def _attribute(step: _FakeStep | TreeStep, names: list[str], parent: Mapping[str, str]) -> _Bytes:
    """Each candidate's bytes (NOTE [tree figures], NOTE [backward work])."""
    ledger = Ledger(fake=isinstance(step, _FakeStep))
    work = _Work(ledger, parent)
    entries: dict[str, list[Any]] = {n: [] for n in names}
    # Ledger records (held, so their ids stay theirs) of made storages taken / returned.
    taken: dict[str, dict[int, tuple[StorageRecord, int]]] = {n: {} for n in names}
    returned: dict[str, dict[int, StorageRecord]] = {n: {} for n in names}
    # Per candidate, the storages alive when its last child returned: not its tail's.
    before_tail: dict[str, set[StorageRecord]] = {}

    def made(value: Any) -> list[tuple[StorageRecord, int]]:
        records = ledger.records()
        out = []
        for leaf in pytree.tree_leaves(value):
            s = storage_of(leaf)
            rec = None if s is None else records.get(id(s))
            if rec is not None and rec.op and s is not None:
                out.append((rec, s.nbytes()))
        return out

    def pre(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            taken[name].update((id(rec), (rec, n)) for rec, n in made((args, kwargs)))
            entries[name].append(ledger.enter(name))

        return hook

    def post(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            ledger.exit(entries[name].pop())
            returned[name].update((id(rec), rec) for rec, _ in made(output))
            before_tail[parent[name]] = set(ledger.records().values())  # NOTE [backward work]
            leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, Tensor)]
            for node in {t.grad_fn for t in leaves if t.grad_fn is not None}:
                node.register_prehook(work.mark(name))

        return hook

    handles = []
    for n in names:
        module = step.model.get_submodule(n)
        handles.append(module.register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(module.register_forward_hook(post(n), with_kwargs=True, always_call=True))
    try:
        with watch(ledger):
            loss = step.loss()
            saved = {k: rec for k, rec in ledger.records().items() if rec.counted and rec.op}
            live = list(saved.values())
            work.start(saved)
            loss.backward()
            work.stop()
            del loss
        peak = ledger.peak
    finally:
        ledger.close()
        for handle in handles:
            handle.remove()
    users: dict[int, list[str]] = {}
    for name in names:
        for key in taken[name]:
            users.setdefault(key, []).append(name)
    own = {ROOT: 0, **{n: 0 for n in names}}
    tail = dict(own)
    owner_of: dict[int, str] = {}
    for rec in live:
        key = id(rec)
        if key in users:
            owner = _innermost(users[key], parent)
        else:
            inside = [name for name in rec.regions if name in own]
            owner = inside[-1] if inside else ROOT
            while owner != ROOT and key in returned[owner]:
                owner = parent[owner]
        owner_of[key] = owner
        own[owner] += rec.counted
        if rec not in before_tail.get(owner, ()):
            tail[owner] += rec.counted
    inputs = {
        name: sum(
            n
            for key, (_, n) in taken[name].items()
            if owner_of.get(key) not in ancestors(name, parent)
        )
        for name in names
    }
    return _Bytes(own, inputs, work.work, tail, peak)


def _innermost(users: list[str], parent: Mapping[str, str]) -> str:
    """The innermost of the candidates taking a storage; several: their nearest common ancestor."""
    above = {a for u in users for a in ancestors(u, parent)}
    inner = [u for u in dict.fromkeys(users) if u not in above]
    if len(inner) == 1:
        return inner[0]
    common = [ROOT, *reversed(ancestors(inner[0], parent)[:-1]), inner[0]]
    for u in inner[1:]:
        chain = {u, *ancestors(u, parent)}
        common = [c for c in common if c in chain]
    return common[-1]


# ------------------------------------------------------------------ times


def _signature(module: nn.Module, layout: _Layout) -> tuple[Any, ...]:
    """What makes two modules alike: they share their figures.

    NOTE [alike stages]: identical blocks (a transformer's layers) cost the
    same, but each one's times, measured over a few repeats on a busy CPU,
    scatter by tens of percent, and the solver takes them at face value: it
    would forget the blocks that happened to measure cheap, picking noise as if
    it were signal. So modules whose type, ``repr``, training flag, parameter
    shapes and input layout match share one set of figures, measured once.
    """
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return (type(module), repr(module), module.training, params, layout)


def _options(
    names: list[str],
    rep_of: Mapping[str, str],
    figures: Mapping[str, Mapping[str, tuple[int, int, float]]],
    policies: Mapping[str, Policy],
    counted: _Bytes,
    parent: Mapping[str, str],
) -> dict[str, tuple[P.TreeOption, ...]]:
    """The innermost candidates' leaf options, measured on each alone (NOTE [tree figures])."""
    if not policies:
        return {}
    held: dict[str, int] = {}
    peak: dict[str, int] = {}
    own, inputs = counted.own, counted.inputs
    for name in reversed(names):  # children before parents: keep-all figures bottom up
        running = most = 0
        for kid in (n for n in names if parent[n] == name):
            most = max(most, running + peak[kid])
            running += held[kid]
        held[name] = own[name] + running
        # NOTE [backward work]: the work on every child held; the tail freed after it.
        work = own[name] + running + counted.work.get(name, 0)
        peak[name] = max(work, own[name] - counted.tail[name] + most)
    # Alike modules share their options' figures (NOTE [alike stages]): measured once.
    out: dict[str, tuple[P.TreeOption, ...]] = {}
    inner = set(names) - set(parent.values())
    for name in (n for n in names if n in inner):
        rep = rep_of[name]
        options = []
        for option, (saves, higher, extra_s) in figures[rep].items():
            policy = policies[option]
            option_held = max(0, held[name] - saves)
            # NOTE [options' peaks]: the kept peak, and what the option's step alone
            # peaked above keeping's; a policy region re-runs in backward on top of its
            # inputs, as a forgotten node does, which its step alone did not hold.
            rerun = 0 if policy.regenerate else inputs.get(name, 0)
            option_peak = peak[name] + higher + rerun
            options.append(
                P.TreeOption(
                    option,
                    held_bytes=option_held,
                    peak_bytes=max(option_held, option_peak),
                    extra_s=extra_s,
                    in_regions=bool(policy.regenerate),
                )
            )
        out[name] = tuple(options)
    return out
