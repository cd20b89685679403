"""WLB-LLM packing as a plan: by hand, every sample once per epoch, figures against brute force."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ringpack.analysis.metrics import evaluate_plan
from ringpack.analysis.peers import WLB, measure_peer
from ringpack.analysis.peers.wlb import WLBConfig, make_wlb_plan
from ringpack.planner import make_plan
from ringpack.planner.epoch import expand_overflow, global_batches
from ringpack.shard_plan import PlanConfig
from tests.helpers.peers import FULL, PER_TOKEN, config


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
        (np.random.default_rng(4).integers(1, 9, size=90).tolist(), dict(dp=3, cp=4, tokens_per_rank=12)),  # L < 2cp
    ],
)
def test_wlb_peer_figures_are_its_plans(lengths, kw):
    """The WLB peer is measured from its packing, without building the plan: the plan's figures exactly."""
    cfg = config(strategy="zigzag", **kw)
    want = evaluate_plan(make_wlb_plan(lengths, cfg), name=WLB)
    got = measure_peer(WLB, lengths, cfg).metrics
    for field in ("mb_exists", "tokens", "pairs", "segments", "cost", "kv_cross_tokens", "zigzag_padding", "samples"):
        assert np.array_equal(getattr(got, field), getattr(want, field)), field
    assert got.loss_tokens.tolist() == want.loss_tokens.tolist()
