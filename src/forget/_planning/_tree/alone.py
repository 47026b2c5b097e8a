"""Tree candidates on real inputs: timed in whole forwards, the innermost run alone.

`forget._planning._tree.profile` takes a step's bytes from a run on fake tensors
(NOTE [tree figures]); what needs real tensors is taken here (`RealRuns`: a
forward without grad, checked against the fake run's calls, then
`alone_figures`): every candidate's forward time, from whole forwards without grad
(`forward_times`), and, one innermost kind of module at a time, its inputs,
captured by a forward without grad stopped at it (`_capture`; several
modules' by one forward, NOTE [captures together]), the workspace its step
takes beyond its storages, and its leaf options' bytes and times (`_Alone`).
One module's work is live at once, beside at most one largest module's
inputs more (NOTE [planning within the budget] in `.planner`).
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ..._engine import copy_structure, may_change, storage_of, tensors_in
from ..._memory import Ledger, measure, watch
from ...policies import Policy
from .._clock import Clock
from .._guard import Overrun, guard, peak_bytes
from .._timing import _region_overhead_s, _step_of, time_calls
from .apply import run_option
from .step import Call, TreeStep, check_same_calls, traced

# A candidate's inputs as the step passes them: per tensor leaf (in pytree order)
# its shape, dtype and whether it requires grad.
Layout = tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]


class _Got(Exception):
    """Stops the forward once the module wanted has its inputs (`_capture`)."""


def _capture(
    step: TreeStep, names: Sequence[str], layouts: Mapping[str, Layout]
) -> dict[str, tuple[Any, Any, int]]:
    """The real inputs each candidate of ``names`` takes in the step, from one forward
    without grad.

    Without grad the forward keeps no activation, and it stops as soon as the
    last of ``names`` is called: its peak is the modules' inputs and one
    module's work, not the step's. Inputs the forward made are copied (a later
    in-place op of the forward may write into them; the step's own inputs and
    parameters are taken as they are) and require grad where the step's did,
    by the ``layouts`` the fake run saw. An input the module may change that is
    no tensor (a key/value cache) is copied as the module found it (NOTE
    [arguments that change] in `forget._engine`). Returns, per name, the args, the kwargs and the
    bytes of the copies.
    """
    model = step.model
    alive = [*pytree.tree_leaves((step.args, step.kwargs)), *model.parameters(), *model.buffers()]
    made_before = {s.data_ptr() for t in alive if (s := storage_of(t)) is not None}
    got: dict[str, tuple[Any, Any, int]] = {}

    def hook_of(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if name in got:
                return
            leaves, spec = pytree.tree_flatten((args, kwargs))
            fake = list(layouts[name])
            copied, copies = [], 0
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    # requires grad as the fake input of its shape and dtype did
                    key = (tuple(leaf.shape), leaf.dtype)
                    match = next((f for f in fake if f[:2] == key), None)
                    if match is not None:
                        fake.remove(match)
                    kept = storage_of(leaf)
                    leaf = leaf.detach()
                    if kept is None or kept.data_ptr() not in made_before:
                        leaf = leaf.clone()
                        copies += leaf.untyped_storage().nbytes()
                    leaf.requires_grad_(bool(match and match[2]))
                elif may_change(leaf):
                    # NOTE [arguments that change] in forget._engine: as the module found
                    # it (a cache the rest of the forward appends to), and the bytes it
                    # holds that the forward made
                    leaf = copy_structure(leaf)
                    storages = (storage_of(t) for t in tensors_in(leaf))
                    made = {s.data_ptr(): s.nbytes() for s in storages if s is not None}
                    copies += sum(n for p, n in made.items() if p not in made_before)
                copied.append(leaf)
            got_args, got_kwargs = pytree.tree_unflatten(copied, spec)
            got[name] = (got_args, got_kwargs, copies)
            if len(got) == len(names):
                raise _Got

        return hook

    handles = [
        model.get_submodule(name).register_forward_pre_hook(hook_of(name), with_kwargs=True)
        for name in names
    ]
    try:
        with torch.no_grad():
            model(*step.args, **step.kwargs)
    except _Got:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return got


def _layout_bytes(layout: Layout) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype, _ in layout)


def _batches(reps: Sequence[str], layouts: Mapping[str, Layout]) -> list[list[str]]:
    """``reps`` in runs whose inputs together are no larger than the largest one's.

    NOTE [captures together]: each capture is a forward without grad up to its
    module, a fifth of a ResNet's planning with its 36 kinds of module
    (benchmarks/measured.md). Modules whose inputs together take no more than
    the largest module's inputs are captured by one forward, and measured one
    at a time, the inputs not yet measured held meanwhile and counted off what
    each measurement may hold (``alone_limit``): planning holds at most one
    largest module's inputs more than capturing each alone did.
    """
    sizes = {rep: _layout_bytes(layouts[rep]) for rep in reps}
    most = max(sizes.values(), default=0)
    out: list[list[str]] = []
    total = 0
    for rep in reps:
        if out and total + sizes[rep] <= most:
            out[-1].append(rep)
            total += sizes[rep]
        else:
            out.append([rep])
            total = sizes[rep]
    return out


def _captured(
    step: TreeStep,
    reps: list[str],
    layouts: Mapping[str, Layout],
    limit: int | None,
    probe: str,
) -> Iterator[tuple[str, Any, Any, int]]:
    """Each of ``reps`` with its captured args and kwargs, and the bytes held with them.

    NOTE [captures together]: by `_batches`, each batch by one forward under the
    guard; the bytes held are the copies of that module and of the batch's
    modules not yet yielded. A batch whose forward passes the limit is captured
    one module at a time instead.
    """
    for batch in _batches(reps, layouts):
        try:
            with guard(limit, probe):
                captured = _capture(step, batch, layouts)
        except Overrun:
            if len(batch) == 1:
                raise
            for rep in batch:
                with guard(limit, probe):
                    args, kwargs, held = _capture(step, [rep], layouts)[rep]
                yield rep, args, kwargs, held
                del args, kwargs
            continue
        for rep in batch:
            args, kwargs, held = captured.pop(rep)
            yield rep, args, kwargs, held + sum(h for _, _, h in captured.values())
            del args, kwargs


class RealRuns:
    """The profile's runs on real tensors: a forward without grad, then each module alone."""

    def __init__(
        self,
        step: TreeStep,
        names: list[str],
        rep_of: Mapping[str, str],
        layouts: Mapping[str, Layout],
        parent: Mapping[str, str],
        policies: Mapping[str, Policy],
        repeats: int,
        probe: str,
        clock: Clock,
    ) -> None:
        self.step, self.names, self.rep_of, self.layouts = step, names, rep_of, layouts
        self.parent, self.policies, self.repeats, self.probe = parent, policies, repeats, probe
        self.clock = clock
        self.calls: list[Call] = []
        self.forward_peak_bytes = 0
        self.times: dict[str, float] = {}
        self.workspace: dict[str, int] = {}
        self.figures: dict[str, dict[str, tuple[int, int, float]]] = {}

    def run(self, limit: int | None, ledger_peak: int, first: list[Call]) -> int | None:
        """Run them within ``limit``; the bytes past it where a forward passed it, else None."""
        step, model = self.step, self.step.model
        overrun: int | None = None
        try:
            with guard(limit, self.probe) as ledger, traced(model) as real, torch.no_grad():
                step.model(*step.args, **step.kwargs)
            self.calls = real
            self.forward_peak_bytes = 0 if ledger is None else ledger.peak
            # Fake tensors may take other paths of the same modules (a model that skips
            # an all-ones mask when it can read it builds one when it cannot): names only.
            check_same_calls(model, _names(first), _names(real), "run on real tensors")
            # A module's step alone runs under the plain step's ledger peak, not the
            # budget: the profile, and so the plan, is then the same at every budget
            # (NOTE [heavy modules] in `.alone`).
            alone_limit = None if limit is None else max(limit, ledger_peak)
            self.times, self.workspace, self.figures = alone_figures(
                step,
                self.names,
                self.rep_of,
                self.layouts,
                self.parent,
                self.policies,
                self.repeats,
                limit,
                alone_limit,
                self.probe,
                self.clock,
            )
        except Overrun as exc:
            # Returned outside this block: an exception raised here would keep the
            # stopped forward's frames (its tensors, its regions) as its context.
            overrun = exc.live_bytes
        return overrun


