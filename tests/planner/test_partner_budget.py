"""The partner budget (``PlanConfig.max_partners``): the planner, the communication model and the schedules."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringpack
from ringpack.analysis.simulate import synthetic_lengths
from ringpack.attention import ScheduleOptions, compile_schedule
from ringpack.attention.mode_choice import resolve_mode
from ringpack.comm_model import CommModel, microbatch_partners, partner_fallback, rank_partners, rank_seconds
from ringpack.plan_config import DEFAULT_MAX_PARTNERS
from ringpack.planner.partners import microbatches_over_budget
from ringpack.planner.stream import PackedMicroBatch
from ringpack.shard_plan import PlanConfig, PlanError
from ringpack.traffic import (
    OVER_BUDGET_SLOT,
    exchange_partners,
    microbatch_over_budget,
    partner_budget_problem,
    remember_over_budget,
)

WORLD, NODE, T = 32, 8, 8192
LENGTHS = synthetic_lengths(600, "lognormal", seed=0, median=1500, sigma=1.3, max_len=65536)


def pool_plan(max_partners: int, lengths=LENGTHS):
    return ringpack.plan(
        lengths, world=WORLD, gpus_per_node=NODE, tokens_per_rank=T, samples_per_step=200, max_partners=max_partners
    )


def shape_of(plan):
    return plan.num_steps, plan.config.dp, max(len(s.microbatches[0]) for s in plan.steps)


def raw_partners(plan) -> np.ndarray:
    """Each micro-batch's targeted-exchange partners per rank, no budget: int ``(S, D, M, C)``."""
    comm = CommModel(mode="p2p", gpus_per_node=NODE)
    return microbatch_partners(plan.piece_arrays, plan.config.cp, shape_of(plan), comm)


def test_the_default_budget_and_its_spelling():
    assert PlanConfig(dp=1, cp=8, tokens_per_rank=64).max_partners == DEFAULT_MAX_PARTNERS == 64
    # the default stays out of plan files and hashes; another budget is recorded
    assert "max_partners" not in PlanConfig(dp=1, cp=8, tokens_per_rank=64).to_dict()
    assert PlanConfig(dp=1, cp=8, tokens_per_rank=64, max_partners=0).to_dict()["max_partners"] == 0


@pytest.mark.parametrize("bad", [1, -1, 2.5, "4", True])
def test_a_bad_budget_is_one_line_naming_the_option(bad):
    with pytest.raises(PlanError) as err:
        PlanConfig(dp=1, cp=8, tokens_per_rank=64, max_partners=bad)
    assert "max_partners" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("budget", [10, 8, 6, 4, 2])
def test_no_rank_exceeds_the_budget_unless_its_microbatch_runs_the_ring(budget):
    plan = pool_plan(budget)
    shape = shape_of(plan)
    comm = CommModel(mode="p2p", gpus_per_node=NODE, max_partners=budget)
    ring = partner_fallback(plan.piece_arrays, WORLD, shape, comm)
    raw = raw_partners(plan).max(axis=-1)
    assert (raw[~ring] <= budget).all()
    assert (raw[ring] > budget).all()
    counted = microbatch_partners(plan.piece_arrays, WORLD, shape, comm)
    assert counted.max() <= budget
    assert (counted.max(axis=-1)[ring] == 2).all()


def test_an_unbinding_budget_leaves_the_plan_as_it_was():
    free = pool_plan(0)
    assert raw_partners(free).max() <= DEFAULT_MAX_PARTNERS
    assert pool_plan(DEFAULT_MAX_PARTNERS).steps == free.steps
    assert pool_plan(int(raw_partners(free).max())).steps == free.steps  # a budget equal to the max


