"""Pool plans: one CP group over nodes (``world=``, ``gpus_per_node``), split node by node."""

from __future__ import annotations

import dataclasses
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringpack
from ringpack.analysis.simulate import synthetic_lengths
from ringpack.cost import CostModel
from ringpack.planner import make_plan, split_microbatch
from ringpack.planner.layout import choose_layout
from ringpack.planner.pool import arrange_nodes, node_groups, node_need
from ringpack.shard_plan import MicroBatch, Piece, PlanConfig, PlanError, microbatch_from_shards

COST = CostModel.preset("llama3-8b")


def ranks_of(mb: MicroBatch) -> dict[int, list[int]]:
    """The ranks holding each sample's pieces."""
    out: dict[int, set[int]] = {}
    for r, shard in enumerate(mb.shards):
        for p in shard.pieces:
            out.setdefault(p.sample, set()).add(r)
    return {s: sorted(r) for s, r in out.items()}


def lognormal(n: int, seed: int = 0, median: int = 1500, max_len: int = 65536) -> np.ndarray:
    return synthetic_lengths(n, "lognormal", seed=seed, median=median, sigma=1.3, max_len=max_len)


# ------------------------------------------------------------------------------- the spelling
def test_world_is_one_cp_group_over_the_pool():
    L = lognormal(300)
    pool = ringpack.plan(L, world=32, gpus_per_node=8, tokens_per_rank=16384, samples_per_step=100)
    same = ringpack.plan(L, dp=1, cp=32, gpus_per_node=8, tokens_per_rank=16384, samples_per_step=100)
    assert pool.content_hash == same.content_hash
    assert (pool.config.dp, pool.config.cp) == (1, 32)


def test_world_with_cp_is_the_cluster_as_on_the_command_line():
    L = lognormal(300)
    mesh = ringpack.plan(L, world=32, cp=8, tokens_per_rank=16384, samples_per_step=100)
    same = ringpack.plan(L, dp=4, cp=8, tokens_per_rank=16384, samples_per_step=100)
    assert mesh.content_hash == same.content_hash


def test_cp_auto_plans_the_layout_choose_layout_ranks_first():
    L = lognormal(400)
    plan = ringpack.plan(L, world=16, cp="auto", gpus_per_node=8, tokens_per_rank=16384, samples_per_step=0)
    best = choose_layout(L, 16, 8, 16384, samples_per_step=None).best
    assert (plan.config.dp, plan.config.cp, plan.config.gpus_per_node) == (best.dp, best.cp, best.gpus_per_node)
    assert plan.config.dp * plan.config.cp == 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world": 8, "cp": 3}, "world=8 is not a multiple of cp=3"),
        ({"world": 8, "dp": 1}, "give world or dp, not both"),
        ({"cp": "auto"}, "cp='auto' needs world=N"),
        ({"world": 8, "cp": "auto", "dp": 2}, "cp='auto' sets dp itself"),
        ({"world": 0}, "world must be an integer >= 1"),
        ({"world": 2.0}, "world must be an integer >= 1"),
    ],
)
def test_world_refuses_a_second_spelling_and_bad_sizes(kwargs, match):
    with pytest.raises(PlanError, match=match):
        ringpack.plan([100, 200], tokens_per_rank=512, **kwargs)


@pytest.mark.parametrize(
    "cp, node, match",
    [
        (12, 8, "gpus_per_node 8 and cp 12: a CP group must fill whole nodes or fit inside one"),
        (8, 0, r"gpus_per_node must be None or an integer in \[1, "),
        (8, 2.5, "gpus_per_node must be None or an integer"),
    ],
)
def test_gpus_per_node_must_tile_the_cp_group(cp, node, match):
    with pytest.raises(PlanError, match=match):
        PlanConfig(dp=1, cp=cp, tokens_per_rank=64, gpus_per_node=node)