def _names(calls: list[Call]) -> list[Call]:
    return [(name, ()) for name, _ in calls]


def alone_figures(
    step: TreeStep,
    names: list[str],
    rep_of: Mapping[str, str],
    layouts: Mapping[str, Layout],
    parent: Mapping[str, str],
    policies: Mapping[str, Policy],
    repeats: int,
    limit: int | None,
    alone_limit: int | None,
    probe: str,
    clock: Clock,
) -> tuple[dict[str, float], dict[str, int], dict[str, dict[str, tuple[int, int, float]]]]:
    """Times (`forward_times`), then workspace and options' figures, one innermost
    representative at a time (NOTE [alike stages]): per candidate its seconds, per
    representative its workspace bytes and its options' figures.

    Each representative's inputs are captured (`_capture`, with others' where
    they are small, NOTE [captures together]), its figures taken, and its
    inputs dropped before the next: one module's work is live at a time, beside
    the inputs captured and not yet measured, which count against it (NOTE
    [planning within the budget]). The runs that measure
    bytes run under the guard, less what the inputs hold; the timed ones do
    not (a guard's ledger would slow them), and hold no more than those.

    NOTE [heavy modules]: the capture runs under the budget (``limit``); a
    module's step alone under ``alone_limit``, the plain step's ledger peak
    from the fake run, so that the figures, and the plan, do not depend on the
    budget: a plan made at the least feasible budget one planner names is the
    plan another finds there. So a module's step alone may pass a budget below
    the plain peak; where one passes even ``alone_limit``, the module is heavy:
    its workspace is not learned, and it is offered no option.
    """
    model = step.model
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    one = {0: torch.ones(1, device=device)}
    fixed = _region_overhead_s([], one, [], repeats, clock) if names else 0
    times = forward_times(step, names, rep_of, repeats, clock)
    inner = set(names) - set(parent.values())
    figures: dict[str, dict[str, tuple[int, int, float]]] = {}
    workspace: dict[str, int] = {}
    # Only the innermost kinds run alone: for their workspace and options.
    reps = [rep for rep in dict.fromkeys(rep_of.values()) if rep in inner]
    for rep, args, kwargs, held in _captured(step, reps, layouts, limit, probe):
        left = None if alone_limit is None else alone_limit - held
        # Bytes first, under the guard: a module whose step alone passes the budget
        # (NOTE [heavy modules]) is offered no option.
        offered: dict[str, tuple[int, int]] = {}
        alone = _Alone(model.get_submodule(rep), args, kwargs)
        try:
            with guard(left, probe):
                workspace[rep] = alone.workspace_bytes(probe)
                offered = alone.option_bytes(policies)
        except Overrun:
            offered = {}
        alone.clear()
        figures[rep] = alone.option_times(offered, policies, repeats, clock)
        alone.clear()
        del args, kwargs, alone
    return {name: times[name] + fixed for name in names}, workspace, figures


