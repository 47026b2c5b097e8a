"""``forget plan module:factory``: plan a user's own model over its module tree.

The command profiles the step once (`forget._planning.TreePlanner`), plans
every budget of ``--budgets`` (smallest first: NOTE [monotone in the budget]),
times each plan's step beside the plain one (NOTE [paired rounds]), prints
each plan's tree (`forget.Plan`'s own text) and a table of the budgets,
and writes ``--json`` and the Pareto PNG (``--pareto``/``--plot``).

NOTE [the command within the budget]: the planning holds no more than
`forget.plan` does (NOTE [planning within the budget] in `forget._planning`):
the profile runs within the largest budget of ``--budgets`` (`profile_budget`),
and the plain step is never profiled, so its peak is predicted. The table gives
each plan's cost over the plain step, measured only beside the plans in the same
rounds (NOTE [paired rounds]: a plain time taken apart carries other noise), so
those rounds run the plain step whatever the budgets. On the CPU a budget is a
limit the planner keeps, not memory the machine lacks; on a CUDA device the
plain step runs there only where its predicted peak fits what the device holds
(`device_room`), and otherwise the plans are timed alone, in milliseconds.

NOTE [factory contract]: the factory is called with no arguments (torch
seeded by ``--seed``) and returns ``(model, batch)`` or ``(model, batch,
loss_fn)``. ``model`` is any ``nn.Module``, in the mode it trains in;
``batch`` is what one step feeds it: a tuple of positional inputs
(``model(*batch)``), a dict of keyword inputs (``model(**batch)``), or one
tensor (``model(batch)``); ``loss_fn(output)`` returns the scalar loss, and
without it the loss is ``output.loss`` (a Hugging Face model given
``labels``) or the sum of a tensor output, as for `forget.plan`. A tuple and
a dict cover every call: positional inputs that need a keyword beside them
go in the dict by their names. Anything else is refused in one line before
any work.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import BudgetInfeasibleError
from .._memory import frozen_heap
from .._planning import Plan, TreePlanner, time_calls, untouched, zero_grads
from ..policies import Policy
from ..schedules import MIB, budget_share, parse_budget
from ._common import (
    Progress,
    UserStep,
    above_plain_note,
    draw_plans,
    load_step,
    resolve_budget,
    step_error,
    wrote,
)


@dataclass
class TreeBudget:
    """One budget: its plan (None: below the least feasible) and measured overhead."""

    label: str
    budget_bytes: int
    plan: Plan | None = None
    step_s: float = 0.0  # the planned step's median seconds
    overhead: float | None = None  # over the plain step, where it was timed


def run(
    spec: str,
    args: argparse.Namespace,
    labels: Sequence[str],
    options: Mapping[str, Policy],
) -> int:
    """Plan ``spec``'s model for ``labels``; print, write; 0, or 2 when nothing was planned."""
    try:
        step = load_step(spec, args.seed)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run_step(spec, step, args, labels, options)


