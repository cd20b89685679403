"""The peers (Megatron-Core dynamic CP, WLB-LLM packing) on small inputs.

Step times hand-computed or recomputed by brute force (explicit loops over the planner's zigzag
split, dense causal masks, a plain LPT loop); every sample once per epoch; the peer rows of the
report and simulate documents.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ringpack.analysis.comm_model import CommModel
from ringpack.analysis.dynamic_cp import (
    DCP,
    PEERS,
    WLB,
    dcp_schedule,
    group_sizes,
    measure_peer,
    parse_peers,
    peer_rows,
    timed_schedule,
    valid_group_sizes,
    zigzag_shares,
)
from ringpack.analysis.metrics import evaluate_plan
from ringpack.analysis.report import STEP_KEYS, SUMMARY_KEYS, build_report, format_table, result_of_plan
from ringpack.analysis.simulate import simulate
from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import expand_overflow, global_batches
from ringpack.planner.split import split_zigzag
from ringpack.planner.wlb import WLBConfig, make_wlb_plan, wlb_packing, wlb_zigzag_table
from ringpack.shard_plan import PlanConfig, PlanError
from tests.helpers import brute

#: One cost unit per token: step times by hand.
PER_TOKEN = CostModel(token=1.0, pair=0.0, unit="s")
#: A model with every term, for brute-force checks.
FULL = CostModel(token=3.0, pair=0.5, segment=7.0, unit="s")
#: A link so fast that communication adds nothing measurable.
INSTANT = CommModel(bandwidth=1e30, latency=0.0, kv_bytes_per_token_layer=1.0, layers=1)


def config(**kw) -> PlanConfig:
    base = dict(dp=2, cp=2, tokens_per_rank=500, samples_per_step=20, overflow="split", cost=FULL)
    base.update(kw)
    return PlanConfig(**base)


# ------------------------------------------------------------------------------------ dynamic CP
def test_group_sizes_round_up_to_a_power_of_two_the_pool_offers():
    assert valid_group_sizes(16).tolist() == [1, 2, 4, 8, 16]
    assert valid_group_sizes(12).tolist() == [1, 2, 4, 12]
    assert valid_group_sizes(6).tolist() == [1, 2, 6]
    lengths = np.array([1, 10, 11, 20, 21, 40, 41, 80])
    assert group_sizes(lengths, 10, 16).tolist() == [1, 1, 2, 2, 4, 4, 8, 8]
    # 41 tokens need 5 ranks, 8 after rounding; a pool of 12 offers no 8, so the whole pool
    assert group_sizes(lengths[:7], 10, 12).tolist() == [1, 1, 2, 2, 4, 4, 12]
    with pytest.raises(ValueError, match="needs more than the 12 GPUs"):
        group_sizes(np.array([121]), 10, 12)


@pytest.mark.parametrize("g", [1, 2, 3, 4])
def test_zigzag_shares_are_the_planner_split_counted_by_brute_force(g):
    lengths = np.array([1, 2, 5, 7, 8, 13, 31])
    tokens, pairs, segments, kv = zigzag_shares(lengths, g)
    for i, length in enumerate(lengths.tolist()):
        mb = split_zigzag([0], [length], g)
        for r, shard in enumerate(mb.shards):
            assert tokens[i, r] == shard.num_tokens
            assert segments[i, r] == len(shard.pieces)
            assert pairs[i, r] == brute.dense_pairs(mb, r)
            assert kv[i, r] == brute.kv_needed_tokens(mb, r)


def test_dcp_step_time_by_hand():
    """One step on a pool of 4 GPUs, 10 tokens per rank, a cost of one per token.

    35 tokens need 4 ranks: zigzag chunks [0,4)+[30,35), [4,8)+[26,30), [8,13)+[21,26),
    [13,17)+[17,21) give ranks 9, 8, 10, 8 tokens; it holds GPUs 0-3 for 10. 12 tokens need 2:
    6 + 6 on the first block of two (a tie, the lower block), which then finishes at 16. The
    single-GPU samples, costliest first onto the least-loaded GPU: 8 onto GPU 2 (18), 5 onto
    GPU 3 (15), 3 onto GPU 3 (18). Busy 15, 14, 18, 16; the step takes 18.
    """
    cfg = PlanConfig(dp=1, cp=4, tokens_per_rank=10, cost=PER_TOKEN)
    schedule = dcp_schedule([35, 12, 8, 5, 3], cfg)
    result = timed_schedule(schedule, INSTANT)
    assert result.busy.tolist() == [[15, 14, 18, 16]]
    assert result.step_cost.tolist() == [18]
    assert result.step_seconds_comm[0] == pytest.approx(18)
    assert result.kv_tokens.tolist() == [30 + 9]  # every chunk but the last of each split sample
    assert result.kv_ring_tokens.tolist() == [30 * 3 + 9 * 1]
    assert result.padding.tolist() == [5]  # 35 -> 40 for 2*4 chunks; 12 is a multiple of 4 already
    summary = result.summary()
    assert tuple(summary) == SUMMARY_KEYS
    assert summary["idle_fraction"] == pytest.approx(1 - 63 / (4 * 18))
    assert summary["imbalance_mean"] == pytest.approx(18 / (63 / 4))
    assert summary["tokens"] == 63 and summary["samples"] == 5
    assert summary["microbatches"] is None and summary["dp_max_mean_mean"] is None and summary["gap_mean"] is None
    row = result.step_rows()[0]
    assert tuple(row) == STEP_KEYS
    assert row["rank_busy"] == [[15, 14, 18, 16]] and row["dp_time"] is None


def _brute_dcp(lengths: np.ndarray, windows: list[np.ndarray], cfg: PlanConfig) -> list[tuple[list, list]]:
    """Per step ``(busy, finish)`` per GPU: explicit loops over the planner's zigzag split and an LPT loop.

    A sample waits until every GPU of its block is free, then holds them all for its slowest rank.
    """
    gpus = cfg.dp * cfg.cp
    offered = [g for g in range(1, gpus + 1) if gpus % g == 0 and (g & (g - 1) == 0 or g == gpus)]
    out = []
    for window in windows:
        jobs = []
        for position, i in enumerate(window.tolist()):
            length = int(lengths[i])
            need = 1
            while need * cfg.tokens_per_rank < length:
                need *= 2
            g = min(x for x in offered if x >= min(need, gpus))
            mb = split_zigzag([0], [length], g)
            costs = [brute.rank_cost(mb, r, cfg.cost) for r in range(g)]
            jobs.append((-g, -max(costs), position, g, costs))
        free, busy = [0.0] * gpus, [0.0] * gpus
        for _, _, _, g, costs in sorted(jobs):
            blocks = [list(range(b, b + g)) for b in range(0, gpus, g)]
            block = min(blocks, key=lambda members: (max(free[x] for x in members), members[0]))
            start = max(free[x] for x in block)
            for r, x in enumerate(block):
                free[x] = start + max(costs)
                busy[x] += costs[r]
        out.append((busy, free))
    return out


@pytest.mark.parametrize("dp, cp, tokens_per_rank", [(2, 4, 40), (3, 4, 30), (1, 2, 64)])
def test_dcp_schedule_against_brute_force(dp, cp, tokens_per_rank):
    lengths = np.random.default_rng(dp * cp).integers(1, 2 * cp * tokens_per_rank, size=90)
    cfg = config(dp=dp, cp=cp, tokens_per_rank=tokens_per_rank, samples_per_step=23)
    batches = global_batches(lengths, cfg)
    result = timed_schedule(dcp_schedule(lengths, cfg), INSTANT)
    want = _brute_dcp(batches.lengths, batches.windows, cfg)
    assert result.metrics.num_steps == len(want)
    for s, (busy, finish) in enumerate(want):
        np.testing.assert_allclose(result.busy[s], busy, rtol=1e-12)
        np.testing.assert_allclose(result.finish[s], finish, rtol=1e-12)
    # every document once, in its own step
    got = sorted(np.concatenate([c.lengths for c in result.metrics.classes]).tolist())
    assert got == sorted(batches.lengths.tolist())
    assert result.metrics.samples.tolist() == [w.size for w in batches.windows]


def test_dcp_charges_the_link_only_for_split_samples():
    cfg = config(dp=2, cp=4, tokens_per_rank=100, samples_per_step=0)
    slow = CommModel(bandwidth=1e-3, latency=1.0, kv_bytes_per_token_layer=1.0, layers=1)
    short = timed_schedule(dcp_schedule([90, 80, 70, 60, 50, 40, 30, 20], cfg), slow)
    assert short.step_seconds_comm[0] == pytest.approx(short.step_cost[0])  # no sample is split
    long = timed_schedule(dcp_schedule([390, 80, 70], cfg), slow)
    assert long.step_seconds_comm[0] > long.step_cost[0] + 100  # K/V of the 4-way split crawls
    assert long.summary()["exposed_comm_seconds"] > 0


# ------------------------------------------------------------------------------------------- WLB
def test_wlb_packing_by_hand():
    """Two DP ranks, one CP rank of 10 tokens, a cost of one per token, one step.

    Longest first onto the least-loaded micro-batch with room: 6 -> 0, 5 -> 1, 4 -> 1, 3 -> 0,
    then 2 fits neither (1 token free each). The last step defers nothing, so it takes a second
    micro-batch per rank: 6, 5, 4, 3 open the four, 2 joins the lightest (3). DP rank 0 runs 6
    and 5 (11), DP rank 1 runs 4 and 3 + 2 (9): the step takes 11.
    """
    cfg = PlanConfig(dp=2, cp=1, tokens_per_rank=10, cost=PER_TOKEN)
    plan = make_wlb_plan([6, 5, 4, 3, 2], cfg, WLBConfig(outlier_fractions=()))
    plan.validate()
    ranks = [[sorted(plan.lengths[s] for s in mb.samples) for mb in rank] for rank in plan.steps[0].microbatches]
    assert ranks == [[[6], [5]], [[4], [2, 3]]]
    assert evaluate_plan(plan).step_cost.tolist() == [11]


def test_wlb_defers_what_fits_nowhere_to_the_next_step():
    """Documents of 6 tokens into micro-batches of 10: two per step's two micro-batches, the third waits."""
    cfg = PlanConfig(dp=1, cp=1, tokens_per_rank=10, samples_per_step=3, cost=PER_TOKEN)
    plan = make_wlb_plan([6] * 6, cfg, WLBConfig(outlier_fractions=()))
    plan.validate()
    assert [len(step.microbatches[0]) for step in plan.steps] == [2, 4]
    assert [sum(len(mb.samples) for mb in step.microbatches[0]) for step in plan.steps] == [2, 4]


