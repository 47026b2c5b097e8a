"""``forget profile``: ledger table, plan, timeline PNG and JSON, errors."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import forget
from forget._cli import _profile
from forget._cli import main as cli_main

FACTORY = """
import torch

def build():
    layer = lambda: torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
    )
    return torch.nn.Sequential(*[layer() for _ in range(3)])

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
            for _ in range(3)
        )

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x

def tree():
    return Net().train(), (torch.randn(16, 8),)

def alone():
    return Net()
"""


@pytest.fixture
def factory_dir(tmp_path, monkeypatch):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_profile_a_user_factory(factory_dir, capsys):
    png, out_json = factory_dir / "timeline.png", factory_dir / "profile.json"
    argv = ["profile", "user_models:build", "--input-shape", "128,16", "--budget", "90%"]
    argv += ["--repeats", "1", "--quiet", "--timeline", str(png), "--json", str(out_json)]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    # A chain is planned over its module tree: its children and runs of them
    # (NOTE [segments]) are the candidates.
    assert lines[0].startswith(
        "forget profile: user_models:build, Sequential over its module tree, 4 candidate "
        "modules, torch "
    )
    assert lines[1].startswith("plain step: peak ")
    assert lines[2].split() == ["module", "kept", "B", "input", "B", "work", "B", "fwd", "ms"]
    # 128 x 16 float32 in per block; the first keeps its first Linear's and GELU's
    # outputs, 2 x 128 x 64 floats (its input is the caller's, not counted).
    assert lines[4].split()[:4] == ["0", "(Sequential)", "65,536", "0"]
    assert lines[5].split()[:4] == ["[1:3]", "(segment)", "0", "8,192"]
    assert lines[6].split()[:4] == ["1", "(Sequential)", "73,728", "8,192"]
    assert lines[10].startswith("forget plan: ")
    data = json.loads(out_json.read_text())
    plan = data["plan"]
    assert plan["measured_peak_bytes"] <= plan["budget_bytes"]
    # The timelines are the ledger's; the plain peak is predicted by the allocator.
    assert 0 < max(data["timeline"]["plain"]) <= data["plain_peak_bytes"]
    assert max(data["timeline"]["planned"]) == plan["ledger_peak_bytes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_an_infeasible_budget_exits_2_naming_the_minimum(factory_dir, capsys):
    argv = ["user_models:build", "--input-shape", "128,16", "--budget", "1000", "--quiet"]
    assert _profile.main([*argv, "--repeats", "1"]) == 2
    assert "below the smallest feasible one" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["user_models:build"], "--input-shape"),
        (["user_models:build", "--input-shape", "x"], "--input-shape"),
        (["user_models:build", "--input-shape", "4,16", "--budget", "lots"], "budget"),
        (["user_models:build", "--input-shape", "4,16", "--repeats", "0"], "--repeats"),
        (["user_models:nothing", "--input-shape", "4,16"], "not a callable"),
    ],
)
def test_profile_usage_errors(factory_dir, argv, message, capsys):
    assert _profile.main(argv) == 2
    assert message in capsys.readouterr().err


def test_profile_takes_min_as_plan_does(factory_dir):
    out_json = factory_dir / "profile.json"
    argv = ["user_models:build", "--input-shape", "128,16", "--budget", "min", "--quiet"]
    assert _profile.main([*argv, "--repeats", "1", "--json", str(out_json)]) == 0
    plan = json.loads(out_json.read_text())["plan"]
    assert plan["budget_bytes"] == plan["min_feasible_bytes"] < plan["plain_peak_bytes"]


def test_an_infeasible_profile_says_what_it_wrote(factory_dir, capsys):
    png, out_json = factory_dir / "timeline.png", factory_dir / "profile.json"
    argv = ["user_models:build", "--input-shape", "128,16", "--budget", "1000", "--quiet"]
    argv += ["--repeats", "1", "--timeline", str(png), "--json", str(out_json)]
    assert _profile.main(argv) == 2
    out, err = capsys.readouterr()
    assert err.endswith("; --budget min plans at the smallest\n")
    assert out.splitlines()[-2:] == [
        f'wrote {out_json}: the ledger and the plain timeline as JSON; "plan" is null: '
        "no plan for the budget 1000",
        f"wrote {png}: live memory over one plain step only: no plan for the budget 1000",
    ]
    assert json.loads(out_json.read_text())["plan"] is None


def test_profile_takes_the_factory_plan_takes(factory_dir, fixed_clock, capsys):
    # `forget plan user_models:tree` plans it; `forget profile` profiles the same target.
    png, out_json = factory_dir / "timeline.png", factory_dir / "profile.json"
    argv = ["profile", "user_models.py:tree", "--budget", "min", "--repeats", "1", "--quiet"]
    assert cli_main([*argv, "--timeline", str(png), "--json", str(out_json)]) == 0
    data = json.loads(out_json.read_text())
    plan = forget.Plan.from_dict(data["plan"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[:3] == [
        "forget profile: user_models.py:tree, Net over its module tree, 3 candidate modules, "
        f"torch {torch.__version__}",
        f"plain step: peak {data['plain_peak_bytes']:,} B "
        f"({forget.schedules.format_bytes(data['plain_peak_bytes'])}) by the allocator "
        f"(profiler), predicted (the plain step never runs); ledger "
        f"{plan.plain_ledger_peak_bytes:,} B on fake tensors",
        "module                         kept B       input B        work B     fwd ms",
    ]
    # A layer keeps its first Linear's and GELU's outputs, 2 x 16 x 32 floats, and its
    # input, 16 x 8 floats, which is all it holds when forgotten (the first layer's input
    # is the batch, alive anyway); the fixed clock gives every module 1 ms. Its backward's
    # work holds the gradients of the parameters after it: layer 0's is layer 1's and the
    # gradients of layer 1's 552 parameters.
    assert lines[4:7] == [
        "  layers.0 (Sequential)         4,096             0         8,516      1.000",
        "  layers.1 (Sequential)         4,608           512         6,308      1.000",
        "  layers.2 (Sequential)         4,608           512         3,588      1.000",
    ]
    assert 8_516 - 6_308 == (8 * 32 + 32 + 32 * 8 + 8) * 4
    assert [m["name"] for m in data["modules"]] == ["<model>", *(f"layers.{i}" for i in range(3))]
    assert f"\n{plan}\n" in out
    assert plan.budget_bytes == plan.min_feasible_bytes == plan.measured_peak_bytes
    assert max(data["timeline"]["plain"]) == plan.plain_ledger_peak_bytes
    assert max(data["timeline"]["planned"]) == plan.ledger_peak_bytes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "target",
    [
        "user_models:alone",  # the model alone: the contract, and how to give a chain instead
        "user_models:nothing",
        "no_such_module_xyz:build",
        "missing.py:build",
    ],
)
def test_profile_refuses_a_target_as_plan_does(factory_dir, target, capsys):
    assert cli_main(["plan", target, "--quiet"]) == 2
    by_plan = capsys.readouterr().err
    assert cli_main(["profile", target, "--quiet"]) == 2
    by_profile = capsys.readouterr().err
    assert by_profile == by_plan.replace("forget plan --model", "forget profile")
    assert len(by_profile.splitlines()) == 1 and by_profile.startswith("forget: ")


def test_profile_refuses_an_input_shape_beside_a_batch(factory_dir, capsys):
    assert cli_main(["profile", "user_models:tree", "--input-shape", "4,64", "--quiet"]) == 2
    assert capsys.readouterr().err == (
        "forget: --input-shape gives a chain its random input; user_models:tree() returned its "
        "own batch, a tuple: leave --input-shape out\n"
    )
