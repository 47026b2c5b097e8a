"""Budgeted planning on a torch model: profile its blocks, solve, apply, verify by measuring.

`plan` turns a chain of blocks into a `forget.plan.Chain` of exact byte counts
(`forget.measure`) and median times, solves it for a memory budget with the
pure planners of `forget.plan`, and returns a `Plan` whose measured peak fits
the budget.

NOTE [measured, not predicted]: the planners' memory model covers the chain's
activations, histories, gradients and its blocks' parameter gradients (which
grow as backward proceeds, NOTE [parameter gradients]); a real step also
holds what lies outside it: the stem and head of a model and their
parameter gradients, the loss, allocator-visible temporaries the model does
not know about. So `plan` never trusts a prediction. It applies every
candidate schedule and measures the training step with the exact ledger,
which repeats to the byte on the same inputs. The smallest feasible budget is
the measured peak of the least-memory schedule; above it, a bisection over
the budget handed to the planner collects schedules whose measured peak is
within the budget, and with them the baselines that fit (forgetting every
block, uniform segments); these are timed side by side and the fastest
measured wins (NOTE [consistently faster] in `_Planner._fastest`), so a
plan is never slower than a fitting uniform segmentation, up to timing
noise. A returned plan has ``measured_peak_bytes <= budget_bytes`` by
construction, for the inputs it was planned with.

NOTE [the last segment]: a top-level region that ends the chain is re-run as
soon as backward starts, so its activations are back at the very moment they
would have been kept until: forgetting it buys no memory at the peak and
costs its re-run (`torch.utils.checkpoint.checkpoint_sequential` runs its last
segment plainly for this reason). A candidate that ends in one (the Rotor
program may, at its least memory; forgetting every block does) is replaced by
the same schedule with that region's items run at the top level, when that
one's measured peak fits as well: less work at a peak within the budget,
which timing noise must not get to choose against. The same holds for a last
stage run under an option: the parts it re-runs come back as backward starts.
And with options, "every stage under this option, the last kept" is a
baseline beside the uniform segmentations: the profile times an option on its
stage alone, where the memory it spares the rest of the step (allocations and
page faults of a step holding less) does not show; measured in the full step,
the choice is made on what it costs there.

NOTE [alike stages]: identical blocks (a transformer's layers, a residual
network's blocks) cost the same, but each one's times, measured alone over a
few repeats on a busy CPU, scatter by tens of percent, and the optimal program
takes them at face value: it forgets the blocks that happened to measure
cheap, picking noise as if it were signal. So stages whose module matches
(type, ``repr``, parameter and buffer shapes, training flag), whose input has
the same layout and whose byte figures are all equal are given the medians of
their times (forward, forward without grad, backward, each option's re-run).
Plain callables, which carry no such description, keep their own.

NOTE [finer stages]: in a memory model where equal blocks cost equal memory,
a budget that some segment count fills is met best by that uniform
segmentation: every schedule over whole blocks that fits it does at least as
much work (parameter gradients break that equality, NOTE [parameter
gradients] in `forget.plan._schedule`, but only by a little). Cutting the
blocks finer opens schedules that are not on whole blocks: a region may end inside
a block, and a part of a block may be kept while the rest is forgotten (a
GPT block's attention half, whose T x T tensors grow with the context, and
its MLP half differ in bytes kept per second of re-run). With ``split``, each
block that offers stages (a ``forget_stages()`` method returning name ->
callable, run in turn; an ``nn.Sequential`` block's children) becomes that
many stages, less those joined at a cut that no backward reads (NOTE [dead
cuts]). The stages meet at single tensors, as blocks do; block ``i``
gives ``block_sizes[i]`` of them. The baselines (a region per block,
uniform segments) stay on whole blocks, as a user would cut the model with
``checkpoint_sequential``, and remain candidates: every schedule over whole
blocks is one over the finer stages too, so the search space only grows.
A plan made with ``split`` records ``block_stages`` (and ``stage_parts``,
where stages were joined) and splits the blocks again when it runs them.

NOTE [monotone in the budget]: one `_Planner` planning several budgets
remembers every schedule it proposed, and a budget's candidates include each
earlier proposal whose measured peak fits it: a plan at a larger budget is
chosen among a superset of a smaller budget's, so it is not slower, up to timing
noise. (Without this a larger budget's bisection probed only above the
smaller's schedules; on the context-512 GPT, the 50 % plan measured +13.9 %
where the 35 % plan, which fits 50 % too, measured -3.5 %.) `forget plan`
plans its budgets from the smallest up for this reason.

NOTE [time of a region]: the planners' time model (Rotor's) charges a
forgotten stage one extra forward without grad. forget's region does
more than that: its forward runs with grad under saved-tensor hooks and a
dispatch mode, the recomputation runs under them again, and every region has
a fixed cost (its setup, RNG state, hooks). On small blocks these dwarf the
forward itself, and a plan built on forward times alone forgets many small
regions where fewer, longer ones are faster. So the profile measures what
forgetting costs: per stage, a one-stage region's full step (forward and
backward) minus the plain step's, timed alternately; and once per chain, how
much less two neighbouring blocks cost forgotten as one region than as two,
the median over up to four pairs spread over the chain, which is the fixed
cost per region (``Chain.region_overhead_s``; a region
around one tiny op stands in for a one-block chain). A stage's
``forward_nograd_s`` is its difference minus that fixed cost, so a one-stage
region costs in the model what it measured.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from . import plan as P
from ._core import run_region
from ._errors import BudgetInfeasibleError
from ._measure import _identity, frozen_heap, measure
from ._regen import regenerating
from ._stateful import _storage_key
from .plan._baselines import forget_each_items, on_sub_stages, uniform_items
from .policies import Policy, as_policy

__all__ = ["Plan", "PlannedSequential", "plan", "profile_chain"]

Block = Callable[[Tensor], Tensor]
LossFn = Callable[[Tensor], Tensor]

# Bisection probes over the planner's budget (each one measured step at most).
_MAX_PROBES = 10
# Pairs of neighbouring blocks the fixed cost of a region is the median over.
_REGION_PAIRS = 4
# Chains up to this length also measure every uniform segmentation as a candidate.
_MAX_UNIFORM_TRIALS = 16


def _default_loss(output: Tensor) -> Tensor:
    return output.sum()


def _nbytes(t: Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def _check_tensor(value: object, what: str) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(
            f"forget: plan runs a chain of blocks, each taking and returning one tensor; "
            f"{what} is {type(value).__name__}"
        )
    return value


# ------------------------------------------------------------------ targets


@dataclass
class _Target:
    """What is planned: the blocks, and how one training step runs them."""

    blocks: Sequence[Block]
    modules: list[nn.Module]
    inputs: tuple[Any, ...]
    kind: str  # "sequential", "block_model" or "callables"
    model: Any  # the nn.Module (a reference model for kind "block_model"), or None
    loss_fn: LossFn | None
    # NOTE [finer stages]: with split, ``blocks`` are the blocks' stages, block
    # ``i`` giving ``block_sizes[i]`` of them (None: one stage per block).
    block_sizes: tuple[int, ...] | None = None
    # NOTE [dead cuts]: how many of the stages a block offers each planned stage
    # runs in turn (None: one each).
    stage_parts: tuple[int, ...] | None = None
    names: list[str] = field(default_factory=list)

    def chain_input(self) -> Tensor:
        if self.kind == "block_model":
            assert self.model is not None
            with torch.no_grad():
                h = self.model.embed(self.inputs[0])
        else:
            h = _check_tensor(self.inputs[0], "the sample input")
        return h.detach().requires_grad_(h.is_floating_point())

    def step(self, runner: Block | None) -> None:
        if self.kind == "block_model":
            assert self.model is not None
            before = self.model.blocks_runner
            self.model.blocks_runner = runner
            try:
                self.model.step(*self.inputs)
            finally:
                self.model.blocks_runner = before
            return
        loss_fn = self.loss_fn or _default_loss
        # As ``loss_fn(model(x)).backward()``: the output is not held during backward.
        loss_fn(self._forward(runner)).backward()

    def _forward(self, runner: Block | None) -> Tensor:
        h = _check_tensor(self.inputs[0], "the sample input")
        if runner is not None:
            return runner(h)
        for block in self.blocks:
            h = block(h)
        return h


def sub_stages(block: object) -> list[tuple[str, Block]] | None:
    """The stages a block offers (NOTE [finer stages]), or None when it is one stage.

    A block offers them with a ``forget_stages()`` method returning a dict of
    name -> callable (tensor -> tensor), which run in turn compute what the
    block computes; an ``nn.Sequential`` block offers its children.

    Raises:
        TypeError: ``forget_stages()`` returned something else.
    """
    offer = getattr(block, "forget_stages", None)
    if callable(offer):
        stages = offer()
        if (
            not isinstance(stages, Mapping)
            or not stages
            or not all(isinstance(k, str) and callable(v) for k, v in stages.items())
        ):
            raise TypeError(
                f"forget: {type(block).__name__}.forget_stages() must return a non-empty dict "
                "of name -> callable (tensor -> tensor)"
            )
        return list(stages.items())
    if isinstance(block, nn.Sequential) and len(block) > 0:
        return list(block.named_children())
    return None


class _Joined(nn.Module):
    """Stages a block offers, run in turn as one planned stage (NOTE [dead cuts])."""

    def __init__(self, parts: Sequence[Block]) -> None:
        super().__init__()
        self.parts = list(parts)
        # Registered when they are modules, so parameters, buffers, train/eval
        # and ``repr`` (NOTE [alike stages]) are those of the parts.
        modules = [p for p in self.parts if isinstance(p, nn.Module)]
        #: Whether the parts are all modules, so the module describes them.
        self.described = len(modules) == len(self.parts)
        if self.described:
            self.layers = nn.ModuleList(modules)

    def forward(self, h: Tensor) -> Tensor:
        for part in self.parts:
            h = part(h)
        return h


def _group(parts: Sequence[Block], groups: Sequence[int]) -> list[Block]:
    """``parts`` run ``groups[k]`` at a time: a group of one is the part itself."""
    out: list[Block] = []
    start = 0
    for size in groups:
        chunk = parts[start : start + size]
        out.append(chunk[0] if size == 1 else _Joined(chunk))
        start += size
    return out


def _dead_cuts(target: _Target, offered: list[list[tuple[str, Block]]]) -> list[list[int]]:
    """Per block, the groups of its stages that meet only at dead cuts.

    NOTE [dead cuts]: the memory model keeps a stage's input and output alive
    until its backward (`forget.plan._schedule`), which is exact when some
    backward reads them. A cut that no backward reads, as between BatchNorm
    (which saves its input) and ReLU (which saves its output), holds in a
    plain step only until the next stage has run; the model would count it to
    the end of the forward, 2 MiB per conv block of the reference CNN, and
    plan at small budgets on a peak off by that much (its plain peak was
    predicted 30.6 MB against 21.0 MB measured). So the stages on either side
    of a dead cut are planned as one: the cut is what the planner loses, a
    region's start there, which costs the same bytes as its neighbours' in
    the usual case. A cut is dead when no tensor that a stage of the block
    saves for backward, nor the block's output, shares its storage. Found by
    running each block once with grad, on the sample input, leaving no trace.
    """
    groups: list[list[int]] = []
    h = target.chain_input()
    with _untouched(target):
        for parts in offered:
            saved: set[tuple[torch.device, int]] = set()

            def pack(t: Tensor, saved: set[tuple[torch.device, int]] = saved) -> Tensor:
                saved.add(_storage_key(t))
                return t

            cuts: list[Tensor] = []
            with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                for k, (_, part) in enumerate(parts):
                    if k:
                        cuts.append(h)
                    h = _check_tensor(part(h), "the output of a block's stage")
            saved.add(_storage_key(h))
            sizes = [1]
            for cut in cuts:
                if _storage_key(cut) in saved:
                    sizes.append(1)
                else:
                    sizes[-1] += 1
            groups.append(sizes)
            del cuts
            h = h.detach().requires_grad_(h.is_floating_point())
    return groups


def _split(target: _Target) -> _Target:
    """The same target, its blocks replaced by their stages (NOTE [finer stages]).

    Stages that meet only at dead cuts are joined (NOTE [dead cuts]).
    """
    offered = [sub_stages(block) or [("", block)] for block in target.blocks]
    groups = _dead_cuts(target, offered) if any(len(o) > 1 for o in offered) else []
    blocks: list[Block] = []
    names: list[str] = []
    sizes: list[int] = []
    parts: list[int] = []
    for k, (name, block_parts) in enumerate(zip(target.names, offered, strict=True)):
        grouping = groups[k] if groups else [1] * len(block_parts)
        blocks += _group([stage for _, stage in block_parts], grouping)
        start = 0
        for size in grouping:
            sub = "+".join(n for n, _ in block_parts[start : start + size])
            names.append(f"{name}.{sub}" if sub else name)
            start += size
        sizes.append(len(grouping))
        parts += grouping
    joined = tuple(parts) if any(n > 1 for n in parts) else None
    return dataclasses.replace(
        target, blocks=blocks, names=names, block_sizes=tuple(sizes), stage_parts=joined
    )


def _target(
    model: object, inputs: tuple[Any, ...], loss_fn: LossFn | None, split: bool = False
) -> _Target:
    if not isinstance(split, bool):
        raise TypeError(f"forget: split must be a bool, got {type(split).__name__}")
    target = _whole_target(model, inputs, loss_fn)
    target.names = _stage_names(target)
    return _split(target) if split else target


def _whole_target(model: object, inputs: tuple[Any, ...], loss_fn: LossFn | None) -> _Target:
    from .models import BlockModel

    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"forget: loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(model, BlockModel):
        if len(inputs) != 2:
            raise TypeError(
                "forget: plan of a reference model takes its sample (input, target), "
                f"got {len(inputs)} sample inputs"
            )
        if loss_fn is not None:
            raise TypeError("forget: a reference model brings its own loss; drop loss_fn")
        blocks = list(model.blocks)
        return _Target(blocks, [model], inputs, "block_model", model, None)
    if len(inputs) != 1:
        raise TypeError(
            f"forget: plan takes one sample input for the first block, got {len(inputs)}"
        )
    if isinstance(model, nn.Sequential):
        blocks = list(model)
        return _Target(blocks, [model], inputs, "sequential", model, loss_fn)
    if isinstance(model, nn.Module):
        raise TypeError(
            f"forget: plan takes an nn.Sequential, an nn.ModuleList or list of blocks, or a "
            f"reference model (forget.models), got {type(model).__name__}; pass its list of "
            "blocks (e.g. model.layers) and run them with Plan.runner(blocks)"
        )
    if isinstance(model, Sequence | nn.ModuleList) and not isinstance(model, str | bytes):
        blocks = list(model)
        for i, block in enumerate(blocks):
            if not callable(block):
                raise TypeError(
                    f"forget: block {i} of the chain is not callable ({type(block).__name__})"
                )
        modules = [b for b in blocks if isinstance(b, nn.Module)]
        return _Target(blocks, modules, inputs, "callables", None, loss_fn)
    raise TypeError(
        "forget: plan takes an nn.Sequential, an nn.ModuleList or list of blocks, or a "
        f"reference model (forget.models), got {type(model).__name__}"
    )


def _parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for module in modules:
        for p in module.parameters():
            seen.setdefault(id(p), p)
    return list(seen.values())


def _cuda_devices(modules: Sequence[nn.Module], inputs: Sequence[Any]) -> list[int]:
    devices = {p.device for m in modules for p in m.parameters()}
    devices |= {x.device for x in inputs if isinstance(x, Tensor)}
    return sorted(d.index or 0 for d in devices if d.type == "cuda")


@contextlib.contextmanager
def _untouched(target: _Target) -> Iterator[None]:
    """Run trial steps that leave no trace: RNG, buffers and ``.grad`` restored after."""
    params = _parameters(target.modules)
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for m in target.modules for b in m.buffers()]
    try:
        with torch.random.fork_rng(devices=_cuda_devices(target.modules, target.inputs)):
            yield
    finally:
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
        for p, g in zip(params, grads, strict=True):
            p.grad = g


def _zero_grads(target: _Target) -> None:
    for p in _parameters(target.modules):
        p.grad = None


# ---------------------------------------------------------------- profiling


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step_timer(forward: Callable[[], Any], clear: Callable[[], None]) -> Callable[[], float]:
    """Time one forward and backward (gradient of ones) of ``forward``."""

    def timed() -> float:
        clear()
        start = time.perf_counter()
        y = forward()
        if isinstance(y, Tensor) and y.requires_grad:
            y.backward(torch.ones_like(y))
        return time.perf_counter() - start

    return timed


def _alternating_median_difference(
    a: Callable[[], float], b: Callable[[], float], repeats: int
) -> float:
    """Median of ``a() - b()`` over pairs run back to back (noise hits both alike), >= 0."""
    a(), b()  # warm up
    return max(0.0, statistics.median(a() - b() for _ in range(max(3, repeats))))


def _pair_starts(n: int) -> list[int]:
    """The first blocks of the disjoint neighbouring pairs `_region_overhead_s` times."""
    starts = list(range(0, n - 1, 2))
    if len(starts) > _REGION_PAIRS:
        last = len(starts) - 1
        starts = [starts[round(j * last / (_REGION_PAIRS - 1))] for j in range(_REGION_PAIRS)]
    return starts


def _region_overhead_s(
    blocks: Sequence[Block], inputs: Mapping[int, Tensor], stages: Sequence[P.Stage], repeats: int
) -> float:
    """The fixed cost of one region, the median over pairs of neighbouring blocks.

    Forgetting blocks ``i`` and ``i + 1`` as one region costs ``extra_pair``
    more than the plain step; as two regions, ``extra_i + extra_i+1`` (their
    stages' ``forward_nograd_s`` as profiled). The difference is what the
    second region's setup, hooks and recomputation cost beyond its ops. One
    pair's difference of differences scatters widely (0 to 4.4 ms on the
    residual MLP, profile to profile), so up to `_REGION_PAIRS` disjoint pairs
    spread over the chain are measured and the median taken (``inputs`` holds
    the input of block 0 and of each pair's first block). With one block, a
    region around a single tiny op stands in.
    """
    if len(blocks) < 2:
        x = torch.ones(1, device=inputs[0].device, requires_grad=True)
        tiny = functools.partial(torch.mul, other=2.0)
        return _alternating_median_difference(
            _step_timer(lambda: run_region(tiny, (x,), {}), lambda: setattr(x, "grad", None)),
            _step_timer(lambda: tiny(x), lambda: setattr(x, "grad", None)),
            max(9, 3 * repeats),
        )
    estimates = []
    for i in _pair_starts(len(blocks)):
        b0, b1, h = blocks[i], blocks[i + 1], inputs[i]
        params = [p for b in (b0, b1) for p in getattr(b, "parameters", list)()]

        def clear(h: Tensor = h, params: list[Any] = params) -> None:
            h.grad = None
            for p in params:
                p.grad = None

        def pair(t: Tensor, b0: Block = b0, b1: Block = b1) -> Tensor:
            out: Tensor = b1(b0(t))
            return out

        extra_pair = _alternating_median_difference(
            _step_timer(lambda: run_region(pair, (h,), {}), clear),  # noqa: B023
            _step_timer(lambda: pair(h), clear),  # noqa: B023
            max(9, repeats),
        )
        estimates.append(stages[i].forward_nograd_s + stages[i + 1].forward_nograd_s - extra_pair)
    return max(0.0, statistics.median(estimates))


def _policy_region(block: Block, policy: Policy) -> Block:
    def run(h: Tensor) -> Tensor:
        return _run_option(block, h, policy)

    return run


def _run_option(block: Block, h: Tensor, policy: Policy) -> Tensor:
    """Run a stage under an option: a policy region, or kept with outputs regenerated."""
    if policy.regenerate:
        with regenerating(policy):  # NOTE [regenerate]
            return block(h)
    out: Tensor = run_region(block, (h,), {}, policy=policy)
    return out


def _profile_stage(
    name: str,
    block: Block,
    h: Tensor,
    policies: Mapping[str, Policy],
    repeats: int,
) -> tuple[P.Stage, Tensor]:
    params = [p for p in getattr(block, "parameters", list)() if p.requires_grad]

    def clear() -> None:
        h.grad = None
        for p in params:
            p.grad = None

    def forward_backward(run: Block) -> tuple[int, int, int, int, Tensor]:
        """Return (saved, forward overhead, backward overhead, output bytes, output)."""
        clear()
        fwd = measure(run, h)
        out = _check_tensor(fwd.result, f"the output of block {name!r}")
        out_bytes = _nbytes(out)
        saved = max(0, fwd.end_bytes - out_bytes)
        fwd_over = max(0, fwd.peak_bytes - fwd.end_bytes)
        if not out.requires_grad:
            return saved, fwd_over, 0, out_bytes, out.detach()
        grad = torch.ones_like(out)
        bwd = measure(out.backward, grad)
        # The step keeps what backward leaves (the input's and parameters'
        # gradients); the rest of its peak is temporary.
        bwd_over = max(0, bwd.peak_bytes - bwd.end_bytes)
        return saved, fwd_over, bwd_over, out_bytes, out.detach()

    saved, fwd_over, bwd_over, out_bytes, out = forward_backward(block)

    def forward_with_grad() -> None:
        block(h)

    def backward_of(run: Block) -> Callable[[], float]:
        def timed() -> float:
            clear()
            y = run(h)
            if not y.requires_grad:
                return 0.0
            grad = torch.ones_like(y)
            start = time.perf_counter()
            y.backward(grad)
            return time.perf_counter() - start

        return timed

    def median_of(fn: Callable[[], float]) -> float:
        return statistics.median(fn() for _ in range(repeats))

    forward_s = _median_s(forward_with_grad, repeats)
    backward_s = median_of(backward_of(block))
    # NOTE [time of a region]: what forgetting this stage alone costs, in full.
    nograd_s = _alternating_median_difference(
        _step_timer(lambda: run_region(block, (h,), {}), clear),
        _step_timer(lambda: block(h), clear),
        repeats,
    )
    options = []
    for option_name, policy in policies.items():
        run = _policy_region(block, policy)
        opt_saved, _, opt_bwd_over, _, _ = forward_backward(run)
        # What running the stage under the policy costs in full, as NOTE [time of a
        # region]: its forward's bookkeeping as well as the re-run in backward.
        extra_s = _alternating_median_difference(
            _step_timer(functools.partial(run, h), clear),
            _step_timer(lambda: block(h), clear),
            repeats,
        )
        options.append(
            P.StageOption(
                option_name,
                saved_bytes=opt_saved,
                recompute_s=extra_s,
                backward_overhead_bytes=max(0, opt_bwd_over - bwd_over),
                # NOTE [options in regions]: regenerate keeps nothing a plain forward
                # would not, so it may run in a region's re-run; a policy region may not.
                in_regions=bool(policy.regenerate),
            )
        )
    clear()
    stage = P.Stage(
        name,
        forward_s=forward_s,
        forward_nograd_s=nograd_s,
        backward_s=backward_s,
        input_bytes=_nbytes(h),
        output_bytes=out_bytes,
        saved_bytes=saved,
        forward_overhead_bytes=fwd_over,
        backward_overhead_bytes=bwd_over,
        options=tuple(options),
    )
    return stage, out.requires_grad_(out.is_floating_point())


def _stage_names(target: _Target) -> list[str]:
    if target.kind == "block_model":
        return [f"blocks.{i}" for i in range(len(target.blocks))]
    if target.kind == "sequential":
        assert target.model is not None
        # Keys, not named_children(): that one lists a module used twice only once.
        return list(target.model._modules)
    return [
        f"{i}:{type(b).__name__ if isinstance(b, nn.Module) else getattr(b, '__name__', 'fn')}"
        for i, b in enumerate(target.blocks)
    ]


def _check_options(options: Mapping[str, object] | None) -> dict[str, Policy]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(
            "forget: options maps option names to policies, e.g. "
            f"{{'matmuls': forget.policies.save_outputs_of(*forget.policies.MATMUL)}}, "
            f"got {type(options).__name__}"
        )
    out: dict[str, Policy] = {}
    for name, value in options.items():
        policy = as_policy(value)  # type: ignore[arg-type]
        if policy is None:
            raise ValueError(f"forget: option {name!r} keeps nothing; that is 'forgotten' already")
        out[name] = policy
    return out


def _signature(block: Block, h: Tensor, stage: P.Stage) -> tuple[Any, ...] | None:
    """What makes two stages alike (NOTE [alike stages]); None for a plain callable."""
    if not isinstance(block, nn.Module) or (isinstance(block, _Joined) and not block.described):
        return None
    params = tuple(
        (name, tuple(p.shape), p.dtype, p.device, p.requires_grad)
        for name, p in block.named_parameters()
    )
    buffers = tuple((name, tuple(b.shape), b.dtype, b.device) for name, b in block.named_buffers())
    sizes = (
        stage.input_bytes,
        stage.output_bytes,
        stage.saved_bytes,
        stage.forward_overhead_bytes,
        stage.backward_overhead_bytes,
        tuple((o.name, o.saved_bytes, o.backward_overhead_bytes) for o in stage.options),
    )
    layout = (tuple(h.shape), tuple(h.stride()), h.dtype, h.device, h.requires_grad)
    return (type(block), repr(block), block.training, params, buffers, layout, sizes)


def _pooled(stages: list[P.Stage], signatures: list[tuple[Any, ...] | None]) -> list[P.Stage]:
    """NOTE [alike stages]: alike stages get the medians of their times."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, signature in enumerate(signatures):
        if signature is not None:
            groups.setdefault(signature, []).append(i)
    out = list(stages)
    for members in groups.values():
        if len(members) < 2:
            continue
        alike = [stages[i] for i in members]
        median = statistics.median
        options = tuple(
            dataclasses.replace(option, recompute_s=median(s.options[k].recompute_s for s in alike))
            for k, option in enumerate(alike[0].options)
        )
        for i in members:
            out[i] = dataclasses.replace(
                stages[i],
                forward_s=median(s.forward_s for s in alike),
                forward_nograd_s=median(s.forward_nograd_s for s in alike),
                backward_s=median(s.backward_s for s in alike),
                options=options,
            )
    return out


def _param_grad_bytes(blocks: Sequence[Block]) -> list[int]:
    """Bytes of the parameter gradients each block's backward writes.

    NOTE [parameter gradients] (in `forget.plan._schedule`): a step that starts
    with ``.grad`` unset (as the planner's trials do) allocates a parameter's
    gradient at the first backward that reaches it, which is that of the last
    block, in forward order, that uses it (a shared or tied weight counts once,
    there). Blocks that are not modules show no parameters and count 0.
    """
    owner: dict[int, tuple[int, int]] = {}
    for i, block in enumerate(blocks):
        if isinstance(block, nn.Module):
            for p in block.parameters():
                if p.requires_grad:
                    owner[id(p)] = (i, p.numel() * p.element_size())
    out = [0] * len(blocks)
    for i, nbytes in owner.values():
        out[i] += nbytes
    return out


def _profile(target: _Target, policies: Mapping[str, Policy], repeats: int) -> P.Chain:
    if not target.blocks:
        raise ValueError("forget: plan needs at least one block, got none")
    h = target.chain_input()
    stages = []
    signatures = []
    # Only the inputs the fixed cost of a region is timed on are held.
    wanted = {0, *_pair_starts(len(target.blocks))}
    inputs: dict[int, Tensor] = {}
    for i, (name, block) in enumerate(zip(target.names, target.blocks, strict=True)):
        if i in wanted:
            inputs[i] = h
        stage, out = _profile_stage(name, block, h, policies, repeats)
        stages.append(stage)
        signatures.append(_signature(block, h, stage))
        h = out
    stages = _pooled(stages, signatures)
    grads = _param_grad_bytes(target.blocks)
    stages = [
        dataclasses.replace(s, param_grad_bytes=g) for s, g in zip(stages, grads, strict=True)
    ]
    # NOTE [time of a region]: the fixed part, charged once per region.
    region_s = _region_overhead_s(target.blocks, inputs, stages, repeats)
    stages = [
        dataclasses.replace(s, forward_nograd_s=max(0.0, s.forward_nograd_s - region_s))
        for s in stages
    ]
    return P.Chain(tuple(stages), region_overhead_s=region_s)


@frozen_heap()  # NOTE [frozen heap] in forget._measure
def profile_chain(
    blocks: object,
    *sample_inputs: Any,
    loss_fn: LossFn | None = None,
    options: Mapping[str, Policy | bool] | None = None,
    repeats: int = 3,
    split: bool = False,
) -> P.Chain:
    """Measure a chain of blocks into a `forget.plan.Chain` of plain numbers.

    Each block runs on its input from the previous block: bytes come from the
    exact ledger (`forget.measure`), times are medians over ``repeats``. The
    model is left as it was (RNG, buffers such as BatchNorm statistics, and
    ``.grad`` are restored).

    Args:
        blocks: an ``nn.Sequential``, an ``nn.ModuleList`` or list of callables
            (tensor -> tensor), or a reference model of `forget.models`.
        *sample_inputs: the first block's input (a reference model: ``x, target``).
        loss_fn: unused here (accepted so that the arguments match `plan`).
        options: name -> policy: partial keeps the planner may pick per stage.
        repeats: timing repeats per figure.
        split: one stage per stage a block offers (NOTE [finer stages]: a
            ``forget_stages()`` method, or an ``nn.Sequential`` block's
            children), named ``block.stage``; blocks that offer none stay whole.

    Returns:
        The chain; ``str(stage)`` shows each stage's figures.
    """
    target = _target(blocks, sample_inputs, loss_fn, split)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"forget: repeats must be an int >= 1, got {repeats!r}")
    with _untouched(target):
        return _profile(target, _check_options(options), repeats)


