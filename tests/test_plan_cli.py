"""``forget plan`` from the command line: table, JSON, Pareto PNG, user factories, errors."""

from __future__ import annotations

import json
import re
import textwrap

import pytest

from forget._cli import _common, _plan
from forget._cli import main as cli_main

HEADER = (
    "model         budget  budget MiB  peak MiB  peak/budget  plan overhead  uniform  "
    "uniform peak MiB  uniform overhead  plan/uniform  90% range  predicted  schedule"
)


def test_plan_reference_model_json_and_pareto(tmp_path, capsys):
    out_json, png = tmp_path / "plan.json", tmp_path / "pareto.png"
    argv = ["plan", "--model", "tiny_gpt", "--size", "tiny", "--budgets", "90%,min"]
    argv += ["--repeats", "1", "--quiet", "--json", str(out_json), "--pareto", str(png)]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == HEADER.split()
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].split()[:2] == ["tiny_gpt", "90%"]
    assert lines[3].split()[0] == "min"
    model = json.loads(out_json.read_text())["models"]["tiny_gpt"]
    assert model["stages"] == 2
    for row in model["budgets"]:
        if not row.get("infeasible"):
            assert row["measured_peak_bytes"] <= row["budget_bytes"]
    least = model["budgets"][-1]
    assert least["budget_bytes"] == least["measured_peak_bytes"] == model["min_feasible_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_user_factory_with_input_shape(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                layer = lambda: torch.nn.Sequential(
                    torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
                )
                return torch.nn.Sequential(*[layer() for _ in range(4)])
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "my_models:build", "--input-shape", "128,16", "--budgets", "min"]
    assert _plan.main([*argv, "--repeats", "1", "--quiet", "--show"]) == 0
    out = capsys.readouterr().out
    assert "my_models:build  min" in out
    assert ": 4 stages, budget" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope"], "module:factory"),
        (["--model", "no_such_module_xyz:f", "--input-shape", "2,2"], "cannot import"),
        (["--model", "forget._cli._models:MODEL_NAMES", "--input-shape", "2"], "not a callable"),
        (["--model", "torch.nn:Identity"], "--input-shape"),
        (["--model", "forget._nn:ForgetSequential", "--input-shape", "2"], "raised TypeError"),
        (["--model", "residual_mlp", "--budgets", "12 parsecs"], "cannot read the budget"),
        (["--model", "residual_mlp", "--budgets", ","], "--budgets is empty"),
        (["--model", "residual_mlp", "--algorithm", "magic"], "valid names"),
        (["--model", "residual_mlp", "--repeats", "0"], "--repeats"),
        (["--model", "tiny_gpt", "--set", "contxt=8"], "contxt: tiny_gpt takes width (now"),
        (["--model", "tiny_gpt", "--set", "context"], "KEY=NUMBER"),
        (["--model", "tiny_gpt", "--set", "context=long"], "KEY=NUMBER"),
        (["--model", "all", "--set", "context=8"], "residual_mlp takes"),
        (["--model", "torch.nn:Identity", "--set", "context=8"], "reference models only"),
        (["--model", "tiny_gpt", "--size", "tiny", "--set", "width=15"], "not divisible"),
    ],
)
def test_plan_usage_errors(argv, message, capsys):
    assert _plan.main(argv) == 2
    assert message in capsys.readouterr().err


def test_set_replaces_a_reference_preset(capsys):
    argv = ["--model", "tiny_gpt", "--size", "tiny", "--set", "depth=3", "--set", "dropout=0.0"]
    assert _plan.main([*argv, "--budgets", "min", "--repeats", "1", "--quiet", "--show"]) == 0
    assert ": 3 stages, budget" in capsys.readouterr().out  # the preset's depth is 2


def test_parse_setting():
    assert _common.parse_setting(" context = 512 ") == ("context", 512)
    assert _common.parse_setting("dropout=0.0") == ("dropout", 0.0)
    assert isinstance(_common.parse_setting("depth=3")[1], int)


def test_parse_shape():
    assert _common.parse_shape("64,512") == (64, 512)
    assert _common.parse_shape("8x3x32x32") == (8, 3, 32, 32)
    for bad in ("", "a,b", "0,4", "-1"):
        with pytest.raises(ValueError, match="--input-shape"):
            _common.parse_shape(bad)


