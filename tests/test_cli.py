"""The ``forget`` command line: routing, usage and every subcommand's --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forget import cli

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