def run_step(
    spec: str,
    step: UserStep,
    args: argparse.Namespace,
    labels: Sequence[str],
    options: Mapping[str, Policy],
) -> int:
    """`run` on a step built already (a reference model's: `forget plan --model`)."""
    progress = Progress(2 + len(labels), enabled=not args.quiet, desc="forget plan", unit="task")
    try:
        with frozen_heap():  # NOTE [frozen heap] in forget._measure
            planner = TreePlanner(
                step.model,
                step.args,
                step.kwargs,
                loss_fn=step.loss_fn,
                candidates=args.candidate or None,
                options={} if args.no_options else options or None,
                repeats=args.repeats,
                budget=profile_budget(labels),
            )
            progress.update("profiled")
            rows = plan_budgets(planner, labels, lambda label: progress.update(label))
            # NOTE [paired rounds], over twice the rounds a selection takes.
            room = device_room(planner)  # NOTE [the command within the budget]
            plain_s, times = time_plans(
                planner,
                {r.label: r.plan for r in rows if r.plan is not None},
                2 * args.repeats,
                plain=room is None or planner.plain_peak <= room,
            )
            for row in rows:
                row.step_s, row.overhead = times.get(row.label, (0.0, None))
            progress.update("timed")
    except BudgetInfeasibleError as exc:  # the profile's forward passed the largest budget
        progress.close()
        print(
            f"forget plan: no budget of {spec} could be planned: {exc}",
            file=sys.stderr,
        )
        return 2
    except Exception as exc:  # NOTE [the user's errors] in ._common
        progress.close()
        line = step_error(exc, spec, step.model, args.traceback)
        if line is None:
            raise
        print(line, file=sys.stderr)  # the step the factory gave is no step forget can plan
        return 2
    finally:
        progress.close()
    least = planner.least()
    if not args.quiet:
        timed = (
            f"{plain_s * 1e3:.3f} ms measured"
            if plain_s is not None
            else f"not run (above the device's {room or 0:,} B)"
        )
        print(
            f"forget plan {spec}: {type(step.model).__name__} over its module tree, "
            f"{len(planner.tree) - 1} candidate modules; plain step: {timed}, "
            f"{planner.plain_peak:,} B peak predicted; probe {planner.profile.probe}, "
            f"{args.repeats} repeats, {torch.get_num_threads()} threads, torch {torch.__version__}"
        )
        for name, policy in planner.policies.items():
            print(f"option {name}: {policy}")
    for row in rows:
        print(f"\n{spec} @ {row.label}:")
        if row.plan is None:
            print(
                f"infeasible: the budget {row.budget_bytes:,} B is below the least feasible "
                f"one, {least:,} B; --budgets min plans at it"
            )
        else:
            print(row.plan)
            if row.budget_bytes >= planner.plain_peak:
                print(f"  {above_plain_note(row.budget_bytes, planner.plain_peak)}")
    print()
    print(format_tree_table(rows, plain_s))
    if not args.quiet:
        print(
            "peak: the allocator's peak of one training step under the plan, measured, always "
            "<= budget; expected: the re-runs the plan adds, from the profile, over the plain "
            "step's measured time; step: its median time; measured: step time vs plain, side "
            "by side, median of paired rounds. The plain step runs only in those rounds."
        )
    if args.json is not None:
        payload = tree_json(spec, step, planner, rows, plain_s)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        wrote(args.json, "the plans (Plan.from_dict reads each) and the figures as JSON")
    if args.pareto is not None and plain_s is None:
        print(f"forget plan: {args.pareto} not drawn: the plain step was not run", file=sys.stderr)
    elif args.pareto is not None and plain_s is not None:
        write_tree_pareto(spec, planner, rows, plain_s, args.pareto)
        wrote(args.pareto, "peak memory against step-time overhead for this model")
    if all(row.plan is None for row in rows):
        print(
            f"forget plan: no budget of {spec} could be planned: each lies below the smallest "
            f"feasible one, {least:,} B (plain peak {planner.plain_peak:,} B); --budgets min "
            "plans at it",
            file=sys.stderr,
        )
        return 2
    return 0


# ------------------------------------------------------------------ planning and timing


def plan_budgets(
    planner: TreePlanner, labels: Sequence[str], done: Callable[[str], None]
) -> list[TreeBudget]:
    """Plan every budget, smallest first (NOTE [monotone in the budget]), in ``labels``' order."""
    least = planner.least()
    rows = [TreeBudget(label, resolve_budget(label, planner.plain_peak, least)) for label in labels]
    for row in sorted(rows, key=lambda row: row.budget_bytes):
        with contextlib.suppress(BudgetInfeasibleError):  # row.plan stays None
            row.plan = planner.plan(row.budget_bytes)
        done(row.label)
    return rows


