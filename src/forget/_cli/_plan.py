"""``forget plan``: plan models into memory budgets, measured against uniform segments.

``forget plan module:factory`` plans a model of the user's over its module
tree (`._plan_tree`, NOTE [factory contract]). Without a target, for every
reference model and budget it prints the measured peak of the plan next to the
budget, and the step-time overhead of the plan next to that of the best uniform
segmentation (``checkpoint_sequential``'s schedule) whose measured peak fits the
same budget, timed side by side in one run. ``--pareto PATH`` writes the
trade-off curves: peak bytes against step-time overhead.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import schedules as P
from .._errors import BudgetInfeasibleError
from .._memory import frozen_heap
from .._planning import (
    Plan,
    Planner,
    paired_overheads,
    ratio_range,
    run_items,
    time_side_by_side,
)
from ..policies import Policy
from ..schedules import MIB
from . import _plan_tree
from ._common import (
    BUDGET_HELP,
    OPTION_GROUPS,
    TRACEBACK_HELP,
    Progress,
    above_plain_note,
    check_budget,
    draw_plans,
    mib,
    model_and_inputs,
    parse_option,
    parse_setting,
    require_matplotlib,
    resolve_budget,
    step_error,
    wrote,
)
from ._models import MODEL_NAMES, SIZES

DEFAULT_BUDGETS = "75%,50%,35%,min"


@dataclass
class BudgetRow:
    """One budget of one model: the plan and the best fitting uniform segmentation."""

    label: str
    budget_bytes: int
    plan: Plan | None = None
    min_feasible_bytes: int = 0
    plan_overhead: float = 0.0
    uniform_segments: int | None = None
    uniform_peak_bytes: int | None = None
    uniform_overhead: float | None = None
    #: NOTE [predicted ratio]: the plan's and the uniform's predicted extra time, in
    #: the planner's own model, free of the timing noise of the measured ratio.
    predicted_ratio: float | None = None
    #: NOTE [ratio range]: the 5th and 95th percentiles of plan/uniform over
    #: resampled rounds; how far one run's measured ratio can be trusted.
    ratio_range: tuple[float, float] | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"budget": self.label, "budget_bytes": self.budget_bytes}
        if self.plan is None:
            out["infeasible"] = True
            out["min_feasible_bytes"] = self.min_feasible_bytes
            return out
        out.update(
            measured_peak_bytes=self.plan.measured_peak_bytes,
            predicted_peak_bytes=self.plan.predicted_peak_bytes,
            schedule=self.plan.layout,
            plan_overhead=self.plan_overhead,
            predicted_overhead=self.plan.predicted_overhead,
            uniform_segments=self.uniform_segments,
            uniform_peak_bytes=self.uniform_peak_bytes,
            uniform_overhead=self.uniform_overhead,
            predicted_ratio=self.predicted_ratio,
            ratio_range=None if self.ratio_range is None else list(self.ratio_range),
        )
        return out


@dataclass
class ModelResult:
    """All budgets of one model, and what the Pareto plot needs."""

    name: str
    plain_peak_bytes: int
    min_feasible_bytes: int
    rows: list[BudgetRow]
    planner: Planner = field(repr=False)

    def as_json(self) -> dict[str, Any]:
        return {
            "plain_peak_bytes": self.plain_peak_bytes,
            "min_feasible_bytes": self.min_feasible_bytes,
            "blocks": len(self.planner.block_sizes),
            "stages": len(self.planner.chain),
            "budgets": [r.as_json() for r in self.rows],
        }


# ------------------------------------------------------------------ timing


def _uniform_schedules(planner: Planner) -> list[tuple[int, P.Schedule]]:
    """Every uniform segmentation of the blocks (NOTE [finer stages]: whole blocks, with split)."""
    return [(k, planner.uniform(k)) for k in range(1, len(planner.block_sizes) + 1)]


def _plan_budgets(
    name: str,
    planner: Planner,
    labels: Sequence[str],
    algorithm: str,
    repeats: int,
    done: Callable[[str], None] = lambda label: None,
) -> ModelResult:
    """Plan and time every budget of one model; ``done(label)`` after each budget."""
    min_feasible = planner.plan(planner.plain_peak, algorithm=algorithm).min_feasible_bytes
    budgets = {label: resolve_budget(label, planner.plain_peak, min_feasible) for label in labels}
    rows: list[BudgetRow] = []
    # NOTE [monotone in the budget]: the smallest budget first, so that each larger
    # one has the smaller ones' schedules among its candidates; rows keep the order.
    for label in sorted(labels, key=lambda label: budgets[label]):
        budget = budgets[label]
        row = BudgetRow(label, budget, min_feasible_bytes=min_feasible)
        try:
            row.plan = planner.plan(budget, algorithm=algorithm)
        except BudgetInfeasibleError:
            rows.append(row)
            done(label)
            continue
        fitting = [
            (k, s, planner.trials.peak(s))
            for k, s in _uniform_schedules(planner)
            if planner.trials.peak(s) <= budget
        ]
        # NOTE [select, then measure]: the fastest of many noisy timings is faster
        # than its schedule is (the least of several scattered medians lies well
        # below their mean, by about 1.5 sigma for ten). The plan was chosen by the planner's
        # own timing round and is timed afresh here; the best uniform segmentation
        # is chosen by one round and timed afresh beside the plan in another.
        plan_items = row.plan.schedule.items
        same = [f for f in fitting if f[1].items == plan_items]
        others = [f for f in fitting if f[1].items != plan_items]
        best = same[0] if same else others[0] if others else None
        if not same and len(others) > 1:
            selection = time_side_by_side(
                planner.target,
                {k: run_items(s.items, planner.target.blocks, {}) for k, s, _ in others},
                repeats,
            )
            best = min(others, key=lambda f: selection[f[0]])
        runners: dict[str, Any] = {"plan": planner.runner(row.plan)}
        if best is not None and not same:
            runners["uniform"] = run_items(best[1].items, planner.target.blocks, {})
        # NOTE [paired rounds], over twice the rounds a selection takes.
        overheads = paired_overheads(planner.target, runners, 2 * repeats)
        row.plan_overhead = statistics.median(overheads["plan"])
        if best is not None:
            k, _, peak = best
            row.uniform_segments, row.uniform_peak_bytes = k, peak
            uniform = overheads.get("uniform", overheads["plan"])
            row.uniform_overhead = statistics.median(uniform)
            row.ratio_range = ratio_range(overheads["plan"], uniform)
            # NOTE [predicted ratio]
            uniform_extra_s = best[1].predicted_overhead_s
            if uniform_extra_s > 0:
                row.predicted_ratio = row.plan.schedule.predicted_overhead_s / uniform_extra_s
        rows.append(row)
        done(label)
    rows.sort(key=lambda row: list(labels).index(row.label))
    return ModelResult(name, planner.plain_peak, min_feasible, rows, planner)


# ------------------------------------------------------------------ output


def _pct(x: float | None) -> str:
    return "" if x is None else f"{100 * x:+.1f}%"


def _range_text(row: BudgetRow) -> str:
    return "" if row.ratio_range is None else "{:.2f}-{:.2f}".format(*row.ratio_range)


def format_table(results: Sequence[ModelResult]) -> str:
    """The budgets of every model as one aligned table (MiB, overheads vs plain)."""
    header = (
        "model",
        "budget",
        "budget MiB",
        "peak MiB",
        "peak/budget",
        "plan overhead",
        "uniform",
        "uniform peak MiB",
        "uniform overhead",
        "plan/uniform",
        "90% range",
        "predicted",
        "schedule",
    )
    rows: list[tuple[str, ...]] = []
    for result in results:
        for i, row in enumerate(result.rows):
            first = result.name if i == 0 else ""
            if row.plan is None:
                rows.append(
                    (first, row.label, mib(row.budget_bytes), "infeasible", "", "", "", "", "", "",
                     "", "", f"min feasible {row.min_feasible_bytes:,} B")
                )  # fmt: skip
                continue
            ratio = ""
            if row.uniform_overhead is not None and row.uniform_overhead > 0:
                # A plan measured faster than plain has no meaningful ratio: noise.
                ratio = (
                    f"{row.plan_overhead / row.uniform_overhead:.2f}x"
                    if row.plan_overhead >= 0
                    else "below plain"
                )
            rows.append(
                (
                    first,
                    row.label,
                    mib(row.budget_bytes),
                    mib(row.plan.measured_peak_bytes),
                    f"{row.plan.measured_peak_bytes / row.budget_bytes:.3f}",
                    _pct(row.plan_overhead),
                    "" if row.uniform_segments is None else f"{row.uniform_segments} seg",
                    "" if row.uniform_peak_bytes is None else mib(row.uniform_peak_bytes),
                    _pct(row.uniform_overhead) or "none fits",
                    ratio,
                    _range_text(row) if ratio.endswith("x") else "",
                    "" if row.predicted_ratio is None else f"{row.predicted_ratio:.2f}x",
                    row.plan.layout,
                )
            )
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        left = {0, 1, 12}
        return "  ".join(
            f"{c:<{w}}" if i in left else f"{c:>{w}}"
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def write_pareto(results: Sequence[ModelResult], path: Path) -> None:
    """Write a PNG: per model, peak memory against step-time overhead.

    Every point's peak is measured (exact, one step each); every time is the
    planner's prediction, except the plans' measured times (crosses).
    """
    from matplotlib.figure import Figure  # lazy: an optional extra

    fig = Figure(figsize=(5.2 * len(results), 4.4), layout="constrained")
    axes = fig.subplots(1, len(results), squeeze=False)[0]
    for ax, result in zip(axes, results, strict=True):
        planner = result.planner
        chain, base = planner.chain, planner.chain.store_all_time_s
        # Peaks are measured (exact, one step each): the memory model leaves out what
        # lies outside the chain and can be megabytes off (small_cnn split at its dead
        # cuts, before NOTE [dead cuts]: its predicted points, shifted by the store-all
        # difference, fell below zero). Overheads are the planner's predicted ones,
        # free of timing noise.
        budgets = [p.budget_bytes for p in P.pareto(chain) if p.algorithm == "optimal"]
        dp = sorted(
            (planner.trials.peak(s), s.predicted_overhead_s)
            for s in {s.items: s for s in (P.solve(chain, b) for b in budgets if b)}.values()
        )
        uni = [(k, s, planner.trials.peak(s)) for k, s in _uniform_schedules(planner)]
        ax.plot(
            [peak / MIB for peak, _ in dp],
            [100 * overhead / base for _, overhead in dp],
            "o-",
            markersize=3,
            label="optimal DP (measured peak, predicted time)",
        )
        ax.plot(
            [peak / MIB for _, _, peak in uni],
            [100 * s.predicted_overhead_s / base for _, s, _ in uni],
            "s",
            label="uniform segments, k = 1..L (measured peak, predicted time)",
        )
        for k, s, peak in uni:
            ax.annotate(
                f"k={k}",
                (peak / MIB, 100 * s.predicted_overhead_s / base),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        blocks = len(result.planner.block_sizes)
        forget_all = result.planner.on_blocks(P.forget_each_items(blocks), "forget_each")
        ax.plot(
            [result.planner.trials.peak(forget_all) / MIB],
            [100 * forget_all.predicted_overhead_s / base],
            "kv",
            markersize=9,
            label="forget-all (measured peak, predicted time)",
        )
        plans = [(r.plan, r.plan_overhead) for r in result.rows if r.plan is not None]
        draw_plans(
            ax,
            result.plain_peak_bytes,
            [(p.measured_peak_bytes, p.predicted_overhead, measured) for p, measured in plans],
            [(r.label, r.budget_bytes) for r in result.rows if r.plan is not None],
        )
        split = f", {len(chain)} stages" if len(chain) != blocks else ""
        ax.set_title(f"{result.name} ({blocks} blocks{split})")
    fig.suptitle("forget plan: peak memory vs recomputation overhead")
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forget plan",
        description=(
            "Plan a model of yours (module:factory) over its module tree into memory "
            "budgets, printing each plan as a tree of regions; or, with no target, plan "
            "the reference models (chains) and print measured peak vs budget and the "
            "step-time overhead vs the best uniform segmentation that fits."
        ),
    )
    p.add_argument(
        "target",
        nargs="?",
        metavar="module:factory",
        help=(
            "plan your model: a module (or path/to/file.py), a colon and a function that "
            "returns (model, batch) or (model, batch, loss_fn); batch is a tuple of "
            "positional inputs or a dict of keyword inputs"
        ),
    )
    p.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar="PATTERN",
        help=(
            "with a target: a module that may become a region, by dotted-name pattern "
            "(fnmatch, '*' crosses dots: 'encoder.layers.*'); replaces the default "
            "candidates (repeatable)"
        ),
    )
    p.add_argument(
        "--model",
        default="all",
        help=(
            f"'all', one of {', '.join(MODEL_NAMES)}, or module:factory returning a chain "
            "(with --input-shape; default all)"
        ),
    )
    p.add_argument("--size", choices=SIZES, default="quick", help="reference sizes (quick)")
    p.add_argument("--input-shape", help="input shape for a module:factory model, e.g. 64,512")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=NUMBER",
        help="replace a reference model's preset argument, e.g. context=512 (repeatable)",
    )
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help=f"comma-separated budgets, each {BUDGET_HELP} (default %(default)s)",
    )
    p.add_argument("--algorithm", default="optimal", help="planner name (default optimal)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=OPS",
        help=(
            "a partial keep the planner may choose per stage: keep the outputs of OPS, "
            f"+-joined groups ({', '.join(OPTION_GROUPS)}) or aten ops, e.g. "
            "sel=LINEAR+CONV+ATTENTION+DROPOUT; or NAME=REGENERATE: keep the stage and "
            "rebuild its GELU/SiLU/LayerNorm outputs and dropout products and masks in backward, "
            "at the top level or in a region's re-run (repeatable)"
        ),
    )
    p.add_argument(
        "--no-options",
        action="store_true",
        help=(
            "module:factory targets: plan with keep and forget alone, not the default "
            "options (selective: keep matmul, attention and dropout outputs; regenerate)"
        ),
    )
    p.add_argument(
        "--split",
        action="store_true",
        help=(
            "plan on the stages the blocks offer (an MLP block's residual sum and "
            "LayerNorm, a GPT block's residual halves, a conv block's conv, BN and ReLU, "
            "joined where no backward reads the tensor between them); uniform segments "
            "stay on whole blocks"
        ),
    )
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of models and inputs (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--pareto", "--plot", type=Path, metavar="PATH", help="write a Pareto PNG (peak vs time)"
    )
    p.add_argument("--show", action="store_true", help="also print each plan's stage table")
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    return p


def _check_mode(args: argparse.Namespace) -> None:
    """Refuse options of one mode given to the other: a chain's to a target, and back."""
    if args.option and args.no_options:
        raise ValueError("forget: --option and --no-options contradict each other; give one")
    if args.target is None:
        if args.no_options:
            raise ValueError(
                "forget: --no-options turns off a module:factory target's default options; "
                "the reference models have none (leave it out)"
            )
        if args.candidate:
            raise ValueError(
                "forget: --candidate picks the regions of a module:factory target's tree; "
                "give the target (forget plan module:factory --candidate ...)"
            )
        return
    chain_only = {
        "--model": args.model != "all",
        "--size": args.size != "quick",
        "--input-shape": args.input_shape is not None,
        "--set": bool(args.set),
        "--split": args.split,
        "--algorithm": args.algorithm != "optimal",
    }
    given = [flag for flag, on in chain_only.items() if on]
    if given:
        raise ValueError(
            f"forget: {', '.join(given)} plan the reference models and chains of blocks; "
            f"{args.target} is planned over its module tree, with its own batch: leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def _budget_done(progress: Progress, name: str, label: str) -> None:
    progress.update(f"{name} {label}")


def main(argv: Sequence[str]) -> int:
    """Run ``forget plan``; return the exit status (0 ok, 2 usage or a model with no plan)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    specs = list(MODEL_NAMES) if args.model == "all" else [args.model]
    labels = [b.strip() for b in args.budgets.split(",") if b.strip()]
    try:
        _check_mode(args)
        P.get_algorithm(args.algorithm)
        if args.repeats < 1:
            raise ValueError(f"forget: --repeats must be at least 1, got {args.repeats}")
        for label in labels:
            check_budget(label)
        if not labels:
            raise ValueError("forget: --budgets is empty")
        options: dict[str, Policy] = {}
        for text in args.option:
            name, policy = parse_option(text)
            if name in options:
                raise ValueError(f"forget: --option {name!r} is given twice")
            options[name] = policy
        if args.pareto is not None:
            require_matplotlib("--pareto")
        settings = dict(parse_setting(text) for text in args.set)
        built = [
            model_and_inputs(s, args.size, args.seed, args.input_shape, settings)
            for s in (specs if args.target is None else [])
        ]
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.target is not None:
        return _plan_tree.run(args.target, args, labels, options)
    # One unit per model profiled and per budget planned and timed.
    progress = Progress(
        len(built) * (1 + len(labels)), enabled=not args.quiet, desc="forget plan", unit="task"
    )
    results = []
    try:
        with frozen_heap():  # NOTE [frozen heap] in forget._measure
            for name, model, inputs in built:
                try:
                    planner = Planner(
                        model,
                        inputs,
                        options=options or None,
                        repeats=args.repeats,
                        split=args.split,
                    )
                except Exception as exc:  # NOTE [the user's errors] in ._common
                    progress.close()
                    line = step_error(exc, name, model, args.traceback)
                    if line is None:
                        raise
                    print(line, file=sys.stderr)
                    return 2
                progress.update(f"{name} profiled")
                done = functools.partial(_budget_done, progress, name)
                results.append(
                    _plan_budgets(name, planner, labels, args.algorithm, args.repeats, done)
                )
    finally:
        progress.close()
    if not args.quiet:
        print(
            f"forget plan ({args.algorithm}): {args.size} sizes, median of {args.repeats} "
            f"steps per schedule, {torch.get_num_threads()} threads, torch {torch.__version__}"
            + (", blocks split into their stages" if args.split else "")
        )
        for name, policy in options.items():
            print(f"option {name}: {policy}")
    print(format_table(results))
    for result in results:
        for row in result.rows:
            if row.plan is not None and row.budget_bytes >= result.plain_peak_bytes:
                print(f"{result.name} @ {row.label}: " + above_plain_note(
                    row.budget_bytes, result.plain_peak_bytes))  # fmt: skip
    if args.show:
        for result in results:
            for row in result.rows:
                if row.plan is not None:
                    print(f"\n{result.name} @ {row.label}:\n{row.plan}")
    if not args.quiet:
        print(
            "peak: exact storage bytes of one training step (forget.measure), always <= "
            "budget; overheads: measured step time vs plain, side by side; uniform: the "
            "fastest checkpoint_sequential-style segmentation whose peak fits the budget; "
            "90% range: plan/uniform over the timing rounds resampled in pairs; "
            "predicted: plan/uniform in the planner's time model, from the profile."
        )
    if args.json is not None:
        payload = {"models": {r.name: r.as_json() for r in results}}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        wrote(args.json, "the table's figures as JSON")
    if args.pareto is not None:
        write_pareto(results, args.pareto)
        wrote(args.pareto, "peak memory against step-time overhead, per model")
    unplanned = [r for r in results if all(row.plan is None for row in r.rows)]
    for r in unplanned:
        print(
            f"forget plan: no budget of {r.name} could be planned: each lies below the "
            f"smallest feasible one, {r.min_feasible_bytes:,} B (plain peak "
            f"{r.plain_peak_bytes:,} B); --budgets min plans at it",
            file=sys.stderr,
        )
    return 2 if unplanned else 0