def test_wlb_outliers_wait_until_every_micro_batch_can_take_one():
    """Which documents each step runs, predicted from the global batches and the queue rule alone."""
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(20, 200, size=70), np.full(9, 1200), np.full(7, 700)])
    cfg = PlanConfig(dp=2, cp=2, tokens_per_rank=1000, samples_per_step=12, cost=FULL)
    capacity = cfg.group_capacity
    batches = global_batches(lengths, cfg)
    L = batches.lengths
    queues: dict[int, list[int]] = {0: [], 1: []}
    expected = []
    for s, window in enumerate(batches.windows):
        bins = cfg.dp * max(1, math.ceil(int(L[window].sum()) / (cfg.dp * capacity)))
        regular = [i for i in window.tolist() if L[i] <= capacity / 4]
        for i in window.tolist():
            if L[i] > capacity / 4:
                queues[0 if L[i] > capacity / 2 else 1].append(i)
        released = []
        for level in (0, 1):
            take = len(queues[level]) if s == len(batches.windows) - 1 else len(queues[level]) // bins * bins
            released += queues[level][:take]
            queues[level] = queues[level][take:]
        expected.append(sorted(regular + released))
    plan = make_wlb_plan(lengths, cfg)
    plan.validate()
    got = [sorted(s for rank in step.microbatches for mb in rank for s in mb.samples) for step in plan.steps]
    assert got == expected
    assert any(len(e) != w.size for e, w in zip(expected, batches.windows)), "no document was delayed"


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="zigzag"),
        dict(strategy="balanced", samples_per_step=25),
        dict(strategy="contiguous", microbatches_per_rank=2, samples_per_step=4),
        dict(strategy="zigzag", overflow="drop", dp=3, cp=3),
    ],
)
def test_wlb_plans_every_sample_exactly_once(kw):
    lengths = np.random.default_rng(7).integers(1, 1500, size=150)
    cfg = config(**kw)
    make_plan(lengths, cfg)  # data ringpack can plan
    plan = make_wlb_plan(lengths, cfg)
    plan.validate()  # every document in exactly one micro-batch, or dropped
    assert plan.num_steps == len(global_batches(lengths, cfg).windows)
    docs = expand_overflow(lengths, cfg.group_capacity)[0] if cfg.overflow == "split" else lengths
    assert len(plan.lengths) == len(docs) and sum(plan.lengths) == int(docs.sum())
    assert all(step.lower_bound is not None for step in plan.steps)
    # the same packing again: deterministic
    assert make_wlb_plan(lengths, cfg).content_hash == plan.content_hash


