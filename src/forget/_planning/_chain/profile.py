"""Profile a chain of blocks into plain numbers: exact bytes, median times.

NOTE [alike stages]: identical blocks (a transformer's layers, a residual
network's blocks) cost the same, but each one's times, measured alone over a
few repeats on a busy CPU, scatter by tens of percent, and the optimal program
takes them at face value: it forgets the blocks that happened to measure
cheap, picking noise as if it were signal. So stages whose module matches
(type, ``repr``, parameter and buffer shapes, training flag), whose input has
the same layout and whose byte figures are all equal are given the medians of
their times (forward, forward without grad, backward, each option's re-run).
Plain callables, which carry no such description, keep their own.

NOTE [time of a region]: Rotor's time model charges a forgotten stage one extra
forward without grad. A forget region costs more: its forward runs with grad
under hooks (and a dispatch mode), its re-run again, and every region has a
fixed cost (setup, RNG state, hooks). On small blocks these dwarf the forward,
and a plan on forward times alone forgets many small regions where fewer,
longer ones are faster. So the profile measures what forgetting costs: per
stage, a one-stage region's full step minus the plain step's, timed
alternately; per chain, how much less two neighbouring blocks cost as one
region than as two (median over up to four pairs), the fixed cost per region
(``Chain.region_overhead_s``). A stage's ``forward_nograd_s`` is its difference
minus that cost, so a one-stage region costs in the model what it measured.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ... import schedules as P
from ..._engine import regenerating, run_region
from ..._memory import frozen_heap, measure
from ...policies import Policy
from .._clock import WALL_CLOCK, Clock
from .._targets import (
    Block,
    LossFn,
    _check_options,
    _check_tensor,
    _nbytes,
    _Target,
    _target,
    untouched,
)
from .._timing import (
    _alternating_median_difference,
    _median_s,
    _pair_starts,
    _region_overhead_s,
    _step_timer,
)


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
    clock: Clock,
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
            return clock.elapsed(functools.partial(y.backward, grad))

        return timed

    def median_of(fn: Callable[[], float]) -> float:
        return statistics.median(fn() for _ in range(repeats))

    forward_s = _median_s(forward_with_grad, repeats, clock)
    backward_s = median_of(backward_of(block))
    # NOTE [time of a region]: what forgetting this stage alone costs, in full.
    nograd_s = _alternating_median_difference(
        _step_timer(lambda: run_region(block, (h,), {}), clear, clock),
        _step_timer(lambda: block(h), clear, clock),
        repeats,
    )
    options = []
    for option_name, policy in policies.items():
        run = _policy_region(block, policy)
        opt_saved, _, opt_bwd_over, _, _ = forward_backward(run)
        # What running the stage under the policy costs in full, as NOTE [time of a
        # region]: its forward's bookkeeping as well as the re-run in backward.
        extra_s = _alternating_median_difference(
            _step_timer(functools.partial(run, h), clear, clock),
            _step_timer(lambda: block(h), clear, clock),
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


def _signature(block: Block, h: Tensor, stage: P.Stage) -> tuple[Any, ...] | None:
    """What makes two stages alike (NOTE [alike stages]); None for a plain callable."""
    if not isinstance(block, nn.Module):
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

    NOTE [parameter gradients] (in `forget.schedules._schedule`): a step that starts
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


def _profile(
    target: _Target, policies: Mapping[str, Policy], repeats: int, clock: Clock
) -> P.Chain:
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
        stage, out = _profile_stage(name, block, h, policies, repeats, clock)
        stages.append(stage)
        signatures.append(_signature(block, h, stage))
        h = out
    stages = _pooled(stages, signatures)
    grads = _param_grad_bytes(target.blocks)
    stages = [
        dataclasses.replace(s, param_grad_bytes=g) for s, g in zip(stages, grads, strict=True)
    ]
    # NOTE [time of a region]: the fixed part, charged once per region.
    region_s = _region_overhead_s(target.blocks, inputs, stages, repeats, clock)
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
    clock: Clock = WALL_CLOCK,
) -> P.Chain:
    """Measure a chain of blocks into a `forget.schedules.Chain` of plain numbers.

    Each block runs on its input from the previous block: bytes come from the
    exact ledger (`forget.measure`), times are medians over ``repeats``. The
    model is left as it was (RNG, buffers such as BatchNorm statistics, and
    ``.grad`` are restored).

    Args:
        blocks: an ``nn.Sequential``, an ``nn.ModuleList`` or list of callables
            (tensor -> tensor), or a reference model of `forget._cli._models`.
        *sample_inputs: the first block's input (a reference model: ``x, target``).
        loss_fn: unused here (accepted so that the arguments match `plan`).
        options: name -> policy: partial keeps the planner may pick per stage.
        repeats: timing repeats per figure.
        split: one stage per stage a block offers (NOTE [finer stages]: a
            ``forget_stages()`` method, or an ``nn.Sequential`` block's
            children), named ``block.stage``; blocks that offer none stay whole.
        clock: what times are read on (`forget._planning.WallClock`; a test's
            `forget._planning.FixedClock` runs nothing).

    Returns:
        The chain; ``str(stage)`` shows each stage's figures.
    """
    target = _target(blocks, sample_inputs, loss_fn, split)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"forget: repeats must be an int >= 1, got {repeats!r}")
    with untouched(target):
        return _profile(target, _check_options(options), repeats, clock)
