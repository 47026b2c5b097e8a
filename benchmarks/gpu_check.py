"""GPU check: the CUDA-marked tests, then the bench rows measured on the device.

    ./dev gpu-check [--size default] [--repeats 20] [--batch-scale 1] [--skip-tests]

runs, from the checkout's source (``PYTHONPATH=src``, nothing installed):

1. ``python3 -m pytest -m cuda -q`` on every test module that marks a test
   ``pytest.mark.cuda`` (five minutes at most);
2. for each reference model (`forget._cli._models`) and for the launch-bound chain
   of ``forget bench`` (`forget._cli._bench_launch`), one training step plain,
   with ``torch.utils.checkpoint`` (non-reentrant) and with ``forget.checkpoint``,
   as ``forget bench`` runs them: the peak bytes the step allocates above what
   was live before it (``torch.cuda.max_memory_allocated`` after
   ``reset_peak_memory_stats``), the median step time over interleaved rounds
   (`forget._planning.time_calls`) read from CUDA events around each step, and
   whether the gradients equal plain's bit for bit;
3. planning a step that does not fit (`plan_within_fraction`): a module
   tree whose plain step peaks at P, under a process memory fraction that
   leaves it 60 % of P (``torch.cuda.set_per_process_memory_fraction``): the
   plain step must fail with ``OutOfMemoryError``, ``forget.plan`` with that
   budget must plan within it (``max_memory_allocated`` around the whole call)
   and the planned step must train within it;
4. one summary table. Exit status 0 when the tests pass, no variant's
   gradients differ from a repeatable plain step and the plan stayed within
   its budget, 1 otherwise, 2 without a CUDA device or on bad arguments.

``nondet`` in the grads column: plain's own gradients differ between two
steps (atomics in a CUDA backward kernel), so bitwise equality cannot be
asked of the checkpoints; that is not a failure.

It uses only long-standing torch APIs (CUDA events, the caching allocator's
statistics), so that it runs on the device machine's torch as it is. On the
CPU (``--device cpu``, for the tests) the same functions read the wall clock
and `forget.measure`'s exact ledger instead.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import torch
except ImportError as exc:  # a python3 without torch: say so, not a traceback
    print(
        f"gpu-check: no CUDA device: {sys.executable} cannot import torch ({exc}); run it "
        "with a python that has CUDA torch: PYTHON=/path/to/python ./dev gpu-check",
        file=sys.stderr,
    )
    raise SystemExit(2) from None

import forget
from forget._cli import _bench, _bench_launch, _common
from forget._cli._common import mib
from forget._cli._models import MODEL_NAMES, SIZES, build_model, model_settings
from forget._planning import time_calls

ROOT = Path(__file__).resolve().parents[1]
VARIANTS: tuple[str, ...] = ("plain", "torch_checkpoint", "forget")
TESTS_TIMEOUT_S = 300


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; return the exit status (0 ok, 1 a failure, 2 no device or usage)."""
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"gpu-check: no CUDA device: torch {torch.__version__} (CUDA build: "
            f"{torch.version.cuda}) sees none, so there is nothing to check; run "
            "`./dev gpu-check` on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    if args.repeats < 1 or args.batch_scale < 1:
        print("gpu-check: --repeats and --batch-scale must be at least 1.", file=sys.stderr)
        return 2
    started = time.perf_counter()
    tests = None if args.skip_tests else run_cuda_tests()
    rows: list[Row] = []
    for name in args.models.split(","):
        print(f"gpu-check: {name} ...", flush=True)
        rows += bench_model(name, args.size, args.repeats, device, args.batch_scale)
    print("gpu-check: launch-bound chain ...", flush=True)
    rows += bench_launch(args.size, args.repeats, device)
    print("gpu-check: planning a step that does not fit ...", flush=True)
    fitted = (
        plan_within_fraction(device)
        if device.type == "cuda"
        else plan_within_fraction(device, width=64, depth=6, rows=256)
    )
    print()
    print(summary(rows, tests, args, device, time.perf_counter() - started))
    print(fitted.line())
    failed = (tests is not None and tests[0] != 0) or any(r.grads == "differ" for r in rows)
    return 1 if failed or not fitted.ok else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=SIZES, default="default", help="model sizes (default)")
    p.add_argument("--repeats", type=int, default=20, help="timed rounds per model (20)")
    p.add_argument(
        "--batch-scale", type=int, default=1, help="multiply each model's batch size (1)"
    )
    p.add_argument("--models", default=",".join(MODEL_NAMES), help="comma-separated models")
    p.add_argument("--skip-tests", action="store_true", help="skip the cuda-marked tests")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the tests
    return p


