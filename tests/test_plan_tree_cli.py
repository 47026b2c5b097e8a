"""``forget plan module:factory``: a user's model planned over its module tree, from the CLI."""

from __future__ import annotations

import io
import json
import sys
import textwrap
import warnings

import pytest

import forget
from forget._cli import main as cli_main

PNG = b"\x89PNG\r\n\x1a\n"

# A nested encoder of torch.nn modules: embed, encoder (layers, norm), head.
ENCODER = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.norm = nn.LayerNorm(width)
            hidden = 2 * width
            self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))

        def forward(self, x):
            return x + self.mlp(self.norm(x))


    class Encoder(nn.Module):
        def __init__(self, width, depth):
            super().__init__()
            self.layers = nn.ModuleList(Block(width) for _ in range(depth))
            self.norm = nn.LayerNorm(width)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)


    class Net(nn.Module):
        def __init__(self, width=16, depth=3):
            super().__init__()
            self.embed = nn.Linear(8, width)
            self.encoder = Encoder(width, depth)
            self.head = nn.Linear(width, 4)

        def forward(self, x):
            return self.head(self.encoder(self.embed(x)))


    def with_loss():
        x = torch.randn(8, 8, 8)
        return Net().train(), (x,), lambda out: out.pow(2).mean()


    def tensor_batch():
        return Net().train(), torch.randn(8, 8, 8)
    """
)

TABLE_HEADER = (
    "budget  budget B  peak B  peak/budget  expected +ms  expected +%  step ms  measured +%  "
    "not kept"
)


@pytest.fixture
def encoder_dir(tmp_path, monkeypatch):
    (tmp_path / "plan_tree_encoder.py").write_text(ENCODER)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_plan_factory_prints_trees_and_writes_json_and_png(
    encoder_dir, fixed_clock, monkeypatch, capsys
):
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        savefig(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    out_json, png = encoder_dir / "plan.json", encoder_dir / "pareto.png"
    # 0.7: a share of the plain peak, as the Python API reads it; 60B: bytes (a bare 60
    # is refused: NOTE [a bare number]); 6 GB: above the plain peak.
    argv = ["plan", "plan_tree_encoder:with_loss", "--budgets", "0.7,60B,min,6 GB"]
    argv += ["--repeats", "1"]
    argv += ["--quiet", "--json", str(out_json), "--plot", str(png)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    assert payload["model"] == "plan_tree_encoder:with_loss"
    assert payload["type"] == "Net"
    # Default candidates: the 3 repeated layers, the encoder above them, and the children
    # with parameters of those and of the model: embed, encoder.norm, head.
    assert payload["candidates"] == 7
    assert list(payload["options"]) == ["selective", "regenerate"]  # NOTE [default options]
    rows = {row["budget"]: row for row in payload["budgets"]}
    assert list(rows) == ["0.7", "60B", "min", "6 GB"]
    assert rows["60B"] == {
        "budget": "60B",
        "budget_bytes": 60,
        "infeasible": True,
        "min_feasible_bytes": payload["min_feasible_bytes"],
    }
    plans = {label: forget.Plan.from_dict(rows[label]["plan"]) for label in ("0.7", "min", "6 GB")}
    for label, plan in plans.items():
        assert plan.measured_peak_bytes <= plan.budget_bytes
        # What is printed is the plan's own text, exactly, under a line naming the budget.
        assert f"plan_tree_encoder:with_loss @ {label}:\n{plan}\n" in out
    assert plans["min"].budget_bytes == payload["min_feasible_bytes"]
    assert plans["min"].measured_peak_bytes == payload["min_feasible_bytes"]
    assert plans["0.7"].budget_bytes == int(0.7 * payload["plain_peak_bytes"])
    assert set(plans["min"].choices) >= {f"encoder.layers.{i}" for i in range(2)}
    assert "      encoder.layers.0 (Block) " in out  # indented two levels below the model
    assert (
        "plan_tree_encoder:with_loss @ 60B:\ninfeasible: the budget 60 B is below the "
        f"least feasible one, {payload['min_feasible_bytes']:,} B; --budgets min plans at it\n"
    ) in out
    # Above the plain peak: the plain step, and a line under it that says why.
    assert plans["6 GB"].choices == {}
    assert (
        f"{plans['6 GB']}\n  the budget 6,000,000,000 B is at or above the plain step's peak, "
        f"{payload['plain_peak_bytes']:,} B: the plain step fits, so nothing is forgotten\n"
    ) in out
    table = out[out.index(TABLE_HEADER.split()[0] + "  ") :].splitlines()
    assert table[0].split() == TABLE_HEADER.split()
    assert set(table[1]) <= {"-", " "}
    assert [line.split()[0] for line in table[2:6]] == ["0.7", "60B", "min", "6"]
    assert table[3].split()[-1] == "infeasible"
    assert table[4].split()[3] == "1.000"  # min: the peak is the budget
    assert out.splitlines()[-2:] == [
        f"wrote {out_json}: the plans (Plan.from_dict reads each) and the figures as JSON",
        f"wrote {png}: peak memory against step-time overhead for this model",
    ]
    assert png.read_bytes()[:8] == PNG
    (ax,) = figures[0].axes
    # The title in two lines (one was cut off at the figure's edge), the axis in words.
    assert ax.get_title() == "plan_tree_encoder:with_loss\nNet, 7 candidate modules"
    assert ax.get_ylabel() == "time recomputation adds (% of plain)"
    _assert_laid_out(figures[0])
    budget_lines = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [line.get_xdata()[0] for line in budget_lines] == [
        plans[label].budget_bytes / 2**20 for label in ("0.7", "min", "6 GB")
    ]  # one dashed line per budget planned, named at the top
    assert [t.get_text() for t in ax.texts] == ["0.7", "min", "6 GB"]
    lines = {line.get_label(): line for line in ax.get_lines() if line not in budget_lines[1:]}
    assert list(lines) == [
        "assignments measured (allocator peak, predicted time)",
        "least time at each peak, of those measured",
        "every innermost candidate forgotten (measured peak, predicted time)",
        "the budgets (--budgets): a plan's peak lies on or left of its own",
        "store-all (plain, predicted)",
        "our plans (measured peak, predicted time)",
        "our plans (measured peak, measured time, noisy)",
    ]
    stars = lines["our plans (measured peak, predicted time)"]
    plain_s = payload["plain_step_s"]
    want = [100 * plans[label].predicted_extra_s / plain_s for label in ("0.7", "min", "6 GB")]
    assert list(stars.get_ydata()) == pytest.approx(want)
    assert list(stars.get_xdata()) == [p.measured_peak_bytes / 2**20 for p in plans.values()]
    peaks = [m["peak_bytes"] for m in payload["measured"]]
    assert min(peaks) == payload["min_feasible_bytes"]
    # The plain step never ran (NOTE [tree figures]): its peak is predicted, above these.
    assert max(peaks) < payload["plain_peak_bytes"]


def _assert_laid_out(fig):
    """Every label inside the figure; the legend under the axes; no text over another."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    box = fig.bbox
    extent = {
        "y label": ax.yaxis.label.get_window_extent(renderer),
        "x label": ax.xaxis.label.get_window_extent(renderer),
        "title": ax.title.get_window_extent(renderer),
        "legend": ax.get_legend().get_window_extent(renderer),
    }
    for name, part in extent.items():  # the y label was cut off at the figure's edges
        assert box.x0 <= part.x0 and part.x1 <= box.x1, name
        assert box.y0 <= part.y0 and part.y1 <= box.y1, name
    # The legend covered the points: now it lies under the axes and their x label.
    assert extent["legend"].y1 < extent["x label"].y0 < ax.get_window_extent(renderer).y0
    for text in ax.texts:  # the budgets' names, above the axes, under the title
        assert not text.get_window_extent(renderer).overlaps(extent["title"]), text.get_text()


