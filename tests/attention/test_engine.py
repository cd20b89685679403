"""The attention engine (schedule + kernels + merge + gradient bookkeeping) on many plans, in one process.

All CP ranks run in this process against a loopback transport that hands each rank the other
ranks' compact buffers and collects their dK/dV contributions. This isolates everything except
the process-group transports (tested in test_attention_distributed.py), so hypothesis can afford
hundreds of random plans. Everything is fp64 on the reference backend and must match the
independent dense reference to 1e-10.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.shard_plan import Piece, microbatch_from_shards
from tests.helpers.attention import (
    Problem,
    assert_within,
    dense_reference,
    handmade_microbatches,
    max_errors,
    random_microbatch,
    run_all_ranks,
    strategy_microbatch,
    zigzag_case,
)

TOL = 1e-10


def assert_exact(
    problem: Problem,
    scale: float | None = None,
    backend: str = "reference",
    dense_threshold: int | None = 4096,
    dense_buckets: int | None = 8,
    part_rows: int | None = None,
) -> None:
    results = run_all_ranks(
        problem,
        scale,
        backend=backend,
        dense_threshold=dense_threshold,
        dense_buckets=dense_buckets,
        part_rows=part_rows,
    )
    check_ranks(problem, dense_reference(problem, scale), results)


def check_ranks(problem: Problem, ref: dict, results: list[dict[str, torch.Tensor]]) -> None:
    """Every rank's out/dq/dk/dv within TOL of the dense reference; a NaN or inf fails."""
    assert len(results) == len(problem.mb.shards)
    for r, got in enumerate(results):
        assert set(got) == {"out", "dq", "dk", "dv"}, sorted(got)
        assert_within(max_errors(problem, r, ref, got), TOL, f"rank {r}")


@pytest.mark.parametrize("where", ["out", "dq", "every tensor"])
@pytest.mark.parametrize("one_element", [True, False])
def test_the_check_fails_on_nan(where, one_element):
    """NaN compares false with everything: the check must still fail on a NaN output, a NaN
    gradient beside a finite output, or a run that is NaN in every tensor."""
    name, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "balanced-like")
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=3)
    ref = dense_reference(problem)
    results = run_all_ranks(problem)
    check_ranks(problem, ref, results)  # the real results pass
    for got in results:
        for tensor in got.values() if where == "every tensor" else [got[where]]:
            (tensor.view(-1)[:1] if one_element else tensor).fill_(float("nan"))
    with pytest.raises(AssertionError, match="inf"):
        check_ranks(problem, ref, results)


@pytest.mark.parametrize("name,mb,lengths", handmade_microbatches(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1)])
def test_handmade_plans_are_exact(name, mb, lengths, heads, kv_heads):
    assert_exact(Problem.make(mb, lengths, heads, kv_heads, 8, seed=3))


@pytest.mark.parametrize("strategy", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_strategy_plans_are_exact(strategy, cp):
    rng = np.random.default_rng(10 + cp)
    for _ in range(3):
        mb, lengths = strategy_microbatch(strategy, rng, cp, num_samples=int(rng.integers(1, 7)))
        assert_exact(Problem.make(mb, lengths, 4, 2, 8, seed=int(rng.integers(1 << 30))))


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cp=st.integers(1, 5),
    n=st.integers(1, 5),
    gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
)
def test_random_plans_are_exact(seed, cp, n, gqa):
    rng = np.random.default_rng(seed)
    mb, lengths = random_microbatch(rng, cp, num_samples=n, max_len=20)
    assert_exact(Problem.make(mb, lengths, gqa[0], gqa[1], 4, seed=seed % 1000), scale=0.7)


# ------------------------------------------------------------------ hybrid backends: the dense split
# reference_hybrid runs the split path of cudnn_hybrid (long segments one by one through the dense
# kernel, the rest through one varlen call, results scattered/merged) with reference kernels, so
# any mistake in the split, the row bookkeeping or the gradient scatter shows up in fp64. Shape
# buckets of 1 per octave (dense parts padded up to powers of two, up to twice a side, over local
# rows or past their end; block keys cut down to one) stress the padding and key-tail paths; None
# keeps exact shapes.


