"""The "what would help" advice: each remedy re-planned, ranked by gain, in report, plan and simulate."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.analysis.advice import advise
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.shard_plan import PlanConfig
from tests.helpers.cli import assert_clean, run_cli


def one_long_per_step(steps: int = 24, per_step: int = 60) -> np.ndarray:
    """Per global batch (after any shuffle) about one sample far costlier than the rest together:
    its DP rank bounds every step it is in, and only moving it between steps balances the ranks."""
    lengths = np.full(steps * per_step, 120, dtype=np.int64)
    lengths[::per_step] = 6000
    return lengths


def test_batch_window_gains_where_the_longest_sample_bounds_every_step():
    cost = CostModel.preset("llama-1b")
    config = PlanConfig(dp=4, cp=1, tokens_per_rank=8192, samples_per_step=60, cost=cost)
    advice = advise(one_long_per_step(), config, CommModel.for_model(cost))
    gains = [r["gain"] for r in advice["remedies"] if r["gain"] is not None]
    assert gains == sorted(gains, reverse=True), "remedies ranked by gain"
    window = next(r for r in advice["remedies"] if r["flag"] == "--batch-window 2")
    assert window["gain"] > 1.0, advice
    assert window["gain"] == pytest.approx(window["tokens_per_second"] / advice["current"]["tokens_per_second"])
    cause = next(c for c in advice["causes"] if c["name"] == "longest sample")
    assert cause["applies"] and cause["value"] > 0.25, cause
    best = advice["remedies"][0]
    assert advice["headline"].startswith(f"what would help: {best['flag']} predicts {best['gain']:.2f}x")


def test_large_inputs_are_advised_on_a_stated_sample_the_same_each_time():
    cost = CostModel.preset("llama-1b")
    lengths = np.random.default_rng(0).integers(50, 3000, 30_000)
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=4096, samples_per_step=100, cost=cost)
    comm = CommModel.for_model(cost)
    first, again = advise(lengths, config, comm), advise(lengths, config, comm)
    assert first == again
    assert "1,200 of 30,000 samples (the first 12 global batches" in first["basis"], first["basis"]


def test_report_shows_the_advice_first_and_in_json_and_html(tmp_path):
    path = tmp_path / "l.npy"
    np.save(path, one_long_per_step())
    doc = tmp_path / "r.json"
    argv = ["report", "--lengths", path, "--dp", "4", "--cp", "1", "--tokens-per-rank", "8192", "--model", "llama-1b"]
    run = run_cli([*argv, "--samples-per-step", "60", "--peers", "none", "--no-plots", "--quiet"]
                  + ["--out", tmp_path / "r", "--json", doc])  # fmt: skip
    assert_clean(run)
    assert run.code == 0
    advice = json.loads(doc.read_text())["advice"]
    best = advice["remedies"][0]
    assert best["gain"] > 1.0
    first = run.out.splitlines()[0]
    assert first == advice["headline"] and best["flag"] in first, first
    assert "== what would help ==" in run.out and "--batch-window 2" in run.out
    page = (tmp_path / "r" / "report.html").read_text()
    assert "<h2>What would help</h2>" in page and f"<code>{best['flag']}</code>" in page
    assert page.index("What would help") < page.index("<pre>"), "the advice comes before the tables"


def _lengths_file(tmp_path) -> list:
    path = tmp_path / "l.npy"
    np.save(path, one_long_per_step())
    return ["--lengths", path, "--cp", "1", "--tokens-per-rank", "8192", "--model", "llama-1b"]


def test_plan_ends_with_the_winning_flag_and_no_advice_skips_it(tmp_path):
    argv = ["plan", *_lengths_file(tmp_path), "--dp", "4", "--samples-per-step", "60", "--quiet"]
    run = run_cli([*argv, "--out", tmp_path / "p.parquet", "--json"])
    assert_clean(run)
    advice = json.loads(run.out)["advice"]
    assert advice["remedies"][0]["gain"] > 1.0, advice
    shown = run_cli([*argv, "--out", tmp_path / "p.parquet"])
    assert shown.out.splitlines()[-1].startswith(advice["headline"]), shown.out
    skipped = run_cli([*argv, "--out", tmp_path / "p.parquet", "--no-advice"])
    assert "what would help" not in skipped.out, skipped.out


@pytest.mark.slow
def test_simulate_puts_the_advice_first_in_its_table_and_json(tmp_path):
    doc = tmp_path / "s.json"
    argv = ["simulate", *_lengths_file(tmp_path), "--world", "4", "--samples-per-step", "60", "--peers", "none"]
    run = run_cli([*argv, "--no-plots", "--quiet", "--jobs", "1", "--out", tmp_path / "s", "--json", doc])
    assert_clean(run)
    advice = json.loads(doc.read_text())["advice"]
    assert advice["remedies"][0]["gain"] > 1.0, advice
    table = run.out.split("headline exchange:", 1)[1].splitlines()
    assert table[1] == advice["headline"], run.out
