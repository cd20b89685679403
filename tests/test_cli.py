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


@pytest.mark.slow
def test_console_script_runs_demo(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringpack.cli",
            "demo",
            "--quick",
            "--no-ring-check",
            "--quiet",
            "--out",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert "standard-library files" in out
    assert "zigzag/first_fit" in out and "contiguous/first_fit" in out and "balanced/balanced" in out
    assert "report.html" in out
    assert (tmp_path / "demo" / "report.html").is_file() and (tmp_path / "demo" / "rank_costs.png").is_file()


@pytest.mark.parametrize("word", ["-:\x1e", "a\nb", "x\u2028y", "\x1c"])
def test_a_usage_error_stays_one_line_whatever_the_arguments_hold(word, capsys):
    """``str.splitlines`` breaks at separators such as ``\\x1e``; the message must not."""
    with pytest.raises(SystemExit) as info:
        main(["plan", "--lengths", "x.npy", "--dp", "1", "--cp", "1", "--tokens-per-rank", "4", "--out", "p", word])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("ringpack: error: unrecognized arguments"), repr(err)
