"""Schedule compilation: exact coverage of the causal document mask, compact buffers, skipped steps.

The coverage check is brute force: it expands every kernel call of every rank into the (query,
key) token pairs it computes, maps both to (sample, position) and demands that the result is the
causal per-sample mask with every pair exactly once. No numerics, so it runs hundreds of plans.
"""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.attention import compile_schedule
from ringpack.attention.schedule import Schedule, dense_bucket, dense_bucket_up
from ringpack.errors import PlanError
from ringpack.shard_plan import MicroBatch, Piece, RankShard, microbatch_from_shards
from tests.helpers.attention import handmade_microbatches, random_microbatch, strategy_microbatch, zigzag_case


def _tokens(mb: MicroBatch, rank: int) -> list[tuple[int, int]]:
    return [(p.sample, pos) for p in mb.shards[rank].pieces for pos in range(p.start, p.stop)]


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:]))


def _check_call_shape(call, n_queries: int, n_keys: int) -> None:
    assert call.cu_seqlens_q.dtype == torch.int32 and call.cu_seqlens_k.dtype == torch.int32
    assert call.cu_seqlens_q.numel() == call.cu_seqlens_k.numel()
    assert int(call.cu_seqlens_q[-1]) == n_queries
    assert int(call.cu_seqlens_k[-1]) == n_keys, "key segments must tile the whole buffer"
    q_lens = [b - a for a, b in _segments(call.cu_seqlens_q)]
    k_lens = [b - a for a, b in _segments(call.cu_seqlens_k)]
    assert min(q_lens + [0]) >= 0 and min(k_lens + [0]) >= 0
    assert call.max_seqlen_q == max(q_lens) and call.max_seqlen_k == max(k_lens)
    assert all(k > 0 for q, k in zip(q_lens, k_lens) if q > 0), "a query segment without keys"


def computed_pairs(mb: MicroBatch, schedules: list[Schedule], rank: int) -> Counter:
    sched = schedules[rank]
    local = _tokens(mb, rank)
    assert sched.num_tokens == len(local)
    pairs: Counter = Counter()
    if sched.local is None:
        assert not local
    else:
        call = sched.local
        assert call.causal and call.rows is None
        _check_call_shape(call, len(local), len(local))
        for (qa, qb), (ka, kb) in zip(_segments(call.cu_seqlens_q), _segments(call.cu_seqlens_k)):
            shift = (kb - ka) - (qb - qa)
            for i in range(qb - qa):
                for j in range(kb - ka):
                    if j <= i + shift:
                        (xs, xp), (ys, yp) = local[qa + i], local[ka + j]
                        if xs == ys:
                            pairs[(xs, xp, yp)] += 1
                        else:
                            pairs[("cross-sample", xs, ys)] += 1
    for step in sched.steps:
        src = sched.source(step)
        src_tokens = _tokens(mb, src)
        buffer = [src_tokens[i] for i in schedules[src].send_index.tolist()]
        used_rows: set[int] = set()
        for call in step.calls:
            assert not call.causal
            rows = row_list(call, len(local))
            assert not used_rows & set(rows), "a query row appears in two calls of one step"
            used_rows |= set(rows)
            _check_call_shape(call, len(rows), len(buffer))
            for (qa, qb), (ka, kb) in zip(_segments(call.cu_seqlens_q), _segments(call.cu_seqlens_k)):
                for i in rows[qa:qb]:
                    for j in range(ka, kb):
                        (xs, xp), (ys, yp) = local[i], buffer[j]
                        pairs[(xs, xp, yp) if xs == ys else ("cross-sample", xs, ys)] += 1
    return pairs


def expected_pairs(mb: MicroBatch, rank: int) -> Counter:
    return Counter((s, p, j) for s, p in _tokens(mb, rank) for j in range(p + 1))


def needed_pieces(mb: MicroBatch, rank: int) -> list[Piece]:
    """Brute force: pieces of ``rank`` that some other rank's query needs."""
    return [
        p
        for p in mb.shards[rank].pieces
        if any(
            o.sample == p.sample and o.start >= p.stop for r, sh in enumerate(mb.shards) if r != rank for o in sh.pieces
        )
    ]