@pytest.mark.parametrize(
    "lengths, kw",
    [
        ([3, 3, 3, 1], dict(dp=1, cp=2, tokens_per_rank=5, samples_per_step=0)),  # floor cuts overflow a rank
        (np.random.default_rng(3).integers(1, 900, size=120).tolist(), dict(dp=2, cp=3, tokens_per_rank=300)),
    ],
)
def test_wlb_piece_table_is_the_plans(lengths, kw):
    cfg = config(strategy="zigzag", **kw)
    plan = make_wlb_plan(lengths, cfg)
    table = wlb_zigzag_table(wlb_packing(lengths, cfg), cfg)

    def canonical(arrays):
        order = np.lexsort([arrays[c] for c in reversed(("step", "dp", "microbatch", "cp", "slot", "start"))])
        return {c: arrays[c][order].tolist() for c in arrays}

    assert canonical(table) == canonical(plan.piece_arrays)


def test_wlb_figures_against_brute_force():
    lengths = np.random.default_rng(11).integers(1, 700, size=60)
    cfg = config()
    part = measure_peer(WLB, lengths, cfg)
    want = brute.figures(make_wlb_plan(lengths, dataclasses.replace(cfg, strategy="zigzag")))
    got = part.metrics
    np.testing.assert_allclose(got.step_cost, [w["step_cost"] for w in want], rtol=1e-12)
    np.testing.assert_allclose(got.busy, [w["rank_busy"] for w in want], rtol=1e-12)
    assert got.kv_cross_tokens.sum(axis=(1, 2, 3)).tolist() == [w["kv_tokens"] for w in want]
    assert part.config["packing"] == WLB and part.config["strategy"] == "zigzag"


