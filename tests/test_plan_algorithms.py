"""Tests of forget.schedules: pure planning, no torch (brute force, golden values, boundaries)."""

from __future__ import annotations

import dataclasses
import doctest
import itertools
import json
import math
import random
import subprocess
import sys
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forget.schedules
from forget._errors import BudgetInfeasibleError
from forget.schedules import (
    ALGORITHMS,
    Chain,
    Keep,
    Region,
    Schedule,
    Stage,
    StageOption,
    evaluate,
    get_algorithm,
    min_feasible_bytes,
    pareto,
    revolve_forward_steps,
    simulate,
    solve,
)
from forget.schedules._schedule import Item

PROFILE = settings(derandomize=True, deadline=None, max_examples=40)


def random_chain(
    rng: random.Random,
    n: int,
    *,
    options: bool = False,
    scale: int = 1,
    grads: bool = False,
    in_regions: bool = False,
) -> Chain:
    """Return a chain with small random integer figures (times and sizes).

    With ``grads``, stages have parameter gradients too (NOTE [parameter
    gradients]), drawn after everything else so the other figures stay as
    they were without. With ``in_regions``, each option may run inside a
    region or not (NOTE [options in regions]), drawn last of all.
    """
    a = [rng.randint(0, 6) * scale for _ in range(n + 1)]
    stages = []
    for i in range(n):
        opts: tuple[StageOption, ...] = ()
        if options and rng.random() < 0.5:
            opts = (
                StageOption(
                    "part",
                    rng.randint(0, 5) * scale,
                    rng.randint(0, 3),
                    rng.randint(0, 3) * scale,
                ),
            )
        stages.append(
            Stage(
                f"s{i}",
                rng.randint(1, 5),
                rng.randint(0, 4),
                rng.randint(1, 5),
                a[i],
                a[i + 1],
                rng.randint(0, 8) * scale,
                rng.randint(0, 3) * scale,
                rng.randint(0, 3) * scale,
                opts,
            )
        )
    if grads:
        stages = [
            dataclasses.replace(stage, param_grad_bytes=rng.randint(0, 4) * scale)
            for stage in stages
        ]
    if in_regions:
        stages = [
            dataclasses.replace(
                stage,
                options=tuple(
                    dataclasses.replace(o, in_regions=rng.random() < 0.7) for o in stage.options
                ),
            )
            for stage in stages
        ]
    return Chain(tuple(stages))


def all_trees(
    chain: Chain, s: int, t: int, *, not_one_region: bool = False, top: bool = True
) -> Iterator[tuple]:
    """Yield every item sequence over [s, t).

    A region whose only item is a region over the same range is skipped (it
    would nest forever; each extra level only adds a forward pass). Options
    inside a region only where they allow it (NOTE [options in regions]).
    """
    if s == t:
        yield ()
        return
    for k in range(s + 1, t + 1):
        heads: list[Item] = []
        if k == s + 1:
            options = chain.stages[s].options
            names = [None, *(o.name for o in options if top or o.in_regions)]
            heads += [Keep(s, name) for name in names]
        if not (not_one_region and k == t):
            inners = all_trees(chain, s, k, not_one_region=True, top=False)
            heads += [Region(inner) for inner in inners]
        for head in heads:
            for rest in all_trees(chain, k, t, top=top):
                yield (head, *rest)


def brute_force(chain: Chain) -> list[tuple[int, float, tuple]]:
    out = []
    for items in all_trees(chain, 0, len(chain)):
        peak, time_s = simulate(chain, items)
        out.append((peak, time_s, items))
    return out


BRUTE_CASES = [
    (seed, n, seed % 2 == 0, 2.5 * (seed % 3 == 1), grads, False)
    for grads in (False, True)
    for seed, n in enumerate([1, 2, 2, 3, 3, 3, 4, 4, 4, 5, 5])
] + [  # NOTE [options in regions]
    (seed, n, True, 2.5 * (seed % 2), seed % 3 == 0, True)
    for seed, n in enumerate([2, 3, 3, 4, 4, 4, 5, 5], start=20)
]