def check_schedule(mb: MicroBatch) -> list[Schedule]:
    cp = len(mb.shards)
    schedules = [compile_schedule(mb, r) for r in range(cp)]
    assert len({s.fingerprint for s in schedules}) == 1
    assert len({s.distances for s in schedules}) == 1, "all ranks must run the same ring steps"
    assert len({s.buffer_tokens for s in schedules}) == 1
    for r, sched in enumerate(schedules):
        got, want = computed_pairs(mb, schedules, r), expected_pairs(mb, r)
        assert got == want, (
            f"rank {r}: missing {list((want - got).items())[:5]}, extra {list((got - want).items())[:5]}"
        )
        # compact buffer = exactly the needed pieces, in canonical order
        local = _tokens(mb, r)
        buffer = [local[i] for i in sched.send_index.tolist()]
        assert buffer == [(p.sample, x) for p in needed_pieces(mb, r) for x in range(p.start, p.stop)]
        assert sched.buffer_tokens[r] == len(buffer)
    # a distance is a step iff some rank needs something from that far back
    for t in range(1, cp):
        needs = any(
            any(
                o.sample == p.sample and o.stop <= p.start
                for p in mb.shards[r].pieces
                for o in mb.shards[(r - t) % cp].pieces
            )
            for r in range(cp)
        )
        assert needs == (t in schedules[0].distances), f"distance {t}"
    return schedules


@pytest.mark.parametrize("name,mb,lengths", handmade_microbatches(), ids=lambda x: x if isinstance(x, str) else "")
def test_handmade_plans_cover_the_mask_exactly(name, mb, lengths):
    check_schedule(mb)


@pytest.mark.parametrize("strategy", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_strategy_plans_cover_the_mask_exactly(strategy, cp):
    rng = np.random.default_rng(cp)
    for _ in range(6):
        check_schedule(strategy_microbatch(strategy, rng, cp, num_samples=int(rng.integers(1, 8)))[0])


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cp=st.integers(1, 5), n=st.integers(1, 6))
def test_random_plans_cover_the_mask_exactly(seed, cp, n):
    check_schedule(random_microbatch(np.random.default_rng(seed), cp, num_samples=n)[0])


def test_no_split_sample_means_no_communication():
    mb = microbatch_from_shards(
        [0, 1, 2, 3], [[Piece(0, 0, 7), Piece(3, 0, 2)], [Piece(1, 0, 9)], [Piece(2, 0, 1)]], {0: 7, 1: 9, 2: 1, 3: 2}
    )
    for r in range(3):
        sched = compile_schedule(mb, r)
        assert sched.steps == () and sched.buffer_tokens == (0, 0, 0) and sched.send_index.numel() == 0
        assert sched.num_kernel_calls == 1


def test_contiguous_split_talks_only_to_the_neighbour():
    mb = microbatch_from_shards(
        [0, 1], [[Piece(0, 0, 6)], [Piece(0, 6, 8), Piece(1, 0, 4)], [Piece(1, 4, 9)], []], {0: 8, 1: 9}
    )
    schedules = check_schedule(mb)
    assert schedules[0].distances == (1,)
    # rank 2 holds the last piece of sample 1: nobody needs it, so it sends nothing
    assert schedules[0].buffer_tokens == (6, 4, 0, 0)


def test_skipped_distance_is_jumped_over():
    _, mb, _ = next(c for c in handmade_microbatches() if c[0] == "balanced-like")
    schedules = check_schedule(mb)
    assert schedules[0].distances == (2,)  # only rank 3 needs rank 1's piece
    assert schedules[0].buffer_tokens == (0, 11, 0, 0)
    assert [len(s.calls) for s in schedules[3].steps] == [1] and all(not s.steps[0].calls for s in schedules[:3])


def test_zigzag_needs_one_call_per_step():
    mb = zigzag_case(4, [37, 64, 5, 1])
    for sched in check_schedule(mb):
        assert len(sched.steps) == 3 and all(len(step.calls) == 1 for step in sched.steps)


def test_interleaved_pieces_split_into_levels():
    _, mb, _ = next(c for c in handmade_microbatches() if c[0] == "interleaved")
    schedules = check_schedule(mb)
    assert max(len(step.calls) for s in schedules for step in s.steps) >= 2