def forward_times(
    step: TreeStep, names: Sequence[str], rep_of: Mapping[str, str], repeats: int, clock: Clock
) -> dict[str, float]:
    """Each candidate's forward seconds, from whole forwards of the model without grad.

    NOTE [forwards timed whole]: a candidate's time is what its call takes within
    ``repeats`` forwards of the model without grad (a hook before and after it;
    `Clock.spans`), the median over them and over the modules alike to it (NOTE
    [alike stages]). Timing each kind of module alone, on inputs captured for it,
    ran a forward of every level of the tree once per repeat and needed a capture
    per kind for nothing else, a large share of planning (benchmarks/measured.md,
    "Fewer steps in planning"). A forward without grad holds no activation, no more
    than the guarded one `profile_tree` runs before; it is a little faster than one
    with grad, alike for every candidate, so it still orders them.
    """
    model = step.model
    modules = {name: model.get_submodule(name) for name in names}
    sync = any(p.is_cuda for p in model.parameters())

    def forward() -> None:
        model(*step.args, **step.kwargs)

    with torch.no_grad():
        rounds = [clock.spans(forward, modules, sync) for _ in range(repeats)]
    alike: dict[str, list[float]] = {}
    for name in names:
        alike.setdefault(rep_of[name], []).extend(r.get(name, 0.0) for r in rounds)
    return {name: statistics.median(alike[rep_of[name]]) for name in names}


