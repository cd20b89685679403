"""The targeted exchange map (``ringpack/attention/exchange.py``) and the engine running it, in one process.

What each rank sends and receives is checked against a brute force over the pieces (every needed
piece once per rank that needs it, in the holder's buffer order, summing to the ``p2p`` traffic);
the engine on the steps compiled on the received rows against the dense reference through a loopback transport that
hands each rank exactly the rows its sources' maps send (fp64, 1e-10). The process-group
transport is tested in ``test_targeted_distributed.py``.
"""

from __future__ import annotations

import pickle
from dataclasses import replace

import numpy as np
import pytest
import torch

from ringpack.attention import compile_schedule, ring_attention
from ringpack.attention.exchange import exchange_ranges, neighbourhood, sends_of_ranks
from ringpack.attention.p2p import targeted_schedule
from ringpack.errors import DataError
from ringpack.piece_table import PieceTable
from ringpack.shard_plan import Piece, microbatch_from_shards
from ringpack.traffic import exchange_tokens, kv_traffic
from tests.helpers.attention import (
    Problem,
    assert_within,
    dense_reference,
    handmade_microbatches,
    max_errors,
    random_microbatch,
    run_all_ranks,
    strategy_microbatch,
    targeted_microbatches,
)

TOL = 1e-10


def plans() -> list[tuple[str, object, dict[int, int]]]:
    """Hand-made corner cases, the targeted ones, strategy cuts and random plans on 2-8 ranks."""
    cases = handmade_microbatches() + targeted_microbatches()
    rng = np.random.default_rng(77)
    for cp in range(2, 9):
        for j in range(3):
            mb, lengths = random_microbatch(rng, cp, num_samples=int(rng.integers(1, 7)))
            cases.append((f"random:cp{cp}:{j}", mb, lengths))
        mb, lengths = strategy_microbatch("zigzag", rng, cp, num_samples=4)
        cases.append((f"zigzag:cp{cp}", mb, lengths))
    return cases


PLANS = plans()
IDS = [name for name, _, _ in PLANS]


def needed_tokens(mb) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``{(holder, needer): tokens}`` from the pieces alone: the tokens ``(sample, position)`` of
    each holder piece that ends at or before the needer's last piece of its sample starts, in the
    holder's canonical order."""
    last_start: dict[tuple[int, int], int] = {}
    for r, shard in enumerate(mb.shards):
        for p in shard.pieces:
            last_start[(r, p.sample)] = max(last_start.get((r, p.sample), -1), p.start)
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for h, shard in enumerate(mb.shards):
        for p in shard.pieces:
            for n in range(len(mb.shards)):
                if n != h and last_start.get((n, p.sample), -1) >= p.stop:
                    out.setdefault((h, n), []).extend((p.sample, t) for t in range(p.start, p.stop))
    return out


def compact_tokens(mb, rank: int) -> list[tuple[int, int]]:
    """The tokens of a rank's compact send buffer: its pieces some other rank needs, in canonical order."""
    needed = {token for (h, _), tokens in needed_tokens(mb).items() if h == rank for token in tokens}
    return [(p.sample, t) for p in mb.shards[rank].pieces for t in range(p.start, p.stop) if (p.sample, t) in needed]


@pytest.mark.parametrize("name,mb,lengths", PLANS, ids=IDS)
def test_each_rank_sends_exactly_what_its_partners_need(name, mb, lengths):
    need = needed_tokens(mb)
    cp = len(mb.shards)
    schedules = [compile_schedule(mb, r) for r in range(cp)]
    sent = 0
    for r, sched in enumerate(schedules):
        ex = sched.exchange
        buffer = compact_tokens(mb, r)
        assert len(buffer) == sched.buffer_tokens[r]
        assert set(ex.dests) == {n for h, n in need if h == r}
        assert set(ex.sources) == {h for h, n in need if n == r}
        for d, count, rows, index in zip(ex.dests, ex.send_tokens, ex.send_ranges, ex.send_index):
            picked = list(range(*rows)) if rows is not None else index.tolist()
            assert [buffer[i] for i in picked] == need[(r, d)], (r, d)
            assert count == len(picked)
            sent += count
        for s, count in zip(ex.sources, ex.recv_tokens):
            assert count == len(need[(s, r)]), (s, r)
    assert sent == kv_traffic(mb).p2p, "each needed piece once per rank that needs it"


def _piece_columns(mb):
    rows = [(c, p.sample, p.start, p.stop) for c, shard in enumerate(mb.shards) for p in shard.pieces]
    c, sample, start, stop = (np.array(col, dtype=np.int64) for col in zip(*rows))
    return np.zeros(len(c), dtype=np.int64), c, sample, start, stop