def test_a_binding_budget_splits_tighter_deterministically():
    free = pool_plan(0)
    edge = int(raw_partners(free).max())
    below = pool_plan(edge - 1)
    assert below.steps != free.steps
    assert below.content_hash == pool_plan(edge - 1).content_hash
    # the re-split micro-batches hold the same samples, within the token budget, now within the budget
    over = raw_partners(free).max(axis=-1) > edge - 1
    raw_below = raw_partners(below).max(axis=-1)
    assert (raw_below[over] <= edge - 1).any()
    for s, (a, b) in enumerate(zip(free.steps, below.steps)):
        for m, (x, y) in enumerate(zip(a.microbatches[0], b.microbatches[0])):
            assert sorted(x.samples) == sorted(y.samples)
            assert max(sh.num_tokens for sh in y.shards) <= T
            if not over[s, 0, m]:
                assert x == y


def test_flat_plans_are_held_too():
    L = synthetic_lengths(300, "lognormal", seed=1, median=3000, sigma=1.3, max_len=65536)
    plan = ringpack.plan(L, dp=1, cp=32, tokens_per_rank=4096, samples_per_step=100, max_partners=4)
    mbs = [mb for st in plan.steps for mb in st.microbatches[0]]
    over = microbatches_over_budget(mbs, plan.config)
    for mb, bad in zip(mbs, over):
        rank, sample, start, stop = mb.piece_columns
        partners = exchange_partners(np.zeros_like(rank), rank, sample, start, stop, 1, 32)
        assert (partners.max() > 4) == bad


def test_the_comm_model_times_and_counts_the_fallback_as_the_ring():
    plan = pool_plan(6)
    shape, a = shape_of(plan), plan.piece_arrays
    budget = CommModel(mode="p2p", gpus_per_node=NODE, max_partners=6)
    ring_marked = partner_fallback(a, WORLD, shape, budget)
    assert ring_marked.any() and not ring_marked.all()
    seconds = rank_seconds(a, WORLD, shape, plan.config.cost, budget)[0]
    p2p = rank_seconds(a, WORLD, shape, plan.config.cost, dataclasses.replace(budget, max_partners=0))[0]
    ring = rank_seconds(a, WORLD, shape, plan.config.cost, dataclasses.replace(budget, mode="ring"))[0]
    np.testing.assert_array_equal(seconds[ring_marked], ring[ring_marked])
    np.testing.assert_array_equal(seconds[~ring_marked], p2p[~ring_marked])
    # over the run, a GPU's partners: the union of its micro-batches', the fallback ones the ring's neighbours
    assert (
        rank_partners(a, WORLD, shape, budget).max()
        <= rank_partners(a, WORLD, shape, dataclasses.replace(budget, max_partners=0)).max() + 2
    )


def test_schedules_at_the_budgets_edge():
    free = pool_plan(0)
    raw = raw_partners(free)
    s, d, m = np.unravel_index(int(np.argmax(raw.max(axis=-1))), raw.shape[:3])
    mb = free.steps[s].microbatches[d][m]
    edge = int(raw[s, d, m].max())
    at = compile_schedule(mb, 0, options=ScheduleOptions(gpus_per_node=NODE, max_partners=edge))
    assert not at.partner_fallback and at.exchange is not None and resolve_mode("p2p", at) == "p2p"
    below = compile_schedule(mb, 0, options=ScheduleOptions(gpus_per_node=NODE, max_partners=edge - 1))
    assert below.partner_fallback and below.exchange is None and below.max_partners == edge - 1
    assert resolve_mode("p2p", below) == "ring" and resolve_mode("ulysses", below) == "ulysses"
    # every rank decides alike
    assert all(
        compile_schedule(mb, r, gpus_per_node=NODE, max_partners=edge - 1).partner_fallback for r in (5, WORLD - 1)
    )


def test_the_plan_budget_reaches_the_schedules():
    options = ScheduleOptions().with_node_size(NODE, 6)
    assert (options.gpus_per_node, options.max_partners) == (NODE, 6)
    assert ScheduleOptions(max_partners=4).with_node_size(None, 6).max_partners == 4  # an explicit value wins
    with pytest.raises(PlanError, match="max_partners"):
        ScheduleOptions(max_partners=1)


