"""``--world`` and ``--cp auto`` of ``plan`` and ``report``: dp from the cluster, the layout chosen and planned."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.comm_model import HEAD_PARALLEL_MODES, MODES
from ringpack.cost import CostModel
from ringpack.planner.layout import choose_layout
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


def _simulate(argv, tmp_path):
    doc = tmp_path / "sim.json"
    base = ["simulate", *TOKENS, "--peers", "none", "--no-plots", "--jobs", "1", "--quiet"]
    run = run_cli([*base, *argv, "--out", tmp_path / "sim", "--json", doc])
    assert_clean(run)
    return run, (json.loads(doc.read_text()) if run.code == 0 else None)


def test_simulate_cp_auto_compares_every_layout_and_simulates_the_chosen_one(one_huge, tmp_path):
    argv = ["--lengths", one_huge, "--gpus", "8", "--cp", "auto", "--gpus-per-node", "4", "--samples-per-step", "100"]
    run, doc = _simulate(argv, tmp_path)
    assert run.code == 0, run.err
    assert "== layouts for 8 GPUs ==" in run.out and "exposed s" in run.out and "IB GB/step" in run.out
    layouts = {(c["layout"], c["mode"]) for c in doc["layout"]["candidates"]}
    # the hybrids only where the CP group spans nodes (inside one node a hybrid is ulysses)
    hybrid = {mode for mode, between in HEAD_PARALLEL_MODES.items() if between}
    want_layouts = {(name, mode) for name in ("cp=1", "cp=2", "cp=4", "pool") for mode in MODES}
    assert layouts == {(name, mode) for name, mode in want_layouts if name == "pool" or mode not in hybrid}
    best = doc["layout"]["candidates"][0]
    assert (doc["dp"], doc["cp"]) == (best["dp"], best["cp"])
    assert doc["plans"][0]["config"].get("gpus_per_node") == best["gpus_per_node"]
    want = choose_layout(np.load(one_huge), 8, 4, 1024, CostModel.preset("llama3-8b"), samples_per_step=100).best
    assert (best["layout"], best["mode"]) == (want.name, want.mode)
    for c in doc["layout"]["candidates"]:
        if c["feasible"] and not c["stopped"]:
            assert c["exposed_comm_seconds"] == pytest.approx(c["step_seconds"] - c["compute_seconds"], abs=1e-12)


def test_simulate_cp_auto_uses_the_links_and_tflops_given(one_huge, tmp_path):
    """The comparison times the layouts with the command's links and rate, not the defaults."""
    argv = ["--lengths", one_huge, "--gpus", "8", "--cp", "auto", "--gpus-per-node", "4", "--samples-per-step", "100"]
    _, fast = _simulate(argv, tmp_path)
    _, slow = _simulate([*argv, "--inter-link", "pcie", "--tflops", "800"], tmp_path)
    by = lambda doc: {(c["layout"], c["mode"]): c for c in doc["layout"]["candidates"] if c["feasible"]}
    a, b = by(fast), by(slow)
    assert b[("cp=4", "ring")]["compute_seconds"] == pytest.approx(a[("cp=4", "ring")]["compute_seconds"] / 2)
    assert b[("pool", "ring")]["exposed_comm_seconds"] > a[("pool", "ring")]["exposed_comm_seconds"]


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--world", "12", "--cp", "auto"], "--world 12"),
        (["--world", "8", "--cp", "auto", "--gpus-per-node", "3"], "--world 8"),
    ],
)
def test_simulate_refuses_before_planning(short, tmp_path, argv, named):
    run, _ = _simulate(["--lengths", short, *argv], tmp_path)
    assert run.code == 1 and named in run.err.splitlines()[-1]


@pytest.fixture
def heavy_tail(tmp_path):
    """Log-normal lengths up to a 4-node group's budget in nodes of 2: a group over nodes wins, with p2p."""
    path = tmp_path / "heavy.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.clip(np.round(rng.lognormal(np.log(400), 1.3, 1500)), 1, 8000).astype(np.int64))
    return path