@pytest.mark.parametrize("name,mb,lengths", handmade_microbatches(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("threshold,buckets", [(1, 1), (2, None), (3, 8), (2, 1)])
def test_handmade_plans_are_exact_with_the_dense_split(name, mb, lengths, threshold, buckets):
    assert_exact(
        Problem.make(mb, lengths, 4, 2, 8, seed=4),
        backend="reference_hybrid",
        dense_threshold=threshold,
        dense_buckets=buckets,
    )


@pytest.mark.parametrize("strategy", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_strategy_plans_are_exact_with_the_dense_split(strategy, cp):
    rng = np.random.default_rng(20 + cp)
    for threshold, buckets in ((1, 1), (4, 8), (9, None), (4, 2)):
        mb, lengths = strategy_microbatch(strategy, rng, cp, num_samples=int(rng.integers(1, 7)))
        problem = Problem.make(mb, lengths, 4, 2, 8, seed=int(rng.integers(1 << 30)))
        assert_exact(problem, backend="reference_hybrid", dense_threshold=threshold, dense_buckets=buckets)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    cp=st.integers(1, 4),
    n=st.integers(1, 5),
    gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
    threshold=st.integers(1, 8),
    buckets=st.sampled_from([None, 1, 2, 8]),
)
def test_random_plans_are_exact_with_the_dense_split(seed, cp, n, gqa, threshold, buckets):
    from ringpack.attention import kernel_calls, kernels

    kernels.TAIL_CHUNK_ROWS, saved = (
        1 + seed % 3,
        kernels.TAIL_CHUNK_ROWS,
    )  # key tails' backward cut into small segments
    saved_rows = kernel_calls.LOCAL_RUN_ROWS
    kernel_calls.LOCAL_RUN_ROWS = 1 + seed % 7  # the local rest cut into several calls
    try:
        _random_plan_with_the_dense_split(seed, cp, n, gqa, threshold, buckets)
    finally:
        kernels.TAIL_CHUNK_ROWS, kernel_calls.LOCAL_RUN_ROWS = saved, saved_rows


def _random_plan_with_the_dense_split(seed, cp, n, gqa, threshold, buckets):
    rng = np.random.default_rng(seed)
    mb, lengths = random_microbatch(rng, cp, num_samples=n, max_len=20)
    problem = Problem.make(mb, lengths, gqa[0], gqa[1], 4, seed=seed % 1000)
    part_rows = (
        None if seed % 2 else 1 + seed % 5
    )  # half the plans: remote blocks' forward in row chunks (as without gradients)
    assert_exact(
        problem,
        scale=0.7,
        backend="reference_hybrid",
        dense_threshold=threshold,
        dense_buckets=buckets,
        part_rows=part_rows,
    )


@pytest.mark.parametrize("part_rows", [1, 3, 8])
def test_forward_row_chunks_of_remote_blocks_are_exact(part_rows):
    """Without gradients, remote dense blocks run in row chunks (the last one padded; keys split or
    not); the output is the unchunked one, and the plan does cut blocks into several chunks."""
    from ringpack.attention import compile_schedule
    from ringpack.attention.engine import _row_chunks

    lengths = [20, 3, 12, 27, 40]
    mb = zigzag_case(2, lengths)
    problem = Problem.make(mb, dict(enumerate(lengths)), 4, 2, 8, seed=8)
    for buckets in (1, None):
        blocks = [
            d
            for r in range(2)
            for st_ in compile_schedule(mb, r, dense_threshold=5, dense_buckets=buckets).steps
            for c in st_.calls
            for d in c.dense
        ]
        chunks = [_row_chunks(d, False, part_rows) for d in blocks]
        assert any(len(c) > 1 for c in chunks), "no remote block was cut"
        for block, pieces in zip(
            blocks, chunks
        ):  # the chunks tile the block's rows, each at most part_rows padded rows
            assert [p.q_start for p in pieces] == list(
                range(block.q_start, block.q_start + block.q_len, pieces[0].q_run)
            )
            assert sum(p.q_len for p in pieces) == block.q_len and all(p.q_run == pieces[0].q_run for p in pieces)
            assert len(pieces) == 1 or pieces[0].q_run <= part_rows
        assert_exact(problem, backend="reference_hybrid", dense_threshold=5, dense_buckets=buckets, part_rows=part_rows)


def test_split_schedules_do_split():
    """The plans above really exercise dense segments next to a rest in one call, local and remote."""
    from ringpack.attention import compile_schedule
    from tests.helpers.attention import zigzag_case

    mb = zigzag_case(2, [40, 3, 1, 17])
    calls = [
        c
        for r in range(2)
        for s in [compile_schedule(mb, r, dense_threshold=5)]
        for c in (s.local, *(c for st_ in s.steps for c in st_.calls))
    ]
    assert any(c.causal and c.dense and c.rest for c in calls)
    assert any(not c.causal and c.dense and c.rest for c in calls)
    # with power-of-two buckets: causal squares padded up over the following local rows (views) or past
    # their end (copies with zeros); full blocks' rows padded, keys split
    mb2 = zigzag_case(2, [20, 3, 12, 27])
    scheds = [compile_schedule(mb2, r, dense_threshold=5, dense_buckets=1) for r in range(2)]
    parts = [
        (s.num_tokens, c.causal, d)
        for s in scheds
        for c in (s.local, *(c for st_ in s.steps for c in st_.calls))
        for d in c.dense
    ]
    assert any(causal and d[4] > d[1] and d[0] + d[4] <= n for n, causal, d in parts), (
        "a causal square padded over local rows"
    )
    assert any(causal and d[0] + d[4] > n for n, causal, d in parts), "a causal square padded past the local rows"
    assert any(not causal and d[4] > d[1] for n, causal, d in parts), "a full block's rows padded"
    assert any(not causal and d[5] < d[3] for n, causal, d in parts), "a full block's keys split"
    problem = Problem.make(
        mb2, dict(enumerate([20, 3, 12, 27])), 4, 2, 8, seed=6
    )  # and the engine is exact on it (fp64)
    assert_exact(problem, backend="reference_hybrid", dense_threshold=5, dense_buckets=1)
    assert all(not c.dense for r in range(2) for c in [compile_schedule(mb, r, dense_threshold=None).local])


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_equal_length_runs_are_batched_and_exact(cp):
    """Runs of equal short samples (fixed-length packing) go to one batched dense call per
    power-of-two group, next to long segments and odd ones; the engine stays exact (fp64)."""
    from ringpack.attention import compile_schedule

    lengths = [6] * 7 + [3, 40] + [5] * 4 + [6, 6]
    mb = zigzag_case(cp, lengths)
    batched = [
        d
        for r in range(cp)
        for s in [compile_schedule(mb, r, dense_threshold=8)]
        if s.local is not None
        for d in s.local.dense
        if d.batch > 1
    ]
    assert batched and all(d.batch in (2, 4) for d in batched)
    assert not any(
        d.batch > 1
        for r in range(cp)
        for s in [compile_schedule(mb, r, dense_threshold=8, dense_batches=False)]
        if s.local
        for d in s.local.dense
    )
    assert_exact(
        Problem.make(mb, dict(enumerate(lengths)), 4, 2, 8, seed=cp), backend="reference_hybrid", dense_threshold=8
    )
    # one batch over every local row: the engine adopts its results instead of copying them
    whole = zigzag_case(1, [4] * 8)
    assert [d.batch for d in compile_schedule(whole, 0, dense_threshold=8).local.dense] == [8]
    assert_exact(
        Problem.make(whole, dict(enumerate([4] * 8)), 4, 2, 8, seed=9), backend="reference_hybrid", dense_threshold=8
    )


def test_backward_holds_the_largest_dense_segment_back_to_hide_the_dkv_transfer():
    """_overlap_split moves the largest local dense segment after the remote steps; the two halves
    cover the local call's parts exactly once, and the engine stays exact with them (fp64)."""
    from ringpack.attention import compile_schedule
    from ringpack.attention.engine import PassConfig, _overlap_split
    from tests.helpers.attention import zigzag_case

    mb = zigzag_case(2, [40, 3, 1, 17])
    local = compile_schedule(mb, 0, dense_threshold=5).local
    assert local.dense and local.rest
    before, after = _overlap_split(local, PassConfig(1.0, "reference_hybrid"))
    assert [c.dense for c in after] == [(max(local.dense, key=lambda d: d[1] * d[3]),)] and after[0].rest == ()
    moved = set(local.dense) - set(after[0].dense)
    assert set(before[0].dense) == moved if moved else before == list(local.rest)
    assert _overlap_split(local, PassConfig(1.0, "reference")) == ([local], [])  # no dense kernel: nothing to split
    assert_exact(Problem.make(mb, [40, 3, 1, 17], 4, 2, 8, seed=5), backend="reference_hybrid", dense_threshold=5)


def test_send_rows_are_a_slice_when_contiguous():
    from ringpack.attention import compile_schedule
    from tests.helpers.attention import zigzag_case

    mb = zigzag_case(2, [40, 3, 1, 17])
    for r in range(2):
        s = compile_schedule(mb, r)
        idx = s.send_index.numpy()
        contiguous = idx.size > 0 and (np.diff(idx) == 1).all()
        assert (s.send_range is not None) == bool(contiguous)
        rows = s.send_rows
        got = torch.arange(s.num_tokens)[rows]
        assert torch.equal(got, s.send_index)


def test_first_transfer_hook_runs_once_after_the_first_local_kernel():
    """_after_first calls the hook (the engine's first transfer) right after the first part is
    produced, before the rest are computed, and exactly once; with no parts, at the end."""
    from ringpack.attention.engine import _after_first

    events = []

    def parts():
        for i in range(3):
            events.append(f"kernel {i}")
            yield i

    assert list(_after_first(parts(), lambda: events.append("transfer"))) == [0, 1, 2]
    assert events == ["kernel 0", "transfer", "kernel 1", "kernel 2"]
    events.clear()
    assert list(_after_first(iter(()), lambda: events.append("transfer"))) == [] and events == ["transfer"]


def test_stream_helpers_are_no_ops_off_cuda():
    from ringpack.attention.streams import issued_after, mark

    t = torch.zeros(2)
    assert mark(t) is None
    with issued_after(None, t.device):
        t.add_(1)
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("local_parts", [1, 2])
def test_first_transfer_order_with_and_without_gradients(monkeypatch, grad, local_parts):
    """The first transfer's buffers (``begin``) come before the first local kernel, and it starts
    right after that kernel is queued; without gradients, where the local result is copied from
    several parts, both wait until the first part is folded in (its buffers are not held beside it)."""
    from ringpack.attention import compile_schedule, kernels
    from ringpack.attention.engine import PassConfig, attention_forward
    from tests.helpers.attention import LoopbackTransport, LoopbackWorld

    events = []
    for table in (kernels._FWD, kernels._DENSE_FWD):
        real = table["reference"]
        monkeypatch.setitem(table, "reference", lambda *a, real=real, **kw: events.append("kernel") or real(*a, **kw))

    class Spy(LoopbackTransport):
        def begin(self, kv, grad_dtype=None):
            events.append("begin")

        def start(self):
            events.append("start")

    tail = (
        [Piece(1, 0, 40)] if local_parts == 2 else []
    )  # a second local sample: the local result is copied from two parts
    lengths = [80, 40]
    mb = microbatch_from_shards([0, 1][:local_parts], [[Piece(0, 0, 40)], [Piece(0, 40, 80), *tail]], lengths)
    scheds = [compile_schedule(mb, r, dense_threshold=16, dense_buckets=None) for r in range(2)]
    assert len(scheds[1].local.dense) == local_parts and not scheds[1].local.rest
    problem = Problem.make(mb, dict(enumerate(lengths)), 2, 1, 4, seed=1)
    q, k, v = (problem.local(x, 1) for x in (problem.q, problem.k, problem.v))
    world = LoopbackWorld(
        scheds, [problem.local(problem.k, r) for r in range(2)], [problem.local(problem.v, r) for r in range(2)]
    )
    config = PassConfig(0.5, "reference_hybrid", lambda s: Spy(s, world), None if grad else 64)
    attention_forward(q, k, v, scheds[1], config)
    local = ["kernel"] * local_parts
    if grad or local_parts == 1:
        assert events[: local_parts + 2] == ["begin", "kernel", "start", *local[1:]]
    else:
        assert events[: local_parts + 2] == ["kernel", "begin", "start", *local[1:]]