def test_the_refusal_names_the_rank_its_partners_and_the_budget():
    assert partner_budget_problem(3, 16, 16) is None and partner_budget_problem(3, 40, 0) is None
    line = partner_budget_problem(3, 17, 16)
    assert "CP rank 3" in line and "17 partners" in line and "max_partners=16" in line and "\n" not in line


def test_the_planners_outcome_travels_with_the_microbatch_and_schedules_read_it():
    budget = int(raw_partners(pool_plan(0)).max()) - 1
    plan = pool_plan(budget)
    mbs = [mb for step in plan.steps for rank in step.microbatches for mb in rank]
    # the planner decided every micro-batch once, and its outcome equals a fresh count
    decided = [vars(mb)[OVER_BUDGET_SLOT][(NODE, budget)] for mb in mbs]
    assert decided == [fresh_count(mb, budget) for mb in mbs]
    # packed for another process, the outcome goes along; the schedule reads it, counting nothing
    mb = mbs[0]
    moved = PackedMicroBatch.of(mb).unpack()
    assert vars(moved)[OVER_BUDGET_SLOT] == vars(mb)[OVER_BUDGET_SLOT]
    remember_over_budget(moved, NODE, budget, not decided[0])
    options = ScheduleOptions(gpus_per_node=NODE, max_partners=budget)
    assert compile_schedule(moved, 0, options=options).partner_fallback is (not decided[0])
    # a budget the planner did not decide for is counted on first use, then remembered
    fresh = PackedMicroBatch.of(mb).unpack()
    wider = microbatch_over_budget(fresh, NODE, budget + 1)
    assert vars(fresh)[OVER_BUDGET_SLOT][(NODE, budget + 1)] is wider


def fresh_count(mb, budget: int) -> bool:
    """Whether some rank of ``mb`` has more than ``budget`` partners, counted from its pieces."""
    rank, sample, start, stop = mb.piece_columns
    return bool(exchange_partners(np.zeros_like(rank), rank, sample, start, stop, 1, WORLD, NODE).max() > budget)


@pytest.mark.parametrize(
    "world,node,budget,seed",
    # (24, 4, 3, 1): a group counted with its own rank numbers would pick other proxies and miss it
    [(24, 4, 3, 1), (24, 4, 5, 2), (32, 8, 7, 0), (32, 8, 7, 2), (32, 8, 10, 1), (48, 8, 9, 3)],
)
def test_the_pool_splits_decision_from_its_node_groups_is_the_whole_microbatchs_count(world, node, budget, seed):
    """The pool split decides each micro-batch from its node groups (counted where they sit in the
    group: the proxies depend on the ranks' numbers); that equals counting the whole micro-batch."""
    lengths = synthetic_lengths(600, "lognormal", seed=seed, median=1500, sigma=1.4, max_len=65536)
    plan = ringpack.plan(
        lengths, world=world, gpus_per_node=node, tokens_per_rank=T, samples_per_step=200, max_partners=budget
    )
    mbs = [mb for step in plan.steps for rank in step.microbatches for mb in rank]
    decided = [vars(mb)[OVER_BUDGET_SLOT][(node, budget)] for mb in mbs]
    counted = []
    for mb in mbs:
        rank, sample, start, stop = mb.piece_columns
        partners = exchange_partners(np.zeros_like(rank), rank, sample, start, stop, 1, world, node)
        counted.append(bool(partners.max() > budget))
    assert decided == counted


def test_a_delivered_microbatch_keeps_its_fingerprint_and_schedules_carry_it():
    mb = pool_plan(0).steps[0].microbatches[0][0]
    moved = PackedMicroBatch.of(mb).unpack()
    assert "fingerprint" in vars(moved) and moved.fingerprint == mb.fingerprint
    assert compile_schedule(moved, 3, gpus_per_node=NODE).fingerprint == mb.fingerprint