@pytest.mark.parametrize("gpus_per_node", [1, 2, 3])
def test_the_relayed_maps_move_what_the_traffic_model_counts(gpus_per_node):
    """Per rank, the relayed maps' stage-one sends within and across nodes, and their forwards,
    are the tokens :func:`ringpack.traffic.exchange_tokens` counts (one routing rule for both);
    the plans include proxies that keep part of what they take, and forwards of several runs."""
    partial = several = 0
    for name, mb, _ in PLANS:
        cp = len(mb.shards)
        if not any(shard.pieces for shard in mb.shards):
            continue
        want = exchange_tokens(*_piece_columns(mb), 1, cp, gpus_per_node)
        for r in range(cp):
            ex = compile_schedule(mb, r, gpus_per_node=gpus_per_node).exchange
            near = sum(n for d, n in zip(ex.dests, ex.send_tokens) if d // gpus_per_node == r // gpus_per_node)
            far = sum(n for d, n in zip(ex.dests, ex.send_tokens) if d // gpus_per_node != r // gpus_per_node)
            forwarded = sum(n for job in ex.proxied for _, _, n, _ in job.forwards)
            got = (near, far, forwarded, sum(job.tokens for job in ex.proxied))
            expected = ("send_intra", "send_inter", "relay_send", "recv_inter")
            assert got == tuple(int(want[k][0, r]) for k in expected), (name, r, got)
            assert sum(n for *_, n in ex.relay_in) == want["relay_recv"][0, r], (name, r)
            partial += sum(job.own_index >= 0 and job.own != ((0, job.tokens, 0),) for job in ex.proxied)
            runs = [(j, frm) for j, frm, _, _ in ex.relay_in]
            several += len(runs) > len(set(runs))
    assert gpus_per_node == 1 or (partial and several), (partial, several)


@pytest.mark.parametrize("name,mb,lengths", PLANS, ids=IDS)
def test_a_rank_runs_one_step_per_source_on_the_rows_it_receives(name, mb, lengths):
    for r in range(len(mb.shards)):
        sched = compile_schedule(mb, r, dense_threshold=2, dense_buckets=1)
        ex, view = sched.exchange, targeted_schedule(sched)
        assert view.steps == ex.steps and view.local is sched.local and view.send_index is sched.send_index
        assert len(view.steps) == (len(ex.sources) or (1 if ex.dests else 0))
        for i, step in enumerate(view.steps):
            if i >= len(ex.sources):
                assert step.calls == () and step.distance == 0, "the step of a rank that only sends"
                continue
            assert view.source(step) == ex.sources[i]
            assert step.calls, "a source is a rank whose keys this rank reads"
            for call in step.calls:
                for part in (call, *call.rest):
                    assert int(part.cu_seqlens_k[-1]) == ex.recv_tokens[i], "calls cover the received rows"
                    assert int(torch.diff(part.cu_seqlens_k).max()) == part.max_seqlen_k
                for dense in call.dense:
                    assert dense.k_start + dense.k_len <= ex.recv_tokens[i]


@pytest.mark.parametrize("name,mb,lengths", PLANS, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,gpus_per_node", [(4, 2, None), (3, 1, None), (4, 2, 2), (3, 1, 3), (2, 1, 1)])
def test_targeted_steps_are_exact(name, mb, lengths, heads, kv_heads, gpus_per_node):
    """Flat and node-relayed (every rank's rows followed through the maps: straight, through its
    proxy, or its own proxied rows), against the dense reference."""
    problem = Problem.make(mb, lengths, heads, kv_heads, 8, seed=5)
    ref = dense_reference(problem)
    for r, got in enumerate(run_all_ranks(problem, mode="p2p", gpus_per_node=gpus_per_node)):
        assert_within(max_errors(problem, r, ref, got), TOL, f"{name} rank {r} gpus_per_node={gpus_per_node}")


@pytest.mark.parametrize(
    "threshold,buckets",
    [pytest.param(*case, marks=pytest.mark.slow) for case in ((1, 1), (2, None), (3, 8))],
)
def test_targeted_steps_are_exact_with_the_dense_split(threshold, buckets):
    """Remapped remote calls keep their dense segments (keys moved onto the received rows) and
    their rest calls; reference_hybrid runs both halves in fp64."""
    remote_dense = 0
    for name, mb, lengths in PLANS:
        problem = Problem.make(mb, lengths, 4, 2, 8, seed=6)
        ref = dense_reference(problem)
        results = run_all_ranks(
            problem, backend="reference_hybrid", dense_threshold=threshold, dense_buckets=buckets, mode="p2p"
        )
        for r, got in enumerate(results):
            assert_within(max_errors(problem, r, ref, got), TOL, f"{name} rank {r}")
            ex = compile_schedule(mb, r, dense_threshold=threshold, dense_buckets=buckets).exchange
            remote_dense += sum(len(c.dense) for st in ex.steps for c in st.calls)
    assert remote_dense > 0, "some remote call ran through the dense kernel"


def _embedded(cp: int):
    """Rank 3's pieces and partners alike in a group of ``cp`` ranks: sample 0 from rank 0 to rank 3,
    sample 1 from rank 3 to rank 5 (interleaved with sample 2, whole); every other rank holds
    samples of its own, split over neighbours that are not 0, 3 or 5."""
    lengths = {0: 9, 1: 8, 2: 3}
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    shards[0].append(Piece(0, 0, 4))
    shards[3] += [Piece(0, 4, 9), Piece(1, 0, 3), Piece(2, 0, 3)]
    shards[5].append(Piece(1, 3, 8))
    free = [r for r in range(cp) if r not in (0, 3, 5)]
    for j, (a, b) in enumerate(zip(free, free[1:] + free[:1])):
        lengths[100 + j] = 6
        shards[a].append(Piece(100 + j, 0, 2))
        shards[b].append(Piece(100 + j, 2, 6))
    return microbatch_from_shards(list(lengths), shards, lengths)


def test_the_exchange_map_of_a_rank_does_not_grow_with_the_group():
    """Rank 3 of 8 and of 64, with the same pieces and partners: the map reads the same pieces
    (its own and its samples' elsewhere), compiles the same steps and comes out the same."""
    found = {}
    for cp in (8, 64):
        mb = _embedded(cp)
        table = PieceTable.from_microbatch(mb)
        mine = np.flatnonzero(table.rank == 3)
        rows = neighbourhood(table, mine)
        pieces = sorted(
            (int(table.rank[i]), mb.samples[table.slot[i]], int(table.start[i]), int(table.stop[i])) for i in rows
        )
        ex = compile_schedule(mb, 3).exchange
        found[cp] = (pieces, ex.sources, ex.recv_tokens, ex.dests, ex.send_tokens, ex.partners, len(ex.steps))
    assert found[8] == found[64]
    pieces, sources, _, dests, *_ = found[8]
    assert len(pieces) == 5 and sources == (0,) and dests == (5,), found[8]


def test_a_schedule_without_an_exchange_map_is_refused_in_p2p_mode():
    _, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "cp1")
    problem = Problem.make(mb, lengths, 2, 2, 4, seed=0)
    sched = replace(compile_schedule(mb, 0), exchange=None)
    q, k, v = (problem.local(x, 0) for x in (problem.q, problem.k, problem.v))
    with pytest.raises(DataError, match="mode='p2p' needs the schedule's exchange map"):
        ring_attention(q, k, v, sched, mode="p2p", backend="reference")
    assert ring_attention(q, k, v, sched, mode="ring", backend="reference").shape == q.shape


def test_p2p_mode_on_one_rank_equals_ring_mode():
    _, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "cp1")
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=1)
    sched = compile_schedule(mb, 0)
    q, k, v = (problem.local(x, 0) for x in (problem.q, problem.k, problem.v))
    out = {mode: ring_attention(q, k, v, sched, mode=mode, backend="reference") for mode in ("ring", "p2p")}
    assert torch.equal(out["ring"], out["p2p"])


