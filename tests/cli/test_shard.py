"""``ringpack shard`` on a text dataset: a too-long sample is refused as soon as it is measured, and
tokenizing counts its rows in a log (with an estimate of the time left) unless ``--quiet``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

import ringpack.progress
from ringpack.cli.shard import AUTO_PROCESS_ROWS, MAX_AUTO_PROCESSES, tokenizing_processes
from ringpack.data import sources
from tests.helpers.cli import assert_clean, run_cli

MESH = ["--dp", "1", "--cp", "2", "--tokens-per-rank", "512", "--samples-per-step", "8", "--no-length-cache"]
ROWS = 600  # more than one batch of the tokenizing map (256 rows)


def write_texts(path, long_row: int | None):
    """``ROWS`` short texts, row ``long_row`` of 3,000 regex tokens (more than cp x tokens_per_rank = 1024)."""
    with path.open("w") as f:
        for i in range(ROWS):
            text = "word " * 3000 if i == long_row else f"short text number {i} " * 5
            f.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture
def encoded(monkeypatch):
    """How many texts the regex tokenizer encodes."""
    seen = []

    def counting(text, *args, **kwargs):
        seen.append(text)
        return real(text, *args, **kwargs)

    real = sources.regex_token_ids
    monkeypatch.setattr(sources, "regex_token_ids", counting)
    return seen


@pytest.mark.parametrize("long_row", [0, 300])
def test_a_too_long_sample_is_refused_before_the_rest_is_tokenized(long_row, tmp_path, encoded):
    data = write_texts(tmp_path / "docs.jsonl", long_row)
    run = run_cli(["shard", data, *MESH, "--out", tmp_path / "out", "--cache-dir", tmp_path / "hf", "--quiet"])
    assert_clean(run)
    assert run.code == 1
    error = run.err.splitlines()[-1]
    assert f"sample {long_row} of {data} has 3000 tokens, more than one CP group holds" in error
    assert "(cp=2 x tokens_per_rank=512 = 1024)" in error
    assert "--tokens-per-rank" in error and "--cp" in error
    assert "--overflow drop" in error and "--overflow split" in error
    assert long_row < len(encoded) <= long_row + 16, "encoding stops right after the long text"
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_ids_from_the_cache_are_refused_before_planning(tmp_path, monkeypatch):
    data = write_texts(tmp_path / "docs.jsonl", 5)
    argv = ["shard", data, *MESH, "--cache-dir", tmp_path / "hf", "--quiet"]
    assert run_cli([*argv, "--out", tmp_path / "split", "--overflow", "split"]).code == 0

    def no_planning(*args, **kwargs):
        raise AssertionError("planned a dataset holding a sample too long")

    monkeypatch.setattr("ringpack.data.shard_writer.make_plan", no_planning)
    run = run_cli([*argv, "--out", tmp_path / "error"])  # refused before any planning
    assert run.code == 1 and f"sample 5 of {data} has 3000 tokens, more than one CP group holds" in run.err


def test_tokenizing_is_counted_in_a_log_with_the_time_left_and_quiet_prints_none(tmp_path, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)  # every count logs: the test sees the lines
    data = write_texts(tmp_path / "docs.jsonl", None)
    argv = ["shard", data, *MESH]  # a fresh datasets cache each run: every run tokenizes
    run = run_cli([*argv, "--out", tmp_path / "a", "--cache-dir", tmp_path / "hf-a"])
    assert run.code == 0 and "\r" not in run.err
    counts = [line for line in run.err.splitlines() if line.startswith("ringpack shard: tokenizing: ")]
    assert counts and all(f"/{ROWS} samples (" in line for line in counts)
    assert any(" left" in line for line in counts), "an estimate of the time left"
    assert f"tokenizing: {ROWS}/{ROWS} samples (100%)" in counts[-1]
    assert " micro-batches (" in run.err  # writing is counted too
    assert run_cli([*argv, "--out", tmp_path / "b", "--cache-dir", tmp_path / "hf-b", "--quiet"]).err == ""
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 3600.0)  # short work logs no count
    assert "tokenizing: " not in run_cli([*argv, "--out", tmp_path / "c", "--cache-dir", tmp_path / "hf-c"]).err


@pytest.mark.slow  # forks tokenizing processes
def test_worker_processes_refuse_a_too_long_sample_as_the_one_process_does(tmp_path):
    rows = AUTO_PROCESS_ROWS + 200  # the default --num-proc then forks a process per core
    data = tmp_path / "docs.jsonl"
    with data.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"text": "word " * 3000 if i == 1100 else f"short text number {i} " * 5}) + "\n")
    # as a user runs it: a fresh process, whose tokenizing workers fork from a process without test threads
    argv = [sys.executable, "-m", "ringpack", "shard", data, *MESH, "--cache-dir", tmp_path / "hf", "--quiet"]
    for processes in ([], ["--num-proc", "2"]):
        argv_run = [str(a) for a in (*argv, *processes, "--out", tmp_path / f"out{len(processes)}")]
        run = subprocess.run(argv_run, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert run.returncode == 1, run.stderr
        assert f"sample 1100 of {data} has 3000 tokens" in run.stderr.splitlines()[-1], run.stderr


def test_the_default_processes_follow_the_rows_and_cores(monkeypatch):
    assert tokenizing_processes(3, 10) == 3 and tokenizing_processes(None, AUTO_PROCESS_ROWS - 1) == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert tokenizing_processes(None, AUTO_PROCESS_ROWS) == MAX_AUTO_PROCESSES


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_while_a_command_runs_ends_on_sigterm_at_once():
    from ringpack.cli.app import _sigterm_unwinds

    with _sigterm_unwinds("shard"):
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the command unwinds on SIGTERM
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child reports its handler and leaves at once
            os.write(write, b"default" if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else b"command")
            os._exit(0)
        os.close(write)
        seen = os.read(read, 16)
        os.waitpid(pid, 0)
    assert seen == b"default"
