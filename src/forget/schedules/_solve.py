"""One interface over every planner: `solve`, `min_feasible_bytes`, the registry, `pareto`."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .._errors import BudgetInfeasibleError
from ._baselines import forget_each_items, sqrt_segments, store_all_items, uniform_items
from ._chain import Chain
from ._dp import (
    DEFAULT_MEMORY_UNITS,
    min_peak_items,
    optimal_items,
    optimal_tables_items,
    store_all_peak_bytes,
    unit_bytes_for,
)
from ._revolve import revolve_items
from ._schedule import Item, Schedule, evaluate
from ._units import format_bytes

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "ParetoPoint",
    "get_algorithm",
    "min_feasible_bytes",
    "pareto",
    "solve",
]


def _check_chain(chain: object) -> Chain:
    if not isinstance(chain, Chain):
        raise TypeError(f"forget: expected a forget.schedules.Chain, got {type(chain).__name__}")
    return chain


def _check_budget(budget_bytes: object) -> int:
    if isinstance(budget_bytes, bool):
        raise TypeError("forget: budget_bytes must be an int number of bytes, got bool")
    try:
        budget = operator.index(budget_bytes)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            f"forget: budget_bytes must be an int number of bytes, got "
            f"{type(budget_bytes).__name__} {budget_bytes!r}; round it with int()"
        ) from None
    if budget < 0:
        raise ValueError(f"forget: budget_bytes must be >= 0, got {budget}")
    return budget


def _check_options(name: str, options: Mapping[str, object], allowed: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        valid = ", ".join(allowed) or "none"
        raise TypeError(
            f"forget: algorithm {name!r} got unknown option(s) {', '.join(unknown)}; "
            f"its options are: {valid}"
        )


def _infeasible(
    name: str, chain: Chain, budget: int, minimum: int, why: str
) -> BudgetInfeasibleError:
    return BudgetInfeasibleError(
        f"forget: no {name!r} schedule fits budget_bytes={budget} for this {len(chain)}-stage "
        f"chain; the smallest feasible budget is {minimum} bytes ({format_bytes(minimum)}), "
        f"because {why}; raise the budget to at least {minimum} bytes, or shrink the "
        "activations (smaller batch or sequence)",
        budget_bytes=budget,
        min_feasible_bytes=minimum,
    )


def _best(
    chain: Chain, candidates: Iterable[tuple[Item, ...]], budget: int | None
) -> tuple[tuple[Item, ...], int, float] | None:
    """Return the fastest candidate within budget (ties: the lower peak), or None."""
    best: tuple[tuple[Item, ...], int, float] | None = None
    for items in candidates:
        peak, time_s = evaluate(chain, items)
        if budget is not None and peak > budget:
            continue
        if best is None or (time_s, peak) < (best[2], best[1]):
            best = (items, peak, time_s)
    return best


@dataclass(frozen=True)
class Algorithm:
    """A planner in the registry.

    Attributes:
        name: the registry key.
        summary: one line for listings.
        solve: ``solve(chain, budget_bytes, **options) -> Schedule``.
        min_feasible_bytes: ``min_feasible_bytes(chain, **options) -> int``.
    """

    name: str
    summary: str
    solve: Callable[..., Schedule]
    min_feasible_bytes: Callable[..., int]


def _candidate_algorithm(
    name: str,
    summary: str,
    candidates: Callable[..., list[tuple[Item, ...]]],
    allowed: Sequence[str],
    why: str,
) -> Algorithm:
    """Build an algorithm that picks the fastest of a finite set of schedules."""

    def minimum(chain: Chain, **options: Any) -> int:
        _check_options(name, options, allowed)
        return min(evaluate(chain, items)[0] for items in candidates(chain, **options))

    def plan(chain: Chain, budget_bytes: int, **options: Any) -> Schedule:
        _check_options(name, options, allowed)
        best = _best(chain, candidates(chain, **options), budget_bytes)
        if best is None:
            raise _infeasible(name, chain, budget_bytes, minimum(chain, **options), why)
        return Schedule.from_items(chain, best[0], algorithm=name, budget_bytes=budget_bytes)

    return Algorithm(name, summary, plan, minimum)


def _uniform_candidates(chain: Chain, segments: int | None = None) -> list[tuple[Item, ...]]:
    n = len(chain)
    if segments is not None:
        return [uniform_items(n, segments)]
    return [uniform_items(n, k) for k in range(1, n + 1)]


def _revolve_candidates(chain: Chain, checkpoints: int | None = None) -> list[tuple[Item, ...]]:
    n = len(chain)
    if checkpoints is not None:
        return [revolve_items(0, n, checkpoints)]
    return [revolve_items(0, n, c) for c in range(1, max(n, 2))]


def _optimal_minimum(chain: Chain, **options: Any) -> int:
    _check_options("optimal", options, ("memory_units", "unit_bytes"))
    return min_peak_items(chain)[0]


def _optimal_unit(chain: Chain, memory_units: int, unit_bytes: int | None) -> int:
    if unit_bytes is not None:
        if isinstance(unit_bytes, bool) or not isinstance(unit_bytes, int) or unit_bytes < 1:
            raise ValueError(f"forget: unit_bytes must be an int >= 1, got {unit_bytes!r}")
        return unit_bytes
    if isinstance(memory_units, bool) or not isinstance(memory_units, int) or memory_units < 1:
        raise ValueError(f"forget: memory_units must be an int >= 1, got {memory_units!r}")
    return unit_bytes_for(chain, memory_units)


_OPTIMAL_WHY = (
    "even the leanest schedule holds the chain input, some stage's input, output, their "
    "gradients and its history at once"
)


def _optimal_finish(chain: Chain, budget: int, dp_items: tuple[Item, ...] | None) -> Schedule:
    minimum, lean = min_peak_items(chain)
    candidates = [lean] if dp_items is None else [dp_items, lean]
    best = _best(chain, candidates, budget)
    if best is None:  # pragma: no cover - lean fits every budget >= minimum
        raise _infeasible("optimal", chain, budget, minimum, _OPTIMAL_WHY)
    return Schedule.from_items(chain, best[0], algorithm="optimal", budget_bytes=budget)


def _optimal_solve(
    chain: Chain,
    budget_bytes: int,
    *,
    memory_units: int = DEFAULT_MEMORY_UNITS,
    unit_bytes: int | None = None,
) -> Schedule:
    """Plan the fastest persistent schedule within the budget (the Rotor DP)."""
    minimum = min_peak_items(chain)[0]
    if budget_bytes < minimum:
        raise _infeasible("optimal", chain, budget_bytes, minimum, _OPTIMAL_WHY)
    if store_all_peak_bytes(chain) <= budget_bytes:
        items = store_all_items(len(chain))
        return Schedule.from_items(chain, items, algorithm="optimal", budget_bytes=budget_bytes)
    unit = _optimal_unit(chain, memory_units, unit_bytes)
    return _optimal_finish(chain, budget_bytes, optimal_items(chain, budget_bytes, unit))


_REGISTRY: dict[str, Algorithm] = {
    "optimal": Algorithm(
        "optimal",
        "fastest nested-forget schedule within the budget (Beaumont et al. 2019 DP)",
        _optimal_solve,
        _optimal_minimum,
    ),
    "store_all": _candidate_algorithm(
        "store_all",
        "keep every stage (the plain run)",
        lambda chain: [store_all_items(len(chain))],
        (),
        "the plain run keeps every activation and history until its backward",
    ),
    "forget_each": _candidate_algorithm(
        "forget_each",
        "every stage in its own forget region",
        lambda chain: [forget_each_items(len(chain))],
        (),
        "this schedule keeps every stage input",
    ),
    "uniform": _candidate_algorithm(
        "uniform",
        "k equal segments as checkpoint_sequential (segments=k, else the best k that fits)",
        _uniform_candidates,
        ("segments",),
        "no uniform segmentation peaks lower (algorithm='optimal' may)",
    ),
    "sqrt": _candidate_algorithm(
        "sqrt",
        "round(sqrt(L)) equal segments (Chen et al. 2016)",
        lambda chain: [uniform_items(len(chain), sqrt_segments(len(chain)))],
        (),
        "sqrt(L) segments peak there (algorithm='optimal' may need less)",
    ),
    "revolve": _candidate_algorithm(
        "revolve",
        "binomial checkpointing (Griewank and Walther 2000; checkpoints=c, else the best c)",
        _revolve_candidates,
        ("checkpoints",),
        "no binomial schedule peaks lower (algorithm='optimal' may)",
    ),
}

ALGORITHMS: Mapping[str, Algorithm] = MappingProxyType(_REGISTRY)


def get_algorithm(name: str) -> Algorithm:
    """Return the registered algorithm called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return ALGORITHMS[name]
    except (KeyError, TypeError):
        valid = ", ".join(sorted(ALGORITHMS))
        raise ValueError(
            f"forget: unknown planning algorithm {name!r}; valid names are: {valid}"
        ) from None