def test_plan_file_path_candidates_and_no_budget_planned(encoder_dir, fixed_clock, capsys):
    out_json = encoder_dir / "plan.json"
    argv = ["plan", str(encoder_dir / "plan_tree_encoder.py") + ":tensor_batch"]
    # A size and a share: the profile runs unbounded (`profile_budget`), both infeasible.
    argv += ["--candidate", "encoder.layers.?", "--budgets", "100B,1%", "--repeats", "1"]
    assert cli_main([*argv, "--quiet", "--no-options", "--json", str(out_json)]) == 2
    captured = capsys.readouterr()
    payload = json.loads(out_json.read_text())
    assert payload["candidates"] == 3  # the layers only
    assert payload["options"] == {}
    assert all(set(m["choices"].values()) == {"forget"} for m in payload["measured"][1:])
    layers = {f"encoder.layers.{i}" for i in range(3)}
    assert all(set(m["choices"]) <= layers for m in payload["measured"])
    assert captured.err.splitlines()[-1] == (
        f"forget plan: no budget of {argv[1]} could be planned: each lies below the smallest "
        f"feasible one, {payload['min_feasible_bytes']:,} B (plain peak "
        f"{payload['plain_peak_bytes']:,} B); --budgets min plans at it"
    )


# An embedding, three residual MLP blocks and a head.
EMBEDDING = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.act, self.fc2 = nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.fc2(self.act(self.fc1(x)))


    class Net(nn.Module):
        def __init__(self, vocab=64, d=16, depth=3):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)


    def build():
        ids = torch.randint(0, 64, (4, 32))
        return Net().train(), (ids,), lambda out: out.logsumexp(-1).mean()
    """
)


def test_a_region_that_frees_nothing_is_not_chosen(tmp_path, monkeypatch, fixed_clock, capsys):
    (tmp_path / "plan_tree_embedding.py").write_text(EMBEDDING)
    monkeypatch.chdir(tmp_path)
    out_json = tmp_path / "plan.json"
    argv = ["plan", "plan_tree_embedding:build", "--budgets", "min", "--repeats", "1"]
    assert cli_main([*argv, "--no-options", "--quiet", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    plan = forget.Plan.from_dict(payload["budgets"][0]["plan"])
    measured = {tuple(sorted(m["choices"])): m["peak_bytes"] for m in payload["measured"]}
    # The least peak measured is the baseline's, which forgets every innermost candidate;
    # forgetting the embedding (its ids are alive anyway) and the head (it holds its input
    # either way) frees nothing: without them the step peaks the same, and re-runs less.
    blocks = ("blocks.0", "blocks.1", "blocks.2")
    assert measured[tuple(sorted(("embed", *blocks, "head")))] == plan.measured_peak_bytes
    assert plan.choices == dict.fromkeys(blocks, "forget")
    # The cost model put the plan above its budget; the measured peak, which decides, fits.
    assert plan.predicted_peak_bytes > plan.budget_bytes == plan.measured_peak_bytes
    assert (
        f"predicted {plan.predicted_peak_bytes:,} B\n  the measured peak decides, and it fits "
        "the budget; the predicted one, the cost model's, only chose which plans to measure\n"
    ) in out


def test_plan_hugging_face_factory_with_a_dict_batch(tmp_path, monkeypatch, fixed_clock, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "plan_tree_llama.py").write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import LlamaConfig, LlamaForCausalLM


            def build():
                config = LlamaConfig(
                    num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                    max_position_embeddings=64,
                )
                ids = torch.randint(0, 64, (2, 16))
                return LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "plan_tree_llama:build", "--budgets", "min", "--repeats", "1", "--quiet"]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "plan_tree_llama:build @ min:\nforget plan: " in out
    rows = [line.split() for line in out.splitlines() if "(LlamaDecoderLayer)" in line]
    assert [row[0] for row in rows] == ["model.layers.0", "model.layers.1"]
    # The loss is output.loss, from the labels: at the least, no layer is kept.
    assert all(row[2] in ("forget", "regenerate", "selective") for row in rows)


ERRORS = textwrap.dedent(
    """
    import torch
    from torch import nn

    def alone(): return nn.Linear(2, 2)
    def four(): return nn.Linear(2, 2), (torch.ones(2),), None, 1
    def not_a_module(): return "model", (torch.ones(2),)
    def list_batch(): return nn.Linear(2, 2), [torch.ones(2)]
    def bad_loss(): return nn.Linear(2, 2), (torch.ones(2),), 5
    def raises(): raise KeyError("no weights here\\nsecond line")
    def vector_loss(): return nn.Linear(2, 2), (torch.ones(2),), lambda out: out
    NOT_CALLABLE = 3
    """
)


@pytest.mark.parametrize(
    ("target", "extra", "message"),
    [
        ("no_colon", [], "forget: expected module:factory or path/to/file.py:factory"),
        ("no_such_module_xyz:build", [], "forget: cannot import 'no_such_module_xyz': "),
        ("plan_tree_broken:build", [], "forget: cannot import 'plan_tree_broken': RuntimeError"),
        ("plan_tree_broken.py:build", [], "forget: cannot import 'plan_tree_broken.py': Runtime"),
        ("missing_file.py:build", [], "forget: cannot import 'missing_file.py': no such file"),
        ("plan_tree_errors:nope", [], "has no attribute 'nope'; it defines alone, four,"),
        ("plan_tree_errors:NOT_CALLABLE", [], "is not a callable factory (type int)"),
        ("plan_tree_errors:raises", [], "raises() raised KeyError: 'no weights here"),
        ("plan_tree_errors:alone", [], "returned only the model (Linear); return (model, batch)"),
        ("plan_tree_errors:four", [], "it returned a tuple of 4 (Linear, tuple, NoneType, int)"),
        ("plan_tree_errors:not_a_module", [], "a model of type str, not an nn.Module"),
        ("plan_tree_errors:list_batch", [], "a batch of type list; the batch is a tuple"),
        ("plan_tree_errors:bad_loss", [], "a loss_fn of type int; the third item is a callable"),
        ("plan_tree_errors:vector_loss", [], "loss_fn(output) must be a floating tensor with one"),
        (
            "plan_tree_errors:alone",
            ["--set", "depth=2", "--size", "tiny"],
            "--size, --set pick the",
        ),
        ("plan_tree_errors:alone", ["--budgets", "lots"], "cannot read the budget"),
        ("plan_tree_errors:alone", ["--budgets", "50"], "'50%' for a share of the plain step"),
        (
            "plan_tree_errors:alone",
            ["--option", "s=LINEAR", "--no-options"],
            "--option and --no-options contradict each other",
        ),
    ],
)
def test_plan_factory_errors_are_one_line(target, extra, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "plan_tree_errors.py").write_text(ERRORS)
    (tmp_path / "plan_tree_broken.py").write_text('raise RuntimeError("at import\\nmore")\n')
    monkeypatch.chdir(tmp_path)
    assert cli_main(["plan", target, *extra, "--repeats", "1", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err  # no traceback
    assert captured.err.startswith("forget: ")
    assert message in captured.err


BAD_FORWARD = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, mask):
            return self.lin(x) * mask


    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Masked() for _ in range(2))

        def forward(self, x, scale=1.0):
            for block in self.blocks:
                x = block(x)
            return x * scale


    def root():
        return Masked().train(), (torch.ones(2, 4),)


    def inner():
        return Outer().train(), {"x": torch.ones(2, 4, dtype=torch.float64), "scale": 2.0}
    """
)
_MISSING = "TypeError: Masked.forward() missing 1 required positional argument: 'mask'"
_FIX = "fix the model or what the factory gives it (--traceback or FORGET_TRACEBACK=1 prints"


