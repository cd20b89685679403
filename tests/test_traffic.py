"""The targeted exchange's receivers and its bytes within and across nodes (ringpack/traffic.py)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.shard_plan import Piece, microbatch_from_shards
from ringpack.traffic import (
    KVTraffic,
    exchange_partners,
    exchange_tokens,
    kv_traffic,
    needed_pieces,
    proxy_index,
    receivers,
)


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


def test_relayed_volumes_by_hand():
    """CP=8 in nodes of 4; sample 0 is [0, 10) on rank 0, [10, 20) on rank 1, [20, 30) on rank 4,
    [30, 40) on rank 5. Rank 0's piece goes to rank 1 directly and once to node 1; rank 1's once to
    node 1; rank 4's to rank 5 directly. On node 1 both sources' receivers are [4, 5]: source 0's
    proxy is index 0 % 2 = 0 (rank 4), source 1's index 1 % 2 = 1 (rank 5); each relays to the other."""
    c = np.array([0, 1, 4, 5])
    start = np.array([0, 10, 20, 30])
    moved = exchange_tokens(np.zeros(4, dtype=np.int64), c, np.zeros(4, dtype=np.int64), start, start + 10, 1, 8, 4)
    rows = {k: v[0].tolist() for k, v in moved.items()}
    assert rows == {
        "send_intra": [10, 0, 0, 0, 10, 0, 0, 0],
        "recv_intra": [0, 10, 0, 0, 0, 10, 0, 0],
        "send_inter": [10, 10, 0, 0, 0, 0, 0, 0],
        "recv_inter": [0, 0, 0, 0, 10, 10, 0, 0],
        "relay_send": [0, 0, 0, 0, 10, 10, 0, 0],
        "relay_recv": [0, 0, 0, 0, 10, 10, 0, 0],
    }


@st.composite
def node_rows(draw):
    """Pieces of up to 3 micro-batches over CP groups of 1 to 3 nodes of 1, 2 or 4 ranks."""
    node = draw(st.sampled_from([1, 2, 4]))
    cp = node * draw(st.integers(1, 3))
    n = draw(st.integers(1, 30))
    ints = lambda lo, hi: np.array(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)))
    start = ints(0, 60)
    return node, cp, (ints(0, 2), ints(0, cp - 1), ints(0, 3), start, start + ints(1, 20))


@settings(max_examples=200, deadline=None)
@given(node_rows())
def test_every_piece_crossing_nodes_arrives_once(drawn):
    """Routed one pair at a time by the rule (of the receivers of a source on a node, ascending, the
    one at ``proxy_index(source, count)`` takes its pieces for the node), every (piece, rank on another node
    that needs it) pair is delivered exactly once, to the proxy over the link between nodes or by
    its relay, and ``exchange_tokens`` counts what that routing moves."""
    G, cp, (group, rank, sample, start, stop) = drawn
    piece, to = receivers(group, rank, sample, start, stop)
    tokens = stop - start
    want = {k: np.zeros((3, cp), dtype=np.int64) for k in ("send_inter", "recv_inter", "relay_send", "relay_recv")}
    delivered: dict[tuple[int, int], int] = {}
    copies = set()
    for i, r in zip(piece.tolist(), to.tolist()):
        g, s = int(group[i]), int(rank[i])
        if s // G == r // G:
            continue
        node_receivers = sorted({t for p, t in zip(piece, to) if group[p] == g and rank[p] == s and t // G == r // G})
        proxy = int(node_receivers[proxy_index(s, len(node_receivers))])
        assert proxy // G == r // G
        if (i, r // G) not in copies:  # one copy of the piece to the node, at its proxy
            copies.add((i, r // G))
            want["send_inter"][g, s] += tokens[i]
            want["recv_inter"][g, proxy] += tokens[i]
            delivered[(i, proxy)] = delivered.get((i, proxy), 0) + (proxy in to[piece == i])
        if r != proxy:
            want["relay_send"][g, proxy] += tokens[i]
            want["relay_recv"][g, r] += tokens[i]
            delivered[(i, r)] = delivered.get((i, r), 0) + 1
    crossing = {(i, r) for i, r in zip(piece.tolist(), to.tolist()) if rank[i] // G != r // G}
    assert {k for k, v in delivered.items() if v} == crossing and set(delivered.values()) <= {0, 1}
    moved = exchange_tokens(group, rank, sample, start, stop, 3, cp, G)
    for k, v in want.items():
        assert np.array_equal(moved[k], v), k
    assert moved["send_inter"].sum() == moved["recv_inter"].sum()
    assert moved["relay_send"].sum() == moved["relay_recv"].sum()
    assert moved["send_intra"].sum() == moved["recv_intra"].sum()


def test_partners_are_what_the_compiled_exchange_talks_to():
    """Counted from the piece table alone, each rank's partners equal its compiled schedule's
    (``TargetedExchange.partners``), flat and node-relayed, on random and hand-made micro-batches."""
    from ringpack.attention import compile_schedule
    from tests.helpers.attention import random_microbatch, targeted_microbatches

    rng = np.random.default_rng(5)
    cases = [(mb, len(mb.shards)) for _, mb, _ in targeted_microbatches()]
    cases += [(random_microbatch(rng, cp, num_samples=int(rng.integers(1, 9)))[0], cp) for cp in (4, 6, 8) * 4]
    for mb, cp in cases:
        ranks, sample, start, stop = mb.piece_columns
        group = np.zeros_like(ranks)
        for node in (None, 2, 3):
            if node is not None and cp % node:
                continue
            got = exchange_partners(group, ranks, sample, start, stop, 1, cp, node)[0]
            want = [compile_schedule(mb, r, gpus_per_node=node).exchange.partners for r in range(cp)]
            assert got.tolist() == want, (cp, node)
    assert exchange_partners(*(np.zeros(0, dtype=np.int64),) * 5, 2, 4).tolist() == [[0] * 4] * 2


def test_the_partner_budget_rule_counts_exactly_behind_its_cheap_bound():
    """``over_partner_budget`` is ``exchange_partners``' max over the budget, flat and node-relayed,
    whether or not its bound (the holders of a rank's samples, plus its node) lets it skip the count."""
    from ringpack.traffic import _partner_bound, over_partner_budget

    rng = np.random.default_rng(11)
    skipped = counted = 0
    for _ in range(60):
        cp, n, groups = int(rng.integers(3, 13)), int(rng.integers(1, 40)), int(rng.integers(1, 4))
        group, rank, sample = rng.integers(0, groups, n), rng.integers(0, cp, n), rng.integers(0, 6, n)
        start = rng.integers(0, 60, n)
        stop = start + rng.integers(1, 20, n)
        for node in (None, *(k for k in (1, 2, 3, 4) if not (cp % k and k % cp))):
            exact = exchange_partners(group, rank, sample, start, stop, groups, cp, node)
            bound = _partner_bound(group, rank, sample, groups, cp, node)
            assert (bound >= exact).all(), (cp, node)
            for budget in (2, 3, 5):
                got = over_partner_budget(group, rank, sample, start, stop, groups, cp, node, budget)
                assert got.tolist() == ((exact.max(axis=1) > budget) & (cp - 1 > budget)).tolist(), (cp, node)
                skipped += int((bound.max(axis=1) <= budget).any())
                counted += int((bound.max(axis=1) > budget).any())
    assert skipped and counted