def solve(
    chain: Chain, budget_bytes: int, *, algorithm: str = "optimal", **options: Any
) -> Schedule:
    """Plan a schedule for one training step of ``chain`` within ``budget_bytes``.

    Forgetting a range of stages trades memory for compute: only its input is
    kept in forward, and it runs once more in backward. ``"optimal"`` finds
    the fastest tree of nested forget regions (and stage options) whose peak,
    in the memory model of `forget.schedules.simulate`, fits the budget; the other
    algorithms are the classic baselines.

    Args:
        chain: the stages.
        budget_bytes: the most memory the step may use, in bytes (the
            activations, histories and gradients of the model; add parameters
            and optimizer state outside).
        algorithm: a name in `ALGORITHMS`.
        **options: the algorithm's options: ``optimal``: ``memory_units`` (DP
            resolution, default 1000 across the store-all peak) or ``unit_bytes``;
            ``uniform``: ``segments``; ``revolve``: ``checkpoints``.

    Returns:
        The schedule, whose ``predicted_peak_bytes <= budget_bytes``.

    Raises:
        BudgetInfeasibleError: the budget is below `min_feasible_bytes`.
        ValueError: unknown algorithm (the message lists them), bad option value.
        TypeError: wrong argument types or unknown options.

    Example:
        >>> from forget.schedules import Chain, Stage, solve
        >>> stage = Stage("layer", 1.0, 0.8, 2.0, 100, 100, 400)
        >>> plan = solve(Chain((stage,) * 8), 2000)
        >>> plan.predicted_peak_bytes <= 2000
        True
    """
    chain = _check_chain(chain)
    budget = _check_budget(budget_bytes)
    return get_algorithm(algorithm).solve(chain, budget, **options)