def profile_budget(labels: Sequence[str]) -> int | str | None:
    """The largest budget of ``labels``, for the profile (NOTE [the command within the budget]).

    A share is of the plain peak, which only the profile predicts, so it cannot
    be set against a size before: with both kinds (or ``min`` alone) the
    profile runs unbounded.
    """
    sizes, shares = [], []
    for label in labels:
        if label == "min":
            continue
        if budget_share(label) is None:
            sizes.append(parse_budget(label))
        else:  # a share: no plain peak to take it of yet
            shares.append(label)
    if sizes and not shares:
        return max(sizes)
    if shares and not sizes:
        return max(shares, key=lambda label: parse_budget(label, 1 << 40))
    return None


def device_room(planner: TreePlanner) -> int | None:
    """Bytes the step's CUDA device can hold now (free and torch's own), or None on the CPU."""
    device = planner.profile.cuda
    if device is None:
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free) + torch.cuda.memory_allocated(device)


def time_plans(
    planner: TreePlanner, plans: Mapping[str, Plan], rounds: int, *, plain: bool = True
) -> tuple[float | None, dict[str, tuple[float, float | None]]]:
    """The plain step's median seconds, and each plan's median seconds and overhead over it.

    NOTE [paired rounds] (`forget._planning.ratio_range`): the plain step
    runs in every round beside the plans, and a plan's overhead in a round is
    its time over plain's in that round, minus one. Plans are applied and
    removed between steps, untimed (``prepare``); the model is left as it was.
    Without ``plain`` (a device the plain step would not fit: NOTE [the command
    within the budget]) the plans run alone: no plain time, no overheads.
    """
    step = planner.step
    model, target = step.model, step.target()
    calls: dict[str | None, Callable[[], object]] = {None: step.run} if plain else {}
    calls.update(dict.fromkeys(plans, step.run))
    applied: list[str] = []

    def prepare(key: str | None) -> None:
        zero_grads(target)
        if applied and applied[0] != key:
            plans[applied.pop()].remove(model)
        if key is not None and not applied:
            plans[key].apply(model)
            applied.append(key)

    with untouched(target):
        try:
            times = time_calls(calls, rounds, prepare=prepare)
        finally:
            if applied:
                plans[applied.pop()].remove(model)
    if not plain:
        return None, {str(key): (statistics.median(ts), None) for key, ts in times.items()}
    base = times.pop(None)
    figures: dict[str, tuple[float, float | None]] = {
        str(key): (
            statistics.median(ts),
            statistics.median(t / b - 1 for t, b in zip(ts, base, strict=True)),
        )
        for key, ts in times.items()
    }
    return statistics.median(base), figures


# ------------------------------------------------------------------ output


def format_tree_table(rows: Sequence[TreeBudget], plain_s: float | None) -> str:
    """The budgets as one aligned table: bytes, peak over budget, expected and measured time."""
    header = (
        "budget",
        "budget B",
        "peak B",
        "peak/budget",
        "expected +ms",
        "expected +%",
        "step ms",
        "measured +%",
        "not kept",
    )
    cells: list[tuple[str, ...]] = []
    for row in rows:
        plan = row.plan
        if plan is None:
            cells.append((row.label, f"{row.budget_bytes:,}", "infeasible", *[""] * 6))
            continue
        cells.append(
            (
                row.label,
                f"{row.budget_bytes:,}",
                f"{plan.measured_peak_bytes:,}",
                f"{plan.measured_peak_bytes / row.budget_bytes:.3f}",
                f"{plan.predicted_extra_s * 1e3:.3f}",
                "-" if plain_s is None else f"{100 * plan.predicted_extra_s / plain_s:+.1f}%",
                f"{row.step_s * 1e3:.3f}",
                "-" if row.overhead is None else f"{100 * row.overhead:+.1f}%",
                f"{len(plan.choices)} of {len(plan.tree) - 1}",
            )
        )
    widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=True)]

    def line(row: Sequence[str]) -> str:
        first = f"{row[0]:<{widths[0]}}"
        rest = [f"{c:>{w}}" for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join([first, *rest]).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, cells)])