def test_the_exchange_map_moves_and_pickles_with_its_schedule():
    _, mb, _ = next(c for c in targeted_microbatches() if c[0] == "interleaved-of-5")
    sched = compile_schedule(mb, 0)
    for copy in (sched.to("cpu"), pickle.loads(pickle.dumps(sched))):
        ex, new = sched.exchange, copy.exchange
        assert new is not ex and (new.sources, new.recv_tokens, new.dests) == (ex.sources, ex.recv_tokens, ex.dests)
        for a, b in zip(ex.steps, new.steps):
            for ca, cb in zip(a.calls, b.calls):
                assert torch.equal(ca.cu_seqlens_k, cb.cu_seqlens_k) and ca.max_seqlen_k == cb.max_seqlen_k
        assert [None if t is None else t.tolist() for t in new.send_index] == [
            None if t is None else t.tolist() for t in ex.send_index
        ]


@pytest.mark.parametrize("name,mb,lengths", PLANS, ids=IDS)
def test_the_sends_of_many_ranks_at_once_are_each_ranks_own(name, mb, lengths):
    """``sends_of_ranks`` (one pass, what a node's relay reads) gives each rank the sends its own
    ``exchange_ranges`` gives, whole and restricted to one node's ranks."""
    table = PieceTable.from_microbatch(mb)
    cp = len(mb.shards)
    own = {r: exchange_ranges(table, table.rows_of(r), r)[1] for r in range(cp)}
    ranks = list(range(0, cp, 2)) + [cp - 1]
    together = sends_of_ranks(table, ranks)
    assert sorted(together) == sorted(set(ranks))
    for r, sends in together.items():
        np.testing.assert_array_equal(sends, own[r])
    for lo, hi in ((0, 2), (1, cp)):
        kept = sends_of_ranks(table, ranks, to=(lo, hi))
        for r, sends in kept.items():
            np.testing.assert_array_equal(sends, own[r][(own[r][:, 0] >= lo) & (own[r][:, 0] < hi)])
