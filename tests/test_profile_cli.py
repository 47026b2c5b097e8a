"""``forget profile``: ledger table, plan, timeline PNG and JSON, errors."""

from __future__ import annotations

import json
import textwrap

import pytest

from forget.cli import _profile
from forget.cli import main as cli_main

FACTORY = """
import torch

def build():
    layer = lambda: torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)
    )
    return torch.nn.Sequential(*[layer() for _ in range(3)])
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
    assert lines[0].startswith("forget profile: user_models:build, 3 blocks, torch ")
    assert lines[1].startswith("plain step: peak ")
    assert (
        " ".join(lines[2].split())
        == "block input B output B kept B fwd tmp B bwd tmp B fwd ms bwd ms"
    )
    # 128 x 16 float32 in and out per block; it keeps the first Linear's and GELU's
    # outputs, 2 x 128 x 64 floats (its input is the caller's, not counted).
    assert lines[3].split()[:4] == ["0", "8,192", "8,192", "65,536"]
    assert lines[7].startswith("forget plan (")
    data = json.loads(out_json.read_text())
    plan = data["plan"]
    assert plan["measured_peak_bytes"] <= plan["budget_bytes"]
    assert max(data["timeline"]["plain"]) == data["plain_peak_bytes"]
    assert max(data["timeline"]["planned"]) == plan["measured_peak_bytes"]
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
