"""Megatron-Core dynamic CP, modelled, on small inputs: step times by hand and by brute force (an
explicit loop over the planner's zigzag split, dense causal masks, a plain LPT loop)."""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.analysis.peers.megatron_dcp import (
    dcp_schedule,
    group_sizes,
    timed_schedule,
    valid_group_sizes,
    zigzag_shares,
)
from ringpack.analysis.report import STEP_KEYS, SUMMARY_KEYS
from ringpack.comm_model import CommModel
from ringpack.planner.epoch import global_batches
from ringpack.planner.split import split_zigzag
from ringpack.shard_plan import PlanConfig
from tests.helpers import brute
from tests.helpers.peers import INSTANT, PER_TOKEN, config


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
