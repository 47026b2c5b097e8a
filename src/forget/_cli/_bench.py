"""``forget bench``: plain vs ``torch.utils.checkpoint`` vs ``forget``, side by side.

Each reference model of `forget._cli._models` runs one training step (forward,
loss, backward) in three variants, all in one process and on identical
inputs:

* ``plain`` -- every block called directly; autograd keeps all activations.
* ``torch_checkpoint`` -- every block through
  ``torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)``.
* ``forget`` -- every block through ``forget.checkpoint(block, h)``.

Memory is the exact byte count of tensor storages from ``forget.measure``
(``peak_bytes`` over the step, ``saved_bytes`` kept for backward), so it is
the same on every run and machine. Time is the median over ``--repeats``
steps, variants interleaved (`forget._planning.time_calls`) after a warm-up,
and is reported as ratios within the run, variant / plain: absolute seconds
depend on the machine, ratios much less so.

The bench also checks correctness: the three variants must compute the same
loss and gradients bit for bit (CPU), and the ``forget`` variant must leave
every buffer (BatchNorm running statistics) as the plain one does. A mismatch
is printed loudly and the command exits with status 1.

After the models' table come the launch-bound row (`_bench_launch`: one
region over a chain of 300 tiny elementwise ops, the cost per op of
checkpointing where launches dominate; ``--no-launch`` skips it) and the
selective-recomputation rows on the GPT blocks (`_bench_selective`); with
``--cap``, per model, `forget.cap` over steps of varying shapes beside a plan
and layer checkpointing at the largest (`_bench_cap`).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

import forget
from forget import ForgetError

from .._planning import time_calls
from ..schedules import MIB
from . import _bench_cap
from ._common import BLOCK_WRAPPERS, Progress, mib, require_matplotlib, wrote
from ._models import MODEL_NAMES, SIZES, build_model

VARIANTS: tuple[str, ...] = ("plain", "torch_checkpoint", "forget")
ALIASES: dict[str, str] = {"mlp": "residual_mlp", "cnn": "small_cnn", "gpt": "tiny_gpt"}


@dataclass(frozen=True)
class VariantResult:
    """One variant of one model: exact bytes and the median step time."""

    peak_bytes: int
    saved_bytes: int
    step_s: float

    def as_json(self) -> dict[str, Any]:
        return {
            "peak_bytes": int(self.peak_bytes),
            "saved_bytes": int(self.saved_bytes),
            "step_s": float(self.step_s),
        }


@dataclass(frozen=True)
class _Measured:
    peak_bytes: int
    saved_bytes: int


def _measure(fn: Callable[[], Any]) -> _Measured:
    report = forget.measure(fn)
    # saved_bytes is None only under the "cuda" probe; the bench uses the ledger.
    if report.saved_bytes is None:
        raise ForgetError("forget: bench needs the ledger probe, which reports saved_bytes.")
    return _Measured(report.peak_bytes, report.saved_bytes)


class _Runner:
    """The three variants of one model, each on its own copy of a pristine model."""

    def __init__(self, name: str, size: str, seed: int) -> None:
        self.name = name
        self.seed = seed
        pristine = build_model(name, size, seed=seed)
        pristine.train()
        self.x, self.target = pristine.example_input(generator=torch.Generator().manual_seed(seed))
        # Deep copies: BatchNorm buffers and counters start identical in every
        # variant, and one variant's updates never leak into another's.
        self.models = {v: copy.deepcopy(pristine) for v in VARIANTS}

    def prepare(self, variant: str) -> None:
        """Ready ``variant`` for a step: no gradients, the seed every step starts from."""
        # Same seed before every step: dropout draws the same masks in every
        # variant, so losses and gradients are comparable bit for bit.
        self.models[variant].zero_grad(set_to_none=True)
        torch.manual_seed(self.seed)

    def run(self, variant: str) -> Tensor:
        """One training step of ``variant`` as it stands (`prepare` first)."""
        return self.models[variant].step(self.x, self.target, BLOCK_WRAPPERS[variant])

    def step(self, variant: str) -> Tensor:
        self.prepare(variant)
        return self.run(variant)

    def measure(self, variant: str) -> _Measured:
        return _measure(lambda: self.step(variant))

    def grads(self, variant: str) -> dict[str, Tensor | None]:
        return {
            n: None if p.grad is None else p.grad.clone()
            for n, p in self.models[variant].named_parameters()
        }

    def buffers(self, variant: str) -> dict[str, Tensor]:
        return {n: b.clone() for n, b in self.models[variant].named_buffers()}


def _same(a: Mapping[str, Tensor | None], b: Mapping[str, Tensor | None]) -> list[str]:
    """Names whose tensors differ (not bitwise equal) between two dicts."""
    bad = []
    for key in a:
        x, y = a[key], b.get(key)
        if x is None or y is None:
            if x is not y:
                bad.append(key)
        elif not torch.equal(x, y):
            bad.append(key)
    return bad


@dataclass
class BenchResult:
    """Everything one run found: per model and variant, plus correctness problems."""

    results: dict[str, dict[str, VariantResult]]
    buffers_match: dict[str, dict[str, bool]]
    problems: list[str]
    meta: dict[str, Any]

    def as_json(self) -> dict[str, Any]:
        return {
            "models": {
                name: {v: r.as_json() for v, r in per.items()} for name, per in self.results.items()
            },
            "meta": self.meta,
        }


@contextmanager
def _private_rng() -> Iterator[None]:
    # The bench reseeds the global RNG before every step; leave the caller's as it was.
    with torch.random.fork_rng(devices=[]):
        yield


def run(
    names: Sequence[str],
    *,
    size: str = "default",
    repeats: int = 5,
    seed: int = 0,
    progress: bool = False,
) -> BenchResult:
    """Benchmark ``names`` in every variant; see the module docstring."""
    results: dict[str, dict[str, VariantResult]] = {}
    buffers_match: dict[str, dict[str, bool]] = {}
    problems: list[str] = []
    # Per model: the checked warm-up, the measured step, the timed rounds.
    bar = Progress(3 * len(names), progress, desc="forget bench", unit="task")
    with _private_rng():
        try:
            for name in names:
                runner = _Runner(name, size, seed)
                _check(runner, problems)
                bar.update(f"{name} checked")
                reports = {v: runner.measure(v) for v in VARIANTS}
                bar.update(f"{name} measured")
                calls = {v: functools.partial(runner.run, v) for v in VARIANTS}
                times = time_calls(calls, repeats, prepare=runner.prepare)
                bar.update(f"{name} timed")
                results[name] = {
                    v: VariantResult(
                        peak_bytes=int(reports[v].peak_bytes),
                        saved_bytes=int(reports[v].saved_bytes),
                        step_s=statistics.median(times[v]),
                    )
                    for v in VARIANTS
                }
                # Every variant ran the same number of steps: stateful layers must agree.
                plain = runner.buffers("plain")
                buffers_match[name] = {v: not _same(plain, runner.buffers(v)) for v in VARIANTS}
                if not buffers_match[name]["forget"]:
                    bad = ", ".join(_same(plain, runner.buffers("forget")))
                    problems.append(f"{name}: forget left buffers unlike plain: {bad}")
        finally:
            bar.close()
    meta = {
        "torch": torch.__version__,
        "forget": forget.__version__,
        "threads": torch.get_num_threads(),
        "size": size,
        "repeats": repeats,
        "seed": seed,
        "buffers_match_plain": buffers_match,
    }
    return BenchResult(results, buffers_match, problems, meta)


def _check(runner: _Runner, problems: list[str]) -> None:
    """Warm every variant up once and check losses and gradients against plain."""
    losses, grads = {}, {}
    for v in VARIANTS:
        losses[v] = runner.step(v)
        grads[v] = runner.grads(v)
    for v in VARIANTS[1:]:
        if not torch.equal(losses["plain"], losses[v]):
            problems.append(
                f"{runner.name}: {v} loss {losses[v].item()!r} != plain loss "
                f"{losses['plain'].item()!r}"
            )
        bad = _same(grads["plain"], grads[v])
        if bad:
            problems.append(f"{runner.name}: {v} gradients differ from plain in {', '.join(bad)}")


# ---------------------------------------------------------------- reporting


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def format_table(result: BenchResult) -> str:
    """Render the run as a fixed-width table: bytes in MiB, time in ms, ratios variant / base."""
    header = (
        "model",
        "variant",
        "peak MiB",
        "saved MiB",
        "step ms",
        "peak/plain",
        "saved/plain",
        "time/plain",
        "peak/torch",
        "time/torch",
        "buffers",
    )
    rows: list[tuple[str, ...]] = []
    for name, per in result.results.items():
        plain, torch_ = per["plain"], per["torch_checkpoint"]
        for v in VARIANTS:
            r = per[v]
            vs_torch = v == "forget"
            rows.append(
                (
                    name if v == "plain" else "",
                    v,
                    mib(r.peak_bytes),
                    mib(r.saved_bytes),
                    f"{r.step_s * 1e3:.1f}",
                    _ratio(r.peak_bytes, plain.peak_bytes),
                    _ratio(r.saved_bytes, plain.saved_bytes),
                    _ratio(r.step_s, plain.step_s),
                    _ratio(r.peak_bytes, torch_.peak_bytes) if vs_torch else "",
                    _ratio(r.step_s, torch_.step_s) if vs_torch else "",
                    "=plain" if result.buffers_match[name][v] else "differ",
                )
            )
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        first = [f"{c:<{w}}" for c, w in zip(cells[:2], widths[:2], strict=True)]
        rest = [f"{c:>{w}}" for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(first + rest).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def write_plot(result: BenchResult, path: Path) -> None:
    """Write a PNG: peak MiB per model and variant, and step time relative to plain."""
    from matplotlib.figure import Figure  # lazy: an optional extra

    names = list(result.results)
    fig = Figure(figsize=(max(8.0, 3.2 * len(names)), 4.2), layout="constrained")
    mem_ax, time_ax = fig.subplots(1, 2)
    width = 0.8 / len(VARIANTS)
    for k, v in enumerate(VARIANTS):
        xs = [i + (k - (len(VARIANTS) - 1) / 2) * width for i in range(len(names))]
        per = [result.results[n][v] for n in names]
        mem_ax.bar(xs, [r.peak_bytes / MIB for r in per], width, label=v)
        plain = [result.results[n]["plain"].step_s for n in names]
        time_ax.bar(xs, [r.step_s / p for r, p in zip(per, plain, strict=True)], width, label=v)
    for ax in (mem_ax, time_ax):
        ax.set_xticks(range(len(names)), names)
        ax.legend()
    mem_ax.set_ylabel("peak memory of one step (MiB, exact storage bytes)")
    mem_ax.set_title("Peak memory")
    time_ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    time_ax.set_ylabel("step time / plain step time (median)")
    time_ax.set_title("Step time relative to plain")
    meta = result.meta
    fig.suptitle(
        f"forget bench ({meta['size']} sizes, {meta['repeats']} repeats, "
        f"{meta['threads']} threads, torch {meta['torch']})"
    )
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="forget bench",
        description=(
            "Benchmark the reference models plain, with torch.utils.checkpoint per block "
            "and with forget.checkpoint per block: exact peak and saved bytes, median step "
            "time and ratios, all in one run."
        ),
    )
    p.add_argument("--quick", action="store_true", help="small sizes (same as --size quick)")
    p.add_argument("--size", choices=SIZES, default=None, help="model sizes (default: default)")
    p.add_argument(
        "--models",
        default=",".join(MODEL_NAMES),
        help=f"comma-separated models (default: all): {', '.join(MODEL_NAMES)}; "
        f"aliases {', '.join(ALIASES)}",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of models and inputs (default 0)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write a PNG bar chart")
    p.add_argument(
        "--no-selective",
        action="store_true",
        help="skip the selective-recomputation rows on the TinyGPT blocks",
    )
    p.add_argument(
        "--no-launch",
        action="store_true",
        help="skip the launch-bound row (a chain of 300 small elementwise ops)",
    )
    p.add_argument(
        "--cap",
        nargs="?",
        const="50%",
        metavar="SHARE",
        help="add the capped rows: per model, forget.cap over steps of varying shapes, "
        "capped at SHARE (default 50%%) of the plain peak at the largest, beside a plan "
        "at that budget and every block checkpointed (plans each model: minutes at the "
        "default size)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar or notes")
    return p


def _parse_models(spec: str) -> list[str]:
    names = []
    for raw in spec.split(","):
        name = ALIASES.get(raw.strip(), raw.strip())
        if name not in MODEL_NAMES:
            raise ValueError(
                f"forget: unknown model {raw.strip()!r} in --models; expected one of "
                f"{', '.join(MODEL_NAMES)} (or {', '.join(ALIASES)})."
            )
        if name not in names:
            names.append(name)
    return names


def main(argv: Sequence[str]) -> int:
    """Run ``forget bench``; return the exit status (0 ok, 1 mismatch, 2 usage)."""
    try:
        args = _parser().parse_args(list(argv))
    except SystemExit as exc:  # argparse exits on --help and on errors
        return exc.code if isinstance(exc.code, int) else 2
    try:
        names = _parse_models(args.models)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"forget: --repeats must be at least 1, got {args.repeats}.", file=sys.stderr)
        return 2
    if args.quick and args.size not in (None, "quick"):
        print(f"forget: --quick contradicts --size {args.size}; give one.", file=sys.stderr)
        return 2
    size = args.size or ("quick" if args.quick else "default")
    try:
        share = None if args.cap is None else _bench_cap.parse_share(args.cap)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.plot is not None:
        try:
            require_matplotlib("--plot")
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2

    result = run(names, size=size, repeats=args.repeats, seed=args.seed, progress=not args.quiet)

    if not args.quiet:
        m = result.meta
        print(
            f"forget bench: {size} sizes, median of {m['repeats']} steps per variant, "
            f"{m['threads']} threads, torch {m['torch']}"
        )
    print(format_table(result))
    if not args.quiet:
        print(
            "bytes: exact tensor storages allocated by the step (forget.measure); "
            "ratios are variant / plain (or / torch_checkpoint), so below 1 is less memory "
            "or time; buffers: module buffers after the run vs plain."
        )
    payload = result.as_json()
    if not args.no_launch:
        from . import _bench_launch

        launch = _bench_launch.run(size=size, repeats=args.repeats, seed=args.seed)
        payload["launch_bound"] = launch.as_json()
        print()
        print(_bench_launch.format_rows(launch))
        result.problems += launch.problems()
    if "tiny_gpt" in names and not args.no_selective:
        from . import _bench_selective

        selective = _bench_selective.run(size=size, repeats=args.repeats, seed=args.seed)
        payload["selective"] = selective
        print()
        print(_bench_selective.format_rows(selective))
        bad = [v for v, row in selective.items() if not row["loss_equal_to_plain"]]
        if bad:
            result.problems.append(f"selective: loss differs from plain in {', '.join(bad)}")
    if share is not None:
        payload["cap"] = {}
        for name in names:
            capped = _bench_cap.run(
                name, share=share, size=size, repeats=args.repeats, seed=args.seed
            )
            payload["cap"][name] = capped.as_json()
            print()
            print(_bench_cap.format_rows(capped))
            result.problems += capped.problems()
    if args.json is not None:
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.json is not None:
        wrote(args.json, "the tables' figures as JSON")
    if args.plot is not None:
        write_plot(result, args.plot)
        wrote(args.plot, "peak MiB and step time / plain, per model and variant")
    if result.problems:
        print(
            "forget bench: MISMATCH -- the variants do not compute the same step:", file=sys.stderr
        )
        for problem in result.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    return 0