def _scalar(output: Any) -> Tensor:
    """The sum of every floating tensor in ``output`` that requires grad (one backward for all)."""
    leaves = [
        t.sum()
        for t in pytree.tree_leaves(output)
        if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return torch.stack(leaves).sum() if leaves else torch.zeros(())


class _Alone:
    """A module run alone on the inputs it took in the step, plainly or under an option.

    NOTE [inputs written in place]: the captured inputs that require grad are
    leaves, where in the step they came out of ops; a module that writes into
    its input (an ``inplace=True`` dropout or ReLU first: torchvision's
    EfficientNet classifier) is refused that on a leaf by autograd. So where a
    call is refused so, it and every later call run on fresh copies of those
    inputs, made per call (a copy's history ends at its leaf, so repeated
    calls do not chain, and the captured values stay as captured). A copy is
    counted with the call that makes it: the same in every figure of the
    module, whose options' bytes and times are differences, and its bytes
    alone a module's input, which the whole step's figures (on fake tensors)
    do not take from here.
    """

    def __init__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.forward = module.forward
        self.args, self.kwargs = args, kwargs
        self.leaves, self.spec = pytree.tree_flatten((args, kwargs))
        params = [p for p in module.parameters() if p.requires_grad]
        leaves = [t for t in self.leaves if isinstance(t, Tensor)]
        self.tensors = [*params, *leaves]
        # NOTE [arguments that change] in forget._engine: copied afresh for every call
        self.changing = [i for i, leaf in enumerate(self.leaves) if may_change(leaf)]
        self.copies = False
        self._plain_peak: int | None = None  # the ledger's, of the plain step alone

    def clear(self) -> None:
        for t in self.tensors:
            t.grad = None

    def call(self, fn: Callable[..., Any], *options: Any) -> Any:
        """``fn(*options, *args, **kwargs)`` on the module's inputs (NOTE [inputs written
        in place]: on copies once a call was refused for writing into a leaf)."""
        if not self.copies:
            try:
                args, kwargs = self.inputs()
                return fn(*options, *args, **kwargs)
            except RuntimeError as error:
                if "leaf Variable that requires grad" not in str(error):
                    raise
                self.copies = True
        args, kwargs = self.inputs()
        return fn(*options, *args, **kwargs)

    def inputs(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The args and kwargs of one call: as captured, but with fresh copies of the
        inputs it may change (NOTE [arguments that change] in `forget._engine`: a cache
        each run would append to) and, once a call was refused
        for writing into a leaf, of those that require grad (NOTE [inputs written in
        place])."""
        if not self.changing and not self.copies:
            return self.args, self.kwargs
        leaves = list(self.leaves)
        if self.copies:
            leaves = [t.clone() if isinstance(t, Tensor) and t.requires_grad else t for t in leaves]
        for i in self.changing:
            leaves[i] = copy_structure(leaves[i])
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return args, kwargs

    def run(self, policy: Policy | None) -> Any:
        if policy is None:
            return self.call(self.forward)
        return self.call(_run_option, self.forward, policy)

    def loss(self, policy: Policy | None) -> Tensor:
        return _scalar(self.run(policy))

    def step(self) -> None:
        """The module's training step alone, run plainly (no backward where nothing needs grad)."""
        loss = self.loss(None)
        if loss.requires_grad:  # a frozen module on inputs that need no grad: no backward
            loss.backward()

    def saved_bytes(self, policy: Policy | None) -> int:
        """Bytes alive after the forward alone (saved for backward, and its outputs)."""
        self.clear()
        return measure(self.run, policy).end_bytes

    def forgotten_bytes(self) -> int:
        """Bytes alive after the forward alone run as a forgotten region (its outputs)."""
        self.clear()
        return measure(self.call, _run_option, self.forward, None).end_bytes

    def workspace_bytes(self, probe: str) -> int:
        """What the allocator hands out beyond the ledger's storages in this module's step.

        Kernel workspaces (a convolution's, on CPU too) are no tensor storage, so
        the ledger, and the fake run it counts, does not see them (NOTE [tree
        figures]); they count in the module's backward work (NOTE [backward
        work]).
        """
        if probe == "ledger":
            return 0
        # One step, watched by both: the ledger's dispatch mode is on in every measured
        # step of the planner too (the guard's, NOTE [guarded steps]).
        self.clear()
        ledger = Ledger()
        try:
            with watch(ledger):
                by_allocator = peak_bytes(self.step, probe)
        finally:
            ledger.close()
        self.clear()
        self._plain_peak = ledger.peak  # `step_peak_bytes` of the plain step, measured here
        return max(0, by_allocator - ledger.peak)

    def step_peak_bytes(self, policy: Policy | None) -> int:
        """The ledger's peak of the module's step alone, under ``policy``."""
        if policy is None and self._plain_peak is not None:
            return self._plain_peak  # measured by `workspace_bytes`
        self.clear()

        def step() -> None:
            loss = self.loss(policy)
            if loss.requires_grad:
                loss.backward()

        peak = measure(step).peak_bytes
        self.clear()
        return peak

    def option_bytes(self, policies: Mapping[str, Policy]) -> dict[str, tuple[int, int]]:
        """Per option offered, the bytes it saves fewer than keeping, held from forward to
        backward, and how much higher its step alone peaks (NOTE [options' peaks]:
        below 0 where lower).

        An option that saves nothing is left out: keeping does as well at no extra
        time. So is a policy region that keeps no more than a forgotten one (a
        ``"selective"`` keep of matmul outputs on a convolution block): it re-runs
        as much, through the slower policy path.
        """
        if not policies:
            return {}
        held = {name: self.saved_bytes(p) for name, p in policies.items()}
        kept = self.saved_bytes(None)
        forgotten: int | None = None
        offered = {}
        for name, policy in policies.items():
            if held[name] >= kept:
                continue
            if not policy.regenerate:
                if forgotten is None:
                    forgotten = self.forgotten_bytes()
                if held[name] <= forgotten:
                    continue
            offered[name] = kept - held[name]
        if not offered:
            return {}
        plain = self.step_peak_bytes(None)
        return {
            name: (saves, self.step_peak_bytes(policies[name]) - plain)
            for name, saves in offered.items()
        }

    def option_times(
        self,
        offered: Mapping[str, tuple[int, int]],
        policies: Mapping[str, Policy],
        repeats: int,
        clock: Clock,
    ) -> dict[str, tuple[int, int, float]]:
        """Per option offered, its bytes saved, how much higher its step peaks, and the
        seconds it adds to a step.

        Each is timed side by side with the plain step (`time_calls`), by the
        median over rounds of its time less the plain step's in the same round.
        """
        if not offered:
            return {}
        steps: dict[str | None, Callable[[], None]] = {
            None: _step_of(functools.partial(self.loss, None))
        }
        steps.update(
            (name, _step_of(functools.partial(self.loss, policies[name]))) for name in offered
        )
        # Every option ran in `option_bytes`, and the plain step in `workspace_bytes`
        # (forward and backward, where a workspace is learned): no warm-up round.
        rounds = time_calls(
            steps, max(3, repeats), prepare=lambda _: self.clear(), warm_up=False, clock=clock
        )
        plain = rounds.pop(None)  # the plain step, once a round beside every option
        extra = {
            name: max(0.0, statistics.median(t - p for t, p in zip(times, plain, strict=True)))
            for name, times in rounds.items()
        }
        return {name: (*saves, extra[name]) for name, saves in offered.items()}


def _run_option(
    forward: Callable[..., Any], policy: Policy | None, *args: Any, **kwargs: Any
) -> Any:
    return run_option(forward, args, kwargs, policy)