@pytest.mark.parametrize(
    ("seed", "n", "options", "region_s", "grads", "in_regions"),
    BRUTE_CASES,
    ids=[
        f"seed{s}-L{n}-opt{o}-region{c}-grads{g}" + ("-inregions" if r else "")
        for s, n, o, c, g, r in BRUTE_CASES
    ],
)
def test_optimal_equals_brute_force(
    seed: int, n: int, options: bool, region_s: float, grads: bool, in_regions: bool
) -> None:
    chain = random_chain(
        random.Random(seed), n, options=options, grads=grads, in_regions=in_regions
    )
    chain = dataclasses.replace(chain, region_overhead_s=region_s)
    results = brute_force(chain)
    for peak, time_s, items in results:
        assert evaluate(chain, items) == pytest.approx((peak, time_s))
    lowest = min(p for p, _, _ in results)
    assert min_feasible_bytes(chain) == lowest
    highest = max(p for p, _, _ in results)
    budgets = sorted(
        {
            lowest,
            highest,
            *random.Random(seed).sample(range(lowest, highest + 1), min(6, highest - lowest + 1)),
        }
    )
    for budget in budgets:
        best_s = min(t for p, t, _ in results if p <= budget)
        schedule = solve(chain, budget, unit_bytes=1)  # integer sizes: discretization is exact
        assert schedule.predicted_time_s == pytest.approx(best_s)
        assert simulate(chain, schedule) == (schedule.predicted_peak_bytes, pytest.approx(best_s))
        assert schedule.predicted_peak_bytes <= budget
    with pytest.raises(BudgetInfeasibleError):
        solve(chain, lowest - 1, unit_bytes=1)


@pytest.mark.parametrize("seed", range(4))
def test_the_dp_rebuilds_schedules_that_fit_with_parameter_gradients(seed: int) -> None:
    # NOTE [parameter gradients]: a region re-run after the backward of the stages
    # behind it has their gradients' less memory; the DP's own schedule (before
    # `solve` falls back to the least-memory one) must fit, at its predicted time.
    from forget.schedules._dp import optimal_items

    rng = random.Random(seed)
    fitted = 0
    for _ in range(60):
        chain = random_chain(rng, rng.randint(3, 7), grads=True)
        lowest = min_feasible_bytes(chain)
        top = solve(chain, 10**9, unit_bytes=1).predicted_peak_bytes
        for budget in range(lowest, top + 1):
            items = optimal_items(chain, budget, 1)
            if items is None:
                continue
            fitted += 1
            peak, time_s = evaluate(chain, items)
            assert peak <= budget, (chain, budget, items)
            assert time_s == pytest.approx(solve(chain, budget, unit_bytes=1).predicted_time_s)
    assert fitted > 100


def test_brute_force_counts_every_tree() -> None:
    # 1 stage: Keep, Region(Keep). 2 stages: {Keep, Region(Keep)} x {Keep, Region(Keep)},
    # plus a region over both holding any of those 4 sequences: 8.
    chain = random_chain(random.Random(1), 3)
    assert sum(1 for _ in all_trees(chain, 0, 1)) == 2
    assert sum(1 for _ in all_trees(chain, 0, 2)) == 8


