"""The layout choice (ringpack/planner/layout.py): fixed CP sizes and the pool, ranked by predicted tokens/s."""

from __future__ import annotations

import numpy as np
import pytest

import ringpack
from ringpack.errors import PlanError
from ringpack.planner.layout import choose_layout, cp_sizes


def test_equal_short_samples_need_no_context_parallelism():
    """Every layout balances equal samples perfectly and none moves K/V: the simplest, pure DP, wins."""
    choice = choose_layout(np.full(2000, 1024), world=16, gpus_per_node=8, tokens_per_rank=16384, steps=2)
    assert (choice.best.name, choice.best.mode, choice.best.dp, choice.best.cp) == ("cp=1", "ring", 16, 1)
    assert choice.reason.startswith("cp=1, ring: the same speed, and simpler of pool")
    assert {c.name for c in choice.candidates} == {"cp=1", "cp=2", "cp=4", "cp=8", "pool"}


def test_one_huge_sample_takes_the_pool():
    """A sample costing most of the step: fixed groups of up to 8 ranks cannot hold it, one of 16
    runs it on half the GPUs while the others idle; the pool spreads it over all 32."""
    lengths = np.concatenate([[120_000], np.random.default_rng(0).integers(200, 800, 200)])
    choice = choose_layout(
        lengths, world=32, gpus_per_node=8, tokens_per_rank=8192, steps=1, samples_per_step=0, pair_price_range=(1, 1)
    )
    best = choice.best
    assert best.name == "pool" and best.plan_kwargs() == {"dp": 1, "cp": 32, "gpus_per_node": 8}
    fixed = min((c for c in choice.candidates if c.feasible and c.name != "pool"), key=lambda c: c.step_seconds)
    assert fixed.name == "cp=16" and best.tokens_per_second > 1.3 * fixed.tokens_per_second
    assert "cp=1, cp=2, cp=4, cp=8: cannot plan these lengths" in choice.reason
    infeasible = [c for c in choice.candidates if not c.feasible]
    assert infeasible and all("sample 0 has 120000 tokens" in c.note for c in infeasible)
    assert choice.candidates.index(infeasible[0]) == len(choice.candidates) - len(infeasible)  # last
    plan = ringpack.plan(lengths, tokens_per_rank=8192, samples_per_step=0, **best.plan_kwargs())
    assert plan.config.gpus_per_node == 8


def test_overflow_cuts_at_the_pool_so_every_layout_plans_the_same_documents():
    """With ``overflow="split"`` the samples longer than the pool holds are cut once, at its
    capacity: every feasible layout's sampled steps hold the same tokens, and a CP size that
    cannot hold the longest document is infeasible rather than winning by cutting samples apart."""
    lengths = np.clip(np.round(np.random.default_rng(0).lognormal(np.log(800), 1.3, 1000)), 1, 40000)
    lengths[5] = 40000  # longer than the pool of 16 x 2048 tokens: cut in two
    choice = choose_layout(lengths.astype(np.int64), 16, 4, 2048, steps=1, overflow="split")
    feasible = [c for c in choice.candidates if c.feasible]
    moved = {round(c.tokens_per_second * c.step_seconds) for c in feasible}
    assert len(moved) == 1, "the same tokens in every layout's step"
    assert {c.name for c in feasible} == {"pool"}, "no fixed size holds a document of 20,000 tokens"
    short = np.minimum(lengths, 9000).astype(np.int64)  # fits cp=8 and the pool
    choice = choose_layout(short, 16, 4, 2048, steps=1, overflow="split")
    assert {c.name for c in choice.candidates if c.feasible} == {"cp=8", "pool"}
    assert len({round(c.tokens_per_second * c.step_seconds) for c in choice.candidates if c.feasible}) == 1


def test_the_sizes_compared_reach_the_longest_sample_and_one_more():
    assert cp_sizes(1024, 8, 131072, 16384) == [1, 2, 4, 8, 16]
    assert cp_sizes(1024, 8, 300_000, 16384) == [1, 2, 4, 8, 16, 32, 64]
    assert cp_sizes(16, 8, 60_000, 8192) == [1, 2, 4, 8]  # the next size is the whole pool


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world=12, gpus_per_node=8), "world=12 is not a whole number of nodes of gpus_per_node=8"),
        (dict(world=16, gpus_per_node=8, dp=2), "choose_layout sets dp itself"),
        (dict(world=16, gpus_per_node=8, modes=["tree"]), "modes must be some of"),
        (dict(world=16, gpus_per_node=8, sizes=[3]), "CP size 3 does not divide world=16"),
        (dict(world=0, gpus_per_node=8), "world must be an integer >= 1"),
    ],
)
def test_bad_arguments_are_one_line(kwargs, match):
    with pytest.raises(PlanError, match=match):
        choose_layout([100] * 64, tokens_per_rank=4096, **kwargs)


@pytest.mark.parametrize("lengths", [[], np.zeros(0, dtype=np.int64)])
def test_no_samples_is_one_line(lengths):
    with pytest.raises(PlanError, match=r"^lengths: no samples, so no layout to choose") as info:
        choose_layout(lengths, 8, 8, 4096)
    assert "\n" not in str(info.value)


def test_a_partner_memory_budget_keeps_layouts_whose_nccl_buffers_exceed_it_out():
    from ringpack.comm_model import PARTNER_BUFFER_BYTES

    lengths = np.concatenate([[120_000], np.random.default_rng(0).integers(200, 800, 200)])
    kwargs = dict(world=32, gpus_per_node=8, tokens_per_rank=8192, steps=1, samples_per_step=0)
    free = choose_layout(lengths, **kwargs)
    pool_p2p = next(c for c in free.candidates if c.label == "pool, p2p")
    assert pool_p2p.partners_max > 2 and pool_p2p.partner_memory_bytes == pool_p2p.partners_max * PARTNER_BUFFER_BYTES
    ring = next(c for c in free.candidates if c.label == "pool, ring")
    assert (ring.partners_median, ring.partners_max) == (2.0, 2)
    budget = 2 * PARTNER_BUFFER_BYTES  # the ring's two neighbours and no more
    tight = choose_layout(lengths, partner_memory_budget=budget, **kwargs)
    over = {c.label: c for c in tight.candidates if "NCCL buffers" in c.note}
    assert "pool, p2p" in over and "pool, ulysses" not in {c.label for c in tight.candidates if c.feasible}
    assert f"NCCL buffers for {pool_p2p.partners_max} partners" in over["pool, p2p"].note
    assert all(c.partner_memory_bytes <= budget for c in tight.candidates if c.feasible and not c.stopped)
    assert tight.best.partners_max <= 2
