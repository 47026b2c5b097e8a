"""Timing: callables in interleaved rounds, medians, paired differences."""

from __future__ import annotations

import functools
import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from .. import schedules as P
from .._engine import run_region
from ._clock import WALL_CLOCK, Clock

Block = Callable[[Tensor], Tensor]

K = TypeVar("K")

# ---------------------------------------------------------------- profiling


def _median_s(fn: Callable[[], Any], repeats: int, clock: Clock) -> float:
    return statistics.median(clock.elapsed(fn) for _ in range(repeats))


def _step_of(forward: Callable[[], Any]) -> Callable[[], None]:
    """One forward and backward (gradient of ones) of ``forward``."""

    def step() -> None:
        y = forward()
        if isinstance(y, Tensor) and y.requires_grad:
            y.backward(torch.ones_like(y))

    return step


def _step_timer(
    forward: Callable[[], Any], clear: Callable[[], None], clock: Clock
) -> Callable[[], float]:
    """Time one forward and backward (gradient of ones) of ``forward`` on ``clock``."""
    step = _step_of(forward)

    def timed() -> float:
        clear()
        return clock.elapsed(step)

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


def time_calls(
    calls: Mapping[K, Callable[[], object]],
    repeats: int,
    *,
    prepare: Callable[[K], object] | None = None,
    warm_up: bool = True,
    clock: Clock = WALL_CLOCK,
) -> dict[K, list[float]]:
    """Times of each call on ``clock`` (the wall clock), round by round, side by side.

    One warm-up round (unless ``warm_up`` is false: every call ran before in
    the process), then ``repeats`` rounds, each running every call once, so
    machine noise hits all alike: the ``r``-th time of every call comes from
    the same round. The order is shuffled each round (seeded): a call timed
    right after a larger one pays for memory the allocator hands back, which a
    fixed order would charge to the same call every round. ``prepare(key)``
    runs before each call, untimed (zeroing gradients, seeding).

    Example:
        >>> rounds = time_calls({"a": lambda: None, "b": lambda: None}, 3)
        >>> {key: len(times) for key, times in rounds.items()}
        {'a': 3, 'b': 3}
    """
    times: dict[K, list[float]] = {key: [] for key in calls}
    order = list(calls)
    rng = random.Random(0)
    for round_ in range(repeats + 1 if warm_up else repeats):
        rng.shuffle(order)
        for key in order:
            if prepare is not None:
                prepare(key)
            seconds = clock.elapsed(calls[key])
            if round_ or not warm_up:
                times[key].append(seconds)
    return times


def fastest_of(time: Callable[[Sequence[int]], Mapping[int, Sequence[float]]], count: int) -> int:
    """The index of the fastest of ``count`` candidates; candidate 0 is the predicted fastest.

    ``time(indices)`` times those candidates side by side and returns their
    step times round by round (`time_calls`).

    NOTE [consistently faster]: the cost model cannot see everything a region
    costs (allocator effects, per-op overheads that vary by position), so the
    few best are timed. Each is ranked by the median of its differences to
    candidate 0, round by round (what the rounds share, drift of the machine,
    cancels), and the best displaces candidate 0 only if it was faster in two
    thirds of the rounds: a lead won by a round or two of noise does not
    overturn the model.

    NOTE [confirmed on fresh rounds]: the challenger is the best of several, so
    the rounds that chose it flatter it; with candidates whose true times tie,
    one wins two rounds of three by luck often. So it displaces candidate 0
    only if it wins two thirds of a fresh set of rounds too, rounds that had no
    part in choosing it.
    """
    if count <= 1:
        return 0
    rounds = time(range(count))
    reference = rounds[0]

    def lead(i: int) -> float:
        return statistics.median(a - b for a, b in zip(rounds[i], reference, strict=True))

    best = min(rounds, key=lambda i: (lead(i), i))
    if best == 0 or not _displaces(rounds[best], reference):
        return 0
    fresh = time([0, best])  # NOTE [confirmed on fresh rounds]
    return best if _displaces(fresh[best], fresh[0]) else 0