@pytest.mark.slow  # seconds: a report over every layout
def test_report_cp_auto_times_the_targeted_exchange_it_chose(heavy_tail, tmp_path):
    """When ``--cp auto`` picks the targeted exchange, report's rows are timed with it, the CP
    group's nodes in the communication model."""
    doc = tmp_path / "r.json"
    run = run_cli(
        ["report", "--lengths", heavy_tail, *TOKENS, "--cp", "auto", "--world", "16", "--gpus-per-node", "2"]
        + ["--global-batch-tokens", "auto", "--peers", "wlb", "--no-plots", "--out", tmp_path / "r", "--json", doc]
    )
    assert_clean(run)
    assert run.code == 0 and "run attention with mode='p2p'" in run.out, run.out[-2000:]
    report = json.loads(doc.read_text())
    comm = report["comm_model"]
    assert comm["mode"] == "p2p" and comm["gpus_per_node"] == 2, comm
    assert report["plans"][0]["summary"]["exposed_comm_seconds"] > 0


@pytest.mark.slow  # seconds: a simulation over every layout
def test_simulate_cp_auto_times_the_epoch_with_the_targeted_exchange_when_asked(heavy_tail, tmp_path):
    """Where ``--cp auto`` chooses the targeted exchange, the simulated epoch is timed with it (nodes of
    the cluster's size): first by default, after the modes of a ``--modes`` that leaves it out."""
    argv = [
        "--lengths",
        heavy_tail,
        "--world",
        "16",
        "--cp",
        "auto",
        "--gpus-per-node",
        "2",
        "--global-batch-tokens",
        "auto",
    ]
    run, doc = _simulate(argv, tmp_path)
    assert run.code == 0, run.err
    assert doc["layout"]["candidates"][0]["mode"] == "p2p" and doc["comm_model"]["mode"] == "p2p"
    assert list(doc["plans"][0]["modes"]) == ["p2p", "ring", "allgather"]
    run, doc = _simulate([*argv, "--modes", "ring"], tmp_path)
    assert run.code == 0, run.err
    assert doc["comm_model"]["mode"] == "ring" and list(doc["plans"][0]["modes"]) == ["ring", "p2p"]
    run, doc = _simulate([*argv, "--modes", "p2p,ring"], tmp_path)
    assert run.code == 0, run.err
    assert doc["comm_model"]["mode"] == "p2p" and doc["comm_model"]["gpus_per_node"] == 2
    modes = doc["plans"][0]["modes"]
    assert set(modes) == {"p2p", "ring"} and modes["p2p"]["exposed_comm_seconds"] > 0


def test_cp_auto_beyond_a_plan_s_ranks_speaks_of_the_pool_not_of_a_cp_flag(short, tmp_path):
    run, _ = _plan(["--lengths", short, *TOKENS, "--cp", "auto", "--world", "100000", "--gpus-per-node", "8"], tmp_path)
    assert run.code == 1
    assert "--cp 100000" not in run.err
    assert "pool: one CP group of 100,000 GPUs, more than the 65,536 ranks a plan holds" in run.err


def test_simulate_cp_auto_with_no_feasible_layout_gives_every_layout_s_reason(tmp_path):
    path = tmp_path / "long.npy"
    np.save(path, np.array([100, 200, 5_000_000]))
    argv = ["simulate", "--lengths", path, "--gpus", "16", "--cp", "auto", "--gpus-per-node", "8",
            "--tokens-per-rank", "4096", "--samples-per-step", "3", "--out", tmp_path / "sim", "--quiet"]  # fmt: skip
    run = run_cli(argv)
    assert_clean(run)
    error = run.err.splitlines()[-1]
    assert run.code == 1 and "no layout of 16 GPUs plans these lengths" in error, error
    for layout, group in (("cp=1", 4096), ("cp=2", 8192), ("cp=4", 16384), ("cp=8", 32768), ("pool", 65536)):
        assert f"{layout}: sample 2 has 5000000 tokens" in error and f"= {group})" in error, (layout, error)
    assert error.count("--overflow split") == 1, "the hint the layouts share is said once"