@pytest.mark.parametrize("seed", range(6))
def test_coarse_units_fit_and_match_simulator(seed: int) -> None:
    chain = random_chain(random.Random(100 + seed), 12, options=True, scale=1000, grads=True)
    lowest = min_feasible_bytes(chain)
    top = solve(chain, 10**12).predicted_peak_bytes
    for budget in (lowest, (lowest + top) // 2, top - 1):
        schedule = solve(chain, budget, memory_units=50)
        assert simulate(chain, schedule) == (
            schedule.predicted_peak_bytes,
            pytest.approx(schedule.predicted_time_s),
        )
        assert schedule.predicted_peak_bytes <= budget


@st.composite
def chains(draw: st.DrawFn) -> Chain:
    n = draw(st.integers(1, 8))
    rng = random.Random(draw(st.integers(0, 10**6)))
    return random_chain(
        rng,
        n,
        options=draw(st.booleans()),
        grads=draw(st.booleans()),
        in_regions=draw(st.booleans()),  # NOTE [options in regions]
    )


@PROFILE
@given(chain=chains(), fractions=st.lists(st.floats(0, 1.2), min_size=2, max_size=5))
def test_cost_never_increases_with_budget(chain: Chain, fractions: list[float]) -> None:
    lowest = min_feasible_bytes(chain)
    top = solve(chain, 10**9).predicted_peak_bytes
    budgets = sorted(lowest + int(f * (top - lowest)) for f in fractions)
    times = []
    for budget in budgets:
        schedule = solve(chain, budget)
        peak, time_s = simulate(chain, schedule)
        assert peak == schedule.predicted_peak_bytes <= budget
        assert time_s == pytest.approx(schedule.predicted_time_s)
        times.append(schedule.predicted_time_s)
    assert all(a >= b - 1e-9 for a, b in itertools.pairwise(times))


@PROFILE
@given(chain=chains(), algorithm=st.sampled_from(sorted(ALGORITHMS)))
def test_every_algorithm_fits_its_budget_and_boundary(chain: Chain, algorithm: str) -> None:
    lowest = min_feasible_bytes(chain, algorithm)
    schedule = solve(chain, lowest, algorithm=algorithm)
    assert simulate(chain, schedule)[0] == schedule.predicted_peak_bytes <= lowest
    assert lowest >= min_feasible_bytes(chain)
    if lowest > 0:
        with pytest.raises(BudgetInfeasibleError) as info:
            solve(chain, lowest - 1, algorithm=algorithm)
        assert info.value.min_feasible_bytes == lowest
        assert info.value.budget_bytes == lowest - 1


def big_chain(n: int, seed: int = 0) -> Chain:
    rng = random.Random(seed)
    a = [rng.randint(1, 8) * 2**20 for _ in range(n + 1)]
    return Chain(
        tuple(
            Stage(f"l{i}", 1e-3, 8e-4, 2e-3, a[i], a[i + 1], 4 * a[i], 2**19, 2**19)
            for i in range(n)
        )
    )


def test_boundary_exact_bytes_despite_discretization() -> None:
    chain = big_chain(30)
    lowest = min_feasible_bytes(chain)
    schedule = solve(chain, lowest)
    assert schedule.predicted_peak_bytes == lowest == simulate(chain, schedule)[0]
    with pytest.raises(BudgetInfeasibleError, match=f"smallest feasible budget is {lowest} bytes"):
        solve(chain, lowest - 1)


def test_a_100_stage_solve_fits_its_budget_and_ties_or_beats_the_segmentations() -> None:
    # How long this takes is benchmarks/solve_time.py's to print; here, what it returns.
    chain = big_chain(100, seed=1)
    lowest = min_feasible_bytes(chain)
    top = solve(chain, 10**15).predicted_peak_bytes
    budget = (lowest + top) // 3
    assert lowest <= budget < top
    schedule = solve(chain, budget)
    assert simulate(chain, schedule)[0] == schedule.predicted_peak_bytes <= budget
    assert schedule.num_stages == 100
    # Below the store-all peak something is re-run, so there is an overhead.
    assert schedule.predicted_overhead_s > 0
    # Revolve, seconds at 100 stages, is compared at 24 (test_optimal_beats_or_ties_baselines).
    for name in ("store_all", "forget_each", "uniform", "sqrt"):
        try:
            other = solve(chain, budget, algorithm=name)
        except BudgetInfeasibleError:
            continue
        # The DP sees a rounded model; allow what a unit of rounding can cost.
        assert schedule.predicted_time_s <= other.predicted_time_s * 1.02 + 1e-12, name


def test_optimal_beats_or_ties_baselines() -> None:
    chain = big_chain(24, seed=3)
    top = solve(chain, 10**15).predicted_peak_bytes
    for budget in (top // 2, top // 4):
        best = solve(chain, budget)
        for name in ALGORITHMS:
            try:
                other = solve(chain, budget, algorithm=name)
            except BudgetInfeasibleError:
                continue
            # The DP sees a rounded model; allow what a unit of rounding can cost.
            assert best.predicted_time_s <= other.predicted_time_s * 1.02 + 1e-12, name


# Griewank and Walther: t(l, c) = r l - beta(c + 1, r - 1), with hand-checked values.
@pytest.mark.parametrize(
    ("steps", "checkpoints", "forward_steps"),
    [
        (1, 1, 0),
        (2, 1, 1),
        (3, 1, 3),  # l (l - 1) / 2 with a single checkpoint
        (4, 1, 6),
        (10, 1, 45),
        (3, 2, 2),  # advance, store, advance, reverse; l - 1 once c >= l - 1
        (4, 2, 4),
        (6, 2, 8),  # beta(2, 2) = 6 steps reach r = 2: 2 * 6 - beta(3, 1) = 12 - 4
        (10, 3, 15),
        (20, 3, 45),  # beta(3, 3) = 20: r = 3, 60 - beta(4, 2) = 60 - 15
        (10, 9, 9),
        (100, 100, 99),
    ],
)
def test_revolve_forward_steps_golden(steps: int, checkpoints: int, forward_steps: int) -> None:
    assert revolve_forward_steps(steps, checkpoints) == forward_steps


@pytest.mark.parametrize("checkpoints", [1, 2, 3, 5])
def test_revolve_schedule_reaches_the_bound(checkpoints: int) -> None:
    for n in range(1, 30):
        chain = big_chain(n)
        schedule = solve(chain, 10**15, algorithm="revolve", checkpoints=checkpoints)
        nograd = sum(op.kind in ("F_ck", "F_n") for op in schedule.ops())
        assert nograd == revolve_forward_steps(n, checkpoints)


def test_revolve_rejects_zero_checkpoints() -> None:
    with pytest.raises(ValueError, match="0 checkpoints"):
        revolve_forward_steps(3, 0)
    assert revolve_forward_steps(1, 0) == 0


def test_baseline_shapes() -> None:
    chain = big_chain(10)
    each = solve(chain, 10**15, algorithm="forget_each")
    assert [d.depth for d in each.stage_decisions()] == [1] * 10
    uniform = solve(chain, 10**15, algorithm="uniform", segments=3)
    assert [d.depth for d in uniform.stage_decisions()] == [1] * 6 + [0] * 4
    assert [d.decision for d in uniform.stage_decisions()][-1] == "kept"
    sqrt = solve(chain, 10**15, algorithm="sqrt")
    assert sqrt.items == uniform.items  # round(sqrt(10)) == 3
    plain = solve(chain, 10**15, algorithm="store_all")
    assert plain.predicted_overhead_s == 0
    assert solve(chain, 10**15).items == plain.items
    with pytest.raises(ValueError, match="between 1 and"):
        solve(chain, 10**15, algorithm="uniform", segments=11)


def test_uniform_without_segments_picks_best_fit() -> None:
    chain = big_chain(16)
    budget = min_feasible_bytes(chain, "uniform", segments=4)
    schedule = solve(chain, budget, algorithm="uniform")
    assert schedule.predicted_peak_bytes <= budget
    fixed = solve(chain, budget, algorithm="uniform", segments=4)
    assert schedule.predicted_time_s <= fixed.predicted_time_s


def test_registry_error_lists_names() -> None:
    with pytest.raises(ValueError, match="valid names are: forget_each, optimal, revolve, sqrt"):
        get_algorithm("rotor")
    with pytest.raises(ValueError, match="unknown planning algorithm 'nope'"):
        solve(big_chain(2), 10**9, algorithm="nope")
    assert get_algorithm("optimal").name == "optimal"
    assert sorted(ALGORITHMS) == [
        "forget_each",
        "optimal",
        "revolve",
        "sqrt",
        "store_all",
        "uniform",
    ]
    with pytest.raises(TypeError, match="its options are: segments"):
        solve(big_chain(2), 10**9, algorithm="uniform", checkpoints=2)


def test_json_round_trip() -> None:
    chain = random_chain(random.Random(7), 9, options=True, scale=1000)
    lowest = min_feasible_bytes(chain)
    for budget in (lowest, lowest * 2):
        schedule = solve(chain, budget)
        text = schedule.to_json()
        assert Schedule.from_json(text) == schedule
        assert Schedule.from_dict(json.loads(text)) == schedule
        assert Schedule.from_dict(schedule.to_dict()).ops() == schedule.ops()
    nested = Schedule.from_items(
        chain,
        (
            Region((Keep(0), Region((Keep(1),)))),
            *(Keep(i, "part" if chain.stages[i].options else None) for i in range(2, 9)),
        ),
    )
    assert Schedule.from_json(nested.to_json()) == nested
    with pytest.raises(ValueError, match="schedule item"):
        Schedule.from_dict({**nested.to_dict(), "items": [{"kept": 0}]})
    with pytest.raises(ValueError, match="not a schedule dict"):
        Schedule.from_dict({"version": 1})


def test_ops_decisions_and_simulator_by_hand() -> None:
    # x: 1 byte each, h: 10 bytes, times 1 (F), 1 (F no grad), 2 (B).
    chain = Chain(tuple(Stage(f"s{i}", 1.0, 1.0, 2.0, 1, 1, 10) for i in range(3)))
    items = (Region((Keep(0), Region((Keep(1),)))), Keep(2))
    schedule = Schedule.from_items(chain, items)
    assert [str(op) for op in schedule.ops()] == [
        "F_ck(0)", "F_n(1)", "F_all(2)", "Loss", "B(2)",
        "F_all(0)", "F_ck(1)", "F_all(1)", "B(1)", "B(0)",
    ]  # fmt: skip
    decisions = schedule.stage_decisions()
    assert [(d.decision, d.depth) for d in decisions] == [
        ("forgotten", 1),
        ("forgotten", 2),
        ("kept", 0),
    ]
    # Peak at B(2): x0, x2, x3, h2, δ3 + δ2 = 1 + 1 + 1 + 10 + 1 + 1 = 15; the re-run
    # of F_all(1) holds x0 x1 x2 h0 h1 δ2 = 24 (B(1) adds δ1: 25); time 3 F + 3 Fn... below.
    peak, time_s = simulate(chain, schedule)
    assert peak == 25
    assert time_s == 3 * 1.0 + 3 * 1.0 + 3 * 2.0
    assert schedule.predicted_overhead_s == 3.0
    assert (schedule.predicted_peak_bytes, schedule.predicted_time_s) == (peak, time_s)


def test_options_only_at_the_top_level() -> None:
    # NOTE [options at the top level]: a policy region inside a forgotten region
    # would keep its outputs from the first forward on; the model rejects it and
    # no planner places one there, at any budget.
    chain = random_chain(random.Random(3), 8, options=True, scale=1000)
    with_option = next(i for i, st in enumerate(chain.stages) if st.options)
    name = chain.stages[with_option].options[0].name
    items = tuple(
        Region((Keep(i, name),)) if i == with_option else Keep(i) for i in range(len(chain))
    )
    with pytest.raises(ValueError, match="inside a region"):
        Schedule.from_items(chain, items)
    lowest = min_feasible_bytes(chain)
    top = solve(chain, 10**12).predicted_peak_bytes
    seen_option = False
    for budget in range(lowest, top + 1, max(1, (top - lowest) // 40)):
        for d in solve(chain, budget).stage_decisions():
            assert d.option is None or d.depth == 0
            seen_option |= d.option is not None
    assert seen_option  # the options are chosen somewhere, at the top level


def test_options_in_regions_lower_the_least_memory() -> None:
    # NOTE [options in regions]: an option that keeps nothing in the first forward
    # may run in a region's re-run, where it holds its smaller history; the
    # least-memory schedule then uses it there, and its figures are exact.
    def chain_of(in_regions: bool) -> Chain:
        light = StageOption("regen", saved_bytes=4, recompute_s=0.25, in_regions=in_regions)
        return Chain(
            tuple(Stage(f"s{i}", 1.0, 1.0, 2.0, 2, 2, 20, options=(light,)) for i in range(6))
        )

    top_only, anywhere = chain_of(False), chain_of(True)
    lowest = min_feasible_bytes(anywhere)
    assert lowest < min_feasible_bytes(top_only)
    schedule = solve(anywhere, lowest, unit_bytes=1)
    deep = [d for d in schedule.stage_decisions() if d.depth > 0 and d.option == "regen"]
    assert deep and all(d.decision == "forgotten" for d in deep)
    assert simulate(anywhere, schedule) == (
        schedule.predicted_peak_bytes,
        pytest.approx(schedule.predicted_time_s),
    )
    assert schedule.predicted_peak_bytes == lowest
    # The same items on the chain whose option stays at the top level are refused.
    with pytest.raises(ValueError, match="inside a region"):
        Schedule.from_items(top_only, schedule.items)
    # And the brute force agrees on the least memory (a 4-stage prefix: every tree).
    small = Chain(anywhere.stages[:4])
    assert min_feasible_bytes(small) == min(p for p, _, _ in brute_force(small))
    assert min(p for p, _, _ in brute_force(small)) < min(
        p for p, _, _ in brute_force(Chain(top_only.stages[:4]))
    )


def test_options_are_chosen_when_they_pay() -> None:
    light = StageOption("matmul_only", saved_bytes=1, recompute_s=0.1)
    chain = Chain(
        tuple(Stage(f"s{i}", 1.0, 1.0, 2.0, 1, 1, 10, options=(light,)) for i in range(4))
    )
    plain_peak = solve(chain, 10**6).predicted_peak_bytes
    schedule = solve(chain, plain_peak - 20, unit_bytes=1)
    assert any(d.option == "matmul_only" for d in schedule.stage_decisions())
    assert "matmul_only" in {d.decision for d in schedule.stage_decisions()}
    assert simulate(chain, schedule)[0] == schedule.predicted_peak_bytes


def test_pareto_points() -> None:
    chain = big_chain(12)
    points = pareto(chain)
    optimal = [p for p in points if p.algorithm == "optimal"]
    uniform = [p for p in points if p.algorithm == "uniform"]
    assert [p.segments for p in uniform] == list(range(1, 13))
    assert len(optimal) >= 2
    for point in optimal:
        assert point.budget_bytes is not None and point.peak_bytes <= point.budget_bytes
        fitting = [u.overhead_s for u in uniform if u.peak_bytes <= point.budget_bytes]
        if fitting:
            assert point.overhead_s <= min(fitting) * 1.02 + 1e-12
    assert pareto(chain, [0])[0].algorithm == "uniform"  # infeasible budgets are skipped


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"input_bytes": -1}, ValueError, "input_bytes must be >= 0"),
        ({"forward_s": -1.0}, ValueError, "forward_s must be a finite time"),
        ({"forward_s": math.nan}, ValueError, "finite"),
        ({"saved_bytes": 1.5}, TypeError, "must be an int number of bytes"),
        ({"saved_bytes": True}, TypeError, "must be an int"),
    ],
    ids=["negative-bytes", "negative-time", "nan-time", "float-bytes", "bool-bytes"],
)
def test_stage_validation(kwargs: dict, error: type, match: str) -> None:
    base = {
        "name": "s",
        "forward_s": 1.0,
        "forward_nograd_s": 1.0,
        "backward_s": 1.0,
        "input_bytes": 1,
        "output_bytes": 1,
        "saved_bytes": 1,
    }
    with pytest.raises(error, match=f"^forget: .*{match}"):
        Stage(**{**base, **kwargs})


