"""The ``forget`` command line: routing, usage and every subcommand's --help."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from forget import _cli as cli

COMMANDS = ["demo", "bench", "plan", "profile"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command, capsys):
    try:
        status = cli.main([command, "--help"])
    except SystemExit as exit_:  # argparse's own exit, where a command lets it through
        status = exit_.code
    assert status == 0
    assert capsys.readouterr().out.startswith(f"usage: forget {command}")


def test_usage_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: forget COMMAND")
    for command in COMMANDS:
        assert f"  {command} " in out


def test_no_command_prints_usage_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: forget COMMAND" in capsys.readouterr().out


def test_unknown_command_is_named(capsys):
    assert cli.main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().out


def test_python_dash_m_runs_the_same_cli():
    done = subprocess.run(
        [sys.executable, "-m", "forget", "--help"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: forget COMMAND")


def test_the_command_line_keeps_kinetos_log_off_stderr():
    # NOTE [kineto's log] in forget._cli: in a fresh process, without the variable set.
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    argv = ["plan", "--model", "residual_mlp", "--size", "tiny", "--budgets", "75%"]
    argv += ["--repeats", "1", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "forget", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "residual_mlp @ 75%:" in done.stdout.splitlines()
    assert done.stderr == ""


def test_demo_help_describes_every_option_with_its_default(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["demo", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Train an MLP of Linear-BatchNorm-ReLU-Dropout blocks" in out
    assert out.split("options:\n", 1)[1] == (
        "  -h, --help         show this help message and exit\n"
        "  --width WIDTH      features of every block (default: 512)\n"
        "  --depth DEPTH      number of blocks (default: 8)\n"
        "  --batch BATCH      samples per step (default: 256)\n"
        "  --steps STEPS      SGD steps each variant trains (default: 5)\n"
        "  --repeats REPEATS  timed steps per variant (default: 7)\n"
    )


@pytest.mark.parametrize("flag", ["--width", "--depth", "--batch", "--steps", "--repeats"])
def test_demo_refuses_a_size_below_one(flag, capsys):
    assert cli.main(["demo", flag, "0"]) == 2
    assert capsys.readouterr().err == f"forget: {flag} must be at least 1\n"


def test_demo_runs_and_matches_plain(capsys):
    argv = ["demo", "--width", "8", "--depth", "2", "--batch", "8", "--steps", "2"]
    assert cli.main([*argv, "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[3:6]] == ["plain", "torch_checkpoint", "forget"]
    # Every ratio is the variant's figure over the baseline's.
    assert [line.split(":")[0] for line in lines[7:12]] == [
        "bytes saved for backward, forget / plain",
        "peak bytes, forget / plain",
        "peak bytes, forget / torch_checkpoint",
        "step time, forget / plain",
        "step time, forget / torch_checkpoint",
    ]
    assert [line.rsplit(" ", 1)[1] for line in lines[-5:-1]] == ["identical"] * 4