# ----------------------------------------------------------------- the tests


def cuda_test_files() -> list[Path]:
    """The test modules that mark a test ``pytest.mark.cuda``."""
    return [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()]


def run_cuda_tests() -> tuple[int, str]:
    """Run the cuda-marked tests from source; return pytest's status and its last line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    files = [str(p.relative_to(ROOT)) for p in cuda_test_files()]
    # pyproject's addopts turn the cache off; -rs lists why any test was skipped.
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-rs", *files]
    print("gpu-check:", " ".join(cmd[2:]), flush=True)
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {TESTS_TIMEOUT_S} s"
    print(done.stdout + done.stderr, flush=True)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, lines[-1].strip("= ") if lines else "no output"


# --------------------------------------------------------- peak and timing


def peak_bytes(step: Callable[[], object], device: torch.device) -> int:
    """Peak bytes ``step`` allocates on ``device`` above what was live before it.

    CUDA: the caching allocator's high-water mark, reset just before the step
    (what the allocator handed out, rounded to its 512-byte blocks). CPU:
    `forget.measure`'s exact ledger of tensor storages.
    """
    if device.type != "cuda":
        return forget.measure(step).peak_bytes
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def time_steps(
    steps: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    prepare: Callable[[str], object],
    event: Callable[[], Any] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each step, round by round, in `time_calls`' interleaved shuffled rounds.

    With ``event`` (``torch.cuda.Event(enable_timing=True)`` on a GPU) each
    step is timed between two recorded events, synchronised after the second:
    the device's time from the step's first launch to its last kernel's end,
    which the host's clock would miss (launches return before kernels end).
    Without, the wall clock of `time_calls`.
    """
    if event is None:
        return time_calls(steps, rounds, prepare=prepare)
    seconds: dict[str, list[float]] = {key: [] for key in steps}

    def timed(key: str) -> None:
        start, end = event(), event()
        start.record()
        steps[key]()
        end.record()
        end.synchronize()
        seconds[key].append(start.elapsed_time(end) / 1e3)  # elapsed_time is in ms

    time_calls({key: functools.partial(timed, key) for key in steps}, rounds, prepare=prepare)
    return {key: ts[1:] for key, ts in seconds.items()}  # time_calls' warm-up round first


def _events(device: torch.device) -> Callable[[], Any] | None:
    if device.type != "cuda":
        return None
    return functools.partial(torch.cuda.Event, enable_timing=True)


# ---------------------------------------------------------------- the rows


@dataclass(frozen=True)
class Row:
    """One variant of one workload on the device."""

    workload: str
    variant: str
    peak_bytes: int
    step_s: float
    grads: str  # "=plain", "differ", "nondet" (plain is not repeatable), "" for plain
    extra_us_per_op: float | None = None  # the launch-bound chain only


def bench_model(
    name: str, size: str, repeats: int, device: torch.device, batch_scale: int = 1, seed: int = 0
) -> list[Row]:
    """One reference model's rows, its variants run as ``forget bench`` runs them."""
    batch_size = model_settings(name, size)["batch_size"] * batch_scale
    pristine = build_model(name, size, seed=seed, batch_size=batch_size).to(device).train()
    x, target = pristine.example_input(generator=torch.Generator().manual_seed(seed))
    x, target = x.to(device), target.to(device)
    models = {v: copy.deepcopy(pristine) for v in VARIANTS}

    def prepare(variant: str) -> None:
        models[variant].zero_grad(set_to_none=True)
        torch.manual_seed(seed)  # the same dropout masks in every variant, on every device

    def step(variant: str) -> None:
        models[variant].step(x, target, _common.BLOCK_WRAPPERS[variant])

    def grads(variant: str) -> dict[str, torch.Tensor | None]:
        prepare(variant)
        step(variant)
        return {
            n: None if p.grad is None else p.grad.clone()
            for n, p in models[variant].named_parameters()
        }

    checks = _grad_checks({v: functools.partial(grads, v) for v in VARIANTS})
    peaks = {
        v: peak_bytes(functools.partial(_prepared, prepare, step, v), device) for v in VARIANTS
    }
    steps = {v: functools.partial(step, v) for v in VARIANTS}
    times = time_steps(steps, repeats, prepare=prepare, event=_events(device))
    return [Row(name, v, peaks[v], statistics.median(times[v]), checks[v]) for v in VARIANTS]