def test_region_overhead_counts_once_per_region() -> None:
    chain = dataclasses.replace(big_chain(4), region_overhead_s=10.0)
    base = dataclasses.replace(chain, region_overhead_s=0.0)
    each = tuple(Region((Keep(i),)) for i in range(4))
    one = (Region(tuple(Keep(i) for i in range(4))),)
    nested = (Region((Region((Keep(0), Keep(1))), Keep(2), Keep(3))),)
    for items, regions in ((each, 4), (one, 1), (nested, 2)):
        for model in (simulate, evaluate):
            assert model(chain, items)[1] == pytest.approx(model(base, items)[1] + 10.0 * regions)
    # With a large fixed cost per region the DP merges regions.
    budget = min_feasible_bytes(base) * 2
    cheap, costly = solve(base, budget), solve(chain, budget)
    count = lambda sch: sum(op.kind == "F_ck" for op in sch.ops())  # noqa: E731
    assert count(costly) <= count(cheap)
    with pytest.raises(ValueError, match="region_overhead_s must be a finite time >= 0"):
        dataclasses.replace(chain, region_overhead_s=-1.0)


def test_chain_validation() -> None:
    with pytest.raises(ValueError, match=r"^forget: a Chain needs at least one stage"):
        Chain(())
    a = Stage("a", 1.0, 1.0, 1.0, 1, 2, 0)
    b = Stage("b", 1.0, 1.0, 1.0, 3, 1, 0)
    with pytest.raises(ValueError, match=r"output_bytes=2 but stage 1 .* input_bytes=3"):
        Chain((a, b))
    with pytest.raises(ValueError, match="unique"):
        Stage("s", 1.0, 1.0, 1.0, 1, 1, 1, options=(StageOption("x", 1, 0.0),) * 2)
    with pytest.raises(ValueError, match="reserved"):
        StageOption("kept", 1, 0.0)
    with pytest.raises(ValueError, match="consecutive"):
        Schedule.from_items(big_chain(3), (Keep(0), Keep(2)))
    with pytest.raises(ValueError, match="budget_bytes must be >= 0"):
        solve(big_chain(2), -1)
    with pytest.raises(TypeError, match="budget_bytes must be an int"):
        solve(big_chain(2), 1.5)  # type: ignore[arg-type]