def test_fingerprint_tracks_the_plan():
    a = zigzag_case(2, [5, 9])
    b = zigzag_case(2, [5, 10])
    c = microbatch_from_shards([0, 1], [list(a.shards[1].pieces), list(a.shards[0].pieces)], {0: 5, 1: 9})
    fps = {compile_schedule(mb, 0).fingerprint for mb in (a, b, c)}
    assert len(fps) == 3


def test_schedule_moves_pickles_and_pins():
    sched = compile_schedule(zigzag_case(3, [11, 4]), 1)
    again = pickle.loads(pickle.dumps(sched))
    assert again.fingerprint == sched.fingerprint and torch.equal(again.send_index, sched.send_index)
    moved = sched.to("cpu")
    assert moved.device == torch.device("cpu") and moved.distances == sched.distances
    if torch.cuda.is_available():
        assert sched.pin_memory().send_index.is_pinned()


def test_invalid_microbatches_are_rejected():
    mb = MicroBatch(
        samples=(0,), shards=(type(zigzag_case(1, [3]).shards[0])((Piece(0, 2, 3), Piece(0, 0, 2))),), loss_tokens=2
    )
    with pytest.raises(ValueError, match="canonical order"):
        compile_schedule(mb, 0)
    overlap = microbatch_from_shards([0], [[Piece(0, 0, 3)], [Piece(0, 2, 4)]], {0: 4})
    with pytest.raises(ValueError, match="overlaps"):
        compile_schedule(overlap, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        compile_schedule(zigzag_case(2, [4]), 2)


# ------------------------------------------------------------------------------------ dense split


def row_list(call, num_tokens: int) -> list[int]:
    """A call's local query rows as a list, from whichever form it stores (all rows, a range, an index)."""
    rows = call.rows
    if rows is None:
        assert call.q_index is None and call.q_range is None
        return list(range(num_tokens))
    if isinstance(rows, slice):
        assert call.q_index is None and 0 <= rows.start < rows.stop
        return list(range(rows.start, rows.stop))
    index = rows.tolist()
    assert index != list(range(index[0], index[0] + len(index))), "contiguous rows must be stored as a range"
    return index


def _expanded_segments(call) -> list[tuple[tuple[int, ...], int, int]]:
    """A call's non-empty segments as (local query rows, first key row of the buffer, key count)."""
    rows = None if call.rows is None else row_list(call, -1)
    k0 = 0 if call.k_range is None else call.k_range[0]
    out = []
    for (qa, qb), (ka, kb) in zip(_segments(call.cu_seqlens_q), _segments(call.cu_seqlens_k)):
        if qb > qa:
            out.append((tuple(range(qa, qb)) if rows is None else tuple(rows[qa:qb]), k0 + ka, kb - ka))
    return out


def _equal_runs(whole, is_long, threshold: int) -> list[int]:
    """Counts of the maximal runs of consecutive short segments of one length >= threshold // 16 that
    hold at least ``threshold`` rows in all (those a causal call batches)."""
    runs, prev = [], None
    for (rows, _, _), flag in zip(whole, is_long):
        n = len(rows)
        key = None if flag or n < max(threshold // 16, 1) else n
        if key is not None and key == prev:
            runs[-1][1] += 1
        elif key is not None:
            runs.append([n, 1])
        prev = key
    return [count for n, count in runs if count >= 2 and count * n >= threshold]


def _pairs(segments, causal: bool) -> Counter:
    """(query row, key row) pairs of segments given as (query rows, first key row, key count), causal bottom-right."""
    pairs = Counter()
    for rows, k0, nk in segments:
        shift = nk - len(rows)
        for i, row in enumerate(rows):
            pairs.update((row, k0 + j) for j in range(nk if not causal else min(nk, i + shift + 1)))
    return pairs


def check_dense_split(call, threshold: int, buckets: int | None, run_rows: int | None = None) -> None:
    """``dense`` + ``rest`` compute exactly the call's (query, key) pairs, each once; the dense parts are the
    long segments whole, their kernel shapes padded up (queries; a causal square's keys too) or cut down
    (a block's keys) to bucket lengths, and (causal) runs of equal short segments batched in power-of-two
    groups, all but at most one segment of each run; rest keeps every key segment. ``run_rows``: the
    local rest calls hold at most that many rows (or one segment), and two adjacent ones would not fit."""
    whole = _expanded_segments(call)
    # the area rule: >= threshold**2 query-key products, both sides >= threshold // 4
    is_long = [
        len(seg[0]) * seg[2] >= threshold**2 and min(len(seg[0]), seg[2]) >= max(threshold // 4, 1) for seg in whole
    ]
    runs = _equal_runs(whole, is_long, threshold) if call.causal else []
    if not any(is_long) and not runs:
        assert call.dense == () and call.rest == ()
        return
    assert all(isinstance(x, int) for d in call.dense for x in d)
    _check_long_parts(call, [seg for seg, flag in zip(whole, is_long) if flag], buckets)
    _check_batched_parts(call, whole, is_long, runs)
    dense = [
        (tuple(range(d.q_start + j * d.q_len, d.q_start + (j + 1) * d.q_len)), d.k_start + j * d.k_len, d.k_len)
        for d in call.dense
        for j in range(d.batch)
    ]
    rest = [seg for part in call.rest for seg in _expanded_segments(part)]
    assert _pairs(dense, call.causal) + _pairs(rest, call.causal) == _pairs(whole, call.causal)
    assert max((_pairs(dense + rest, call.causal)).values()) == 1
    _check_rest_calls(call, run_rows)


def _check_long_parts(call, long: list, buckets: int | None) -> None:
    """The unbatched dense parts are the long segments, in order, with bucket shapes."""
    want = []
    for rows, k0, nk in long:
        nq = len(rows)
        q_run = int(dense_bucket_up(nq, buckets))
        want.append((rows[0], nq, k0, nk, q_run, q_run if call.causal else int(dense_bucket(nk, buckets)), 1))
        assert list(rows) == list(range(rows[0], rows[0] + nq))
        assert buckets is None or (nq <= q_run < nq * (1 + 1 / buckets) + 1 and q_run == dense_bucket(q_run, buckets))
    assert [d for d in call.dense if d.batch == 1] == want


def _check_batched_parts(call, whole: list, is_long: list[bool], runs: list[int]) -> None:
    """Batched parts: consecutive whole short segments of one length, unpadded, power-of-two groups."""
    batched = [d for d in call.dense if d.batch > 1]
    starts = {seg[0][0]: i for i, seg in enumerate(whole)}
    for d in batched:
        assert (
            call.causal
            and d.batch & (d.batch - 1) == 0
            and d.q_len == d.k_len == d.q_run == d.k_run
            and d.q_start == d.k_start
        )
        first = starts[d.q_start]
        assert all(len(whole[first + j][0]) == d.q_len and not is_long[first + j] for j in range(d.batch))
    assert sum(d.batch for d in batched) == sum(count - count % 2 for count in runs)


def _check_rest_calls(call, run_rows: int | None) -> None:
    """Rest calls: plain varlen calls; local ones are ranges read as views (cut greedily at ``run_rows``),
    the remote one keeps every key segment."""
    for part in call.rest:
        assert part.causal == call.causal and not part.dense and not part.rest
        q_lens = [b - a for a, b in _segments(part.cu_seqlens_q)]
        assert part.max_seqlen_q == max(q_lens) and len(row_list(part, -1)) == sum(q_lens)
        assert part.max_seqlen_k == max(b - a for a, b in _segments(part.cu_seqlens_k))
        if call.causal:  # local: a run of short segments between dense parts, its rows and keys ranges read as views
            assert part.q_index is None and part.q_range == part.k_range
            if run_rows is not None:
                assert sum(q_lens) <= run_rows or len(q_lens) == 1
        else:
            assert len(call.rest) == 1 and part.k_range is None
            assert torch.equal(part.cu_seqlens_k, call.cu_seqlens_k), (
                "rest must keep every key segment (dK/dV rows zeroed)"
            )
    if call.causal and run_rows is not None:  # cut greedily: a call ends only where the next segment would not fit
        for a, b in zip(call.rest, call.rest[1:]):
            if a.q_range[1] == b.q_range[0]:
                assert (a.q_range[1] - a.q_range[0]) + int(b.cu_seqlens_q[1]) > run_rows


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cp=st.integers(1, 5),
    n=st.integers(1, 6),
    threshold=st.integers(1, 10),
    buckets=st.sampled_from([None, 1, 2, 4, 8]),
    run_rows=st.sampled_from([1, 5, 16, 8192]),
)
def test_dense_split_partitions_every_call(seed, cp, n, threshold, buckets, run_rows):
    from ringpack.attention import kernel_calls

    kernel_calls.LOCAL_RUN_ROWS, saved = (
        run_rows,
        kernel_calls.LOCAL_RUN_ROWS,
    )  # the local rest cut into calls of at most this many rows
    try:
        _dense_split_partitions_every_call(seed, cp, n, threshold, buckets, run_rows)
    finally:
        kernel_calls.LOCAL_RUN_ROWS = saved


def _dense_split_partitions_every_call(seed, cp, n, threshold, buckets, run_rows):
    mb = random_microbatch(np.random.default_rng(seed), cp, num_samples=n)[0]
    for r in range(cp):
        sched = compile_schedule(mb, r, dense_threshold=threshold, dense_buckets=buckets)
        plain = compile_schedule(mb, r, dense_threshold=None)
        for call, base in zip(
            (sched.local, *(c for s in sched.steps for c in s.calls)),
            (plain.local, *(c for s in plain.steps for c in s.calls)),
        ):
            if call is None:
                continue
            assert torch.equal(call.cu_seqlens_q, base.cu_seqlens_q) and base.dense == () and base.rest == ()
            check_dense_split(call, threshold, buckets, run_rows)
        moved = sched.to("cpu")
        assert moved.local is None or (
            moved.local.dense == sched.local.dense and len(moved.local.rest) == len(sched.local.rest)
        )


def test_dense_bucket_lengths():
    lengths = np.arange(1, 5000)
    cut = dense_bucket(lengths, 8)
    assert (cut <= lengths).all() and (lengths - cut < np.maximum(lengths / 8, 1)).all()
    assert (dense_bucket(cut, 8) == cut).all(), "bucket lengths are fixed points"
    assert len(set(cut[cut >= 1024].tolist())) == 8 + 8 + 2  # 1024..4999: octaves 1K-2K and 2K-4K, then 4096, 4608
    assert (dense_bucket(lengths, None) == lengths).all()
    up = dense_bucket_up(lengths, 8)
    buckets = np.unique(dense_bucket(np.arange(1, 10000), 8))
    assert (up == buckets[np.searchsorted(buckets, lengths)]).all(), "the smallest bucket length >= the length"
    assert ((up == lengths) == (cut == lengths)).all() and (dense_bucket_up(lengths, None) == lengths).all()
    with pytest.raises(ValueError, match="dense_buckets"):
        compile_schedule(zigzag_case(2, [4]), 0, dense_buckets=3)


def test_dense_threshold_is_validated():
    with pytest.raises(ValueError, match="dense_threshold"):
        compile_schedule(zigzag_case(2, [4]), 0, dense_threshold=0)


def test_schedule_options_are_compile_schedules_keywords():
    """ScheduleOptions declares compile_schedule's options once: its fields are the keywords (with their
    defaults), values are normalised to plain ints and bools, a bad value names its field, and
    options= compiles what the keywords compile."""
    import inspect
    from dataclasses import fields

    from ringpack.attention import ScheduleOptions
    from ringpack.attention.schedule import DENSE_KEYWORDS, DenseOptions
    from ringpack.errors import PlanError

    params = inspect.signature(compile_schedule).parameters
    names = [f.name for f in fields(ScheduleOptions)]
    assert names == [name for name in params if name not in ("microbatch", "cp_rank", "options")]
    assert tuple(name for name in names if name.startswith("dense_")) == DENSE_KEYWORDS
    defaults = ScheduleOptions()
    assert [getattr(defaults, name) for name in names] == [params[name].default for name in names]
    assert defaults.dense == DenseOptions()
    options = ScheduleOptions.from_keywords({"dense_threshold": np.int64(8), "dense_batches": np.bool_(False)})
    assert options == ScheduleOptions(dense_threshold=8, dense_batches=False)
    assert type(options.dense_threshold) is int and type(options.dense_batches) is bool
    with pytest.raises(TypeError):
        ScheduleOptions(8)  # keyword-only
    with pytest.raises(PlanError, match=r"unknown schedule option\(s\) \['threshold'\]"):
        ScheduleOptions.from_keywords({"threshold": 8})
    for field, bad in (("dense_batches", "yes"), ("dense_buckets", 3), ("dense_threshold", 0), ("gpus_per_node", 0)):
        with pytest.raises(PlanError, match=f"^{field} must be"):
            ScheduleOptions(**{field: bad})
    assert ScheduleOptions().with_node_size(4).gpus_per_node == 4
    assert ScheduleOptions(gpus_per_node=2).with_node_size(4).gpus_per_node == 2
    mb = zigzag_case(2, [40, 9])
    low = {"dense_threshold": 2, "dense_buckets": None}
    by_options = compile_schedule(mb, 1, options=ScheduleOptions(**low))
    assert by_options.local.dense == compile_schedule(mb, 1, **low).local.dense and by_options.local.dense
    with pytest.raises(PlanError, match=r"options= or the keywords \['dense_threshold'\], not both"):
        compile_schedule(mb, 1, dense_threshold=2, options=ScheduleOptions())
    with pytest.raises(PlanError, match="options must be a ScheduleOptions, got dict"):
        compile_schedule(mb, 1, options=low)


# ------------------------------------------------------------------ compile cost against the group size


def _ring_distances_brute(mb: MicroBatch) -> list[int]:
    """Distances ``(r - s) mod C`` of every rank pair where ``r`` holds a piece of a sample starting
    at or after the end of a piece of it on ``s``: straight from the pieces."""
    cp = len(mb.shards)
    found = set()
    for r, mine in enumerate(mb.shards):
        for s, theirs in enumerate(mb.shards):
            if r != s and any(p.sample == o.sample and p.start >= o.stop for p in mine.pieces for o in theirs.pieces):
                found.add((r - s) % cp)
    return sorted(found)


@settings(max_examples=120, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cp=st.integers(1, 12),
    n=st.integers(1, 8),
    max_pairs=st.sampled_from([1, 3, 1 << 20]),
)
def test_ring_distances_come_from_the_pairs_of_ranks_sharing_a_sample(seed, cp, n, max_pairs):
    """The distances every rank skips to, from each sample's rank pairs in chunks of any size."""
    from ringpack.piece_table import PieceTable, ring_distances

    mb, _ = random_microbatch(np.random.default_rng(seed), cp, num_samples=n, max_pieces=8)
    want = _ring_distances_brute(mb)
    assert ring_distances(PieceTable.from_microbatch(mb), max_pairs=max_pairs) == want
    assert compile_schedule(mb, 0).distances == tuple(want)


def _wide_microbatch(rng: np.random.Generator, cp: int, num_samples: int) -> MicroBatch:
    """Samples cut into many pieces over random runs of consecutive ranks (spans up to the group),
    the shape of pool plans: many samples of few spans, a few very wide ones."""
    ids = rng.choice(10 * num_samples, size=num_samples, replace=False).tolist()
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    lengths = {}
    for s in ids:
        width = int(rng.choice([1, 1, 2, 8, 8, cp // 2, cp]))
        first = int(rng.integers(cp - width + 1))
        k = int(rng.integers(1, 2 * width + 1))
        lengths[s] = k * 3
        for i in range(k):
            shards[first + int(rng.integers(width))].append(Piece(s, 3 * i, 3 * i + 3))
    return microbatch_from_shards(ids, shards, lengths)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cp=st.sampled_from([16, 48]), max_pairs=st.sampled_from([1, 64, 1 << 20]))
def test_ring_distances_of_wide_samples_match_every_rank_pair(seed, cp, max_pairs):
    """Samples over runs of up to the whole group: skipping the samples whose span allows no
    distance not yet found leaves the list of every pair's distances."""
    from ringpack.piece_table import PieceTable, ring_distances

    mb = _wide_microbatch(np.random.default_rng(seed), cp, num_samples=30)
    assert ring_distances(PieceTable.from_microbatch(mb), max_pairs=max_pairs) == _ring_distances_brute(mb)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cp=st.integers(1, 9), n=st.integers(1, 8))
def test_needed_pieces_of_the_table_follow_the_traffic_rule(seed, cp, n):
    """The table's one-pass needed flags are :func:`ringpack.traffic.needed_pieces`'s."""
    from ringpack.piece_table import PieceTable
    from ringpack.traffic import needed_pieces as traffic_needed

    mb, _ = random_microbatch(np.random.default_rng(seed), cp, num_samples=n, max_pieces=8)
    t = PieceTable.from_microbatch(mb)
    sample = np.asarray(mb.samples, dtype=np.int64)[t.slot]
    assert np.array_equal(t.needed, traffic_needed(np.zeros_like(t.rank), t.rank, sample, t.start, t.stop) > 0)


def test_a_sample_listed_twice_is_named():
    mb = MicroBatch(samples=(5, 9, 5), shards=(RankShard((Piece(5, 0, 2), Piece(9, 0, 1))),), loss_tokens=1)
    with pytest.raises(PlanError, match=r"^microbatch lists sample 5 twice$"):
        compile_schedule(mb, 0)


@pytest.mark.parametrize("offset", [0, 10**12], ids=["dataset indices", "large ids"])
def test_sample_ids_of_any_size_compile_alike_and_unknown_or_repeated_ones_are_named(offset):
    """Slots come from a lookup table over small ids and from a sort over large ones, alike."""
    mb, _ = random_microbatch(np.random.default_rng(11), 4, num_samples=6)
    moved = MicroBatch(
        samples=tuple(s + offset for s in mb.samples),
        shards=tuple(
            RankShard(tuple(Piece(p.sample + offset, p.start, p.stop) for p in sh.pieces)) for sh in mb.shards
        ),
        loss_tokens=mb.loss_tokens,
    )
    for r in range(4):
        a, b = compile_schedule(mb, r), compile_schedule(moved, r)
        assert a.distances == b.distances and a.buffer_tokens == b.buffer_tokens
        assert torch.equal(a.send_index, b.send_index) and repr(a.local) == repr(b.local)
    stray = Piece(offset + 5000, 0, 1)
    unknown = MicroBatch(samples=moved.samples, shards=(RankShard((stray,)), *moved.shards[1:]), loss_tokens=1)
    rank = next(r for r, sh in enumerate(unknown.shards) if stray in sh.pieces)
    with pytest.raises(PlanError, match=f"cp rank {rank}: piece of sample {offset + 5000}, which"):
        compile_schedule(unknown, 0)
    repeated = MicroBatch(samples=(*moved.samples, moved.samples[2]), shards=moved.shards, loss_tokens=1)
    with pytest.raises(PlanError, match=f"lists sample {moved.samples[2]} twice"):
        compile_schedule(repeated, 0)


def test_a_compiled_microbatch_pickles_as_before():
    """The piece columns a compile caches on the micro-batch stay out of its pickles (what a
    DataLoader worker sends back with the batch)."""
    mb, _ = random_microbatch(np.random.default_rng(3), 4)
    before = pickle.dumps(mb)
    compile_schedule(mb, 1)
    assert "piece_columns" in vars(mb) and pickle.dumps(mb) == before


def test_a_rank_compiles_remote_calls_for_its_sources_only(monkeypatch):
    """In a group of 64 where every rank sends one rank and receives from one (32 ring distances),
    a rank compiles one step's calls; the other steps are empty without looking at their ranks."""
    from ringpack.attention import schedule as schedule_module

    cp = 64
    lengths, shards = {}, [[] for _ in range(cp)]
    for r in range(cp):  # rank r's sample ends on rank 3r + 1 (a bijection: odd distances 2r + 1)
        lengths[r] = 6
        shards[r].append(Piece(r, 0, 3))
        shards[(3 * r + 1) % cp].append(Piece(r, 3, 6))
    mb = microbatch_from_shards(list(range(cp)), shards, lengths)
    asked = []
    key_groups = schedule_module._key_groups

    def counted(table, mine, sources):
        asked.append(sources.tolist())
        return key_groups(table, mine, sources)

    monkeypatch.setattr(schedule_module, "_key_groups", counted)
    sched = compile_schedule(mb, 5)
    assert len(sched.steps) == 32 and sum(bool(step.calls) for step in sched.steps) == 1
    assert asked == [[44]], "one source asked for its keys"
    assert sched.exchange.sources == (44,) and sched.exchange.dests == ((3 * 5 + 1) % cp,)