def test_parse_option_groups_and_ops():
    from forget import policies

    name, policy = _common.parse_option("sel=linear+ATTENTION+bmm")
    assert name == "sel"
    want = policies.save_outputs_of(*policies.LINEAR, *policies.ATTENTION, "aten.bmm")
    assert policy.description == want.description
    assert policy.decide("aten.bmm.default", 4).value == "save"
    assert policy.decide("aten.gelu.default", 4).value == "recompute"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("bad", "NAME=OPS"),
        ("=LINEAR", "NAME=OPS"),
        ("sel=", "NAME=OPS"),
        ("kept=LINEAR", "is taken"),
        ("sel=LINEAR++CONV", "empty op"),
    ],
)
def test_parse_option_errors(option, message):
    with pytest.raises(ValueError, match=message):
        _common.parse_option(option)


def test_plan_option_reaches_the_planner(monkeypatch, capsys):
    seen = {}
    real = _plan.Planner

    def spy(*args, options=None, **kwargs):
        seen["options"] = options
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(_plan, "Planner", spy)
    argv = ["--model", "residual_mlp", "--size", "tiny", "--budgets", "min", "--repeats", "1"]
    assert _plan.main([*argv, "--option", "sel=LINEAR"]) == 0
    out = capsys.readouterr().out
    assert "option sel: save outputs of aten._addmm_activation, aten.addmm, aten.mm" in out
    assert list(seen["options"]) == ["sel"]
    argv += ["--option", "a=LINEAR", "--option", "a=CONV"]
    assert _plan.main(argv) == 2
    assert "given twice" in capsys.readouterr().err


def test_best_uniform_is_selected_then_timed_afresh(monkeypatch):
    # NOTE [select, then measure]: the uniform segmentation is picked by one timing
    # round and its overhead comes from a second round, beside the plan and plain.
    import torch

    from forget._planning import Planner

    torch.manual_seed(0)
    layer = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)
    )
    model = torch.nn.Sequential(*[layer() for _ in range(6)])
    planner = Planner(model, (torch.randn(256, 32),), repeats=1)
    rounds = []

    def fake(target, runners, repeats):  # the selection round: k segments take k seconds
        rounds.append(sorted(map(str, runners)))
        return {k: float(k) for k in runners}

    def final(target, runners, repeats):  # NOTE [paired rounds]: beside plain
        rounds.append(sorted(runners))
        assert repeats == 2
        return {"plan": [0.25, 0.2, 0.3], "uniform": [0.5, 0.5, 0.5]}

    monkeypatch.setattr(_plan, "time_side_by_side", fake)
    monkeypatch.setattr(_plan, "paired_overheads", final)
    # The plan: a fitting candidate that is no uniform segmentation.
    uniforms = {planner.uniform(k).items for k in range(1, 7)}
    monkeypatch.setattr(
        Planner,
        "_fastest",
        lambda self, fitting: next((f for f in fitting if f[0].items not in uniforms), fitting[0]),
    )
    # 80 % of the predicted plain peak (NOTE [chain planning within the budget]): below
    # the plain step's, so that no segmentation is the plain step itself.
    result = _plan._plan_budgets("m", planner, ["80%"], "optimal", 1)
    (row,) = result.rows
    assert rounds[-1] == ["plan", "uniform"]
    selection = [int(k) for k in rounds[-2]]
    assert row.uniform_segments == min(selection)
    assert row.plan_overhead == pytest.approx(0.25)
    assert row.uniform_overhead == pytest.approx(0.5)
    # NOTE [ratio range]: resampled medians of 0.2, 0.25, 0.3 over 0.5.
    assert row.ratio_range == pytest.approx((0.4, 0.6))
    # NOTE [predicted ratio]: the same two schedules in the planner's time model.
    from forget import schedules as P

    plain_s = planner.chain.store_all_time_s
    items = P.uniform_items(6, row.uniform_segments)
    uniform_s = P.Schedule.from_items(planner.chain, items).predicted_time_s
    assert row.plan is not None and row.predicted_ratio is not None
    expected = (row.plan.schedule.predicted_time_s - plain_s) / (uniform_s - plain_s)
    assert row.predicted_ratio == pytest.approx(expected)
    assert row.as_json()["predicted_ratio"] == row.predicted_ratio