@pytest.mark.parametrize("command", ["plan", "profile"])
@pytest.mark.parametrize(
    ("factory", "call"),
    [
        ("root", "the model (Masked) with (float32[2, 4])"),
        ("inner", "blocks.0 (Masked) with (float64[2, 4])"),
    ],
)
def test_an_error_in_the_users_model_is_one_line_naming_the_call(
    command, factory, call, tmp_path, monkeypatch, capsys
):
    (tmp_path / "plan_tree_badfwd.py").write_text(BAD_FORWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FORGET_TRACEBACK", raising=False)
    target = f"plan_tree_badfwd.py:{factory}"
    assert cli_main([command, target, "--repeats", "1", "--quiet"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"forget: the step of {target} failed calling {call}: {_MISSING}; {_FIX} the whole trace)\n"
    )


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal, as a user's is."""

    def isatty(self):
        return True


@pytest.mark.parametrize("terminal", [False, True], ids=["file", "terminal"])
def test_the_bar_is_cleared_before_the_error_and_drawn_only_on_a_terminal(
    terminal, tmp_path, monkeypatch, capsys
):
    # NOTE [bars on a terminal] in forget._cli._common: not --quiet, so a bar where
    # stderr is a terminal, none where it is a file (capsys's), whose log got every frame.
    (tmp_path / "plan_tree_badfwd.py").write_text(BAD_FORWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FORGET_TRACEBACK", raising=False)
    if terminal:
        monkeypatch.setattr(sys, "stderr", _Terminal())
    assert cli_main(["plan", "plan_tree_badfwd.py:root", "--repeats", "1"]) == 2
    err = sys.stderr.getvalue() if terminal else capsys.readouterr().err
    line = "forget: the step of plan_tree_badfwd.py:root failed calling the model (Masked)"
    head, sep, tail = err.partition(line)
    assert sep and tail.endswith("the whole trace)\n") and "\n" not in tail[:-1]
    if not terminal:
        assert head == ""
        return
    # The bar was drawn, then its line cleared, the cursor at its start: the error has
    # the line to itself.
    frames = head.split("\r")
    assert any(frame.startswith("forget plan:") for frame in frames)
    assert frames[-1] == "" and frames[-2].strip() == ""


def test_a_warning_goes_above_the_bar_and_the_bar_gives_warnings_back(monkeypatch):
    pytest.importorskip("tqdm")
    from forget._cli._common import Progress

    monkeypatch.setattr(sys, "stderr", _Terminal())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        before = warnings.showwarning
        progress = Progress(2, enabled=True, desc="forget plan", unit="task")
        warnings.warn("the model is in eval mode", UserWarning, stacklevel=1)
        progress.update("profiled")
        progress.close()
        assert warnings.showwarning is before
    err = sys.stderr.getvalue()
    # The warning on a line of its own, the bar's frames around it, never on its line.
    (warned,) = [line for line in err.split("\n") if "UserWarning: the model is" in line]
    *bar, own = warned.split("\r")
    assert bar[-1].strip() == ""  # the bar's line cleared first
    assert own.startswith(__file__) and own.endswith(": UserWarning: the model is in eval mode")


def test_traceback_prints_the_whole_trace_before_the_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "plan_tree_badfwd.py").write_text(BAD_FORWARD)
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "plan_tree_badfwd:inner", "--repeats", "1", "--quiet"]
    assert cli_main([*argv, "--traceback"]) == 2
    by_flag = capsys.readouterr().err.splitlines()
    monkeypatch.setenv("FORGET_TRACEBACK", "1")
    assert cli_main(argv) == 2
    by_env = capsys.readouterr().err.splitlines()
    for err in (by_flag, by_env):
        assert err[0] == "Traceback (most recent call last):"
        assert err[-2:] == [
            _MISSING,
            f"forget: the step of plan_tree_badfwd:inner failed calling blocks.0 (Masked) with "
            f"(float64[2, 4]): {_MISSING}; {_FIX} the whole trace)",
        ]


def test_candidate_picks_a_reference_models_regions_too(fixed_clock, capsys):
    # One planner: --candidate and --no-options mean the same for a reference model.
    argv = ["plan", "--model", "residual_mlp", "--size", "tiny", "--budgets", "min"]
    argv += ["--repeats", "1", "--quiet"]
    assert cli_main([*argv, "--candidate", "blocks.*", "--no-options"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.fc1 (Linear)" in out and "regenerate" not in out
    assert cli_main([*argv, "--candidate", "encoder.*"]) == 2
    assert "candidates=['encoder.*'] matches no submodule of ResidualMLP" in capsys.readouterr().err


def test_below_the_plain_peak_the_plain_step_is_timed_beside_the_plans(
    encoder_dir, fixed_clock, capsys
):
    # NOTE [the command within the budget]: every budget lies below the plain peak; the
    # plain step is never profiled, and runs in the timing rounds beside the plans.
    out_json = encoder_dir / "plan.json"
    argv = ["plan", "plan_tree_encoder:with_loss", "--budgets", "min", "--repeats", "1"]
    assert cli_main([*argv, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out_json.read_text())
    (row,) = payload["budgets"]
    plain_s, plan = payload["plain_step_s"], forget.Plan.from_dict(row["plan"])
    assert plan.measured_peak_bytes < payload["plain_peak_bytes"]
    assert plain_s > 0 and row["step_s"] > 0
    # One round, paired: the plan's overhead is its time over plain's in that round.
    assert row["measured_overhead"] == pytest.approx(row["step_s"] / plain_s - 1)
    assert (
        ": Net over its module tree, 7 candidate modules; plain step: "
        f"{plain_s * 1e3:.3f} ms measured, {payload['plain_peak_bytes']:,} B peak predicted; "
        "probe profiler, 1 repeats, "
    ) in out
    table = out[out.index(TABLE_HEADER.split()[0] + "  ") :].splitlines()
    cells = table[2].split()
    assert cells[0] == "min"
    assert cells[5] == f"{100 * plan.predicted_extra_s / plain_s:+.1f}%"
    assert float(cells[6]) == pytest.approx(1e3 * row["step_s"], abs=1e-3)
    assert cells[7] == f"{100 * row['measured_overhead']:+.1f}%"


def test_a_device_the_plain_step_would_not_fit_times_the_plans_alone(
    encoder_dir, fixed_clock, monkeypatch, capsys
):
    # NOTE [the command within the budget]: on a CUDA device with less room than the
    # plain step's predicted peak, the plain step never runs; the plans are timed alone.
    from forget._cli import _plan_tree

    ran = []
    monkeypatch.setattr(_plan_tree, "device_room", lambda planner: ran.append(1) or 1024)
    out_json, png = encoder_dir / "plan.json", encoder_dir / "p.png"
    argv = ["plan", "plan_tree_encoder:with_loss", "--budgets", "min", "--repeats", "1"]
    assert cli_main([*argv, "--json", str(out_json), "--plot", str(png)]) == 0
    out, err = capsys.readouterr()
    payload = json.loads(out_json.read_text())
    (row,) = payload["budgets"]
    assert ran and payload["plain_step_s"] is None and row["measured_overhead"] is None
    assert row["step_s"] > 0
    assert "plain step: not run (above the device's 1,024 B)" in out
    cells = out[out.index(TABLE_HEADER.split()[0] + "  ") :].splitlines()[2].split()
    assert cells[5] == cells[7] == "-"
    assert not png.exists() and "not drawn: the plain step was not run" in err


def test_a_size_below_the_forward_without_grad_names_the_least(encoder_dir, capsys):
    # The profile runs within the largest budget asked (`profile_budget`); the forward
    # without grad passes 100 B, which is then infeasible, and the least is measured
    # under the predicted plain peak (NOTE [an infeasible budget named]).
    out_json = encoder_dir / "plan.json"
    argv = ["plan", "plan_tree_encoder:with_loss", "--budgets", "100B,60B", "--repeats", "1"]
    assert cli_main([*argv, "--quiet", "--json", str(out_json)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    payload = json.loads(out_json.read_text())
    assert err == (
        "forget plan: no budget of plan_tree_encoder:with_loss could be planned: each lies "
        f"below the smallest feasible one, {payload['min_feasible_bytes']:,} B (plain peak "
        f"{payload['plain_peak_bytes']:,} B); --budgets min plans at it"
    )
    assert payload["min_feasible_bytes"] > 100
