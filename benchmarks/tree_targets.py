"""Issue 25's targets: `forget.plan` on Hugging Face models against transformers' baselines.

    python benchmarks/tree_targets.py [--models llama,gpt2,bert,resnet]
        [--budgets 75%,50%,35%,least] [--rounds 15] [--threads 1]
        [--options default|none|sel,regen] [--quick]

Models are built from configs here (no downloads): Llama, GPT-2 and BERT with
hidden 256, 4 layers, sequence 128, batch 4, and a ResNet of four stages of
three BasicLayers (widths 16 to 128) on 8 images of 128x128 (BatchNorm
convolutions; transformers has no gradient checkpointing for it). Per model
and budget, one row:

* the plan: a fresh `forget._planning.TreePlanner` (what `forget.plan` runs,
  with ``--options`` as its leaf options: by default forget's own,
  `forget.policies.DEFAULT_OPTIONS`; ``none`` for keep and forget alone;
  ``sel`` keeps the outputs of LINEAR, ATTENTION and DROPOUT ops, ``regen`` is
  `forget.policies.regenerate`, the two defaults under their old names)
  planned for that budget; its wall time, against 30 plain steps; its step's
  peak over the budget, by the allocator (``probe="profiler"``);
* the baselines, each run as a tree plan (the same engine, so only the choice
  of what to forget differs) and measured by the same allocator probe to see
  whether it fits: transformers-style first-k layers forgotten (the least k
  that fits), ``every_n_layers`` (layers 0, n, 2n, ... forgotten, as
  transformers' ``_set_gradient_checkpointing`` does; the fitting n >= 2 of
  least overhead) and every layer forgotten; ``no fit`` where none fits;
* step-time overheads over plain, all timed side by side in one run
  (`forget._planning.time_calls`: interleaved, shuffled rounds, each
  assignment on its own copy of the model), each the median over rounds of
  its time over plain's in the same round, less one;
* plan / best: the plan's overhead over the fastest fitting baseline's, and
  its 90 % range over the rounds resampled in pairs (as ``forget plan``'s).

A row whose ratio is above 0.9 gets one line on why no cheaper fitting plan
was found. A budget below the least feasible one is skipped with a note.
Torch runs one thread (``--threads``): on a shared 2-core machine two
threads contending with other processes made some steps ten times slower.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import re
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import forget
from forget import policies as P
from forget._planning import TreePlanner, ratio_range, time_calls
from forget.policies import DEFAULT_OPTIONS

_Key = tuple[tuple[str, str], ...]  # an assignment's (module, choice) pairs, sorted


# ------------------------------------------------------------------ models


def _text(name: str, quick: bool) -> tuple[nn.Module, dict[str, Any]]:
    import transformers as tf

    hidden, layers, seq = (64, 2, 32) if quick else (256, 4, 128)
    ids = torch.randint(1, 1000, (4, seq))
    inputs = {"input_ids": ids, "labels": ids}
    if name == "llama":
        config: Any = tf.LlamaConfig(
            num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
            intermediate_size=2 * hidden + hidden // 2, num_key_value_heads=2, vocab_size=1000,
            max_position_embeddings=seq, use_cache=False,
        )  # fmt: skip
        return tf.LlamaForCausalLM(config).train(), inputs
    if name == "gpt2":
        config = tf.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=4, vocab_size=1000, n_positions=seq,
            bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        return tf.GPT2LMHeadModel(config).train(), inputs
    config = tf.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=4 * hidden,
        num_attention_heads=4, vocab_size=1000, max_position_embeddings=seq, pad_token_id=0,
    )  # fmt: skip
    return tf.BertForMaskedLM(config).train(), inputs


def _resnet(quick: bool) -> tuple[nn.Module, dict[str, Any]]:
    import transformers as tf

    sizes: dict[str, Any] = dict(
        num_channels=3, embedding_size=16, hidden_sizes=[16, 32] if quick else [16, 32, 64, 128],
        depths=[1, 1] if quick else [3, 3, 3, 3], layer_type="basic", num_labels=10,
    )  # fmt: skip
    side = 32 if quick else 128
    pixels = torch.randn(8, 3, side, side)
    labels = torch.arange(8) % 10
    return tf.ResNetForImageClassification(tf.ResNetConfig(**sizes)).train(), {
        "pixel_values": pixels,
        "labels": labels,
    }


# name -> (factory, the repeated layers the baselines forget: a regex on module paths)
MODELS: dict[str, tuple[Callable[[bool], tuple[nn.Module, dict[str, Any]]], str]] = {
    "llama": (lambda quick: _text("llama", quick), r"model\.layers\.\d+"),
    "gpt2": (lambda quick: _text("gpt2", quick), r"transformer\.h\.\d+"),
    "bert": (lambda quick: _text("bert", quick), r"bert\.encoder\.layer\.\d+"),
    "resnet": (_resnet, r"resnet\.encoder\.stages\.\d+\.layers\.\d+"),
}


# ------------------------------------------------------------------ one model

OPTIONS: dict[str, forget.policies.Policy] = {
    "sel": P.save_outputs_of(*P.LINEAR, *P.ATTENTION, *P.DROPOUT),
    "regen": P.regenerate(),
}


@dataclass
class Row:
    """One budget of one model: the plan, the fitting baselines, their figures."""

    budget: str
    budget_bytes: int = 0
    plan: forget.Plan | None = None
    plan_s: float = 0.0
    planner: TreePlanner | None = None
    note: str = ""
    # kind ("first-k", "every-n", "all") -> the fitting assignments (label, key) timed
    fitting: dict[str, list[tuple[str, _Key]]] = field(default_factory=dict)


@dataclass
class Result:
    """A model's rows, and per assignment its allocator peak and per-round overheads."""

    rows: list[Row]
    peaks: dict[_Key, int]
    overheads: dict[_Key, list[float]]
    plain_s: float