def tree_json(
    spec: str,
    step: UserStep,
    planner: TreePlanner,
    rows: Sequence[TreeBudget],
    plain_s: float | None,
) -> dict[str, Any]:
    """The run as JSON: each budget's plan (`Plan.to_dict`) and every assignment measured."""
    budgets: list[dict[str, Any]] = []
    for row in rows:
        entry: dict[str, Any] = {"budget": row.label, "budget_bytes": row.budget_bytes}
        if row.plan is None:
            entry.update(infeasible=True, min_feasible_bytes=planner.least())
        else:
            entry.update(step_s=row.step_s, measured_overhead=row.overhead, plan=row.plan.to_dict())
        budgets.append(entry)
    return {
        "model": spec,
        "type": type(step.model).__name__,
        "probe": planner.profile.probe,
        "plain_peak_bytes": planner.plain_peak,
        "plain_step_s": plain_s,
        "min_feasible_bytes": planner.least(),
        "candidates": len(planner.tree) - 1,
        "options": {name: str(policy) for name, policy in planner.policies.items()},
        "budgets": budgets,
        "measured": [
            {"choices": choices, "peak_bytes": peak, "predicted_extra_s": planner.extra_s(choices)}
            for choices, peak in planner.measured.values()
        ],
    }


def write_tree_pareto(
    spec: str, planner: TreePlanner, rows: Sequence[TreeBudget], plain_s: float, path: Path
) -> None:
    """Write a PNG: the allocator's peak against step-time overhead, for this model.

    Every assignment the planner measured is a dot (its allocator peak, its
    predicted re-runs over the plain step's measured time), the least of them
    joined into the measured trade-off curve; the baseline that forgets every
    innermost candidate, plain, and the plans (`draw_plans`, which puts the
    legend under the axes, off the points).
    """
    from matplotlib.figure import Figure  # lazy: an optional extra

    fig = Figure(figsize=(6.4, 6.0), layout="constrained")
    ax = fig.subplots()
    scale = 100 / plain_s  # y: a share of the plain step's time, in %
    points = sorted(
        (peak / MIB, scale * planner.extra_s(choices))
        for choices, peak in planner.measured.values()
    )
    frontier: list[tuple[float, float]] = []
    for x, y in points:  # by peak rising: keep a point only if it is faster than every lower one
        if not frontier or y < frontier[-1][1]:
            frontier.append((x, y))
    ax.plot(
        [x for x, _ in points],
        [y for _, y in points],
        "o",
        color="tab:blue",
        alpha=0.4,
        markersize=4,
        label="assignments measured (allocator peak, predicted time)",
    )
    ax.plot(
        [x for x, _ in frontier],
        [y for _, y in frontier],
        "-",
        color="tab:blue",
        label="least time at each peak, of those measured",
    )
    baseline = planner.baseline()
    ax.plot(
        [planner.peak(baseline) / MIB],
        [scale * planner.extra_s(baseline)],
        "kv",
        markersize=9,
        label="every innermost candidate forgotten (measured peak, predicted time)",
    )
    plans = [(r.plan, r.overhead) for r in rows if r.plan is not None]
    draw_plans(
        ax,
        planner.plain_peak,
        [(p.measured_peak_bytes, p.predicted_extra_s / plain_s, over) for p, over in plans],
        [(r.label, r.budget_bytes) for r in rows if r.plan is not None],
    )
    model = type(planner.step.model).__name__
    # Two short lines, each wrapped to the figure's width: one long line was cut off.
    ax.set_title(
        "\n".join(
            [
                *textwrap.wrap(spec, 60),
                f"{model}, {len(planner.tree) - 1} candidate modules",
            ]
        ),
        fontsize=9,
        pad=12,  # above the budgets' names (`draw_plans`)
    )
    fig.suptitle("forget plan: peak memory vs time added by recomputation")
    fig.savefig(path, dpi=120)
