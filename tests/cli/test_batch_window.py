"""``--batch-window``: the flag of every planning command, and what ``plan`` and ``report`` print about it."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import global_batches
from ringpack.shard_plan import Plan, PlanConfig
from tests.helpers.cli import assert_clean, run_cli

MESH = ["--dp", "4", "--cp", "2", "--tokens-per-rank", "2048", "--samples-per-step", "80"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    rng = np.random.default_rng(5)
    lengths = np.clip(rng.lognormal(5.0, 1.3, 1500).astype(np.int64), 1, 4096)
    np.save(root / "lengths.npy", lengths)
    model = CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")  # long samples are outliers
    model.save(root / "heavy.json")
    return {"root": root, "lengths": lengths, "model": model}


def args(inputs, *more):
    return ["--lengths", inputs["root"] / "lengths.npy", *MESH, "--model", inputs["root"] / "heavy.json", *more]


def test_plan_prints_what_the_window_moved_and_bought(inputs):
    out = inputs["root"] / "plan.json"
    run = run_cli(["plan", *args(inputs, "--batch-window", "2", "--out", out, "--quiet")])
    assert_clean(run)
    assert run.code == 0
    plan = Plan.load(out)
    cfg = PlanConfig(dp=4, cp=2, tokens_per_rank=2048, samples_per_step=80, cost=inputs["model"], batch_window=2)
    assert plan.config.batch_window == 2 and plan == make_plan(inputs["lengths"], cfg)
    moves = global_batches(inputs["lengths"], cfg).moves()
    line = next(line for line in run.out.splitlines() if line.startswith("batch window 2:"))
    assert f"{moves.count:,} samples ({moves.count / 1500:.2%})" in line
    assert f"at most {moves.distances.max()} and on average {moves.distances.mean():.2f} batches away" in line
    ratio = float(re.search(r"\((\d+\.\d+)x\)$", line).group(1))
    assert ratio == pytest.approx(moves.predicted_drawn.sum() / moves.predicted.sum(), abs=0.01) and ratio > 1

    summary = json.loads(run_cli(["plan", *args(inputs, "--batch-window", "2", "--out", out, "--json")]).out)
    assert summary["batch_window"]["moved"] == moves.count and summary["batch_window"]["max_distance"] <= 2
    plain = run_cli(["plan", *args(inputs, "--out", out, "--quiet")])
    assert plain.code == 0 and "batch window" not in plain.out


def test_report_shows_the_plan_without_the_window(inputs):
    out = inputs["root"] / "report"
    run = run_cli(
        ["report", *args(inputs, "--batch-window", "2", "--strategies", "balanced", "--packings", "balanced",
                         "--peers", "wlb", "--out", out, "--quiet", "--no-plots")]
    )  # fmt: skip
    assert_clean(run)
    assert run.code == 0
    doc = json.loads((out / "report.json").read_text())
    names = [p["name"] for p in doc["plans"]]
    assert names == ["balanced/balanced", "balanced/balanced no window"]
    assert doc["plans"][0]["config"]["batch_window"] == 2 and "batch_window" not in doc["plans"][1]["config"]
    window = doc["batch_window"]
    assert window["plan"] == "balanced/balanced" and window["without"] == "balanced/balanced no window"
    assert window["moved"] > 0 and window["max_distance"] <= 2
    text = " ".join(run.out.split())
    assert "batch window 2: " in text
    summaries = {p["name"]: p["summary"] for p in doc["plans"]}
    speed = (
        summaries["balanced/balanced no window"]["predicted_seconds_comm"]
        / summaries["balanced/balanced"]["predicted_seconds_comm"]
    )
    assert speed > 1.1, "the window lowers the predicted epoch time here"
    assert f"without (the 'balanced/balanced no window' row): {speed:.2f}x" in text
    wlb = doc["peers"][0]
    assert wlb["name"] == "wlb" and "batch_window" not in wlb["config"], "a peer starts from the batches as drawn"


@pytest.mark.parametrize("command", ["plan", "report", "simulate", "shard"])
@pytest.mark.parametrize("bad", ["-1", "x", "1.5"])
def test_a_bad_window_is_one_line_naming_the_flag(command, bad, inputs):
    run = run_cli([command, "--batch-window", bad])
    assert_clean(run)
    assert run.code == 2 and "argument --batch-window:" in run.err


def test_a_config_file_sets_the_window(inputs):
    toml = inputs["root"] / "run.toml"
    toml.write_text("batch_window = 3\n")
    out = inputs["root"] / "from-file.json"
    run = run_cli(["plan", *args(inputs, "--config", toml, "--out", out, "--quiet")])
    assert run.code == 0, run.err
    assert Plan.load(out).config.batch_window == 3


def simulate_args(inputs, out, *more):
    return [
        "simulate", "--lengths", inputs["root"] / "lengths.npy", "--world", "8", "--cp", "2", "--tokens-per-rank",
        "2048", "--samples-per-step", "80", "--model", inputs["root"] / "heavy.json", "--strategies", "balanced",
        "--packings", "balanced", "--peers", "none", "--jobs", "1", "--out", out, "--json", "-", "--quiet",
        "--no-plots", *more,
    ]  # fmt: skip


def test_simulate_refuses_chunks_that_do_not_hold_whole_window_blocks(inputs):
    out = inputs["root"] / "sim-refused"
    run = run_cli(simulate_args(inputs, out, "--batch-window", "4", "--chunk-steps", "1"))
    assert_clean(run)
    assert run.code == 1 and "--batch-window 4" in run.err and "--chunk-steps 1" in run.err, run.err
    assert "multiple of 5" in run.err


def test_simulate_plans_the_window_in_whole_blocks(inputs):
    def simulated(*more):
        run = run_cli(simulate_args(inputs, inputs["root"] / "sim", *more))
        assert run.code == 0, run.err
        doc = json.loads(run.out)
        return doc["planning"]["chunk_steps"], doc["plans"][0]["summary"]["predicted_seconds_comm"]

    plain_chunk, plain = simulated()
    chunk, windowed = simulated("--batch-window", "2")
    assert (plain_chunk, chunk) == (8, 9), "the default chunk is rounded up to whole blocks of 3 steps"
    assert windowed < plain, "the window lowers the predicted epoch time here"
    assert simulated("--batch-window", "2", "--chunk-steps", "3")[0] == 3