# --------------------------------------------------------------------------------- report, CLI
LENGTHS = np.random.default_rng(0).integers(1, 400, size=80)


def test_report_document_carries_the_peers():
    cfg = config(cost=CostModel.preset("tiny"))
    comm = CommModel.for_model(cfg.cost)
    plans = [make_plan(LENGTHS, dataclasses.replace(cfg, strategy=s, packing=p)) for s, p in (("zigzag", "first_fit"),)]
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS, peers=peer_rows(LENGTHS, cfg, comm))
    assert [p["name"] for p in doc["plans"]] == ["zigzag/first_fit"]
    assert [p["name"] for p in doc["peers"]] == list(PEERS)
    for peer in doc["peers"]:
        assert tuple(peer["summary"]) == SUMMARY_KEYS and peer["description"]
        assert all(tuple(row) == STEP_KEYS for row in peer["steps"])
        assert peer["summary"]["tokens"] == int(LENGTHS.sum())
        assert peer["summary"]["speedup_vs_baseline"] > 0
    dcp = doc["peers"][0]["summary"]
    assert dcp["dp_max_mean_mean"] is None and dcp["cp_max_mean_mean"] is None and dcp["microbatches"] is None
    json.dumps(doc, allow_nan=False)
    table = format_table(doc, steps_shown=1)
    assert "megatron-dcp (peer)" in table and "wlb (peer)" in table


