"""The piece table: built once per micro-batch object, kept out of its identity, and carried with
a delivered micro-batch so a rank's schedule compiles without reading the other ranks' pieces."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

import ringpack
import ringpack.piece_table as piece_table_module
from ringpack.analysis.simulate import synthetic_lengths
from ringpack.attention import compile_schedule
from ringpack.errors import PlanError
from ringpack.piece_table import TABLE_SLOT, PieceTable, piece_table
from ringpack.planner.stream import PackedMicroBatch
from ringpack.shard_plan import MicroBatch, Piece, RankShard

WORLD, NODE = 32, 8


@pytest.fixture(scope="module")
def pool_microbatch() -> MicroBatch:
    """One micro-batch of a 32-rank pool plan (4 nodes): samples spread over nodes and relays."""
    lengths = synthetic_lengths(400, "lognormal", seed=3, median=1500, sigma=1.3, max_len=32768)
    plan = ringpack.plan(lengths, world=WORLD, gpus_per_node=NODE, tokens_per_rank=4096, samples_per_step=120)
    return plan.steps[0].microbatches[0][0]


def test_the_table_is_built_once_and_kept_out_of_the_microbatchs_identity():
    shards = (RankShard((Piece(4, 0, 3),)), RankShard((Piece(4, 3, 5), Piece(7, 0, 2))))
    mb = MicroBatch(samples=(4, 7), shards=shards, loss_tokens=5)
    before = pickle.dumps(mb)
    table = piece_table(mb)
    assert piece_table(mb) is table and vars(mb)[TABLE_SLOT] is table
    assert table.rank.tolist() == [0, 1, 1] and table.slot.tolist() == [0, 0, 1]
    assert table.needed.tolist() == [True, False, False] and table.buffer_tokens == (3, 0)
    assert table.distances == (1,) and table.offset.tolist() == [0, 0, 2]
    assert pickle.dumps(mb) == before and mb == MicroBatch(samples=(4, 7), shards=shards, loss_tokens=5)


def test_a_bad_microbatch_raises_on_every_read_and_keeps_no_table():
    mb = MicroBatch(samples=(4,), shards=(RankShard((Piece(4, 1, 3),)),), loss_tokens=1)
    for _ in range(2):
        with pytest.raises(PlanError, match=r"sample 4: tokens \[0, 1\) are in no piece"):
            piece_table(mb)
    assert TABLE_SLOT not in vars(mb)


def schedule_signature(schedule) -> tuple:
    """What a rank's schedule says, as comparable values (tensors as lists)."""
    ex = schedule.exchange
    steps = tuple((st.distance, tuple(c.cu_seqlens_q.tolist() + c.cu_seqlens_k.tolist() for c in st.calls))
                  for st in schedule.steps)  # fmt: skip
    exchange = None if ex is None else (ex.sources, ex.recv_tokens, ex.dests, ex.send_tokens, ex.via, ex.relay_in)
    return (schedule.num_tokens, schedule.distances, schedule.buffer_tokens, schedule.send_index.tolist(),
            schedule.fingerprint, steps, exchange)  # fmt: skip


def test_a_delivered_microbatch_compiles_from_the_planners_table_alone(pool_microbatch, monkeypatch):
    mb = pool_microbatch
    want = [schedule_signature(compile_schedule(mb, r, gpus_per_node=NODE)) for r in range(WORLD)]
    sent = pickle.dumps(PackedMicroBatch.of(mb))  # what a planner process sends: table and derived parts

    def refuse(*_):
        raise AssertionError("the loader rebuilt what the planner sent")

    monkeypatch.setattr(PieceTable, "from_microbatch", classmethod(refuse))
    monkeypatch.setattr(piece_table_module, "ring_distances", refuse)
    for r in range(WORLD):
        delivered = pickle.loads(sent).unpack()
        assert schedule_signature(compile_schedule(delivered, r, gpus_per_node=NODE)) == want[r], f"rank {r}"
        assert set(delivered.shards._built) <= {r}, "no other rank's pieces built as objects"


def test_the_shipped_table_equals_a_fresh_one(pool_microbatch):
    shipped = pickle.loads(pickle.dumps(PackedMicroBatch.of(pool_microbatch))).table
    fresh = PieceTable.from_microbatch(MicroBatch(pool_microbatch.samples, pool_microbatch.shards, 0))
    for name in ("rank", "slot", "start", "stop", "offset", "needed", "compact", "by_sample", "sample_bounds"):
        assert np.array_equal(getattr(shipped, name), getattr(fresh, name)), name
    derived = ("distances", "buffer_tokens")
    assert all(name in vars(shipped) for name in derived), "derived parts travel with the table"
    assert [getattr(shipped, n) for n in derived] == [getattr(fresh, n) for n in derived]