def test_budgets_are_planned_from_the_smallest_up(monkeypatch):
    # NOTE [monotone in the budget]: each larger budget sees the smaller ones'
    # schedules; the rows keep the order the budgets were given in.
    import torch

    from forget._planning import Planner

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    planner = Planner(model, (torch.randn(64, 32),), repeats=1)
    planned = []
    real = Planner.plan

    def spy(self, budget, **kwargs):
        planned.append(budget)
        return real(self, budget, **kwargs)

    monkeypatch.setattr(Planner, "plan", spy)
    monkeypatch.setattr(
        _plan, "time_side_by_side", lambda target, runners, repeats: dict.fromkeys(runners, 1.0)
    )
    monkeypatch.setattr(
        _plan, "paired_overheads", lambda target, runners, repeats: {k: [0.0] for k in runners}
    )
    result = _plan._plan_budgets("m", planner, ["90%", "min", "95%"], "optimal", 1)
    assert [row.label for row in result.rows] == ["90%", "min", "95%"]
    budgets = planned[1:]  # the first call finds the least feasible budget
    assert budgets == sorted(budgets) and len(budgets) == 3


def test_split_plans_the_blocks_stages_against_uniform_segments_of_whole_blocks(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny_gpt", "--size", "tiny", "--budgets", "75%,min", "--split"]
    assert cli_main([*argv, "--repeats", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "blocks split into their stages" in out
    model = json.loads(out_json.read_text())["models"]["tiny_gpt"]
    assert (model["blocks"], model["stages"]) == (2, 4)
    for row in model["budgets"]:
        assert row["measured_peak_bytes"] <= row["budget_bytes"]
        # Uniform segments are counted in whole blocks.
        assert row["uniform_segments"] in (None, 1, 2)


def test_ratio_range_resamples_paired_rounds():
    # NOTE [ratio range]: equal rounds give a point; spread rounds a range around
    # the medians' ratio; a uniform overhead at or below zero gives none.
    assert _plan.ratio_range([0.1] * 4, [0.2] * 4) == pytest.approx((0.5, 0.5))
    lo, hi = _plan.ratio_range([0.1, 0.2, 0.3, 0.1, 0.2], [0.2, 0.2, 0.3, 0.3, 0.2])
    assert 0 < lo < hi and lo <= 0.2 / 0.2 <= hi
    assert _plan.ratio_range([0.1, 0.2], [-0.1, -0.2]) is None
    with pytest.raises(ValueError, match="same, non-zero number of rounds"):
        _plan.ratio_range([0.1], [0.1, 0.2])


def test_a_plan_measured_below_plain_has_no_ratio(monkeypatch):
    from forget import schedules as P
    from forget._planning import Plan

    chain = P.Chain(tuple(P.Stage(f"s{i}", 1.0, 0.8, 2.0, 100, 100, 400) for i in range(2)))
    schedule = P.Schedule.from_items(chain, (P.Region((P.Keep(0),)), P.Keep(1)))
    plan = Plan(schedule, chain, 1000, 900, 900, 2000, 500)
    rows = [
        _plan.BudgetRow("75%", 1000, plan, 500, -0.01, 2, 950, 0.07, 0.5),
        _plan.BudgetRow("50%", 1000, plan, 500, 0.03, 2, 950, 0.3, 0.5),
    ]
    result = _plan.ModelResult("m", 2000, 500, rows, planner=None)  # type: ignore[arg-type]
    lines = _plan.format_table([result]).splitlines()
    assert "below plain" in lines[2] and "-0.14x" not in lines[2]
    assert "0.10x" in lines[3]


def _nested_plan():
    from forget import schedules as P
    from forget._planning import Plan

    chain = P.Chain(tuple(P.Stage(f"s{i}", 1e-3, 8e-4, 2e-3, 100, 100, 400) for i in range(4)))
    items = (P.Region((P.Keep(0), P.Region((P.Keep(1),)))), P.Region((P.Keep(2),)), P.Keep(3))
    return Plan(P.Schedule.from_items(chain, items), chain, 1000, 900, 950, 2000, 500)


def test_plan_table_shows_regions_and_one_measured_one_predicted_peak():
    plan = _nested_plan()
    assert plan.layout == "(0 (1)) (2) 3"
    assert [row["region"] for row in plan.rows()] == ["R1", "R1.1", "R2", None]
    lines = str(plan).splitlines()
    assert lines[1:] == [
        "  stage          region  decision   depth     kept bytes   recompute",
        "  s0             R1      forgotten      1              0     0.800ms",
        "  s1             R1.1    forgotten      2              0     1.600ms",
        "  s2             R2      forgotten      1              0     0.800ms",
        "  s3             -       kept           0            400     0.000ms",
        "  regions: (0 (1)) (2) 3  (stage indices; a bracket is one forget region)",
        "  peak: measured 900 B (0.45x the plain 2,000 B); predicted 950 B",
        f"  time: predicted overhead +{100 * plan.predicted_overhead:.1f} % of a plain step",
    ]


def test_plan_of_every_tiny_model_saves_memory_and_reports_progress(tmp_path, monkeypatch):
    # The smallest sizes plan below the plain peak; progress counts each model's
    # profile and each budget planned, smallest budget first.
    class Recorder:
        def __init__(self, total, enabled, desc, unit):
            self.total, self.labels = total, []
            recorders.append(self)

        def update(self, label):
            self.labels.append(label)

        def close(self):
            pass

    recorders = []
    monkeypatch.setattr(_plan, "Progress", Recorder)
    out_json = tmp_path / "plan.json"
    argv = ["--size", "tiny", "--budgets", "min,1%", "--repeats", "1", "--quiet"]
    assert _plan.main([*argv, "--json", str(out_json)]) == 0
    models = json.loads(out_json.read_text())["models"]
    for name, model in models.items():
        assert model["min_feasible_bytes"] < model["plain_peak_bytes"], name
        assert model["budgets"][1]["infeasible"], name
    (progress,) = recorders
    assert progress.total == 9
    assert progress.labels == [f"{n} {step}" for n in models for step in ("profiled", "1%", "min")]


def test_plan_exits_2_when_no_budget_is_planned(capsys):
    argv = ["--model", "residual_mlp", "--size", "tiny", "--budgets", "1%,2", "--repeats", "1"]
    assert _plan.main([*argv, "--quiet"]) == 2
    out, err = capsys.readouterr()
    row = out.splitlines()[2].split()
    assert row[:2] + row[3:4] + row[-4:-2] == [
        "residual_mlp",
        "1%",
        "infeasible",
        "min",
        "feasible",
    ]
    assert re.fullmatch(r"0\.00[0-9]", row[2])  # 1 % of the predicted plain peak, in MiB
    least = row[-2]
    assert re.fullmatch(
        f"forget plan: no budget of residual_mlp could be planned: each lies below the "
        f"smallest feasible one, {least} B \\(plain peak [0-9,]+ B\\); --budgets min plans at it; "
        "did you mean 2%\\?\n",  # 2 is bytes, as a number without a unit is
        err,
    )


def test_pareto_plots_plans_on_the_curves_axes_and_labels_measured_times(tmp_path, monkeypatch):
    import torch
    from matplotlib.figure import Figure

    from forget._cli._models import build_model
    from forget._planning import Planner

    model = build_model("tiny_gpt", "tiny", seed=0)
    planner = Planner(model, model.example_input(generator=torch.Generator()), repeats=1)
    result = _plan._plan_budgets("tiny_gpt", planner, ["min", "90%"], "optimal", 1)
    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    _plan.write_pareto([result], tmp_path / "p.png")
    (ax,) = figures[0].axes
    assert ax.get_ylabel() == "time recomputation adds to a step (% of plain)"
    budget_lines = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert [line.get_xdata()[0] for line in budget_lines] == [
        row.budget_bytes / 2**20 for row in result.rows
    ]
    assert [t.get_text() for t in ax.texts if t.get_text() in ("min", "90%")] == ["min", "90%"]
    lines = {line.get_label(): line for line in ax.get_lines() if line not in budget_lines[1:]}
    assert list(lines) == [
        "optimal DP (measured peak, predicted time)",
        "uniform segments, k = 1..L (measured peak, predicted time)",
        "forget-all (measured peak, predicted time)",
        "the budgets (--budgets): a plan's peak lies on or left of its own",
        "store-all (plain, predicted)",
        "our plans (measured peak, predicted time)",
        "our plans (measured peak, measured time, noisy)",
    ]
    plans = [row.plan for row in result.rows if row.plan is not None]
    stars = lines["our plans (measured peak, predicted time)"]
    assert list(stars.get_ydata()) == pytest.approx([100 * p.predicted_overhead for p in plans])
    crosses = lines["our plans (measured peak, measured time, noisy)"]
    assert list(crosses.get_ydata()) == [100 * row.plan_overhead for row in result.rows]


def test_plan_of_a_module_that_is_no_chain_is_a_tree_plan():
    # forget.plan takes any module; one that is no chain is planned over its module
    # tree (tests/test_tree_plan*.py), and the same plan.apply(model) runs it.
    import torch

    import forget

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

        def forward(self, x):
            return self.layers[0](x)

    net = Net()
    plan = forget.plan(net, torch.randn(2, 4), budget="1KiB", repeats=1)
    assert isinstance(plan, forget.Plan) and plan.choices == {}
    assert plan.apply(net) is net
