"""``forget bench``: JSON schema, plot, errors, and the built-in correctness check.

Smoke tests at tiny sizes; no test asserts a timing.
"""

from __future__ import annotations

import gc
import json
import re
import sys

import pytest
import torch
import torch.utils.checkpoint

import forget
from forget import _cli as cli
from forget._cli import _bench, _bench_launch, _common
from forget._cli._models import MODEL_NAMES, build_model

VARIANTS = ["plain", "torch_checkpoint", "forget"]
TINY = ["--size", "tiny", "--repeats", "1", "--quiet"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "out.json"
    status = _bench.main([*TINY, "--json", str(path)])
    return status, json.loads(path.read_text())


def test_json_schema_is_exact(tiny_run):
    status, data = tiny_run
    assert status == 0
    assert set(data) == {"models", "meta", "launch_bound", "selective"}
    assert list(data["models"]) == list(MODEL_NAMES)
    for name, per in data["models"].items():
        assert list(per) == VARIANTS, name
        for variant, row in per.items():
            assert set(row) == {"peak_bytes", "saved_bytes", "step_s"}, (name, variant)
            assert type(row["peak_bytes"]) is int
            assert type(row["saved_bytes"]) is int
            assert type(row["step_s"]) is float
            assert row["peak_bytes"] >= row["saved_bytes"] >= 0


def test_step_time_is_the_median_of_the_interleaved_rounds(monkeypatch, capsys):
    # The bench times through forget._planning.time_calls: every variant once per
    # round, --repeats rounds; step_s is each variant's median and the ratios are
    # variant / plain (and forget / torch_checkpoint), as the note says.
    rounds = {"plain": [3.0, 1.0, 2.0], "torch_checkpoint": [2.0, 6.0, 4.0]}
    rounds["forget"] = [9.0, 3.0, 3.0]
    seen = []

    def fake_time_calls(calls, repeats, *, prepare):
        seen.append((list(calls), repeats))
        for key, call in calls.items():  # each call still runs: a real step
            prepare(key)
            call()
        return {key: rounds[key] for key in calls}

    monkeypatch.setattr(_bench, "time_calls", fake_time_calls)
    argv = ["--size", "tiny", "--repeats", "3", "--models", "mlp", "--no-selective", "--no-launch"]
    assert _bench.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert seen == [(VARIANTS, 3)]
    plain, torch_, forget_ = (line.split() for line in out[3:6])
    assert plain[:2] == ["residual_mlp", "plain"]
    assert (plain[4], plain[7]) == ("2000.0", "1.00x")
    assert (torch_[0], torch_[3], torch_[6]) == ("torch_checkpoint", "4000.0", "2.00x")
    assert (forget_[0], forget_[3], forget_[6], forget_[8]) == (
        "forget",
        "3000.0",
        "1.50x",
        "0.75x",
    )
    assert out[6] == (
        "bytes: exact tensor storages allocated by the step (forget.measure); ratios are "
        "variant / plain (or / torch_checkpoint), so below 1 is less memory or time; "
        "buffers: module buffers after the run vs plain."
    )


def test_launch_bound_row_in_the_json(tiny_run):
    _, data = tiny_run
    row = data["launch_bound"]
    assert set(row) == {
        *("ops", "numel", "rounds", "step_s", "plain_us_per_op", "extra_us_per_op"),
        *("forget_over_torch_us_per_op", "grads_equal_to_plain"),
    }
    assert (row["ops"], row["numel"], row["rounds"]) == (_bench_launch.OPS["tiny"], 64, 5)
    assert list(row["step_s"]) == VARIANTS
    assert list(row["extra_us_per_op"]) == VARIANTS[1:]
    assert row["grads_equal_to_plain"] == {"torch_checkpoint": True, "forget": True}


def test_launch_bound_row_is_paired_microseconds_per_op(monkeypatch, capsys, tmp_path):
    # --repeats 1: five rounds; each checkpoint's extra time is the median of its
    # per-round difference to plain (or to torch's), over the chain's 300 ops.
    plain = [3000e-6, 3300e-6, 2700e-6, 6000e-6, 3000e-6]
    rounds = {
        "plain": plain,
        "torch_checkpoint": [
            t + d for t, d in zip(plain, [3e-3, 3e-3, 3e-3, 9e-3, 0.0], strict=True)
        ],
        "forget": [t + 6e-3 for t in plain],
    }
    seen = []

    def fake_time_calls(calls, repeats, *, prepare):
        seen.append((list(calls), repeats))
        return {key: rounds[key] for key in calls}

    def no_model_timing(calls, repeats, *, prepare):
        return {key: [1.0] for key in calls}

    monkeypatch.setattr(_bench_launch, "time_calls", fake_time_calls)
    monkeypatch.setattr(_bench, "time_calls", no_model_timing)
    path = tmp_path / "out.json"
    argv = ["--quick", "--repeats", "1", "--models", "mlp", "--no-selective", "--json", str(path)]
    assert _bench.main(argv) == 0
    row = json.loads(path.read_text())["launch_bound"]
    assert seen == [(VARIANTS, 5)]
    out = capsys.readouterr().out.splitlines()
    start = out.index(
        "launch-bound chain: 300 elementwise ops on 64 floats, one region over the chain; "
        "step = forward + backward, median of 5 rounds"
    )
    assert out[start + 1].split() == [
        *("variant", "step", "ms", "us/op", "+us/op", "vs", "plain"),
        *("+us/op", "vs", "torch", "grads"),
    ]
    cells = [line.split() for line in out[start + 3 : start + 6]]
    assert cells[0] == ["plain", "3.00", "10.00"]
    assert cells[1] == ["torch_checkpoint", "6.00", "20.00", "+10.00", "=plain"]
    assert cells[2] == ["forget", "9.00", "30.00", "+20.00", "+10.00", "=plain"]
    assert row["plain_us_per_op"] == pytest.approx(10.0)
    assert row["extra_us_per_op"] == pytest.approx({"torch_checkpoint": 10.0, "forget": 20.0})
    assert row["forget_over_torch_us_per_op"] == pytest.approx(10.0)


@pytest.mark.parametrize("variant", ["torch_checkpoint", "forget"])
def test_launch_bound_gradient_mismatch_is_reported(variant, monkeypatch, capsys):
    def wrong(ops, x):
        return _bench_launch.chain(x, ops) * 2.0

    monkeypatch.setitem(_bench_launch.RUNNERS, variant, wrong)
    assert _bench.main([*TINY, "--models", "mlp", "--no-selective"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err
    assert f"launch_bound: {variant} gradients differ from plain" in err


def test_launch_bound_checkpoints_rerun_the_chain_once():
    # What the row's extra time pays for: both checkpoints keep x and run the chain
    # again in backward (four ops: the last sin saves a tensor made in the region).
    calls = []

    def counted(h, ops):
        calls.append(ops)
        return _bench_launch.chain(h, ops)

    x = torch.randn(4, requires_grad=True)
    for run in (
        lambda: torch.utils.checkpoint.checkpoint(counted, x, 4, use_reentrant=False),
        lambda: forget.checkpoint(counted, x, 4),
    ):
        calls.clear()
        run().sum().backward()
        assert calls == [4, 4]


def test_selective_rows_on_the_gpt_blocks(tiny_run):
    _, data = tiny_run
    rows = data["selective"]
    assert list(rows) == ["plain", "forget_all", "selective", "selective_masks", "offload"]
    assert all(row["loss_equal_to_plain"] for row in rows.values())
    saved = {v: row["saved_bytes"] for v, row in rows.items()}
    # Keeping matmul and attention outputs sits between keeping all and keeping none;
    # on CPU offload is a no-op and keeps what selective keeps.
    assert saved["forget_all"] < saved["selective"] < saved["plain"]
    assert saved["offload"] == saved["selective"]
    # Keeping the dropout masks costs exactly their bits (NOTE [kept draws]): per
    # block the attention's B x H x T x T mask and two residual B x T x C masks.
    gpt = build_model("tiny_gpt", "tiny")
    b, t, c = gpt.batch_size, gpt.context, gpt.blocks[0].ln1.normalized_shape[0]
    h = gpt.blocks[0].attn.heads
    per_block = -(-b * h * t * t // 8) + 2 * -(-b * t * c // 8)
    assert saved["selective_masks"] - saved["selective"] == len(gpt.blocks) * per_block


def test_checkpointed_variants_peak_no_higher_than_plain(tiny_run):
    _, data = tiny_run
    for name, per in data["models"].items():
        plain = per["plain"]
        assert plain["saved_bytes"] > 0, name
        for variant in ("torch_checkpoint", "forget"):
            assert per[variant]["peak_bytes"] <= plain["peak_bytes"], (name, variant)
            assert per[variant]["saved_bytes"] < plain["saved_bytes"], (name, variant)


def test_forget_peaks_no_higher_than_torch_checkpoint(tiny_run):
    # Issue 3's promise, to the byte, on every reference model (small_cnn's BatchNorm
    # counters included: NOTE [write-only state]).
    _, data = tiny_run
    for name, per in data["models"].items():
        ours, theirs = per["forget"], per["torch_checkpoint"]
        assert ours["peak_bytes"] <= theirs["peak_bytes"], name
        assert ours["saved_bytes"] <= theirs["saved_bytes"], name


def test_meta_records_the_run_and_buffer_check(tiny_run):
    _, data = tiny_run
    meta = data["meta"]
    assert meta["size"] == "tiny"
    assert meta["repeats"] == 1
    assert isinstance(meta["threads"], int)
    buffers = meta["buffers_match_plain"]
    assert all(buffers[name]["forget"] for name in MODEL_NAMES)
    # torch.utils.checkpoint updates BatchNorm statistics twice per step.
    assert buffers["small_cnn"]["torch_checkpoint"] is False


def test_quick_run_of_one_model_prints_a_table(tmp_path, capsys):
    path = tmp_path / "quick.json"
    status = _bench.main(["--quick", "--models", "mlp", "--repeats", "1", "--json", str(path)])
    assert status == 0
    out = capsys.readouterr().out
    assert "quick sizes" in out
    header = out.splitlines()[1].split()
    assert header[:4] == ["model", "variant", "peak", "MiB"]
    for variant in VARIANTS:
        assert variant in out
    assert list(json.loads(path.read_text())["models"]) == ["residual_mlp"]


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "bench.png"
    assert _bench.main([*TINY, "--models", "residual_mlp,small_cnn", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_exits_2_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    monkeypatch.setattr(_bench, "run", None)  # must not be reached
    assert _bench.main([*TINY, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "forget: --plot needs matplotlib; install it with pip install matplotlib (the [plot] extra)"
    )
    assert not (tmp_path / "x.png").exists()


def test_unknown_model_is_a_clear_error(capsys):
    assert _bench.main([*TINY, "--models", "residual_mlp,resnet"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'resnet'" in err
    assert "residual_mlp, small_cnn, tiny_gpt" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--quick", "--size", "default"], "--quick contradicts --size default"),
    ],
    ids=["repeats", "quick-vs-size"],
)
def test_bad_flags_exit_2(argv, message, capsys):
    assert _bench.main(argv) == 2
    assert message in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert _bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--quick", "--json", "--plot", "--repeats", "--quiet", "--models"):
        assert flag in out


def test_mismatch_is_reported_loudly(monkeypatch, capsys):
    def wrong(block, h):
        return block(h) * 2.0

    monkeypatch.setitem(_common.BLOCK_WRAPPERS, "forget", wrong)
    assert _bench.main([*TINY, "--models", "residual_mlp"]) == 1
    err = capsys.readouterr().err
    assert "MISMATCH" in err
    assert "residual_mlp: forget loss" in err


def test_runs_without_tqdm_and_says_once_how_to_get_bars(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a bar is for a terminal
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(_common, "_noted_no_tqdm", False)
    for _ in range(2):
        assert _bench.main(["--size", "tiny", "--repeats", "1", "--models", "gpt"]) == 0
    out, err = capsys.readouterr()
    assert "tiny_gpt" in out
    assert err.count("pip install tqdm (the [cli] extra)") == 1


def test_quiet_without_tqdm_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(_common, "_noted_no_tqdm", False)
    assert _bench.main(["--size", "tiny", "--repeats", "1", "--models", "gpt", "--quiet"]) == 0
    assert "[cli] extra" not in capsys.readouterr().err


def test_cli_routes_bench(capsys):
    assert cli.main(["bench", *TINY, "--models", "cnn"]) == 0
    assert "small_cnn" in capsys.readouterr().out


def test_selective_rows_at_another_shape(capsys):
    # python -m forget._cli._bench_selective --width ...: the rows for a shape of one's own.
    from forget._cli import _bench_selective

    assert _bench_selective.main(["--size", "tiny", "--repeats", "1", "--width", "32"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split() == [
        *("variant", "peak", "MiB", "saved", "MiB", "step", "ms"),
        *("peak/plain", "saved/plain", "time/plain"),  # variant / plain, as the main table
    ]
    assert [line.split()[0] for line in out.splitlines()[2:7]] == list(_bench_selective.VARIANTS)


def test_selective_default_shape_keeps_attention_tensors_on_the_heap():
    # At 32 MiB a T x T tensor is past glibc's heap ceiling: each allocation is a fresh
    # mapping whose page faults slow plain the most (the shape's comment in the module).
    from forget._cli import _bench_selective
    from forget._cli._models import model_settings

    shape = {**model_settings("tiny_gpt", "default"), **_bench_selective.OVERRIDES["default"]}
    scores = shape["batch_size"] * shape["heads"] * shape["context"] ** 2 * 4
    assert scores == 16 * 2**20
    assert shape["width"] // shape["heads"] == 64


def _instructions_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "instructions.py"
    spec = importlib.util.spec_from_file_location("instructions", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_instruction_counter_usage_errors(monkeypatch, capsys):
    script = _instructions_script()
    monkeypatch.setattr(sys, "argv", ["instructions.py", "--variants", "plain,bogus"])
    with pytest.raises(SystemExit) as exc:
        script.main()
    assert exc.value.code == 2
    assert "unknown variants ['bogus']" in capsys.readouterr().err
    monkeypatch.setattr(script.shutil, "which", lambda tool: None)
    monkeypatch.setattr(sys, "argv", ["instructions.py", "--variants", "plain"])
    with pytest.raises(SystemExit):
        script.main()
    assert "valgrind is not installed" in capsys.readouterr().err


def test_instruction_counter_step_runs_each_variant(monkeypatch):
    # Outside valgrind, callgrind_control has no process to switch: stand in for it.
    script = _instructions_script()
    calls = []
    monkeypatch.setattr(script.subprocess, "run", lambda cmd, **kw: calls.append(cmd[2]))
    threads = torch.get_num_threads()
    try:
        for variant in script.VARIANTS:
            script._step("residual_mlp", "tiny", variant)
    finally:
        torch.set_num_threads(threads)  # _step runs one thread, as under valgrind
    assert calls == ["on", "off"] * len(script.VARIANTS)
    assert gc.isenabled()  # the counted step turns collection off only while it runs


def _fake_rounds(calls, repeats, **_):
    # Every step still runs once (a real step); each (variant, shape) gets rounds whose
    # per-round ratio to plain at its shape is 1.5, 2.0 and 4.0: median 2.0.
    for call in calls.values():
        call()
    return {key: [3.0, 4.0, 8.0] if key[0] != "plain" else [2.0, 2.0, 2.0] for key in calls}


class _CheckpointEveryBlock:
    """Stands in for forget.plan (minutes of measured steps; the planner has its own
    tests): what it was asked, and a plan that checkpoints every block."""

    def __init__(self):
        self.asked = []

    def __call__(self, model, x, *, budget, loss_fn):
        self.asked.append((tuple(x.shape), budget))
        return self

    def apply(self, model):
        from forget._planning._tree.apply import wrap_all

        wrap_all(model, {f"blocks.{i}": "forget" for i in range(len(model.blocks))}, {})


def test_cap_rows_run_varying_shapes_beside_a_plan_and_checkpointing(monkeypatch):
    from forget._cli import _bench_cap

    plan = _CheckpointEveryBlock()
    monkeypatch.setattr(_bench_cap, "time_calls", _fake_rounds)
    monkeypatch.setattr(forget, "plan", plan)
    result = _bench_cap.run("residual_mlp", share=0.9, size="tiny", repeats=1)
    data = json.loads(json.dumps(result.as_json()))
    model = build_model("residual_mlp", "tiny").train()
    x, target = model.example_input(generator=torch.Generator().manual_seed(0))
    plain = forget.measure(model.step, x, target).peak_bytes
    assert (data["share"], data["plain_peak_bytes"]) == (0.9, plain)
    assert data["budget_bytes"] == int(0.9 * plain)
    assert plan.asked == [((64, x.shape[1]), data["budget_bytes"])]  # at the largest shape
    assert data["largest"] == "batch 64"
    rows = data["rows"]
    assert [(r["variant"], r["shape"]) for r in rows] == [
        *(("cap", f"batch {n}") for n in (32, 64, 16, 48)),
        *((v, "batch 64") for v in ("plan", "torch_checkpoint", "forget")),
    ]
    capped = rows[:4]
    assert all(r["peak_bytes"] <= data["budget_bytes"] for r in capped)
    assert all(r["grads_equal_to_plain"] for r in capped)
    assert sum(r["evicted"] for r in capped) > 0  # the cap did evict
    assert rows[4]["peak_bytes"] == rows[6]["peak_bytes"]  # the plan's step was measured
    assert all(r["time_vs_plain"] == 2.0 and r["step_s"] == 4.0 for r in rows)
    assert not any("note" in r for r in rows)  # a note only where a step did not run
    out = _bench_cap.format_rows(result).splitlines()
    start = 0
    assert out[0].startswith("forget.cap on residual_mlp, shapes varying step to step")
    assert out[start + 1].split() == [
        *("variant", "shape", "peak", "MiB", "peak/cap", "evicted", "step", "ms", "time/plain")
    ]
    cells = out[start + 3].split()
    assert cells[:3] == ["cap", "batch", "32"]
    share = f"{capped[0]['peak_bytes'] / data['budget_bytes']:.2f}"
    evicted = f"{capped[0]['evicted']}/{capped[0]['regions']}"
    assert cells[4:] == [share, evicted, "4000.0", "2.00x"]


def test_cap_rows_report_a_capped_step_unlike_plain_and_a_plan_that_cannot_fit(
    monkeypatch, tmp_path, capsys
):
    from forget._cli import _bench_cap

    def no_plan(*args, budget, **kwargs):
        message = f"forget: the budget {budget:,} B is below it; no"
        raise forget.BudgetInfeasibleError(message, budget_bytes=budget, min_feasible_bytes=10**9)

    cap = forget.cap

    def wrong_cap(model, budget):  # a cap that changed what the step computes
        model.blocks[0].register_forward_hook(lambda module, args, out: out * 2.0)
        return cap(model, budget)

    monkeypatch.setattr(_bench_cap, "time_calls", _fake_rounds)
    monkeypatch.setattr(forget, "plan", no_plan)
    monkeypatch.setattr(forget, "cap", wrong_cap)
    path = tmp_path / "cap.json"
    argv = [*TINY, "--models", "mlp", "--no-launch", "--cap", "0.9", "--json", str(path)]
    assert _bench.main(argv) == 1
    rows = json.loads(path.read_text())["cap"]["residual_mlp"]["rows"]
    assert [set(r) for r in rows if r["variant"] == "plan"] == [
        {"variant", "shape", "note"}  # a note in place of the figures: it did not run
    ]
    out, err = capsys.readouterr()
    assert "MISMATCH" in err
    assert "cap: residual_mlp at batch 32: loss or gradients differ from plain" in err
    assert re.search(r"^plan +batch 64 +\(the budget [\d,]+ B is below it\)$", out, re.M)


@pytest.mark.parametrize("share", ["150%", "0", "half"], ids=["above-plain", "zero", "no-share"])
def test_cap_share_is_checked_before_anything_runs(share, monkeypatch, capsys):
    monkeypatch.setattr(_bench, "run", None)  # must not be reached
    assert _bench.main([*TINY, "--cap", share]) == 2
    assert capsys.readouterr().err.startswith(
        f"forget: --cap takes a share of the plain step's peak, such as 50% or 0.5, got {share!r}"
    )