def _displaces(rounds: Sequence[float], reference: Sequence[float]) -> bool:
    """NOTE [consistently faster]: faster than ``reference`` in two thirds of the rounds or more."""
    wins = sum(a < b for a, b in zip(rounds, reference, strict=True))
    return 3 * wins >= 2 * len(rounds)


# Pairs of neighbouring blocks the fixed cost of a region is the median over.
_REGION_PAIRS = 4


def ratio_range(
    plan: Sequence[float], reference: Sequence[float], draws: int = 2000
) -> tuple[float, float] | None:
    """The 5th and 95th percentiles of median(plan) / median(reference) over resampled rounds.

    NOTE [paired rounds]: a plan's overhead is timed beside the plain step in
    every round, and its overhead in a round is its time over plain's in the
    same round, minus one; the median of those is its overhead. A ratio of two
    medians would let a slow stretch of the machine that fell on plain's steps
    in some rounds and on the plan's in others count as overhead; paired, what
    a round shares divides out.

    NOTE [ratio range]: ``plan`` and ``reference`` are per-round overheads of the
    same rounds (NOTE [paired rounds]); the rounds are drawn with replacement,
    as pairs, ``draws`` times (seeded, so a table repeats given its timings).
    A draw whose reference median is not above zero has no ratio and is left
    out; with fewer than half the draws left, there is no range.
    """
    if len(plan) != len(reference) or not plan:
        raise ValueError("forget: plan and reference need the same, non-zero number of rounds")
    rng = random.Random(0)
    n = len(plan)
    ratios = []
    for _ in range(draws):
        picks = [rng.randrange(n) for _ in range(n)]
        below = statistics.median(reference[i] for i in picks)
        if below > 0:
            ratios.append(statistics.median(plan[i] for i in picks) / below)
    if 2 * len(ratios) < draws:
        return None
    cuts = statistics.quantiles(ratios, n=20, method="inclusive")
    return cuts[0], cuts[-1]


def _region_overhead_s(
    blocks: Sequence[Block],
    inputs: Mapping[int, Tensor],
    stages: Sequence[P.Stage],
    repeats: int,
    clock: Clock,
) -> float:
    """The fixed cost of one region, the median over pairs of neighbouring blocks.

    NOTE [time of a region]: a forgotten region costs more than its re-run: its
    forward runs under hooks, its re-run again, and every region has a fixed
    cost (setup, RNG state, hooks). On small modules this outweighs the
    forward, and a plan on forward times alone forgets many small regions where
    fewer are faster; so the profile charges each region this fixed cost.
    Forgetting blocks ``i`` and ``i + 1`` as one region costs ``extra_pair``
    more than the plain step; as two regions, ``extra_i + extra_i+1`` (their
    stages' ``forward_nograd_s`` as profiled). The difference is what the
    second region's setup, hooks and recomputation cost beyond its ops. One
    pair's difference of differences scatters widely from profile to profile
    (benchmarks/measured.md), so up to `_REGION_PAIRS` disjoint pairs
    spread over the chain are measured and the median taken (``inputs`` holds
    the input of block 0 and of each pair's first block). With one block, a
    region around a single tiny op stands in.
    """
    if len(blocks) < 2:
        x = torch.ones(1, device=inputs[0].device, requires_grad=True)
        tiny = functools.partial(torch.mul, other=2.0)

        def clear_x() -> None:
            x.grad = None

        return _alternating_median_difference(
            _step_timer(lambda: run_region(tiny, (x,), {}), clear_x, clock),
            _step_timer(lambda: tiny(x), clear_x, clock),
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
            _step_timer(lambda: run_region(pair, (h,), {}), clear, clock),  # noqa: B023
            _step_timer(lambda: pair(h), clear, clock),  # noqa: B023
            max(9, repeats),
        )
        estimates.append(stages[i].forward_nograd_s + stages[i + 1].forward_nograd_s - extra_pair)
    return max(0.0, statistics.median(estimates))
