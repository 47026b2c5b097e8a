"""benchmarks/gpu_check.py (``./dev gpu-check``) on a machine without a GPU.

The no-device exit, and the CPU path of the functions the check measures with
(on a GPU they read the allocator and CUDA events instead). No test asserts a
timing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import forget
from forget._cli import _bench_launch

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
VARIANTS = ["plain", "torch_checkpoint", "forget"]


@pytest.fixture(scope="module")
def gpu_check():
    path = ROOT / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up while it runs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["gpu_check"]


def test_dev_gpu_check_without_cuda_exits_2_at_once():
    # Through ./dev, as on the GPU machine; CUDA hidden in case this machine has one.
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [str(ROOT / "dev"), "gpu-check"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("gpu-check: no CUDA device: torch ")
    assert done.stderr.rstrip().endswith("run `./dev gpu-check` on a machine with an NVIDIA GPU.")


def test_no_cuda_runs_nothing(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_cuda_tests", None)  # must not be reached
    assert gpu_check.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_cuda_test_files_are_those_that_mark_cuda_tests(gpu_check):
    names = [p.name for p in gpu_check.cuda_test_files()]
    assert {"test_cuda.py", "test_measure.py", "test_policies.py"} <= set(names)
    assert "test_bench.py" not in names


def test_peak_on_cpu_is_the_ledgers(gpu_check):
    def step():
        a = torch.ones(1024)  # 4 KiB
        b = a * 2  # 4 KiB more, both alive
        return b.sum()

    assert gpu_check.peak_bytes(step, CPU) == forget.measure(step).peak_bytes >= 8192


class _WallEvent:
    """A stand-in for ``torch.cuda.Event(enable_timing=True)``: fixed milliseconds."""

    recorded = 0

    def record(self):
        _WallEvent.recorded += 1
        self.at = _WallEvent.recorded

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 1000.0 * (end.at - self.at)  # ms: 1 s per record in between


def test_event_timing_drops_the_warm_up_round(gpu_check):
    runs = {"a": 0, "b": 0}
    prepared = []

    def call(key):
        runs[key] += 1

    steps = {key: (lambda key=key: call(key)) for key in runs}
    times = gpu_check.time_steps(steps, 3, prepare=prepared.append, event=_WallEvent)
    assert runs == {"a": 4, "b": 4}  # the warm-up round, then three
    assert sorted(prepared) == ["a"] * 4 + ["b"] * 4
    assert times == {"a": [1.0, 1.0, 1.0], "b": [1.0, 1.0, 1.0]}


def test_wall_timing_without_events(gpu_check):
    times = gpu_check.time_steps({"a": lambda: None}, 2, prepare=lambda _: None)
    assert list(times) == ["a"] and len(times["a"]) == 2


def test_model_rows_on_cpu(gpu_check):
    rows = gpu_check.bench_model("residual_mlp", "tiny", 1, CPU)
    assert [(r.workload, r.variant, r.grads) for r in rows] == [
        ("residual_mlp", "plain", ""),
        ("residual_mlp", "torch_checkpoint", "=plain"),
        ("residual_mlp", "forget", "=plain"),
    ]
    peak = {r.variant: r.peak_bytes for r in rows}
    assert peak["forget"] == peak["torch_checkpoint"] < peak["plain"]


def test_launch_rows_on_cpu(gpu_check):
    rows = gpu_check.bench_launch("tiny", 1, CPU)
    ops = _bench_launch.OPS["tiny"]
    assert [(r.workload, r.variant, r.grads) for r in rows] == [
        (f"chain({ops} ops)", "plain", ""),
        (f"chain({ops} ops)", "torch_checkpoint", "=plain"),
        (f"chain({ops} ops)", "forget", "=plain"),
    ]
    assert rows[0].extra_us_per_op is None
    assert all(isinstance(r.extra_us_per_op, float) for r in rows[1:])


@pytest.mark.usefixtures("fixed_clock")  # bytes matter here, not times
def test_plan_within_fraction_on_cpu_plans_within_the_budget(gpu_check):
    fitted = gpu_check.plan_within_fraction(CPU, width=64, depth=6, rows=256)
    assert fitted.error == "" and fitted.plain_failed is None  # no fraction on the CPU
    assert fitted.budget_bytes == int(0.6 * fitted.plain_peak_bytes)
    assert fitted.step_peak_bytes <= fitted.budget_bytes and fitted.regions > 0
    assert fitted.planning_peak_bytes <= fitted.budget_bytes * 1.05
    assert fitted.ok and fitted.line().endswith(": ok")


@pytest.mark.usefixtures("fixed_clock")
def test_a_gradient_that_differs_from_a_repeatable_plain_fails(gpu_check, monkeypatch, capsys):
    monkeypatch.setitem(_bench_launch.RUNNERS, "forget", lambda ops, x: 2 * x)
    argv = ["--device", "cpu", "--size", "tiny", "--repeats", "1", "--skip-tests"]
    assert gpu_check.main([*argv, "--models", "residual_mlp"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[-3].split()[-1] == "differ"
    assert out.splitlines()[-1].startswith("plan within a memory fraction (cpu): plain step")


def test_nondeterministic_plain_is_not_a_failure(gpu_check):
    draws = iter(range(100))

    def grads():
        return {"g": torch.tensor(float(next(draws)))}

    checks = gpu_check._grad_checks({v: grads for v in VARIANTS})
    assert checks == {"plain": "nondet", "torch_checkpoint": "nondet", "forget": "nondet"}


def test_summary_table_is_exact(gpu_check):
    Row = gpu_check.Row
    mib = 2**20
    rows = [
        Row("residual_mlp", "plain", 8 * mib, 0.004, ""),
        Row("residual_mlp", "torch_checkpoint", 2 * mib, 0.006, "=plain"),
        Row("residual_mlp", "forget", 2 * mib, 0.009, "=plain"),
        Row("chain(300 ops)", "plain", 1024, 0.003, ""),
        Row("chain(300 ops)", "torch_checkpoint", 1024, 0.006, "nondet", 10.0),
        Row("chain(300 ops)", "forget", 1024, 0.009, "=plain", 20.0),
    ]
    assert gpu_check.format_rows(rows).splitlines() == [
        "workload        variant           peak MiB  peak/plain  step ms  time/plain  "
        "time/torch  +us/op   grads",
        "--------------  ----------------  --------  ----------  -------  ----------  "
        "----------  ------  ------",
        "residual_mlp    plain                8.000       1.00x    4.000       1.00x",
        "                torch_checkpoint     2.000       0.25x    6.000       1.50x"
        "                      =plain",
        "                forget               2.000       0.25x    9.000       2.25x"
        "       1.50x          =plain",
        "chain(300 ops)  plain                0.001       1.00x    3.000       1.00x",
        "                torch_checkpoint     0.001       1.00x    6.000       2.00x"
        "              +10.00  nondet",
        "                forget               0.001       1.00x    9.000       3.00x"
        "       1.50x  +20.00  =plain",
    ]
