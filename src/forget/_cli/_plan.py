"""``forget plan``: plan models into memory budgets, each over its module tree.

``forget plan module:factory`` plans a model of the user's (`._plan_tree`,
NOTE [factory contract]). Without a target, each reference model (``--model``,
or a factory returning a chain with ``--input-shape``) is planned the same way,
by the one planner: its step is the reference model's input and its loss
against the target (`chain_step`). With several models, ``--json`` and
``--pareto`` write one file per model, the model's name added to the stem.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..policies import Policy
from . import _plan_tree
from ._common import (
    BUDGET_HELP,
    OPTION_GROUPS,
    TRACEBACK_HELP,
    chain_step,
    check_budget,
    model_and_inputs,
    parse_option,
    parse_setting,
    require_matplotlib,
)
from ._models import MODEL_NAMES, SIZES

DEFAULT_BUDGETS = "75%,50%,35%,min"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forget plan",
        description=(
            "Plan a model of yours (module:factory) over its module tree into memory "
            "budgets, printing each plan as a tree of regions and a table of the budgets; "
            "with no target, the reference models (--model), the same way."
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
            "a module that may become a region, by dotted-name pattern "
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
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=OPS",
        help=(
            "a partial keep the planner may choose per innermost candidate: keep the outputs "
            "of OPS, "
            f"+-joined groups ({', '.join(OPTION_GROUPS)}) or aten ops, e.g. "
            "sel=LINEAR+CONV+ATTENTION+DROPOUT; or NAME=REGENERATE: keep the stage and "
            "rebuild its GELU/SiLU/LayerNorm outputs and dropout products and masks in backward "
            "(repeatable; replaces the default options)"
        ),
    )
    p.add_argument(
        "--no-options",
        action="store_true",
        help=(
            "plan with keep and forget alone, not the default "
            "options (selective: keep matmul, attention and dropout outputs; regenerate)"
        ),
    )
    p.add_argument("--repeats", type=int, default=5, help="timed steps per plan (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of models and inputs (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--pareto", "--plot", type=Path, metavar="PATH", help="write a Pareto PNG (peak vs time)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    p.add_argument("--traceback", action="store_true", help=TRACEBACK_HELP)
    return p


def _check_mode(args: argparse.Namespace) -> None:
    """Refuse the reference models' options given with a target."""
    if args.option and args.no_options:
        raise ValueError("forget: --option and --no-options contradict each other; give one")
    if args.target is None:
        return
    reference_only = {
        "--model": args.model != "all",
        "--size": args.size != "quick",
        "--input-shape": args.input_shape is not None,
        "--set": bool(args.set),
    }
    given = [flag for flag, on in reference_only.items() if on]
    if given:
        raise ValueError(
            f"forget: {', '.join(given)} pick the reference models and chains of blocks; "
            f"{args.target} brings its own model and batch: leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def _per_model(path: Path | None, name: str, several: bool) -> Path | None:
    """``path``, or with several models one file per model: the name added to the stem."""
    if path is None or not several:
        return path
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
    return path.with_name(f"{path.stem}-{safe}{path.suffix}")


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
    status = 0
    for i, (name, model, inputs) in enumerate(built):
        if i:
            print()
        several = len(built) > 1
        per_model = argparse.Namespace(**vars(args))
        per_model.json = _per_model(args.json, name, several)
        per_model.pareto = _per_model(args.pareto, name, several)
        code = _plan_tree.run_step(name, chain_step(model, inputs), per_model, labels, options)
        status = max(status, code)
    return status