def bench_launch(size: str, repeats: int, device: torch.device, seed: int = 0) -> list[Row]:
    """The launch-bound chain's rows: one region over ``OPS[size]`` tiny elementwise ops."""
    ops = _bench_launch.OPS[size]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(_bench_launch.NUMEL, generator=g).to(device).requires_grad_()

    def prepare(_: str) -> None:
        x.grad = None

    def step(variant: str) -> None:
        _bench_launch.RUNNERS[variant](ops, x).sum().backward()

    def grads(variant: str) -> dict[str, torch.Tensor | None]:
        prepare(variant)
        step(variant)
        return {"x": None if x.grad is None else x.grad.clone()}

    checks = _grad_checks({v: functools.partial(grads, v) for v in VARIANTS})
    peaks = {
        v: peak_bytes(functools.partial(_prepared, prepare, step, v), device) for v in VARIANTS
    }
    rounds = _bench_launch.ROUNDS_PER_REPEAT * repeats
    steps = {v: functools.partial(step, v) for v in VARIANTS}
    times = time_steps(steps, rounds, prepare=prepare, event=_events(device))
    workload = f"chain({ops} ops)"
    return [
        Row(
            workload,
            v,
            peaks[v],
            statistics.median(times[v]),
            checks[v],
            None if v == "plain" else _bench_launch.paired_us_per_op(times[v], times["plain"], ops),
        )
        for v in VARIANTS
    ]


def _prepared(
    prepare: Callable[[str], object], step: Callable[[str], object], variant: str
) -> None:
    """One step of ``variant`` after its preparation (as the timed steps run)."""
    prepare(variant)
    step(variant)


def _grad_checks(
    grads: Mapping[str, Callable[[], dict[str, torch.Tensor | None]]],
) -> dict[str, str]:
    """Per variant: its gradients against plain's, bit for bit (plain itself run twice)."""
    plain, again = grads["plain"](), grads["plain"]()
    repeatable = not _bench._same(plain, again)
    checks = {"plain": "" if repeatable else "nondet"}
    for v in VARIANTS[1:]:
        same = not _bench._same(plain, grads[v]())
        checks[v] = "=plain" if same else "differ" if repeatable else "nondet"
    return checks


# ------------------------------------------------- a step that does not fit


