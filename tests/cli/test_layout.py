"""``--world`` and ``--cp auto`` of ``plan`` and ``report``: dp from the cluster, the layout chosen and planned."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.analysis.layout import choose_layout
from ringpack.cost import CostModel
from ringpack.shard_plan import Plan
from tests.helpers.cli import assert_clean, run_cli

TOKENS = ["--tokens-per-rank", "1024", "--model", "llama3-8b"]


@pytest.fixture
def short(tmp_path):
    """Equal short samples: every rank's work fits whole, so no split and no K/V exchange pays."""
    path = tmp_path / "short.npy"
    np.save(path, np.full(256, 200, dtype=np.int64))
    return path


@pytest.fixture
def one_huge(tmp_path):
    """One sample as long as a node's whole budget among short ones: it has to be split."""
    path = tmp_path / "huge.npy"
    lengths = np.full(300, 100, dtype=np.int64)
    lengths[7] = 4 * 1024 - 64
    np.save(path, lengths)
    return path


def _plan(argv, tmp_path):
    out = tmp_path / "p.json"
    run = run_cli(["plan", *argv, "--out", out, "--json", "--quiet"])
    assert_clean(run)
    return run, out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--cp", "auto"], "--world"),
        (["--cp", "auto", "--world", "8", "--dp", "2"], "--dp"),
        (["--cp", "3", "--world", "8"], "--world 8"),
        (["--cp", "2", "--world", "8", "--dp", "2"], "--dp 2"),
        (["--cp", "banana", "--world", "8"], "--cp"),
    ],
)
def test_bad_layout_flags_get_one_line_naming_the_flag(short, tmp_path, argv, named):
    run, _ = _plan(["--lengths", short, *TOKENS, *argv], tmp_path)
    assert run.code in (1, 2) and named in run.err.splitlines()[-1]


def test_neither_dp_nor_world_is_a_usage_error(short, tmp_path):
    run, _ = _plan(["--lengths", short, *TOKENS, "--cp", "2"], tmp_path)
    assert run.code == 2 and "--dp" in run.err


def test_world_sets_dp(short, tmp_path):
    run, out = _plan(["--lengths", short, *TOKENS, "--cp", "2", "--world", "8", "--samples-per-step", "64"], tmp_path)
    assert run.code == 0
    config = Plan.load(out).config
    assert (config.dp, config.cp) == (4, 2)


@pytest.mark.parametrize("fixture", ["short", "one_huge"])
def test_cp_auto_plans_the_layout_choose_layout_ranks_first(fixture, request, tmp_path):
    lengths = request.getfixturevalue(fixture)
    argv = ["--lengths", lengths, *TOKENS, "--cp", "auto", "--world", "8", "--gpus-per-node", "4"]
    run, out = _plan([*argv, "--samples-per-step", "100"], tmp_path)
    assert run.code == 0, run.err
    summary = json.loads(run.out)
    best = summary["layout"]["candidates"][0]
    config = Plan.load(out).config
    assert (config.dp, config.cp, config.gpus_per_node) == (best["dp"], best["cp"], best["gpus_per_node"])
    assert config.dp * config.cp == 8
    want = choose_layout(
        np.load(lengths), 8, 4, 1024, CostModel.preset("llama3-8b"), samples_per_step=100
    ).best  # the same choice as the library's, for the same lengths and batch
    assert (best["layout"], best["mode"]) == (want.name, want.mode)
    if fixture == "short":
        assert best["cp"] < 8, "equal short samples need no pool"
    else:
        assert best["cp"] >= 4, "a sample of a node's budget needs a group of at least a node"


def test_cp_auto_table_and_report(short, tmp_path):
    argv = ["--lengths", short, *TOKENS, "--cp", "auto", "--world", "8", "--gpus-per-node", "4"]
    run = run_cli(["plan", *argv, "--samples-per-step", "64", "--out", tmp_path / "p.json", "--quiet"])
    assert_clean(run)
    assert "layout for these lengths" in run.out and "planning with dp=" in run.out
    run = run_cli(
        ["report", *argv, "--samples-per-step", "64", "--peers", "none", "--no-plots", "--out", tmp_path / "r"]
    )
    assert_clean(run)
    assert run.code == 0 and "layout for these lengths" in run.out
