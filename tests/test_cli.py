"""The command line: every subcommand has --help; unfinished ones exit 2 with a message; the demo runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ringpack.cli import build_parser, main

SUBCOMMANDS = ("plan", "report", "shard", "demo", "simulate", "calibrate")


def test_every_subcommand_is_registered():
    parser = build_parser()
    choices = next(a for a in parser._actions if a.dest == "command").choices
    assert set(SUBCOMMANDS) <= set(choices)


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert command in capsys.readouterr().out


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_console_script_runs_demo():
    out = subprocess.run(
        [sys.executable, "-m", "ringpack.cli", "demo", "--microbatches", "2", "--cp", "2"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    assert "standard-library files" in out
    assert "zigzag" in out and "contiguous" in out