# ---------------------------------------------------------------- applying


class _Items:
    """Run some schedule items on a tensor (the body of one forget region)."""

    def __init__(
        self,
        items: Sequence[P.Keep | P.Region],
        blocks: Sequence[Block],
        policies: Mapping[str, Policy],
    ) -> None:
        self.items = tuple(items)
        self.blocks = blocks
        self.policies = policies
        self.__qualname__ = f"plan_region[{self.items[0].start}:{self.items[-1].stop}]"

    def __call__(self, h: Tensor) -> Tensor:
        for item in self.items:
            if isinstance(item, P.Keep):
                block = self.blocks[item.stage_index]
                if item.option is None:
                    h = block(h)
                else:
                    h = _run_option(block, h, self.policies[item.option])
            else:
                h = run_region(_Items(item.items, self.blocks, self.policies), (h,), {})
        return h


class PlannedSequential(nn.Sequential):
    """An ``nn.Sequential`` whose layers run as a `Plan` says (same names, same state_dict keys)."""

    def __init__(self, sequential: nn.Sequential, runner: Block) -> None:
        super().__init__(OrderedDict(sequential.named_children()))
        self._runner = runner

    def forward(self, x: Tensor) -> Tensor:
        """Run the layers under the plan's schedule."""
        return self._runner(x)