class _Tree(torch.nn.Module):
    """A module tree (no chain): a stem, residual MLP blocks and a head."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(width, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(width),
                torch.nn.Linear(width, 4 * width),
                torch.nn.GELU(),
                torch.nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@dataclass
class Fitted:
    """How `plan_within_fraction` went: bytes of each call, against the budget."""

    device: str
    plain_peak_bytes: int
    budget_bytes: int
    plain_failed: bool | None  # the plain step under the fraction (None: not tried, CPU)
    planning_peak_bytes: int
    step_peak_bytes: int
    regions: int
    error: str = ""

    @property
    def ok(self) -> bool:
        within = self.planning_peak_bytes <= self.budget_bytes * 1.05
        return not self.error and within and self.step_peak_bytes <= self.budget_bytes

    def line(self) -> str:
        if self.error:
            return f"plan within a memory fraction ({self.device}): FAILED: {self.error}"
        plain = {None: "not tried", True: "out of memory", False: "FITS (the check is void)"}
        return (
            f"plan within a memory fraction ({self.device}): plain step peak "
            f"{self.plain_peak_bytes:,} B, budget {self.budget_bytes:,} B (60 %); plain step "
            f"under it: {plain[self.plain_failed]}; planning peak {self.planning_peak_bytes:,} B "
            f"({self.planning_peak_bytes / self.budget_bytes:.3f} of the budget); planned step "
            f"peak {self.step_peak_bytes:,} B ({self.step_peak_bytes / self.budget_bytes:.3f}), "
            f"{self.regions} regions: {'ok' if self.ok else 'FAILED'}"
        )


def plan_within_fraction(
    device: torch.device, width: int = 1024, depth: int = 8, rows: int = 4096, share: float = 0.6
) -> Fitted:
    """Plan a step under a memory bound that its plain step passes (issue 30's GPU case).

    CUDA: the process's memory fraction is set so that what is allocated now
    plus ``share`` of the plain peak is all the caching allocator may hold; the
    plain step must fail under it, ``forget.plan`` must not, and its planned
    step trains within it. CPU (the tests): no fraction; the peaks are the
    ledger's.
    """
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = _Tree(width, depth).to(device)
    x = torch.randn(rows, width, device=device)

    def step() -> None:
        model(x).square().mean().backward()

    model.zero_grad(set_to_none=True)
    plain = peak_bytes(step, device) if cuda else forget.measure(step, probe="profiler").peak_bytes
    model.zero_grad(set_to_none=True)
    budget = int(share * plain)
    plain_failed: bool | None = None
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = float(getter(device)) if cuda and getter is not None else 1.0
    try:
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            fraction = (torch.cuda.memory_allocated(device) + budget) / total
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            try:
                step()
                plain_failed = False
            except torch.cuda.OutOfMemoryError:
                plain_failed = True
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        planned: list[Any] = []

        def planning() -> None:
            planned.append(
                forget.plan(model, x, budget=budget, loss_fn=lambda y: y.square().mean())
            )

        planning_peak = peak_bytes(planning, device)
        if not cuda:
            # The CPU's peak_bytes is the ledger, a dispatch mode, under which regions take
            # the exact path only; the plan stepped here is made as a user makes it.
            planned.clear()
            planning()
        plan = planned[0]
        plan.apply(model)
        model.zero_grad(set_to_none=True)
        # The budget is the allocator's: on the CPU its own events, as the planner reads.
        step_peak = (
            peak_bytes(step, device) if cuda else forget.measure(step, probe="profiler").peak_bytes
        )
        plan.remove(model)
        return Fitted(
            str(device), plain, budget, plain_failed, planning_peak, step_peak, len(plan.choices)
        )
    except Exception as exc:  # report it in the summary, as a failure
        return Fitted(
            str(device), plain, budget, plain_failed, 0, 0, 0, f"{type(exc).__name__}: {exc}"
        )
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(before, device)


# ---------------------------------------------------------------- the table


def summary(
    rows: Sequence[Row],
    tests: tuple[int, str] | None,
    args: argparse.Namespace,
    device: torch.device,
    total_s: float,
) -> str:
    """The one table the check ends with, under what ran it and how the tests went."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"gpu-check summary: {name}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"forget {forget.__version__}; {args.size} sizes, batch x{args.batch_scale}, "
        f"median of {args.repeats} rounds ({_bench_launch.ROUNDS_PER_REPEAT * args.repeats} "
        f"for the chain), {'CUDA events' if device.type == 'cuda' else 'wall clock'}",
        "cuda tests: "
        + ("skipped (--skip-tests)" if tests is None else f"{tests[1]} (pytest status {tests[0]})"),
        format_rows(rows),
        "peak: bytes allocated above those live before the step; ratios: variant / plain, "
        "time/torch: forget / torch_checkpoint; +us/op: median paired extra time per op "
        f"over plain. Total {total_s:.0f} s.",
    ]
    return "\n".join(lines)


def format_rows(rows: Sequence[Row]) -> str:
    """Rows as a fixed-width table; ratios are each variant's over its workload's plain."""
    header = (
        *("workload", "variant", "peak MiB", "peak/plain", "step ms", "time/plain"),
        *("time/torch", "+us/op", "grads"),
    )
    base = {r.workload: r for r in rows if r.variant == "plain"}
    torch_ = {r.workload: r for r in rows if r.variant == "torch_checkpoint"}
    cells = []
    for r in rows:
        plain, theirs = base[r.workload], torch_[r.workload]
        cells.append(
            (
                r.workload if r.variant == "plain" else "",
                r.variant,
                mib(r.peak_bytes),
                _bench._ratio(r.peak_bytes, plain.peak_bytes),
                f"{r.step_s * 1e3:.3f}",
                _bench._ratio(r.step_s, plain.step_s),
                _bench._ratio(r.step_s, theirs.step_s) if r.variant == "forget" else "",
                "" if r.extra_us_per_op is None else f"{r.extra_us_per_op:+.2f}",
                r.grads,
            )
        )
    widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=True)]

    def line(row: Sequence[str]) -> str:
        first = [f"{c:<{w}}" for c, w in zip(row[:2], widths[:2], strict=True)]
        rest = [f"{c:>{w}}" for c, w in zip(row[2:], widths[2:], strict=True)]
        return "  ".join(first + rest).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(c) for c in cells])


if __name__ == "__main__":
    raise SystemExit(main())
