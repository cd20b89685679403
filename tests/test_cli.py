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


def test_running_out_of_memory_is_one_line_naming_the_input_and_its_size(tmp_path, monkeypatch):
    import numpy as np

    from ringpack import lengths as lengths_module
    from tests.helpers.cli import assert_clean, run_cli

    path = tmp_path / "lengths.npy"
    np.save(path, np.arange(1, 1001))

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 76.3 MiB for an array with shape (10000000,) and data type int64")

    monkeypatch.setattr(lengths_module, "check_lengths", no_memory)
    run = run_cli(["report", "--lengths", path, "--dp", 2, "--cp", 2, "--tokens-per-rank", 4096, "--no-plots"])
    assert_clean(run)
    size = f"{path.stat().st_size / 2**20:,.1f} MiB"
    assert run.code == 1 and f"ringpack report: error: out of memory on --lengths {path} ({size}): Unable to" in run.err


@pytest.mark.slow
def test_report_of_ten_million_samples_in_one_gigabyte_is_one_line(tmp_path):
    """Under a 1 GB address-space limit: no traceback, one error line (a MemoryError or the OS refusing a read)."""
    import resource

    import numpy as np

    path = tmp_path / "lengths.npy"
    np.save(path, np.random.default_rng(0).integers(1, 4000, 10_000_000))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))

    argv = ["report", "--lengths", str(path), "--dp", "8", "--cp", "2", "--tokens-per-rank", "8192", "--no-plots"]
    done = subprocess.run(
        [sys.executable, "-m", "ringpack.cli", *argv], capture_output=True, text=True, timeout=300, preexec_fn=limit
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert lines[-1].startswith("ringpack report: error: ") and str(path) in lines[-1], done.stderr[-3000:]
    assert sum("error:" in line for line in lines) == 1, done.stderr[-3000:]