def test_report_cli_adds_peers_from_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    argv = ["report", "--lengths", str(path), "--dp", "2", "--cp", "2", "--tokens-per-rank", "500", "--model", "tiny"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--quiet", "--no-plots", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["peers"]] == [DCP, WLB]
    assert main([*argv, "--peers", "wlb", "--baseline", "wlb", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "wlb (peer) *" in printed and "megatron-dcp" not in printed
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    assert doc["baseline"] == WLB and doc["peers"][0]["summary"]["speedup_vs_baseline"] == 1.0
    assert (tmp_path / "b" / "rank_costs.png").is_file()
    assert main([*argv, "--peers", "none", "--out", str(tmp_path / "c"), "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / "c" / "report.json").read_text())["peers"] == []
    capsys.readouterr()
    assert main([*argv, "--peers", "nope", "--out", str(tmp_path / "d"), "--quiet"]) == 1
    assert "--peers" in capsys.readouterr().err


def test_report_cli_refuses_peers_for_plan_files(tmp_path, capsys):
    plan = make_plan(LENGTHS, config(cost=CostModel.preset("tiny")))
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "--peers", DCP, "--out", str(tmp_path / "r"), "--quiet"]) == 1
    assert "--peers" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "r"), "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / "r" / "report.json").read_text())["peers"] == []


def test_simulate_joins_peer_chunks():
    lengths = np.random.default_rng(2).integers(1, 3000, size=400)
    cfg = config(dp=4, cp=2, tokens_per_rank=1024, samples_per_step=30, cost=CostModel.preset("llama-1b"))
    doc = simulate(lengths, cfg, chunk_steps=3, jobs=1, progress=False, peers=PEERS)
    docs = expand_overflow(lengths, cfg.group_capacity)[0]
    steps = {p["summary"]["steps"] for p in doc["plans"]}
    for peer in doc["peers"]:
        s = peer["summary"]
        assert s["tokens"] == int(docs.sum()) and s["samples"] == len(docs)
        assert {s["steps"]} == steps  # the same global batches as ringpack's plans
        assert set(peer["modes"]) == {"ring", "allgather"}
    assert [p["name"] for p in doc["peers"]] == list(PEERS)


def test_parse_peers():
    assert parse_peers("none") == []
    assert parse_peers(" wlb , megatron-dcp ") == [DCP, WLB]
    for bad in ("", "wlb,wlb", "none,wlb", "dcp"):
        with pytest.raises(ValueError, match="--peers"):
            parse_peers(bad)


def test_a_peer_that_cannot_plan_the_data_is_left_out(caplog):
    """A fixed micro-batch count too small for the last step's deferred documents."""
    cfg = PlanConfig(dp=1, cp=1, tokens_per_rank=10, samples_per_step=3, microbatches_per_rank=1, cost=PER_TOKEN)
    with pytest.raises(PlanError):
        make_wlb_plan([4] * 6, cfg, WLBConfig(outlier_fractions=()))
    rows = peer_rows([4] * 6, cfg, INSTANT, [WLB])
    assert rows == [] and "wlb left out" in caplog.text
