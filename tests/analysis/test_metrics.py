"""Every reported figure against an independent brute force (dense masks, explicit token loops)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from ringpack.analysis.metrics import concat_metrics, evaluate_plan, zigzag_rule_padding
from ringpack.analysis.report import build_report, result_of_plan
from ringpack.comm_model import CommModel, kv_cross_tokens, microbatch_seconds
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.shard_plan import PlanConfig
from tests.helpers import brute
from tests.helpers.plans import random_plan

REL = 1e-9


def planned(strategy: str, packing: str, lengths, dp=2, cp=3, budget=40, per_step=0, model=None):
    cfg = PlanConfig(
        dp=dp,
        cp=cp,
        tokens_per_rank=budget,
        strategy=strategy,
        packing=packing,
        samples_per_step=per_step,
        cost=model or CostModel(token=3.0, pair=0.5, segment=7.0, flops_per_second=1e3),
    )
    return make_plan(lengths, cfg)


def check_report_against_brute(plan):
    comm = CommModel(bandwidth=1e3, latency=1e-3, kv_bytes_per_token_layer=5.0, layers=2)
    doc = build_report([result_of_plan(plan, comm, name="p")])
    want = brute.figures(plan)
    got = doc["plans"][0]["steps"]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        for key in (
            "step_cost",
            "step_seconds",
            "idle_fraction",
            "imbalance",
            "max_mean",
            "dp_max_mean",
            "cp_max_mean",
        ):
            assert g[key] == pytest.approx(w[key], rel=REL, abs=1e-12), key
        np.testing.assert_allclose(g["rank_busy"], w["rank_busy"], rtol=REL)
        np.testing.assert_allclose(g["dp_time"], w["dp_time"], rtol=REL)
        assert len(g["microbatch_costs"]) == len(w["microbatch_costs"])
        for gd, wd in zip(g["microbatch_costs"], w["microbatch_costs"]):
            np.testing.assert_allclose(gd, wd, rtol=REL)
        assert g["kv_bytes"] == pytest.approx(w["kv_tokens"] * comm.kv_bytes_per_token)
        assert g["zigzag_rule_padding_tokens"] == w["zigzag_rule_padding_tokens"]
        assert g["padding_tokens"] == 0
        assert g["tokens"] == w["tokens"] and g["samples"] == w["samples"]
    s = doc["plans"][0]["summary"]
    total_busy = sum(sum(map(sum, w["rank_busy"])) for w in want)
    total_step = sum(w["step_cost"] for w in want)
    gpus = plan.config.dp * plan.config.cp
    assert s["idle_fraction"] == pytest.approx(1 - total_busy / (gpus * total_step), rel=REL, abs=1e-12)
    assert s["predicted_seconds"] == pytest.approx(total_step / plan.config.cost.flops_per_second, rel=REL)
    assert s["zigzag_rule_padding_tokens"] == sum(w["zigzag_rule_padding_tokens"] for w in want)
    assert s["tokens"] == sum(plan.lengths[i] for i in range(len(plan.lengths)) if i not in plan.dropped)


@pytest.mark.parametrize("strategy", ["balanced", "zigzag", "contiguous"])
@pytest.mark.parametrize("packing", ["balanced", "first_fit"])
def test_planned_figures_match_brute_force(strategy, packing):
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 70, size=30)
    check_report_against_brute(planned(strategy, packing, lengths, per_step=10))


@settings(max_examples=25)
@given(random_plan(max_samples=12, max_len=25))
def test_random_plan_figures_match_brute_force(plan):
    """Random cuts and random rank placement (not a planner's habits), drops, uneven ranks."""
    check_report_against_brute(plan)


def test_matches_the_balancers_plan_costs():
    """Same definitions as the planner's own metrics (one implementation of cost, shared meaning)."""
    from ringpack.planner.bounds import plan_costs

    lengths = np.random.default_rng(3).integers(1, 200, size=60)
    plan = planned("balanced", "balanced", lengths, dp=3, cp=2, budget=300, per_step=20, model=CostModel.preset("tiny"))
    m = evaluate_plan(plan)
    ref = plan_costs(plan)
    np.testing.assert_allclose(m.cost, ref["mb_rank_cost"], rtol=1e-12)
    np.testing.assert_allclose(m.step_cost, ref["step_cost"], rtol=1e-12)
    np.testing.assert_allclose(m.busy, ref["rank_cost"], rtol=1e-12)


def test_kv_cross_tokens_per_piece_match_token_loop():
    lengths = np.random.default_rng(5).integers(1, 50, size=25)
    for strategy in ("balanced", "zigzag", "contiguous"):
        plan = planned(strategy, "first_fit", lengths, dp=1, cp=4, budget=60)
        m = evaluate_plan(plan)
        for s, d, i, mb in plan.iter_microbatches():
            for r in range(plan.config.cp):
                assert m.kv_cross_tokens[s, d, i, r] == brute.kv_needed_tokens(mb, r)
        assert kv_cross_tokens(plan.piece_arrays).sum() == m.kv_cross_tokens.sum()


def test_zigzag_rule_padding_matches_materialised_padding():
    lengths = np.arange(1, 80)
    for cp in (1, 2, 3, 4, 8):
        got = zigzag_rule_padding(lengths, cp)
        for L, row in zip(lengths, got):
            assert row.tolist() == brute.zigzag_padding(int(L), cp)
        assert (got.sum(axis=1) == (-lengths) % (2 * cp)).all()


def test_ring_comm_model_by_hand():
    """One micro-batch, cp=2: per layer a forward ring and a backward ring with twice the bytes."""
    model = CostModel(token=0.0 + 1.0, pair=2.0, segment=0.0, flops_per_second=1.0)
    comm = CommModel(bandwidth=10.0, latency=0.5, mode="ring", kv_bytes_per_token_layer=4.0, layers=2)
    tokens = np.array([[3, 5]])
    pairs = np.array([[6, 30]])
    segments = np.array([[1, 1]])
    kv = np.array([[3, 0]])  # rank 0's 3 tokens are needed by rank 1
    seconds, exposed = microbatch_seconds(tokens, pairs, segments, kv, model, comm)
    largest = 3 * 4.0  # bytes per layer
    for r in range(2):
        attn = 2.0 * pairs[0, r]
        want = tokens[0, r] * 1.0
        for share, factor in ((1 / 3.5, 1.0), (2.5 / 3.5, 2.0)):
            a = attn * share / 2 / 2  # per layer, per ring step
            want += 2 * (a + 1 * max(a, 0.5 + factor * largest / 10.0))
        assert seconds[0, r] == pytest.approx(want)
        assert exposed[0, r] == pytest.approx(want - tokens[0, r] - attn)
    allgather = CommModel(bandwidth=10.0, latency=0.5, mode="allgather", kv_bytes_per_token_layer=4.0, layers=2)
    seconds, _ = microbatch_seconds(tokens, pairs, segments, kv, model, allgather)
    for r in range(2):
        assert seconds[0, r] == pytest.approx(tokens[0, r] + 2.0 * pairs[0, r] + 2 * 2 * (0.5 + largest / 10.0))
    # nothing crosses ranks: no transfer, no latency
    seconds, exposed = microbatch_seconds(tokens, pairs, segments, np.zeros_like(kv), model, comm)
    assert (exposed == 0).all() and seconds.tolist() == [[3 + 12, 5 + 60]]


def test_comm_times_grow_as_links_slow_down():
    lengths = np.random.default_rng(11).integers(100, 3000, size=40)
    plan = planned("zigzag", "balanced", lengths, dp=2, cp=4, budget=4000, model=CostModel.preset("llama3-8b"))
    times = []
    for bw in (1e12, 1e10, 1e8):
        r = result_of_plan(plan, CommModel.for_model(plan.config.cost, bandwidth=bw))
        times.append(r.step_seconds_comm.sum())
        assert (r.step_seconds_comm >= r.metrics.step_seconds * (1 - 1e-12)).all()
    assert times[0] <= times[1] < times[2]


def test_concat_metrics_equals_one_plan_per_part():
    lengths = np.random.default_rng(2).integers(1, 3000, size=200)
    cfg = PlanConfig(
        dp=4, cp=2, tokens_per_rank=4096, samples_per_step=25, overflow="split", cost=CostModel.preset("llama-1b")
    )
    parts = [evaluate_plan(make_plan(lengths[i : i + 100], cfg)) for i in (0, 100)]
    whole = concat_metrics(parts, "x")
    assert whole.num_steps == sum(p.num_steps for p in parts)
    np.testing.assert_allclose(whole.step_cost, np.concatenate([p.step_cost for p in parts]))
    assert whole.tokens.sum() == lengths.sum()
