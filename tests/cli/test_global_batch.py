"""One global batch on every subcommand: ``--samples-per-step`` (0: one step) or ``--global-batch-tokens``."""

from __future__ import annotations

import json

import numpy as np
import pytest

import ringpack.cli.demo_run
from ringpack.analysis.demo import DemoConfig
from ringpack.shard_plan import global_batch_samples
from tests.helpers.cli import assert_clean, run_cli, token_rows

LENGTHS = np.random.default_rng(7).integers(1, 3000, size=300)
MESH = ["--dp", "2", "--cp", "2", "--tokens-per-rank", "4096", "--model", "tiny"]


@pytest.fixture
def lengths(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    return path


def planned(argv: list) -> dict:
    run = run_cli(["plan", *argv, "--json", "--quiet"])
    assert run.code == 0, run.err
    return json.loads(run.out)


@pytest.mark.parametrize("batch", [[], ["--samples-per-step", "40"], ["--global-batch-tokens", "60000"]])
def test_report_plans_what_plan_plans_with_the_same_flags(lengths, tmp_path, batch):
    plan = planned(["--lengths", lengths, *MESH, *batch, "--out", tmp_path / "p.json"])
    argv = ["report", "--lengths", lengths, *MESH, *batch, "--out", tmp_path / "r", "--no-plots", "--quiet"]
    run = run_cli([*argv, "--json", "-", "--peers", "none", "--strategies", "balanced", "--packings", "balanced"])
    assert run.code == 0, run.err
    assert [p["hash"] for p in json.loads(run.out)["plans"]] == [plan["hash"]]
    if not batch:
        assert plan["steps"] == 1  # 0 samples per step: every sample in one step, on both


def test_global_batch_tokens_sizes_the_batch_from_the_mean_length(lengths, tmp_path):
    for tokens, want in (("60000", int(60000 / LENGTHS.mean())), ("auto", int(2 * 2 * 4096 / LENGTHS.mean()))):
        plan = planned(["--lengths", lengths, *MESH, "--global-batch-tokens", tokens, "--out", tmp_path / "p.json"])
        per_step = json.loads((tmp_path / "p.json").read_text())["config"]["samples_per_step"]
        assert (
            per_step
            == max(2, want)
            == global_batch_samples(
                LENGTHS, tokens if tokens == "auto" else int(tokens), dp=2, cp=2, tokens_per_rank=4096
            )
        )
        assert plan["steps"] == -(-len(LENGTHS) // per_step)


def test_one_global_batch_at_a_time(lengths, tmp_path):
    argv = ["plan", "--lengths", lengths, *MESH, "--out", tmp_path / "p.json"]
    run = run_cli([*argv, "--samples-per-step", "40", "--global-batch-tokens", "60000"])
    assert_clean(run)
    assert run.code == 1 and "--samples-per-step and --global-batch-tokens" in run.err
    assert run_cli([*argv, "--samples-per-step", "40", "--global-batch-tokens", "0"]).code == 0  # 0: not used
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"samples_per_step": 40}))
    plan = planned([*argv[1:], "--config", config, "--global-batch-tokens", "60000"])  # the command line wins
    assert plan["hash"] == planned([*argv[1:], "--global-batch-tokens", "60000"])["hash"]


def test_simulate_states_its_batch_and_refuses_an_epoch_in_one_step(lengths, tmp_path):
    argv = ["simulate", "--lengths", lengths, "--world", "4", "--cp", "2", "--tokens-per-rank", "4096", "--jobs", "1"]
    run = run_cli([*argv, "--samples-per-step", "0", "--out", tmp_path / "s", "--no-plots", "--quiet"])
    assert_clean(run)
    assert run.code == 1 and "--samples-per-step 0" in run.err and "--global-batch-tokens" in run.err
    run = run_cli([*argv, "--out", tmp_path / "s", "--no-plots", "--quiet", "--json", "-"])
    assert run.code == 0, run.err
    auto = global_batch_samples(LENGTHS, "auto", dp=2, cp=2, tokens_per_rank=4096)
    assert {p["config"]["samples_per_step"] for p in json.loads(run.out)["plans"]} == {auto}


def test_the_demo_reads_its_batch_as_every_command_does(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(ringpack.cli.demo_run, "run_demo", lambda config, progress: seen.append(config) or 0)
    for extra in ([], ["--samples-per-step", "0"], ["--samples-per-step", "9"], ["--global-batch-tokens", "5000"]):
        assert run_cli(["demo", "--out", tmp_path / "d", *extra]).code == 0
    per_step = [config.samples_per_step_of(LENGTHS) for config in seen]
    assert per_step == [
        global_batch_samples(LENGTHS, "auto", dp=4, cp=4, tokens_per_rank=32768),
        0,
        9,
        max(4, int(5000 / LENGTHS.mean())),  # at least one sample per DP rank
    ]
    assert DemoConfig().samples_per_step_of(LENGTHS) == max(4, int(4 * 4 * 32768 / LENGTHS.mean()))


def test_shard_sizes_its_batch_from_the_token_ids_it_writes(tmp_path):
    rows = token_rows(40)
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    argv = ["shard", ids, "--dp", "2", "--cp", "2", "--tokens-per-rank", "256", "--cache-dir", tmp_path / "cache"]
    run = run_cli([*argv, "--global-batch-tokens", "600", "--out", tmp_path / "shards", "--quiet"])
    assert run.code == 0, run.err
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    mean = np.mean([len(r) for r in rows])
    assert manifest["config"]["samples_per_step"] == max(2, int(600 / mean))