# ------------------------------------------------------------------------------- hash neutral
@pytest.mark.parametrize(
    "kw",
    [
        dict(dp=4, cp=4, tokens_per_rank=32768, samples_per_step=64),
        dict(dp=2, cp=8, tokens_per_rank=16384, samples_per_step=64, strategy="zigzag", overflow="split"),
        dict(dp=1, cp=16, tokens_per_rank=8192, samples_per_step=80, overflow="drop", pair_price_range=(1, 1)),
    ],
)
def test_plans_without_a_topology_are_unchanged(kw):
    """No ``gpus_per_node``: the config's dict and every hash as before the field existed; a CP
    group inside one node: the same pieces as the flat plan, only the config differs."""
    L = lognormal(400, seed=3)
    flat = make_plan(L, PlanConfig(**kw))
    assert "gpus_per_node" not in flat.config.to_dict()
    assert make_plan(L, PlanConfig.from_dict(flat.config.to_dict())).content_hash == flat.content_hash
    inside = make_plan(L, PlanConfig(**kw, gpus_per_node=16))
    assert inside.config.to_dict()["gpus_per_node"] == 16
    assert inside.steps == flat.steps and inside.content_hash != flat.content_hash


# ------------------------------------------------------------------------------- the plans
def _check_node_groups(plan, node: int) -> int:
    """Nodes joined by the samples crossing them form groups of consecutive nodes, each holding a
    sample that needs more than one node; returns the split samples that cross nodes."""
    crossing = 0
    lengths = np.asarray(plan.lengths)
    for _, _, _, mb in plan.iter_microbatches():
        need = dict(zip(mb.samples, node_need(lengths[list(mb.samples)], plan.config).tolist()))
        where = {s: sorted({r // node for r in ranks}) for s, ranks in ranks_of(mb).items()}
        group = list(range(plan.config.cp // node))  # union-find over the nodes
        for nodes in where.values():
            for n in nodes[1:]:
                a, b = group[nodes[0]], group[n]
                group = [min(a, b) if g in (a, b) else g for g in group]
        for root in set(group):
            members = [n for n, g in enumerate(group) if g == root]
            assert members == list(range(members[0], members[0] + len(members))), members
            if len(members) > 1:
                held = [s for s, nodes in where.items() if nodes[0] in members]
                assert max(need[s] for s in held) > 1, "nodes joined without a sample that needs them"
        crossing += sum(len(nodes) > 1 for nodes in where.values())
    return crossing


@pytest.mark.parametrize("prices", [None, (1.0, 1.0)])
def test_pool_plans_are_valid_and_split_samples_stay_in_a_node(prices):
    L = lognormal(1500, seed=1, max_len=131072)
    plan = ringpack.plan(
        L, world=64, gpus_per_node=8, tokens_per_rank=16384, samples_per_step=250, pair_price_range=prices
    )
    plan.validate()  # every sample exactly once, token budgets, tiling, canonical order
    crossing = _check_node_groups(plan, 8)
    split = sum(len(r) > 1 for _, _, _, mb in plan.iter_microbatches() for r in ranks_of(mb).values())
    assert split and crossing <= split // 4, (crossing, split)


def test_a_sample_gets_the_fewest_ranks_its_cost_needs_and_whole_nodes_beyond_one():
    """Without the token guard: a sample costing under a rank's share stays whole; one of 1.5 ranks
    takes two ranks of one node; one bigger than a node takes whole, consecutive nodes."""
    tiny = [256] * 400
    seen = {}
    for big in (6000, 9000, 30000, 60000):
        L = np.array([big, *tiny])
        plan = ringpack.plan(
            L, world=16, gpus_per_node=4, tokens_per_rank=32768, samples_per_step=len(L), pair_price_range=(1, 1),
            cp_token_slack=1e9,
        )  # fmt: skip
        mb = plan.steps[0].microbatches[0][0]
        share = COST.sample_cost(L).sum() / 16  # a rank's share of the step's cost
        need = COST.sample_cost([big])[0] / share
        ranks = ranks_of(mb)[0]
        seen[big] = (round(need, 2), ranks)
        nodes = sorted({r // 4 for r in ranks})
        assert nodes == list(range(nodes[0], nodes[0] + len(nodes)))  # consecutive nodes
        if need <= 4:  # fits a node: its ranks, the fewest its cost needs (or one more) in one node
            assert len(nodes) == 1 and np.ceil(need) <= len(ranks) <= np.ceil(need) + 1
        else:  # whole nodes: as many as its cost needs
            assert len(nodes) == np.ceil(need / 4)
    assert seen[6000][1] == [0] and len(seen[9000][1]) == 2, seen


def test_split_microbatch_splits_a_pool_micro_batch_node_by_node():
    L = lognormal(200, seed=5, max_len=131072)
    config = PlanConfig(dp=1, cp=32, tokens_per_rank=32768, gpus_per_node=8)
    plan = make_plan(L, dataclasses.replace(config, samples_per_step=len(L)))
    mb = plan.steps[0].microbatches[0][0]
    assert split_microbatch(list(mb.samples), L, config) == mb


def test_arranging_ranks_keeps_a_small_split_inside_one_node():
    """A sample over ranks 0 and 9 of a two-node group: moved into one node, costs unchanged."""
    shards = [[] for _ in range(16)]
    shards[0].append(Piece(0, 0, 50))
    shards[9].append(Piece(0, 50, 100))
    for r in range(16):
        if r not in (0, 9):
            shards[r].append(Piece(r + 1, 0, 40))
    lengths = [100] + [40] * 16
    mb = microbatch_from_shards([0, *range(1, 17)], shards, lengths)
    arranged = arrange_nodes(mb, 8)
    where = ranks_of(arranged)[0]
    assert len({r // 8 for r in where}) == 1
    assert sorted(map(repr, arranged.shards)) == sorted(map(repr, mb.shards))
    assert arrange_nodes(arranged, 8) is arranged  # nothing left to improve: the same object


# ------------------------------------------------------------------------------- scale
def _planned(world: int) -> tuple[float, int, int, int]:
    """Plan one global batch of ``world`` ranks (90% of their tokens): seconds, peak traced bytes, pieces, samples."""
    L = synthetic_lengths(world * 8, "lognormal", seed=0, median=800, sigma=1.2, max_len=32768)
    L = L[: int(np.searchsorted(np.cumsum(L), 0.9 * world * 8192))]
    tracemalloc.start()
    start = time.perf_counter()
    plan = ringpack.plan(
        L, world=world, gpus_per_node=8, tokens_per_rank=8192, samples_per_step=len(L), microbatches_per_rank=1,
        pair_price_range=(1, 1),
    )  # fmt: skip
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak, len(plan.piece_arrays["start"]), len(L)


def test_pool_planning_memory_grows_linearly_with_the_pool():
    """Four times the ranks (and samples): the planner's peak memory and the plan's pieces grow about
    four times, not sixteen (a zigzag over the pool would give every sample two pieces per rank)."""
    _, small_peak, small_pieces, small_n = _planned(64)
    _, big_peak, big_pieces, big_n = _planned(256)
    assert big_peak < 8 * small_peak, (small_peak, big_peak)
    assert small_pieces <= 2 * (small_n + 64) and big_pieces <= 2 * (big_n + 256), (small_pieces, big_pieces)


def test_near_a_full_budget_a_group_of_nodes_splits_only_the_samples_that_cross_nodes():
    """At 99% of the tokens a group of several nodes zigzags its big samples over its ranks and keeps
    every sample that fits a node's share whole, so only the big samples send K/V between nodes."""
    world, tpr = 128, 16384
    L = synthetic_lengths(20000, "lognormal", seed=2, median=1536, sigma=1.3, max_len=131072)
    L = L[: int(0.99 * world * tpr / L.mean())]
    plan = ringpack.plan(L, world=world, gpus_per_node=8, tokens_per_rank=tpr, samples_per_step=len(L))
    plan.validate()
    mb = plan.steps[0].microbatches[0][0]
    share = COST.sample_cost(L[list(mb.samples)]).sum() / (world // 8)  # a node's share of the cost
    crossing = {s: r for s, r in ranks_of(mb).items() if len({x // 8 for x in r}) > 1}
    assert crossing, "expected samples over several nodes"
    for s, ranks in crossing.items():  # only samples that need more than a rank's share cross nodes
        assert COST.sample_cost([L[s]])[0] > share / 8 or L[s] > tpr, (s, int(L[s]), len(ranks))


# ------------------------------------------------------------------------------- the shape
def _nodes_of(mb: MicroBatch, node: int) -> dict[int, list[int]]:
    """The nodes holding each sample's pieces (CP rank ``c`` on node ``c // node``)."""
    return {s: sorted({r // node for r in ranks}) for s, ranks in ranks_of(mb).items()}


@pytest.mark.parametrize(
    "lengths, world",
    [
        ([20, 9, 3, 13, 13, 12, 13, 13, 12, 3], 8),
        ([20, 14, 10, 16, 20, 13, 13, 11], 8),
        ([20, 22, 12, 15, 17, 12, 5], 7),
    ],
)
def test_a_sample_bigger_than_a_node_of_one_rank_takes_consecutive_nodes(lengths, world):
    """16 tokens per rank, one rank per node: the 20-token sample (and every other) lies on consecutive nodes."""
    plan = ringpack.plan(lengths, world=world, gpus_per_node=1, tokens_per_rank=16, samples_per_step=0)
    plan.validate()
    for _, _, _, mb in plan.iter_microbatches():
        for sample, nodes in _nodes_of(mb, 1).items():
            assert nodes == list(range(nodes[0], nodes[-1] + 1)), (sample, lengths[sample], nodes)


@st.composite
def pool_case(draw) -> tuple[np.ndarray, dict]:
    """A random pool: 1 to 4 GPUs a node, 2 to 6 nodes a CP group, tiny to roomy tokens per rank,
    lengths from a rank's tokens to three nodes' (never over the group's)."""
    node, nodes = draw(st.integers(1, 4)), draw(st.integers(2, 6))
    tpr = draw(st.sampled_from([1, 2, 5, 16, 64, 1024]))
    group = node * nodes * tpr
    longest = min(group, draw(st.sampled_from([tpr, node * tpr, 3 * node * tpr])))
    lengths = draw(st.lists(st.integers(1, longest), min_size=1, max_size=30))
    config = dict(
        dp=1, cp=node * nodes, gpus_per_node=node, tokens_per_rank=tpr, samples_per_step=0,
        strategy=draw(st.sampled_from(["balanced", "balanced", "zigzag", "contiguous"])),
        pair_price_range=draw(st.sampled_from([None, (1.0, 1.0)])),
        cost=draw(st.sampled_from([COST, CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")])),
    )  # fmt: skip
    return np.array(lengths, dtype=np.int64), config


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool_case())
def test_every_sample_of_a_pool_plan_lies_on_consecutive_nodes(case):
    """Any pool, any strategy: every sample's pieces lie on consecutive nodes, and a sample crosses
    nodes only where some sample of its micro-batch needs several nodes or the micro-batch's samples
    do not pack whole into its nodes (then it is one group of all of them)."""
    lengths, kw = case
    plan = ringpack.plan(lengths, **kw)
    plan.validate()
    node, nodes = kw["gpus_per_node"], kw["cp"] // kw["gpus_per_node"]
    for _, _, _, mb in plan.iter_microbatches():
        where = _nodes_of(mb, node)
        for sample, held in where.items():
            assert held == list(range(held[0], held[-1] + 1)), (sample, int(lengths[sample]), held)
        if any(len(held) > 1 for held in where.values()):
            L = lengths[list(mb.samples)]
            joined = node_need(L, plan.config).max() > 1 or node_groups(L, plan.config)[0][1] == nodes
            assert joined, ("a sample that fits a node crosses nodes", L.tolist())


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 40), links=st.lists(st.lists(st.integers(0, 39), min_size=1, max_size=5), max_size=12))
def test_components_of_links_match_union_find(n, links):
    """The vectorised components name every item by its component's lowest item, as union-find does."""
    from ringpack.planner.pool import _components, _joined

    links = [[x % n for x in items] for items in links]
    a = np.array([items[0] for items in links for _ in items[1:]], dtype=np.int64)
    b = np.array([x for items in links for x in items[1:]], dtype=np.int64)
    assert _components(n, a, b).tolist() == _joined(n, links)


def test_cycle_collection_is_paused_inside_and_restored_after():
    import gc

    from ringpack.planner.pool import cycle_collection_paused

    was = gc.isenabled()
    try:
        gc.enable()
        with cycle_collection_paused():
            assert not gc.isenabled()
        assert gc.isenabled()
        with pytest.raises(KeyError), cycle_collection_paused():
            raise KeyError("x")
        assert gc.isenabled()
        gc.disable()
        with cycle_collection_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as it was
    finally:
        (gc.enable if was else gc.disable)()