def min_feasible_bytes(chain: Chain, algorithm: str = "optimal", **options: Any) -> int:
    """Return the smallest budget, in exact bytes, for which ``algorithm`` has a schedule.

    `solve` succeeds at this budget and raises `BudgetInfeasibleError` one byte
    below it.

    Args:
        chain: the stages.
        algorithm: a name in `ALGORITHMS`.
        **options: as for `solve`.
    """
    chain = _check_chain(chain)
    return get_algorithm(algorithm).min_feasible_bytes(chain, **options)


@dataclass(frozen=True)
class ParetoPoint:
    """One (peak, overhead) point of a memory/compute trade-off curve.

    Attributes:
        algorithm: ``"optimal"`` or ``"uniform"``.
        peak_bytes: predicted peak of the schedule.
        overhead_s: predicted time minus the store-all time.
        budget_bytes: the budget it was planned for (``optimal``), else None.
        segments: the segment count (``uniform``), else None.
    """

    algorithm: str
    peak_bytes: int
    overhead_s: float
    budget_bytes: int | None = None
    segments: int | None = None


def pareto(
    chain: Chain,
    budgets_bytes: Sequence[int] | None = None,
    *,
    memory_units: int = DEFAULT_MEMORY_UNITS,
) -> tuple[ParetoPoint, ...]:
    """Return trade-off points of the optimal DP and of uniform segments, for a plot.

    Args:
        chain: the stages.
        budgets_bytes: the budgets for the optimal DP; infeasible ones are
            skipped. Default: 20 budgets evenly from the minimum feasible one to
            the store-all peak.
        memory_units: DP resolution, as for `solve`.

    Returns:
        One ``optimal`` point per feasible budget (one DP run serves all), then
        one ``uniform`` point per segment count ``1 .. L``.
    """
    chain = _check_chain(chain)
    minimum = min_peak_items(chain)[0]
    top = store_all_peak_bytes(chain)
    if budgets_bytes is None:
        steps = 19
        budgets = sorted({minimum + (top - minimum) * i // steps for i in range(steps + 1)})
    else:
        budgets = [_check_budget(b) for b in budgets_bytes]
    feasible = [b for b in budgets if b >= minimum]
    unit = _optimal_unit(chain, memory_units, None)
    points = []
    for budget, items in zip(feasible, optimal_tables_items(chain, feasible, unit), strict=True):
        schedule = (
            Schedule.from_items(chain, store_all_items(len(chain)), algorithm="optimal")
            if budget >= top
            else _optimal_finish(chain, budget, items)
        )
        points.append(
            ParetoPoint(
                "optimal", schedule.predicted_peak_bytes, schedule.predicted_overhead_s, budget
            )
        )
    store_all_s = chain.store_all_time_s
    for k in range(1, len(chain) + 1):
        peak, time_s = evaluate(chain, uniform_items(len(chain), k))
        points.append(ParetoPoint("uniform", peak, time_s - store_all_s, segments=k))
    return tuple(points)