def _fmt_bytes(n: int | float) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Plan:
    """A schedule for a chain of blocks that fits a memory budget, measured.

    Attributes:
        schedule: the planner's `forget.plan.Schedule` (nested forget regions).
        chain: the profiled figures it was solved on.
        budget_bytes: the budget, in bytes.
        measured_peak_bytes: peak of the planned training step (`forget.measure`).
        predicted_peak_bytes: the planner's peak plus what lies outside its
            model (the plain step's measured peak minus its predicted peak).
        plain_peak_bytes: measured peak of the plain step.
        min_feasible_bytes: measured peak of the least-memory schedule: the
            smallest budget `plan` accepts for this model and input.
        option_names: the stage options the planner could choose from.
        block_stages: planned with ``split`` (NOTE [finer stages]): how many
            stages each block gave; ``None``: one stage per block.
        stage_parts: planned with ``split``: how many of the stages a block
            offers each planned stage runs in turn, where stages meeting at a
            cut no backward reads were joined (NOTE [dead cuts]); ``None``:
            one each.
    """

    schedule: P.Schedule
    chain: P.Chain
    budget_bytes: int
    measured_peak_bytes: int
    predicted_peak_bytes: int
    plain_peak_bytes: int
    min_feasible_bytes: int
    option_names: tuple[str, ...] = ()
    policies: Mapping[str, Policy] = field(default_factory=dict, compare=False, repr=False)
    block_stages: tuple[int, ...] | None = None
    stage_parts: tuple[int, ...] | None = None

    @property
    def predicted_overhead(self) -> float:
        """Predicted extra time of a step, as a fraction of the plain step's time."""
        return self.schedule.predicted_overhead_s / max(self.chain.store_all_time_s, 1e-12)

    def runner(self, blocks: Sequence[Block]) -> Block:
        """Return a callable running ``blocks`` (tensor -> tensor) under this plan.

        Raises:
            ValueError: not as many blocks as the plan has stages, or an option
                the plan uses has no policy (a loaded plan: pass ``options``);
                for a plan made with ``split``, not as many blocks as it was
                made for, or a block that now gives another number of stages.
        """
        blocks = list(blocks)
        if self.block_stages is not None:
            blocks = self._stages_of(blocks)
        if len(blocks) != self.schedule.num_stages:
            raise ValueError(
                f"forget: this plan is for {self.schedule.num_stages} blocks, got {len(blocks)}"
            )
        used = {d.option for d in self.schedule.stage_decisions() if d.option is not None}
        missing = sorted(used - set(self.policies))
        if missing:
            raise ValueError(
                f"forget: the plan uses the options {missing} but has no policy for them; "
                "load it with Plan.load(path, options={name: policy, ...})"
            )
        return _Items(self.schedule.items, blocks, self.policies)

    def _stages_of(self, blocks: list[Block]) -> list[Block]:
        """The blocks' stages, as the plan was made on them (NOTE [finer stages])."""
        sizes = self.block_stages
        assert sizes is not None
        if len(blocks) != len(sizes):
            raise ValueError(
                f"forget: this plan is for {len(sizes)} blocks split into "
                f"{self.schedule.num_stages} stages, got {len(blocks)} blocks"
            )
        parts = self.stage_parts or (1,) * sum(sizes)
        out: list[Block] = []
        start = 0
        for i, (block, size) in enumerate(zip(blocks, sizes, strict=True)):
            stages = [stage for _, stage in sub_stages(block) or [("", block)]]
            grouping = parts[start : start + size]
            start += size
            if len(stages) != sum(grouping):
                raise ValueError(
                    f"forget: block {i} gives {len(stages)} stages, but the plan was made "
                    f"when it gave {sum(grouping)}"
                )
            out += _group(stages, grouping)  # NOTE [dead cuts]
        return out

    def apply(self, model: Any) -> Any:
        """Make ``model`` run under this plan.

        Args:
            model: an ``nn.Sequential`` (returns a `PlannedSequential` with the
                same layers and state_dict keys), a reference model of
                `forget.models` (sets its ``blocks_runner``; returns it), or a
                list / ``nn.ModuleList`` of blocks (returns a callable).
        """
        from .models import BlockModel

        if isinstance(model, BlockModel):
            model.blocks_runner = self.runner(list(model.blocks))
            return model
        if isinstance(model, nn.Sequential):
            return PlannedSequential(model, self.runner(list(model)))
        if isinstance(model, Sequence | nn.ModuleList):
            return self.runner(list(model))
        raise TypeError(
            "forget: Plan.apply takes an nn.Sequential, a reference model or a list of "
            f"blocks, got {type(model).__name__}"
        )

    def rows(self) -> list[dict[str, Any]]:
        """Per stage: name, decision, option, depth, saved bytes and expected recompute time."""
        rows = []
        for d in self.schedule.stage_decisions():
            stage = self.chain.stages[d.stage_index]
            option = stage.option(d.option)
            saved = stage.saved_bytes if option is None else option.saved_bytes
            recompute = d.depth * stage.forward_nograd_s + (option.recompute_s if option else 0.0)
            rows.append(
                {
                    "stage": stage.name,
                    "decision": d.decision,
                    "option": d.option,
                    "depth": d.depth,
                    # A forgotten stage keeps nothing in the forward, under an option or not.
                    "saved_bytes": 0 if d.depth > 0 else saved,
                    "recompute_s": recompute,
                }
            )
        return rows

    def __str__(self) -> str:
        lines = [
            f"forget plan ({self.schedule.algorithm}): {self.schedule.num_stages} stages, "
            f"budget {_fmt_bytes(self.budget_bytes)} ({self.budget_bytes:,} B)",
            f"  {'stage':<14} {'decision':<10} {'depth':>5} {'kept bytes':>14} {'recompute':>11}",
        ]
        for row in self.rows():
            decision = row["decision"]
            if row["depth"] and row["option"] is not None:
                decision += f"[{row['option']}]"  # NOTE [options in regions]: in its re-run
            lines.append(
                f"  {row['stage']:<14} {decision:<10} {row['depth']:>5} "
                f"{row['saved_bytes']:>14,} {row['recompute_s'] * 1e3:>9.3f}ms"
            )
        lines += [
            f"  peak: measured {self.measured_peak_bytes:,} B, predicted "
            f"{self.predicted_peak_bytes:,} B, plain {self.plain_peak_bytes:,} B "
            f"({self.measured_peak_bytes / max(self.plain_peak_bytes, 1):.2f}x)",
            f"  predicted time overhead: +{100 * self.predicted_overhead:.1f} % of a plain step; "
            f"schedule {self.schedule}",
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (policies are saved by name only)."""
        return {
            "format": "forget.plan/1",
            "schedule": self.schedule.to_dict(),
            "chain": [dataclasses.asdict(s) for s in self.chain.stages],
            "region_overhead_s": self.chain.region_overhead_s,
            "budget_bytes": self.budget_bytes,
            "measured_peak_bytes": self.measured_peak_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "plain_peak_bytes": self.plain_peak_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "option_names": list(self.option_names),
            "block_stages": None if self.block_stages is None else list(self.block_stages),
            "stage_parts": None if self.stage_parts is None else list(self.stage_parts),
        }

    def to_json(self) -> str:
        """The plan as JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(
        cls, obj: Mapping[str, Any], *, options: Mapping[str, Policy | bool] | None = None
    ) -> Plan:
        """Rebuild a plan from `to_dict`'s output; ``options`` gives the policies by name."""
        if not isinstance(obj, Mapping) or obj.get("format") != "forget.plan/1":
            raise ValueError("forget: not a saved forget plan (format 'forget.plan/1' expected)")
        stages = []
        for s in obj["chain"]:
            fields = dict(s)
            fields["options"] = tuple(P.StageOption(**o) for o in fields.get("options", ()))
            stages.append(P.Stage(**fields))
        sizes = obj.get("block_stages")
        if sizes is not None and sum(int(n) for n in sizes) != len(stages):
            raise ValueError(
                f"forget: the saved plan's block_stages {sizes} do not add up to its "
                f"{len(stages)} stages"
            )
        parts = obj.get("stage_parts")
        if parts is not None and (
            sizes is None or len(parts) != len(stages) or any(int(n) < 1 for n in parts)
        ):
            raise ValueError(
                f"forget: the saved plan's stage_parts {parts} do not give its {len(stages)} "
                "split stages a count >= 1 each"
            )
        return cls(
            schedule=P.Schedule.from_dict(obj["schedule"]),
            chain=P.Chain(
                tuple(stages), region_overhead_s=float(obj.get("region_overhead_s", 0.0))
            ),
            budget_bytes=int(obj["budget_bytes"]),
            measured_peak_bytes=int(obj["measured_peak_bytes"]),
            predicted_peak_bytes=int(obj["predicted_peak_bytes"]),
            plain_peak_bytes=int(obj["plain_peak_bytes"]),
            min_feasible_bytes=int(obj["min_feasible_bytes"]),
            option_names=tuple(obj.get("option_names", ())),
            policies=_check_options(options),
            block_stages=None if sizes is None else tuple(int(n) for n in sizes),
            stage_parts=None if parts is None else tuple(int(n) for n in parts),
        )

    @classmethod
    def from_json(cls, text: str, *, options: Mapping[str, Policy | bool] | None = None) -> Plan:
        """Rebuild a plan from `to_json`'s text."""
        return cls.from_dict(json.loads(text), options=options)

    @classmethod
    def load(cls, path: str | Path, *, options: Mapping[str, Policy | bool] | None = None) -> Plan:
        """Read a plan written by `save`."""
        return cls.from_json(Path(path).read_text(), options=options)


# ---------------------------------------------------------------- planning


class _Trials:
    """Measured peaks of candidate schedules, each schedule measured once."""

    def __init__(self, target: _Target, policies: Mapping[str, Policy]) -> None:
        self.target = target
        self.policies = policies
        self.peaks: dict[tuple[P.Keep | P.Region, ...], int] = {}

    def peak(self, schedule: P.Schedule) -> int:
        key = schedule.items
        if key not in self.peaks:
            runner = _Items(schedule.items, self.target.blocks, self.policies)
            with _untouched(self.target):
                _zero_grads(self.target)
                self.peaks[key] = measure(self.target.step, runner).peak_bytes
        return self.peaks[key]


@frozen_heap()  # NOTE [frozen heap] in forget._measure
def plan(
    model_or_blocks: object,
    *sample_inputs: Any,
    budget: int | float | str,
    loss_fn: LossFn | None = None,
    algorithm: str = "optimal",
    options: Mapping[str, Policy | bool] | None = None,
    repeats: int = 3,
    chain: P.Chain | None = None,
    split: bool = False,
) -> Plan:
    """Fit a training step into ``budget`` bytes with the least recomputation.

    Profiles the blocks (`profile_chain`), solves the chain with ``algorithm``
    (`forget.plan.ALGORITHMS`), applies candidate schedules and measures the
    step, and returns the fastest whose measured peak fits (NOTE [measured, not
    predicted] in this module). The model is left as it was.

    Args:
        model_or_blocks: an ``nn.Sequential``, an ``nn.ModuleList`` or list of
            blocks (tensor -> tensor), or a reference model of `forget.models`.
        *sample_inputs: the first block's input (reference model: ``x, target``).
        budget: bytes (``int``), a string (``"512MiB"``, ``"2GB"``, ``"50%"``),
            or a fraction in ``(0, 1]`` of the plain step's measured peak.
        loss_fn: output -> scalar loss for the step (default: ``output.sum()``).
        algorithm: the planner (``"optimal"``, ``"uniform"``, ``"sqrt"``, ...).
        options: name -> policy: partial keeps per stage (issue: selective
            recomputation), e.g. ``{"matmuls": save_outputs_of(*MATMUL)}``.
        repeats: timing repeats per profiled figure.
        chain: figures from an earlier `profile_chain` of the same blocks and
            options (and ``split``), to skip profiling.
        split: plan on the stages the blocks offer (NOTE [finer stages]), so
            regions may start and end inside a block: a GPT block's two
            residual halves, a conv block's conv, BatchNorm and ReLU. The
            baselines stay on whole blocks. Off by default: profiling costs
            the same per stage as per block, so a split chain takes longer.

    Returns:
        A `Plan`; ``print(plan)`` shows it, ``plan.apply(model)`` runs it.

    Raises:
        BudgetInfeasibleError: the budget is below the smallest feasible one,
            which the error names (``min_feasible_bytes``).

    Example:
        >>> import torch, forget
        >>> def layer():
        ...     return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
        ...                                torch.nn.Linear(256, 64))
        >>> net = torch.nn.Sequential(*[layer() for _ in range(6)])
        >>> p = forget.plan(net, torch.randn(256, 64), budget="60%", repeats=1)
        >>> p.measured_peak_bytes <= p.budget_bytes
        True
        >>> forget.plan.Plan is forget.Plan
        True
    """
    planner = _Planner(
        model_or_blocks,
        sample_inputs,
        loss_fn=loss_fn,
        options=options,
        repeats=repeats,
        chain=chain,
        split=split,
    )
    return planner.plan(budget, algorithm=algorithm)


def time_rounds(
    target: _Target, runners: Mapping[Any, Block | None], repeats: int
) -> dict[Any, list[float]]:
    """Step times of each runner (``None``: plain), round by round, timed side by side.

    One warm-up round, then ``repeats`` rounds, each running every runner once,
    so machine noise hits all alike: the ``r``-th time of every runner comes from
    the same round. The order is shuffled each round (seeded): a runner timed
    right after a larger one pays for memory the allocator hands back, which a
    fixed order would charge to the same runner every round. The model is left
    as it was (`_untouched`).
    """
    times: dict[Any, list[float]] = {key: [] for key in runners}
    order = list(runners)
    rng = random.Random(0)
    with _untouched(target):
        for round_ in range(repeats + 1):
            rng.shuffle(order)
            for key in order:
                _zero_grads(target)
                start = time.perf_counter()
                target.step(runners[key])
                if round_:
                    times[key].append(time.perf_counter() - start)
    return times


def time_side_by_side(
    target: _Target, runners: Mapping[Any, Block | None], repeats: int
) -> dict[Any, float]:
    """Median step time of each runner (``None``: plain), timed side by side (`time_rounds`)."""
    return {key: statistics.median(ts) for key, ts in time_rounds(target, runners, repeats).items()}


def paired_overheads(
    target: _Target, runners: Mapping[Any, Block], repeats: int
) -> dict[Any, list[float]]:
    """Step-time overhead of each runner over the plain step, round by round.

    NOTE [paired rounds]: the plain step is timed in every round beside the
    runners (`time_rounds`), and a runner's overhead in a round is its time
    over plain's *in the same round*, minus one; the median of those is the
    runner's overhead. A ratio of two medians would let a slow stretch of the
    machine that fell on plain's steps in some rounds and on a runner's in
    others count as overhead; paired, what a round shares divides out. The
    rounds stay paired across runners too, for a ratio's spread (`forget
    plan`'s 90 % range).
    """
    plain = object()
    rounds = time_rounds(target, {plain: None, **runners}, repeats)
    base = rounds.pop(plain)
    return {key: [t / b - 1 for t, b in zip(ts, base, strict=True)] for key, ts in rounds.items()}


def _displaces(rounds: Sequence[float], reference: Sequence[float]) -> bool:
    """NOTE [consistently faster]: faster than ``reference`` in two thirds of the rounds or more."""
    wins = sum(a < b for a, b in zip(rounds, reference, strict=True))
    return 3 * wins >= 2 * len(rounds)


class _Planner:
    """Profile once, then plan for several budgets, sharing the measured trials."""

    @frozen_heap()  # NOTE [frozen heap] in forget._measure
    def __init__(
        self,
        model_or_blocks: object,
        sample_inputs: tuple[Any, ...],
        *,
        loss_fn: LossFn | None = None,
        options: Mapping[str, Policy | bool] | None = None,
        repeats: int = 3,
        chain: P.Chain | None = None,
        split: bool = False,
    ) -> None:
        self.target = _target(model_or_blocks, sample_inputs, loss_fn, split)
        self.policies = _check_options(options)
        if chain is None:
            chain = profile_chain(
                model_or_blocks, *sample_inputs, options=options, repeats=repeats, split=split
            )
        elif not isinstance(chain, P.Chain) or len(chain) != len(self.target.blocks):
            raise ValueError(
                "forget: chain must be a forget.plan.Chain with one stage per block "
                f"({'per stage of a block, with split' if split else 'no split'}: "
                f"{len(self.target.blocks)})"
            )
        self.chain = chain
        self.repeats = repeats
        self.trials = _Trials(self.target, self.policies)
        # NOTE [monotone in the budget]: every schedule proposed so far, by its items.
        self.proposed: dict[tuple[P.Keep | P.Region, ...], P.Schedule] = {}
        n = len(chain)
        self.store_all = P.Schedule.from_items(
            chain, tuple(P.Keep(i) for i in range(n)), algorithm="store_all"
        )
        self.plain_peak = self.trials.peak(self.store_all)
        self.outside = self.plain_peak - self.store_all.predicted_peak_bytes
        # Baselines measured alongside the planner's own schedules: the plan is
        # never slower (predicted) than a fitting one of them. They are made on
        # the blocks (NOTE [finer stages]), as a user would cut the model.
        self.block_sizes = self.target.block_sizes or (1,) * n
        self.baselines = [self.on_blocks(forget_each_items(len(self.block_sizes)), "forget_each")]
        # NOTE [the last segment]: every stage under one option, the last kept whole.
        self.baselines += [
            P.Schedule.from_items(
                chain,
                (*(P.Keep(i, option=name) for i in range(n - 1)), P.Keep(n - 1)),
                algorithm=f"every stage {name}",
            )
            for name in self.policies
        ]
        if len(self.block_sizes) <= _MAX_UNIFORM_TRIALS:
            self.baselines += [self.uniform(k) for k in range(2, len(self.block_sizes) + 1)]
        # NOTE [parameter gradients] (in forget.plan._schedule): the least-memory
        # schedule of the model without them is a candidate too; measured, it can
        # peak lower (on the context-512 GPT: 151.7 MiB against 158.2 MiB).
        flat = dataclasses.replace(
            chain,
            stages=tuple(dataclasses.replace(s, param_grad_bytes=0) for s in chain.stages),
        )
        if flat != chain:
            items = P.solve(flat, P.min_feasible_bytes(flat)).items
            self.baselines.append(
                P.Schedule.from_items(
                    chain, items, algorithm="least memory without parameter gradients"
                )
            )

    def runner(self, plan: Plan) -> Block:
        """Run ``plan`` on the planned chain's stages (as `Plan.runner` on the blocks)."""
        return _Items(plan.schedule.items, self.target.blocks, plan.policies)

    def on_blocks(self, items: tuple[P.Keep | P.Region, ...], algorithm: str) -> P.Schedule:
        """A schedule written over the blocks, on the planned chain (NOTE [finer stages])."""
        return P.Schedule.from_items(
            self.chain, on_sub_stages(items, self.block_sizes), algorithm=algorithm
        )

    def uniform(self, segments: int) -> P.Schedule:
        """``segments`` uniform segments of the blocks, as ``checkpoint_sequential`` cuts them."""
        items = uniform_items(len(self.block_sizes), segments)
        return self.on_blocks(items, f"uniform({segments})")

    def _keep_last_segment(
        self, schedule: P.Schedule, peak: int, budget_bytes: int
    ) -> tuple[P.Schedule, int]:
        """``schedule`` with a region that ends the chain unwrapped, if that fits.

        NOTE [the last segment]. Unwraps repeatedly (a nested region may end the
        chain again; an option a stage runs inside a region may run at the top
        level too, so the result is a valid schedule), and keeps the last stage
        whole rather than under an option, whose re-run of the stage's parts
        comes as backward starts too.
        """
        items = schedule.items
        while isinstance(items[-1], P.Region):  # a region is never empty
            items = items[:-1] + items[-1].items
        last = items[-1]
        if isinstance(last, P.Keep) and last.option is not None:
            items = (*items[:-1], P.Keep(last.stage_index))
        if items == schedule.items:
            return schedule, peak
        variant = P.Schedule.from_items(
            self.chain, items, algorithm=f"{schedule.algorithm}, last segment kept"
        )
        variant_peak = self.trials.peak(variant)
        if variant_peak <= budget_bytes:
            return variant, variant_peak
        return schedule, peak

    def _fastest(self, fitting: list[tuple[P.Schedule, int]]) -> tuple[P.Schedule, int]:
        """The fitting schedule whose step is fastest, measured (NOTE [measured, not predicted]).

        The time model cannot see everything a region costs (allocator effects,
        per-op overheads that vary by position), so the candidates are timed side
        by side, round-robin after one warm-up round, ``repeats`` steps each.
        NOTE [consistently faster]: each is ranked by the median of its differences
        to the predicted fastest, round by round (what the rounds share, drift of
        the machine, cancels), and the winner displaces the predicted fastest only
        if it was faster in at least two rounds of three: a lead won by a round or
        two of noise does not overturn the model. Ties go to the lower predicted
        time, then peak.

        NOTE [confirmed on fresh rounds]: the challenger is the best of many
        candidates, so the rounds that chose it flatter it: with ten candidates
        whose true times tie the predicted fastest's, one of them wins two
        rounds of three by luck more often than not (on the residual MLP at
        50 %, a schedule predicted 12 % slower came through so, and measured
        7 % slower than the best uniform segmentation when timed again). So it
        displaces the predicted fastest only if it wins two thirds of a fresh
        set of rounds against it too, rounds that had no part in choosing it.
        """
        unique: dict[tuple[P.Keep | P.Region, ...], tuple[P.Schedule, int]] = {}
        for schedule, peak in sorted(fitting, key=lambda sp: (sp[0].predicted_time_s, sp[1])):
            unique.setdefault(schedule.items, (schedule, peak))
        candidates = list(unique.values())
        if len(candidates) == 1:
            return candidates[0]
        runners = {
            i: _Items(s.items, self.target.blocks, self.policies)
            for i, (s, _) in enumerate(candidates)
        }
        rounds = time_rounds(self.target, runners, max(1, self.repeats))
        reference = rounds[0]  # the predicted fastest

        def lead(i: int) -> float:
            return statistics.median(a - b for a, b in zip(rounds[i], reference, strict=True))

        best = min(rounds, key=lambda i: (lead(i), i))
        if best != 0 and _displaces(rounds[best], reference):
            # NOTE [confirmed on fresh rounds]
            fresh = time_rounds(
                self.target, {0: runners[0], best: runners[best]}, max(1, self.repeats)
            )
            if not _displaces(fresh[best], fresh[0]):
                best = 0
        else:
            best = 0
        return candidates[best]

    @frozen_heap()  # NOTE [frozen heap] in forget._measure
    def plan(self, budget: int | float | str, *, algorithm: str = "optimal") -> Plan:
        chain, trials = self.chain, self.trials
        budget_bytes = P.parse_budget(budget, self.plain_peak)
        chain_min = P.min_feasible_bytes(chain, algorithm)
        least = P.solve(chain, chain_min, algorithm=algorithm)
        fitting: list[tuple[P.Schedule, int]] = []
        peaks = []
        for schedule in [least, *self.baselines]:
            peak = trials.peak(schedule)
            peaks.append(peak)
            if peak <= budget_bytes:
                fitting.append((schedule, peak))
        min_feasible = min(self.plain_peak, *peaks)
        if budget_bytes < min_feasible:
            raise BudgetInfeasibleError(
                f"forget: the budget {budget_bytes:,} B is below the smallest feasible one, "
                f"{min_feasible:,} B (the least measured peak of any schedule tried; the "
                f"plain step peaks at {self.plain_peak:,} B)",
                budget_bytes=budget_bytes,
                min_feasible_bytes=min_feasible,
            )
        if budget_bytes >= self.plain_peak:
            fitting = [(self.store_all, self.plain_peak)]
        else:
            lo, hi = chain_min, self.store_all.predicted_peak_bytes
            probe = min(max(budget_bytes - self.outside, lo), hi)
            for _ in range(_MAX_PROBES):
                candidate = P.solve(chain, probe, algorithm=algorithm)
                peak = trials.peak(candidate)
                if peak <= budget_bytes:
                    fitting.append((candidate, peak))
                    lo = probe
                else:
                    hi = probe
                if hi - lo <= max(1, hi // 1000):
                    break
                probe = (lo + hi) // 2
        fitting = [self._keep_last_segment(s, p, budget_bytes) for s, p in fitting]
        if budget_bytes < self.plain_peak:
            # NOTE [monotone in the budget]: earlier proposals that fit are candidates.
            fitting += [
                (s, peak)
                for s in self.proposed.values()
                if (peak := trials.peak(s)) <= budget_bytes
            ]
            for s, _ in fitting:
                self.proposed.setdefault(s.items, s)
        best, best_peak = self._fastest(fitting)
        schedule = dataclasses.replace(best, budget_bytes=budget_bytes)
        return Plan(
            schedule=schedule,
            chain=chain,
            budget_bytes=budget_bytes,
            measured_peak_bytes=best_peak,
            predicted_peak_bytes=best.predicted_peak_bytes + self.outside,
            plain_peak_bytes=self.plain_peak,
            min_feasible_bytes=min_feasible,
            option_names=tuple(self.policies),
            policies=self.policies,
            block_stages=self.target.block_sizes,
            stage_parts=self.target.stage_parts,
        )
