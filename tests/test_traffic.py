"""The targeted exchange's receivers and its bytes within and across nodes (ringpack/traffic.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.shard_plan import Piece, microbatch_from_shards
from ringpack.traffic import KVTraffic, exchange_tokens, kv_traffic, needed_pieces, receivers


@st.composite
def piece_rows(draw):
    n = draw(st.integers(1, 30))
    ints = lambda lo, hi: draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))
    start = np.array(ints(0, 60))
    return np.array(ints(0, 2)), np.array(ints(0, 5)), np.array(ints(0, 3)), start, start + np.array(ints(1, 20))


@settings(max_examples=200, deadline=None)
@given(piece_rows())
def test_receivers_are_the_ranks_holding_a_later_piece(rows):
    group, rank, sample, start, stop = rows
    piece, to = receivers(group, rank, sample, start, stop)
    n = len(start)
    for i in range(n):
        later = {
            int(rank[j])
            for j in range(n)
            if group[j] == group[i] and sample[j] == sample[i] and start[j] >= stop[i] and rank[j] != rank[i]
        }
        assert sorted(to[piece == i].tolist()) == sorted(later)
    assert np.array_equal(np.bincount(piece, minlength=n), needed_pieces(group, rank, sample, start, stop))


def test_bytes_within_and_across_nodes_by_hand():
    """Sample 0 over CP ranks 0, 1, 2 (nodes of 2 ranks): [0, 10) goes to rank 1 (same node) and
    rank 2 (the other), [10, 20) to rank 2; sample 1 stays on rank 3."""
    shards = [[Piece(0, 0, 10)], [Piece(0, 10, 20)], [Piece(0, 20, 30)], [Piece(1, 0, 5)]]
    mb = microbatch_from_shards([0, 1], shards, [30, 5])
    assert kv_traffic(mb) == KVTraffic(unique=20, p2p=30, ring=60, p2p_inter=0)
    assert kv_traffic(mb, 2, gpus_per_node=2) == KVTraffic(unique=40, p2p=60, ring=120, p2p_inter=40)
    rows = [(c, p.sample, p.start, p.stop) for c, s in enumerate(mb.shards) for p in s.pieces]
    c, sample, start, stop = (np.array(col) for col in zip(*rows))
    moved = exchange_tokens(np.zeros(len(c), dtype=np.int64), c, sample, start, stop, 1, 4, gpus_per_node=2)
    assert moved["send_intra"].tolist() == [[10, 0, 0, 0]]
    assert moved["send_inter"].tolist() == [[10, 10, 0, 0]]
    assert moved["recv_intra"].tolist() == [[0, 10, 0, 0]]
    assert moved["recv_inter"].tolist() == [[0, 0, 20, 0]]
    flat = exchange_tokens(np.zeros(len(c), dtype=np.int64), c, sample, start, stop, 1, 4)
    assert flat["send_intra"].tolist() == [[20, 10, 0, 0]] and not flat["send_inter"].any()
