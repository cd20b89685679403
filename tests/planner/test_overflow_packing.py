"""Every overflow policy plans every shape: a valid plan or one clear PlanError, never an internal error.

Price-robust packing (the default) packs each pair-price scenario alone, then all of them at once;
greedy packing is order-dependent, so the joint order can fail to place a sample that every
scenario's own order placed. Samples near a CP group's capacity -- what ``overflow="split"``
makes of a long sample -- are where that happens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.cost import CostModel
from ringpack.planner.epoch import _pack, _pack_robust, make_plan
from ringpack.planner.packing import PackingProblem
from ringpack.shard_plan import OVERFLOW_POLICIES, PACKINGS, STRATEGIES, PlanConfig, PlanError
from tests.helpers.cli import assert_clean, run_cli, write_jsonl

#: One global batch of dp=2 x cp=2 at 4096 tokens per rank (8192 a group) whose three near-full
#: documents the joint price scenarios' greedy order cannot place, though each scenario's can.
TIGHT_STEP = [1489, 2632, 1513, 1431, 7665, 1221, 3390, 7664, 3414, 818, 3813, 636, 655, 7948, 2110, 827]
#: The same step before ``overflow="split"``: one sample of 15,329 tokens becomes 7,664 + 7,665.
TIGHT_INPUT = [x for x in TIGHT_STEP if x not in (7664, 7665)] + [15329]


def _mesh(**options) -> PlanConfig:
    return PlanConfig(dp=2, cp=2, tokens_per_rank=4096, **options)


def test_a_step_of_near_full_documents_packs_at_every_price():
    plan = make_plan(TIGHT_STEP, _mesh()).validate()
    assert plan.config.price_range != (1.0, 1.0)  # the joint packing of two price scenarios ran
    assert sorted(s for step in plan.steps for rank in step.microbatches for mb in rank for s in mb.samples) == list(
        range(len(TIGHT_STEP))
    )


@pytest.mark.parametrize("seed", range(3))
def test_a_split_sample_that_leaves_near_full_documents_plans(seed):
    plan = make_plan(TIGHT_INPUT, _mesh(overflow="split", seed=seed)).validate()
    assert sorted(plan.lengths) == sorted(TIGHT_STEP)
    assert sum(plan.lengths) == sum(TIGHT_INPUT)


def test_the_command_line_plans_and_shards_it(tmp_path):
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.array(TIGHT_INPUT))
    flags = ["--dp", 2, "--cp", 2, "--tokens-per-rank", 4096, "--overflow", "split"]
    run = run_cli(["plan", "--lengths", lengths, *flags, "--out", tmp_path / "plan.parquet", "--quiet"])
    assert_clean(run)
    assert run.code == 0 and "planned 16 samples" in run.out, run.err
    rng = np.random.default_rng(0)
    data = write_jsonl(tmp_path / "data.jsonl", [{"input_ids": rng.integers(0, 100, n).tolist()} for n in TIGHT_INPUT])
    run = run_cli(["shard", data, "--out", tmp_path / "shards", *flags, "--quiet"])
    assert_clean(run)
    assert run.code == 0 and f"sharded 15 samples ({sum(TIGHT_INPUT):,} tokens)" in run.out, run.err


def _legit(exc: PlanError, lengths: list[int], config: PlanConfig) -> bool:
    """The PlanErrors a random shape may deserve: too long (``overflow="error"``), too few samples,
    nothing left after dropping, or samples that do not fit -- which balanced packing may only say
    where first-fit packing cannot place them either."""
    text = str(exc)
    if config.overflow == "error" and "more than one CP group holds" in text:
        return True
    if "cannot fill" in text or "no samples left" in text:
        return True
    if "do not fit" in text and config.packing == "balanced":
        try:
            make_plan(lengths, dataclasses.replace(config, packing="first_fit"))
        except PlanError as other:
            return "do not fit" in str(other) or "cannot fill" in str(other)
        return False
    return "do not fit" in text


@st.composite
def overflow_case(draw):
    dp = draw(st.integers(1, 3))
    cp = draw(st.integers(1, 3))
    tokens_per_rank = draw(st.sampled_from([16, 64, 4096]))
    capacity = cp * tokens_per_rank
    n = draw(st.integers(dp, 48))
    # short samples, near-full ones, and a few longer than a group: the shapes a split leaves
    short = st.integers(1, max(1, capacity // 2))
    near_full = st.integers(max(1, capacity - capacity // 8), capacity)
    too_long = st.integers(capacity + 1, 6 * capacity)
    lengths = draw(st.lists(st.one_of(short, short, near_full, too_long), min_size=n, max_size=n))
    config = PlanConfig(
        dp=dp,
        cp=cp,
        tokens_per_rank=tokens_per_rank,
        overflow=draw(st.sampled_from(OVERFLOW_POLICIES)),
        packing=draw(st.sampled_from(PACKINGS)),
        strategy=draw(st.sampled_from(STRATEGIES)),
        samples_per_step=draw(st.sampled_from([0, 2 * dp, 4 * dp, 16])),
        seed=draw(st.integers(0, 2**16)),
        cost=CostModel.preset(draw(st.sampled_from(["llama3-8b", "tiny"]))),
    )
    return lengths, config


@settings(max_examples=120, deadline=None)
@given(overflow_case())
def test_every_overflow_policy_gives_a_valid_plan_or_a_plan_error(case):
    lengths, config = case
    try:
        plan = make_plan(lengths, config)
    except PlanError as exc:
        assert _legit(exc, lengths, config), str(exc)
        return
    plan.validate()
    capacity = config.group_capacity
    assert max(plan.lengths[s] for step in plan.steps for r in step.microbatches for mb in r for s in mb.samples) <= (
        capacity
    )
    if config.overflow == "split":
        assert sum(plan.lengths) == sum(lengths) and not plan.dropped
    elif config.overflow == "drop":
        assert sorted(plan.dropped) == [i for i, x in enumerate(lengths) if x > capacity]


@pytest.mark.parametrize("overflow", ["split", "drop"])
@pytest.mark.parametrize("dp, cp, per_step", [(2, 2, 32), (2, 2, 16), (4, 2, 64), (1, 4, 8), (3, 1, 24)])
def test_heavy_tailed_data_plans_under_every_policy(overflow, dp, cp, per_step):
    """Mostly a few thousand tokens, some of 100K: the data long-context training plans."""
    rng = np.random.default_rng(dp * 100 + cp * 10 + per_step)
    lengths = rng.integers(500, 5000, size=12 * per_step)
    lengths[rng.choice(lengths.size, lengths.size // 16, replace=False)] = 100_000
    for packing in PACKINGS:
        config = PlanConfig(
            dp=dp, cp=cp, tokens_per_rank=4096, samples_per_step=per_step, overflow=overflow, packing=packing
        )
        plan = make_plan(lengths, config).validate()
        too_long = np.flatnonzero(lengths > config.group_capacity).tolist()
        assert list(plan.dropped) == (too_long if overflow == "drop" else [])
        assert sum(plan.lengths) - sum(plan.lengths[s] for s in plan.dropped) == lengths.sum() - lengths[
            too_long
        ].sum() * (overflow == "drop")


@st.composite
def tight_packing(draw):
    """Samples cut from ``dp * m`` nearly full bins (so a packing exists) and two unrelated price
    scenarios, whose greedy orders and rank loads differ."""
    dp, m = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    capacity = draw(st.sampled_from([64, 1000]))
    tokens = []
    for _ in range(dp * m):
        fill = capacity - draw(st.integers(0, capacity // 10))
        cuts = sorted(draw(st.sets(st.integers(1, fill - 1), max_size=3)))
        tokens += np.diff([0, *cuts, fill]).tolist()
    tokens = draw(st.permutations(tokens))
    factors = st.lists(st.floats(0.5, 2.0), min_size=len(tokens), max_size=len(tokens))
    t = np.array(tokens, dtype=np.float64)
    scenarios = [t**2 * np.array(draw(factors)), t * np.array(draw(factors))]
    return np.array(tokens, dtype=np.int64), dp, m, capacity, scenarios


@settings(max_examples=200, deadline=None)
@given(tight_packing())
def test_joint_price_packing_succeeds_whenever_every_price_alone_does(case):
    tokens, dp, m, capacity, weights = case
    config = PlanConfig(dp=dp, cp=1, tokens_per_rank=capacity)
    scenarios = [(w, float(w.sum()) / dp) for w in weights]
    alone = [_pack(PackingProblem(w, tokens, dp, m, capacity), bound, config) for w, bound in scenarios]
    packed = _pack_robust(tokens, m, scenarios, 1.0, config)
    if any(bins is None for bins in alone):
        return
    assert packed is not None
    bins, height = packed
    assert np.all(np.bincount(bins, weights=tokens, minlength=dp * m) <= capacity)
    assert np.all(np.bincount(bins, minlength=dp * m) >= 1)
    assert np.isfinite(height) and height >= 1 - 1e-9
