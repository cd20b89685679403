"""Pool plans (``dp=1``, one CP group of every rank, split node by node) through the data path: the
sampler streams the plan, balanced shards hold it, and every token reaches exactly one rank once."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

import ringpack
from ringpack.cost import CostModel
from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader
from ringpack.data.shard_writer import write_shards
from tests.helpers.data import Coverage, batch_signature

WORLD, NODE, T = 8, 4, 512
HEAVY = CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")
OPTS = dict(samples_per_step=48, gpus_per_node=NODE, cost=HEAVY, seed=5)


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(2)
    lens = np.clip(rng.lognormal(4.5, 1.2, 150).astype(np.int64), 1, T)
    lens[[3, 70]] = [NODE * T + 300, 2 * T + 10]  # one bigger than a node, one split inside a node
    return [rng.integers(0, 1000, int(k)) for k in lens]


@pytest.fixture(scope="module")
def lengths(samples):
    return [len(s) for s in samples]


def test_the_pool_plan_splits_node_by_node(lengths):
    plan = ringpack.plan(lengths, world=WORLD, tokens_per_rank=T, **OPTS)
    assert (plan.config.dp, plan.config.cp, plan.config.gpus_per_node) == (1, WORLD, NODE)
    ranks_of: dict[tuple, set] = {}
    for s, step in enumerate(plan.steps):
        for m, mb in enumerate(step.microbatches[0]):
            for c, shard in enumerate(mb.shards):
                for piece in shard.pieces:
                    ranks_of.setdefault((s, m, piece.sample), set()).add(c)
    nodes = {key: {c // NODE for c in ranks} for key, ranks in ranks_of.items() if len(ranks) > 1}
    assert any(len(n) > 1 for n in nodes.values()), "the sample bigger than a node spans nodes"
    assert any(len(n) == 1 for n in nodes.values()), "a sample that fits a node is split inside one"


def test_sampler_collator_and_shards_give_every_token_once(samples, lengths, tmp_path):
    """The loader's batches (sampler, dataset, collator with the rank's attention schedule, for the
    plan's nodes) equal the shards', and together they hold every token exactly once."""
    plan = ringpack.plan(lengths, world=WORLD, tokens_per_rank=T, **OPTS)
    ds = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in samples]})
    write_shards(ds, tmp_path / "shards", plan.config, progress=False)
    cov = Coverage(samples)
    for c in range(WORLD):
        sampler = BalancedBatchSampler(lengths, 0, 1, WORLD, T, **OPTS)
        assert sampler.plan() == plan
        collator = PackedCollator(c, WORLD)
        from_loader = [collator(PackedDataset(ds).__getitems__(t)) for t in sampler]
        assert all(b["schedule"] is not None for b in from_loader), "the rank's schedule compiles"
        assert {b["schedule"].gpus_per_node for b in from_loader} == {NODE}, "relayed across the plan's nodes"
        reader = ShardReader(tmp_path / "shards", 0, c, dp_size=1, cp_size=WORLD, schedule=c < 2)
        assert reader.plan == plan
        batches = list(reader)
        if c < 2:
            assert {b["schedule"].gpus_per_node for b in batches} == {NODE}, "the shards' schedules relay too"
            routes = [[_routes(b["schedule"].exchange) for b in run] for run in (batches, from_loader)]
            assert routes[0] == routes[1] and any(r[-1] for r in routes[0]), "the same relays, some of them"
        assert [batch_signature(b) for b in batches] == [batch_signature(b) for b in from_loader]
        cov.add_all(batches)
    cov.check_exactly_once()


def _routes(ex) -> tuple:
    """What a relayed exchange map moves where (its fields without the tensors)."""
    return (ex.sources, ex.via, ex.recv_tokens, ex.dests, ex.send_tokens, ex.relay_in, ex.proxied)


@pytest.mark.parametrize("planner", ["thread", pytest.param("process", marks=pytest.mark.slow)])
def test_a_cp_ranks_tickets_list_only_the_rows_its_pieces_come_from(samples, lengths, planner):
    """With ``cp_rank``, a ticket lists the rows of the samples that rank holds pieces of (its loader
    reads no other), and the rank's batches are those of the whole micro-batch's rows, bit for bit;
    a collator of another CP rank refuses such a ticket in one line."""
    import pickle

    from ringpack.errors import DataError

    ds = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in samples]})
    config = ringpack.plan(lengths, world=WORLD, tokens_per_rank=T, **OPTS).config
    whole = list(BalancedBatchSampler(lengths, config, 0, planner="thread"))
    fewer = 0
    for c in range(WORLD):
        sampler = BalancedBatchSampler(lengths, config, 0, cp_rank=c, planner=planner)
        tickets = list(sampler)
        assert [t.cursor for t in tickets] == [t.cursor for t in whole]
        collator = PackedCollator(c, WORLD)
        for mine, every in zip(tickets, whole):
            own = {p.sample for p in every.microbatch.shards[c].pieces}
            assert [every.microbatch.samples[k] for k in mine.positions] == [
                s for s in every.microbatch.samples if s in own
            ]
            assert list(mine) == [every[k] for k in mine.positions]
            fewer += len(mine) < len(every)
            got = collator(PackedDataset(ds).__getitems__(mine))
            want = collator(PackedDataset(ds).__getitems__(every))
            assert batch_signature(got) == batch_signature(want)
            copy = pickle.loads(pickle.dumps(mine))
            assert copy.positions == mine.positions and list(copy) == list(mine)
    assert fewer > 0, "some rank reads fewer rows than the micro-batch holds"
    ticket = next(t for t in BalancedBatchSampler(lengths, config, 0, cp_rank=0) if len(t) < len(t.microbatch.samples))
    other = next(c for c in range(1, WORLD) if {p.sample for p in ticket.microbatch.shards[c].pieces} - set(ticket))
    with pytest.raises(DataError, match=rf"^cp rank {other}: the ticket has no rows of sample \d+") as err:
        PackedCollator(other, WORLD)(PackedDataset(ds).__getitems__(ticket))
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"cp_rank must be None or in \[0, 8\)"):
        BalancedBatchSampler(lengths, config, 0, cp_rank=WORLD)