def test_docstring_examples() -> None:
    from forget.schedules import _revolve, _solve

    for module in (forget.schedules, _solve, _revolve):
        result = doctest.testmod(module, extraglobs={"Stage": Stage, "Chain": Chain})
        assert result.failed == 0 and result.attempted > 0, module.__name__


def test_import_does_not_pull_torch() -> None:
    code = "import forget.schedules, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_on_sub_stages_maps_block_schedules_onto_finer_stages() -> None:
    from forget.schedules._baselines import on_sub_stages, uniform_items

    sizes = (2, 1, 3)
    assert on_sub_stages(uniform_items(3, 2), sizes) == (
        Region((Keep(0), Keep(1))),
        Keep(2),
        Keep(3),
        Keep(4),
        Keep(5),
    )
    nested = (Region((Region((Keep(0),)), Keep(1, option="sel"))), Keep(2))
    assert on_sub_stages(nested, sizes) == (
        Region((Region((Keep(0), Keep(1))), Keep(2, option="sel"))),
        Keep(3),
        Keep(4),
        Keep(5),
    )
    assert on_sub_stages(uniform_items(3, 3), (1, 1, 1)) == uniform_items(3, 3)
    with pytest.raises(ValueError, match="at least one stage"):
        on_sub_stages((Keep(0),), (0,))
    with pytest.raises(ValueError, match="names block 3, but there are 3 blocks"):
        on_sub_stages((Keep(3),), sizes)