def _key(choices: Mapping[str, str]) -> _Key:
    return tuple(sorted(choices.items()))


def _baselines(layers: Sequence[str]) -> dict[str, list[tuple[str, _Key]]]:
    """Every assignment of the three baseline kinds, in the order a kind tries them."""
    n = len(layers)

    def forgets(names: Sequence[str]) -> _Key:
        return _key(dict.fromkeys(names, "forget"))

    return {
        "first-k": [(f"k={k}", forgets(layers[:k])) for k in range(1, n + 1)],
        "every-n": [(f"n={m}", forgets(layers[0:n:m])) for m in range(2, n + 1)],
        "all": [(f"all {n}", forgets(layers))],
    }


def run_model(
    name: str, budgets: Sequence[str], rounds: int, quick: bool, options: Mapping[str, Any]
) -> Result:
    """Plan ``name`` for each budget, measure the baselines, time everything side by side."""
    factory, pattern = MODELS[name]
    torch.manual_seed(0)
    model, inputs = factory(quick)
    layers = [n for n, _ in model.named_modules() if re.fullmatch(pattern, n)]
    kinds = _baselines(layers)
    rows: list[Row] = []
    peaks: dict[_Key, int] = {}
    for budget in budgets:
        row = Row(budget)
        rows.append(row)
        start = time.perf_counter()
        planner = TreePlanner(model, (), inputs, options=options)
        peaks[()] = planner.plain_peak
        try:
            row.plan = planner.plan(planner.least() if budget == "least" else budget)
        except forget.BudgetInfeasibleError as error:
            least = error.min_feasible_bytes
            row.budget_bytes = error.budget_bytes
            row.note = (
                f"below the least feasible budget, {least:,} B "
                f"({least / planner.plain_peak:.0%} of plain): skipped"
            )
            continue
        row.plan_s = time.perf_counter() - start
        row.planner = planner
        row.budget_bytes = row.plan.budget_bytes
        peaks[_key(row.plan.choices)] = planner.measure_peak(row.plan.choices)
        for kind, assignments in kinds.items():
            fitting = row.fitting[kind] = []
            for label, key in assignments:
                if key not in peaks:
                    peaks[key] = planner.measure_peak(dict(key))
                if peaks[key] <= row.budget_bytes:
                    fitting.append((label, key))
                    if kind == "first-k":
                        break  # the least k that fits
    overheads, plain_s = _time_all(model, inputs, rows, rounds)
    return Result(rows, peaks, overheads, plain_s)


def _time_all(
    model: nn.Module, inputs: Mapping[str, Any], rows: Sequence[Row], rounds: int
) -> tuple[dict[_Key, list[float]], float]:
    """Per-round overheads over plain of every assignment the rows name, one interleaved run.

    Each assignment runs on its own copy of the model, applied once, as a
    tree plan: a baseline is a plan's copy with other choices.
    """
    plans: dict[_Key, forget.Plan | None] = {(): None}
    for row in rows:
        if row.plan is not None:
            plans[_key(row.plan.choices)] = row.plan
            for fitting in row.fitting.values():
                for _, key in fitting:
                    plans.setdefault(key, dataclasses.replace(row.plan, choices=dict(key)))
    copies: dict[_Key, nn.Module] = {}
    for key, plan in plans.items():
        copies[key] = copy.deepcopy(model)
        if plan is not None:
            plan.apply(copies[key])

    def step(module: nn.Module) -> Callable[[], None]:
        def run() -> None:
            module(**inputs).loss.backward()

        return run

    times = time_calls(
        {key: step(m) for key, m in copies.items()},
        rounds,
        prepare=lambda key: copies[key].zero_grad(set_to_none=True),
    )
    base = times[()]
    overheads = {k: [t / b - 1 for t, b in zip(ts, base, strict=True)] for k, ts in times.items()}
    return overheads, statistics.median(base)


