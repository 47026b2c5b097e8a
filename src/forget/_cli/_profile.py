"""``forget profile MODEL``: the memory ledger of a user's model, a plan, a memory timeline.

MODEL is what ``forget plan`` takes: ``module:factory`` or
``path/to/file.py:factory`` returning ``(model, batch[, loss_fn])`` (NOTE
[factory contract] in `._plan_tree`: profiled and planned over its module
tree), a factory returning a chain (an ``nn.Sequential``, a list of blocks)
with ``--input-shape``, or a reference model's name, each planned over its
module tree as well. The command prints the plain step's figures, what each
candidate module keeps for backward, the plan for ``--budget``, and with
``--timeline PATH`` writes a PNG of live bytes over one training step, op by op, plain and planned.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .._errors import BudgetInfeasibleError
from .._memory import Ledger, frozen_heap, watch
from .._planning import Plan, TreePlanner, untouched, zero_grads
from ..schedules import MIB, format_bytes
from ._common import (
    BUDGET_HELP,
    TRACEBACK_HELP,
    Progress,
    UserStep,
    above_plain_note,
    call_factory,
    chain_inputs,
    chain_step,
    check_budget,
    check_factory_output,
    model_and_inputs,
    require_matplotlib,
    resolve_budget,
    step_error,
    wrote,
)
from ._models import MODEL_NAMES, SIZES


class _TimelineLedger(Ledger):
    """The ledger, sampling the live total after every op: (live bytes, in backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.samples: list[tuple[int, bool]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.samples.append((self.live, torch._C._current_graph_task_id() != -1))
        return out


def tree_timeline(planner: TreePlanner, plan: Plan | None) -> list[tuple[int, bool]]:
    """`timeline` for a model planned over its module tree, under ``plan`` (None: plain)."""
    step = planner.step
    target = step.target()
    ledger = _TimelineLedger()
    with untouched(target):
        zero_grads(target)
        if plan is not None:
            plan.apply(step.model)
        try:
            with watch(ledger):
                step.run()
        finally:
            ledger.close()
            if plan is not None:
                plan.remove(step.model)
    return ledger.samples


def format_tree_ledger(planner: TreePlanner) -> str:
    """Per candidate module, as its forward runs: what its own ops keep, its inputs, its time."""
    types = dict(planner.structure)
    rows: list[tuple[str, int, int, int, float]] = []

    def visit(node: Any, depth: int) -> None:
        path = node.name if depth else ""
        kind = types.get(path, "segment").rsplit(".", 1)[-1]  # a run of children: no module
        name = f"{'  ' * depth}{node.name} ({kind})"
        rows.append((name, node.own_bytes, node.input_bytes, node.work_bytes, node.forward_s))
        for child in node.children:
            visit(child, depth + 1)

    visit(planner.tree.root, 0)
    width = max(len(r[0]) for r in rows)
    lines = [f"{'module':<{width}}  {'kept B':>12}  {'input B':>12}  {'work B':>12}  {'fwd ms':>9}"]
    lines += [
        f"{n:<{width}}  {kept:>12,}  {inp:>12,}  {work:>12,}  {s * 1e3:>9.3f}"
        for n, kept, inp, work, s in rows
    ]
    lines.append(
        "(kept B: what the module's own ops keep for backward in a plain step; input B: what "
        "it holds when forgotten, its inputs; work B: what its own backward allocates beyond "
        "that, gradients and temporaries; fwd ms: its forward, children included)"
    )
    return "\n".join(lines)


def write_timeline(
    path: Path,
    name: str,
    plain: Sequence[tuple[int, bool]],
    planned: Sequence[tuple[int, bool]],
    plan: Plan | None,
) -> None:
    """Write the PNG: live MiB over the ops of one step, plain and planned."""
    from matplotlib.figure import Figure  # lazy: an optional extra

    fig = Figure(figsize=(10, 4.8), layout="constrained")
    ax = fig.subplots()
    for row, (samples, label, color) in enumerate(
        ((plain, "plain", "tab:blue"), (planned, "planned (forget)", "tab:red"))
    ):
        if not samples:
            continue
        xs = [100 * i / max(len(samples) - 1, 1) for i in range(len(samples))]
        ys = [live / MIB for live, _ in samples]
        peak = max(ys)
        ax.plot(xs, ys, color=color, linewidth=1.4, label=f"{label}: peak {peak:.2f} MiB")
        start = next((x for x, (_, bwd) in zip(xs, samples, strict=True) if bwd), None)
        if start is not None:
            ax.axvline(start, color=color, linestyle=":", linewidth=1)
            # Named at the foot of the axes, one row per step: a step's memory is at its
            # highest where its backward starts, so a name at its peak crossed its line.
            ax.annotate(
                f"{label}: backward starts",
                (start, 0.0),
                xycoords=("data", "axes fraction"),
                color=color,
                fontsize=8,
                xytext=(4, 4 + 11 * row),
                textcoords="offset points",
            )
    if plan is not None:
        ax.axhline(
            plan.budget_bytes / MIB,
            color="black",
            linestyle="--",
            linewidth=1,
            label=f"budget {plan.budget_bytes / MIB:.2f} MiB",
        )
    ax.set_xlabel("progress through one training step (% of its ops: forward, then backward)")
    ax.set_ylabel("live tensor memory (MiB, exact storage bytes)")
    ax.set_title(f"forget profile: {name}, memory over one step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    fig.savefig(path, dpi=120)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forget profile",
        description=(
            "Print the exact memory ledger of one training step of a model, per block, "
            "and a plan for a budget; optionally draw live memory over the step."
        ),
    )
    p.add_argument(
        "model",
        help=(
            "module:factory or path/to/file.py:factory returning (model, batch) or "
            "(model, batch, loss_fn), as forget plan takes it; a factory returning a chain "
            "(with --input-shape); or a reference model name"
        ),
    )
    p.add_argument("--input-shape", help="a chain factory's random input shape, e.g. 64,512")
    p.add_argument("--size", choices=SIZES, default="quick", help="reference model size")
    p.add_argument(
        "--budget", default="50%", help=f"budget for the plan: {BUDGET_HELP} (default 50%%)"
    )
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    p.add_argument("--timeline", type=Path, metavar="PATH", help="write a memory-timeline PNG")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``forget profile``; return the exit status (0 ok, 2 usage or infeasible)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.repeats < 1:
            raise ValueError(f"forget: --repeats must be at least 1, got {args.repeats}")
        check_budget(args.budget)
        if args.timeline is not None:
            require_matplotlib("--timeline")
        if args.model in MODEL_NAMES or ":" not in args.model:
            name, model, inputs = model_and_inputs(
                args.model, args.size, args.seed, args.input_shape
            )
        else:
            out = call_factory(args.model, args.seed)
            if args.input_shape is None or isinstance(out, tuple):
                if args.input_shape is not None:
                    raise ValueError(
                        f"forget: --input-shape gives a chain its random input; {args.model}() "
                        "returned its own batch, a tuple: leave --input-shape out"
                    )
                return run_tree(args.model, check_factory_output(args.model, out, "profile"), args)
            name, model, inputs = chain_inputs(args.model, out, args.seed, args.input_shape)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run_tree(name, chain_step(model, inputs), args)


def run_tree(spec: str, step: UserStep, args: argparse.Namespace) -> int:
    """Profile ``spec``'s step over its module tree (`forget._planning.TreePlanner`)."""
    progress = Progress(3, enabled=not args.quiet, desc="forget profile", unit="task")
    infeasible: BudgetInfeasibleError | None = None
    plan: Plan | None = None
    try:
        with frozen_heap():  # NOTE [frozen heap] in forget._measure
            planner = TreePlanner(
                step.model, step.args, step.kwargs, loss_fn=step.loss_fn, repeats=args.repeats
            )
            progress.update("profiled")
            budget = resolve_budget(args.budget, planner.plain_peak, planner.least())
            try:
                plan = planner.plan(budget)
            except BudgetInfeasibleError as exc:
                infeasible = exc
            progress.update("planned")
            plain_line = tree_timeline(planner, None)
            planned_line = [] if plan is None else tree_timeline(planner, plan)
            progress.update("timeline")
    except Exception as exc:  # NOTE [the user's errors] in ._common
        progress.close()
        line = step_error(exc, spec, step.model, args.traceback)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2
    finally:
        progress.close()
    model = type(step.model).__name__
    print(
        f"forget profile: {spec}, {model} over its module tree, {len(planner.tree) - 1} "
        f"candidate modules, torch {torch.__version__}"
    )
    print(
        f"plain step: peak {planner.plain_peak:,} B ({format_bytes(planner.plain_peak)}) by the "
        f"allocator ({planner.profile.probe}), predicted (the plain step never runs); ledger "
        f"{planner.profile.plain_ledger_peak_bytes:,} B on fake tensors"
    )
    print(format_tree_ledger(planner))
    print()
    no_plan = _print_plan(args, plan, infeasible, planner.plain_peak)
    payload: dict[str, Any] | None = None
    if args.json is not None:
        types = dict(planner.structure)
        payload = {
            "model": spec,
            "type": model,
            "plain_peak_bytes": planner.plain_peak,
            "modules": [
                {
                    "name": node.name,
                    "type": types.get("" if node is planner.tree.root else node.name, "?"),
                    "kept_bytes": node.own_bytes,
                    "input_bytes": node.input_bytes,
                    "work_bytes": node.work_bytes,
                    "forward_s": node.forward_s,
                }
                for node in _nodes(planner.tree.root)
            ],
        }
    return _write(args, payload, spec, plain_line, planned_line, plan, no_plan)


def _nodes(node: Any) -> list[Any]:
    out = [node]
    for child in node.children:
        out += _nodes(child)
    return out


def _print_plan(
    args: argparse.Namespace, plan: Any, infeasible: object, plain_peak_bytes: int
) -> str:
    """Print the plan, or why there is none (on stderr); what the files say where there is none."""
    if plan is None:
        print(f"{infeasible}; --budget min plans at the smallest", file=sys.stderr)
    else:
        print(plan)
        if plan.budget_bytes >= plain_peak_bytes:
            print(above_plain_note(plan.budget_bytes, plain_peak_bytes))
    return f"no plan for the budget {args.budget}"


def _write(
    args: argparse.Namespace,
    payload: dict[str, Any] | None,
    name: str,
    plain_line: Any,
    planned_line: Any,
    plan: Any,
    no_plan: str,
) -> int:
    """Write ``--json`` (``payload`` and the timelines) and ``--timeline``; the exit status."""
    if args.json is not None and payload is not None:
        payload["plan"] = None if plan is None else plan.to_dict()
        payload["timeline"] = {
            "plain": [live for live, _ in plain_line],
            "planned": [live for live, _ in planned_line],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        wrote(
            args.json,
            "the ledger, the plan and the timelines as JSON"
            if plan is not None
            else f'the ledger and the plain timeline as JSON; "plan" is null: {no_plan}',
        )
    if args.timeline is not None:
        write_timeline(args.timeline, name, plain_line, planned_line, plan)
        wrote(
            args.timeline,
            "live memory over one step, plain and planned"
            if plan is not None
            else f"live memory over one plain step only: {no_plan}",
        )
    return 0 if plan is not None else 2
