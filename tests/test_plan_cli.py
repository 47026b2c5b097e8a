"""``forget plan`` with no target: the reference models and chains, by the one planner.

A target of the user's (``forget plan module:factory``) is tested in
tests/test_plan_tree_cli.py; here, the reference models (``--model``, ``--size``,
``--set``) and a factory returning a chain (``--input-shape``), each planned as
its module tree, with the same printout, JSON and plot, and the option parsers.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from forget._cli import _common, _plan, _plan_tree
from forget._cli import main as cli_main

# Bytes and plans, not times: the clock runs nothing (conftest.py).
pytestmark = pytest.mark.usefixtures("fixed_clock")


def test_plan_reference_model_json_and_pareto(tmp_path, capsys):
    out_json, png = tmp_path / "plan.json", tmp_path / "pareto.png"
    argv = ["plan", "--model", "tiny_gpt", "--size", "tiny", "--budgets", "90%,min"]
    argv += ["--repeats", "1", "--quiet", "--json", str(out_json), "--pareto", str(png)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    assert "tiny_gpt @ 90%:" in out and "tiny_gpt @ min:" in out
    assert "blocks.0 (_GPTBlock)" in out  # the plan's tree: the blocks are candidates
    data = json.loads(out_json.read_text())
    assert data["model"] == "tiny_gpt" and data["type"] == "TinyGPT"
    for row in data["budgets"]:
        assert row["plan"]["measured_peak_bytes"] <= row["budget_bytes"]
    least = data["budgets"][-1]
    assert least["budget_bytes"] == data["min_feasible_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_models_write_one_file_each(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    argv = ["--size", "tiny", "--budgets", "min,1%", "--repeats", "1", "--quiet"]
    assert _plan.main([*argv, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for name in ("residual_mlp", "small_cnn", "tiny_gpt"):
        data = json.loads((tmp_path / f"plan-{name}.json").read_text())
        assert data["min_feasible_bytes"] < data["plain_peak_bytes"], name
        assert data["budgets"][1]["infeasible"], name
        assert f"{name} @ min:" in out
    assert not out_json.exists()


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
    assert _plan.main([*argv, "--repeats", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "my_models:build @ min:" in out
    assert all(f"    {i} (Sequential)" in out for i in range(4))  # the chain's children


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nope"], "module:factory"),
        (["--model", "no_such_module_xyz:f", "--input-shape", "2,2"], "cannot import"),
        (["--model", "forget._cli._models:MODEL_NAMES", "--input-shape", "2"], "not a callable"),
        (["--model", "torch.nn:Identity"], "--input-shape"),
        (["--model", "forget._nn:ForgetSequential", "--input-shape", "2"], "raised TypeError"),
        (["--model", "residual_mlp", "--budgets", "12 parsecs"], "cannot read the budget"),
        # NOTE [a bare number]: refused before any work, naming both readings.
        (["--model", "residual_mlp", "--budgets", "50%,60"], "write '60%' for a share"),
        (["--model", "residual_mlp", "--budgets", ","], "--budgets is empty"),
        (["--model", "residual_mlp", "--algorithm", "optimal"], "unrecognized arguments"),
        (["--model", "residual_mlp", "--split"], "unrecognized arguments"),
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
    assert _plan.main([*argv, "--budgets", "min", "--repeats", "1", "--quiet"]) == 0
    out = capsys.readouterr().out  # the preset's depth is 2
    assert "blocks.2 (_GPTBlock)" in out and "blocks.3 (" not in out


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
    real = _plan_tree.TreePlanner

    def spy(*args, options=None, **kwargs):
        seen["options"] = options
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(_plan_tree, "TreePlanner", spy)
    argv = ["--model", "residual_mlp", "--size", "tiny", "--budgets", "min", "--repeats", "1"]
    assert _plan.main([*argv, "--option", "sel=LINEAR"]) == 0
    out = capsys.readouterr().out
    assert "option sel: save outputs of aten._addmm_activation, aten.addmm, aten.mm" in out
    assert list(seen["options"]) == ["sel"]
    argv += ["--option", "a=LINEAR", "--option", "a=CONV"]
    assert _plan.main(argv) == 2
    assert "given twice" in capsys.readouterr().err


def test_plan_exits_2_when_no_budget_is_planned(capsys):
    argv = ["--model", "residual_mlp", "--size", "tiny", "--budgets", "1%,2B", "--repeats", "1"]
    assert _plan.main([*argv, "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert "residual_mlp @ 1%:\ninfeasible: the budget" in out
    assert err.startswith("forget plan: no budget of residual_mlp could be planned")