def spread(plan: Sequence[float], best: Sequence[float]) -> str:
    """``forget._planning.ratio_range`` of the rounds as ``lo-hi``, or ``n/a``."""
    cuts = ratio_range(plan, best)
    return "n/a" if cuts is None else f"{cuts[0]:.2f}-{cuts[-1]:.2f}"


# ------------------------------------------------------------------ output


def _pct(values: Sequence[float]) -> str:
    return f"{100 * statistics.median(values):+.1f}%"


def _why(row: Row, best: tuple[str, str, _Key], spread: str) -> str:
    """One line: why no cheaper fitting plan than the best baseline was found."""
    assert row.plan is not None and row.planner is not None
    kind, label, key = best
    if _key(row.plan.choices) == key:
        return (
            f"the plan is {kind} {label} itself: the baseline is in the search space and "
            "was the fastest fitting assignment the planner measured (1.00 by identity)"
        )
    fit = {k for k, (_, peak) in row.planner.measured.items() if peak <= row.budget_bytes}
    seen = "measured it, fitting" if key in fit else "never measured it"
    bounds = re.fullmatch(r"(-?[\d.]+)-(-?[\d.]+)", spread)
    if bounds is None:
        return f"no range for the ratio ({spread}); the planner {seen}"
    low, high = float(bounds.group(1)), float(bounds.group(2))
    if high < 1.0:
        return (
            f"the plan is faster than {kind} {label} beyond the noise (the range {spread} "
            "lies below 1.00), if by less than a tenth"
        )
    if low <= 1.0:
        return (
            f"the plan and {kind} {label} differ by less than the noise (the range "
            f"{spread} covers 1.00); the planner {seen}"
        )
    return f"{kind} {label} is faster beyond the noise: a miss; the planner {seen}"


def _choices_text(choices: Mapping[str, str]) -> str:
    return ", ".join(n if c == "forget" else f"{n}:{c}" for n, c in choices.items())


def report(name: str, result: Result) -> None:
    """The model's rows as a Markdown table, then a line per ratio above 0.9."""
    overheads, plain_s = result.overheads, result.plain_s
    print(
        f"\n{name}: plain peak {result.peaks[()]:,} B, plain step {plain_s * 1e3:.1f} ms, "
        f"30 plain steps {30 * plain_s:.2f} s\n"
    )
    print(
        "| budget | budget B | peak / budget | plan | first-k | every-n | all | plan / best "
        "| 90 % range | plan s (/ 30 steps) | not kept |"
    )
    print("|---|---:|---:|---:|---|---|---|---:|---|---|---|")
    why = []
    for row in result.rows:
        if row.plan is None:
            print(f"| {row.budget} | {row.budget_bytes:,} | {row.note} | | | | | | | | |")
            continue
        plan_key = _key(row.plan.choices)
        cells = []
        best: tuple[str, str, _Key] | None = None
        for kind in ("first-k", "every-n", "all"):
            fitting = row.fitting.get(kind)
            if not fitting:
                cells.append("no fit")
                continue
            # every-n: the fitting n of least overhead
            label, key = min(fitting, key=lambda lk: statistics.median(overheads[lk[1]]))
            cells.append(f"{label} {_pct(overheads[key])}")
            if best is None or statistics.median(overheads[key]) < statistics.median(
                overheads[best[2]]
            ):
                best = (kind, label, key)
        ratio = range_text = ""
        if best is not None:
            below = statistics.median(overheads[best[2]])
            value = statistics.median(overheads[plan_key]) / below if below > 0 else math.nan
            ratio = f"{value:.2f}x"
            range_text = spread(overheads[plan_key], overheads[best[2]])
            if not value <= 0.9:
                why.append(f"- {row.budget}: {_why(row, best, range_text)}")
        else:
            why.append(f"- {row.budget}: no baseline fits; the plan does")
        print(
            f"| {row.budget} | {row.budget_bytes:,} | "
            f"{result.peaks[plan_key] / row.budget_bytes:.3f} | {_pct(overheads[plan_key])} | "
            f"{' | '.join(cells)} | {ratio} | {range_text} | "
            f"{row.plan_s:.2f} ({row.plan_s / (30 * plain_s):.2f}x) | "
            f"{_choices_text(row.plan.choices)} |"
        )
    print("\n".join(["", *why]) if why else "")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--budgets", default="75%,50%,35%,least")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--options",
        default="default",
        help=(
            "default: forget.policies.DEFAULT_OPTIONS; none: keep and forget alone; or "
            f"comma-separated leaf options, of {', '.join(OPTIONS)}"
        ),
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    options: Mapping[str, Any] = (
        DEFAULT_OPTIONS
        if args.options == "default"
        else {name: OPTIONS[name] for name in args.options.split(",") if name and name != "none"}
    )
    budgets = args.budgets.split(",")
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.rounds} rounds")
    for name in args.models.split(","):
        report(name, run_model(name, budgets, args.rounds, args.quick, options))


if __name__ == "__main__":
    main()
