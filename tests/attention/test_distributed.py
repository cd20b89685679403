"""The public API over real process groups (gloo, CPU, fp64, reference backend).

One spawn of 4 processes serves every world size: sub-groups ``[2]`` (CP=1 on a non-zero global
rank), ``[1, 3]`` (CP=2 on non-adjacent global ranks), ``[1, 2, 3]`` (CP=3) and the world (CP=4).
Every rank walks the same case list and runs the cases of the groups it belongs to, so a group's
cases run in the same order on all its ranks. Each case runs ring, all-gather and p2p mode, checks
out/dq/dk/dv against the dense reference to 1e-10 and the other modes against ring. The
mismatch cases check that ranks given different plans (or inputs) all raise instead of hanging,
and that the group is still usable afterwards. Every collective has a 60 s timeout.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringpack.attention import ScheduleMismatchError, compile_schedule, ring_attention
from ringpack.attention.schedule import Schedule
from ringpack.modes import SEQUENCE_MODES
from ringpack.shard_plan import Piece, microbatch_from_shards
from tests.helpers.attention import (
    Problem,
    dense_reference,
    handmade_microbatches,
    max_abs_error,
    max_errors,
    random_microbatch,
    run_processes,
    strategy_microbatch,
    within,
)

TOL = 1e-10
GROUPS = {1: [2], 2: [1, 3], 3: [1, 2, 3], 4: [0, 1, 2, 3]}
MODES = SEQUENCE_MODES


def build_cases(have_planner: bool) -> list[tuple[str, int, object, dict, int, int]]:
    """(name, cp, micro-batch, lengths, heads, kv_heads), identical on every rank."""
    rng = np.random.default_rng(1234)
    cases = []
    for name, mb, lengths in handmade_microbatches():
        cases.append((f"hand:{name}", len(mb.shards), mb, lengths, 4, 2))
    strategies = ["contiguous", "zigzag"] + (["balanced"] if have_planner else [])
    for cp in (1, 2, 3, 4):
        for strategy in strategies:
            for j in range(2):
                mb, lengths = strategy_microbatch(strategy, rng, cp, num_samples=int(rng.integers(1, 7)))
                cases.append((f"{strategy}:cp{cp}:{j}", cp, mb, lengths, 4, (1, 2, 4)[j % 3]))
        for j in range(4):
            mb, lengths = random_microbatch(rng, cp, num_samples=int(rng.integers(1, 6)))
            cases.append((f"random:cp{cp}:{j}", cp, mb, lengths, 3 if j % 2 else 2, 1))
    return [c for c in cases if c[1] in GROUPS]


def _run_case(problem: Problem, sched: Schedule, rank: int, group, mode: str) -> dict[str, torch.Tensor]:
    q = problem.local(problem.q, rank).requires_grad_()
    k = problem.local(problem.k, rank).requires_grad_()
    v = problem.local(problem.v, rank).requires_grad_()
    out = ring_attention(q, k, v, sched, group=group, mode=mode, backend="reference")
    out.backward(problem.local(problem.dout, rank))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _strided_inputs(problem: Problem, rank: int, layout: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """q, k, v as non-contiguous views with a unit-stride head dim, and the leaf they view.

    ``head_major``: one ``[H, T, D]`` buffer per tensor, transposed to ``[T, H, D]``; ``fused``: one
    ``[T, H + 2 H_kv, D]`` buffer whose head slices are q, k and v (a fused QKV projection)."""
    q, k, v = (problem.local(x, rank) for x in (problem.q, problem.k, problem.v))
    if layout == "head_major":
        leaves = tuple(x.transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))
        return leaves, tuple(x.transpose(0, 1) for x in leaves)
    fused = torch.cat([q, k, v], dim=1).requires_grad_()
    h, h_kv = q.shape[1], k.shape[1]
    return (fused,), (fused[:, :h], fused[:, h : h + h_kv], fused[:, h + h_kv :])


def _run_strided(
    problem: Problem, sched: Schedule, rank: int, group, mode: str, layout: str
) -> dict[str, torch.Tensor]:
    leaves, (q, k, v) = _strided_inputs(problem, rank, layout)
    assert not q.is_contiguous() or q.shape[0] <= 1, "a strided view"
    out = ring_attention(q, k, v, sched, group=group, mode=mode, backend="reference")
    out.backward(problem.local(problem.dout, rank))
    if layout == "head_major":
        dq, dk, dv = (x.grad.transpose(0, 1) for x in leaves)
    else:
        h, h_kv = q.shape[1], k.shape[1]
        grad = leaves[0].grad
        dq, dk, dv = grad[:, :h], grad[:, h : h + h_kv], grad[:, h + h_kv :]
    return {"out": out.detach(), "dq": dq, "dk": dk, "dv": dv}


CHUNKED = {"grad": 0, "no_grad": 0}  # remote dense blocks run in several row chunks, by grad mode


def _count_chunks() -> None:
    """Count, in this worker process, the remote blocks the engine cuts into row chunks."""
    from ringpack.attention import engine

    engine.FORWARD_ONLY_PART_ROWS = 2  # tiny, so the small test blocks are cut
    chunks = engine._row_chunks

    def counted(segment, causal, part_rows):
        pieces = chunks(segment, causal, part_rows)
        CHUNKED["grad" if torch.is_grad_enabled() else "no_grad"] += len(pieces) > 1
        return pieces

    engine._row_chunks = counted


def _forwards_with_the_dense_split(problem: Problem, mb, rank: int, group, mode: str, ref: dict) -> dict[str, float]:
    """Max error of out against the dense reference through the hybrid backend's split (tiny
    threshold and buckets): with gradients, and without them (remote blocks in row chunks)."""
    sched = compile_schedule(mb, rank, dense_threshold=2, dense_buckets=1)
    errors = {}
    for grad in (True, False):
        q, k, v = (problem.local(x, rank).requires_grad_(grad) for x in (problem.q, problem.k, problem.v))
        with torch.set_grad_enabled(grad):
            out = ring_attention(q, k, v, sched, group=group, mode=mode, backend="reference_hybrid")
        errors["out" if grad else "out_no_grad"] = max_errors(problem, rank, ref, {"out": out.detach()})["out"]
    return errors


def suite_worker(rank: int, world: int, have_planner: bool) -> list[tuple]:
    groups = {cp: dist.new_group(ranks) for cp, ranks in GROUPS.items()}  # collective: same order everywhere
    _count_chunks()
    report = []
    for name, cp, mb, lengths, heads, kv_heads in build_cases(have_planner):
        if rank not in GROUPS[cp]:
            continue
        group = groups[cp]
        cp_rank = dist.get_rank(group)
        problem = Problem.make(mb, lengths, heads, kv_heads, 8, seed=zlib.crc32(name.encode()) % 10_000)
        sched = compile_schedule(mb, cp_rank)
        ref = dense_reference(problem)
        got = {mode: _run_case(problem, sched, cp_rank, group, mode) for mode in MODES}
        errors = {mode: max_errors(problem, cp_rank, ref, got[mode]) for mode in got}
        errors.update(
            {f"{mode}-hybrid": _forwards_with_the_dense_split(problem, mb, cp_rank, group, mode, ref) for mode in MODES}
        )
        if name.startswith(("hand:", "zigzag:")):  # strided layouts of q/k/v, every mode
            for mode in MODES:
                for layout in ("head_major", "fused"):
                    errors[f"{mode}-{layout}"] = max_errors(
                        problem, cp_rank, ref, _run_strided(problem, sched, cp_rank, group, mode, layout)
                    )
        agree = {f"{mode}:{x}": max_abs_error(got["ring"][x], got[mode][x]) for mode in MODES[1:] for x in got["ring"]}
        report.append((name, cp, cp_rank, errors, agree, len(sched.steps)))
    return report


MISMATCH_RANKS = [0, 2]


def mismatch_checks(rank: int, group) -> list[str]:
    """Seven broken set-ups on a 2-rank group, each followed by a healthy call on the same group."""
    cp_rank = dist.get_rank(group)
    _, a, lengths = next(c for c in handmade_microbatches() if c[0] == "interleaved")  # cp=2
    b = microbatch_swap(a)
    problem = Problem.make(a, lengths, 2, 2, 4, seed=0)
    q0 = problem.local(problem.q, cp_rank)
    k0 = problem.local(problem.k, cp_rank)
    messages = []

    def attempt(sched: Schedule, mode: str = "ring", q=q0, k=k0, grad: bool = False, grad_mode: bool = True) -> None:
        q, k = (x.detach().requires_grad_(grad) for x in (q, k))
        try:
            with torch.set_grad_enabled(grad_mode):
                out = ring_attention(q, k, k, sched, group=group, mode=mode, backend="reference")
            messages.append("no error")
            if out.requires_grad:  # a rank that got through would now wait in backward for its peer
                out.sum().backward()
        except (ScheduleMismatchError, ValueError) as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
        # the group must still work: a correct call right after
        ring_attention(q0, k0, k0, compile_schedule(a, cp_rank), group=group, backend="reference")

    attempt(compile_schedule(a if cp_rank == 0 else b, cp_rank))  # different micro-batches
    attempt(compile_schedule(a, 1 - cp_rank))  # schedules of the wrong CP ranks
    attempt(compile_schedule(a, cp_rank), mode="ring" if cp_rank == 0 else "allgather")  # different modes
    short = slice(None) if cp_rank == 0 else slice(0, -1)
    attempt(compile_schedule(a, cp_rank), q=q0[short], k=k0[short])  # one rank's tokens do not fit its schedule
    attempt(compile_schedule(a, cp_rank), grad=cp_rank == 0)  # only rank 0's inputs require grad
    # both require grad, but rank 1 runs under no_grad (all-gather mode: its backward has collectives too)
    attempt(compile_schedule(a, cp_rank), mode="allgather", grad=True, grad_mode=cp_rank == 0)
    # rank 0 reuses a schedule object it already checked for another micro-batch: caught in DETAIL mode
    old = compile_schedule(a, cp_rank)
    ring_attention(q0, k0, k0, old, group=group, backend="reference")
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        attempt(old if cp_rank == 0 else compile_schedule(b, cp_rank))
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    return messages


def wire_bytes(rank: int, group) -> dict:
    """Bytes this rank hands the ring's point-to-point sends in one forward and one backward (GQA:
    4 query heads, 1 K/V head), with the rows it sends: a sample split 7 + 5 over a 2-rank group."""
    from ringpack.attention import ring

    cp_rank = dist.get_rank(group)
    mb = microbatch_from_shards([0], [[Piece(0, 0, 7)], [Piece(0, 7, 12)]], {0: 12})
    problem = Problem.make(mb, {0: 12}, 4, 1, 4, seed=5)
    sched = compile_schedule(mb, cp_rank)
    sent = {"forward": 0, "backward": 0}
    phase = ["forward"]
    exchange = ring._P2P.exchange

    def counted(self, send, *args, **kwargs):
        sent[phase[0]] += sum(t.numel() * t.element_size() for t in send)
        return exchange(self, send, *args, **kwargs)

    ring._P2P.exchange = counted
    try:
        q, k, v = (problem.local(x, cp_rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
        out = ring_attention(q, k, v, sched, group=group, mode="ring", backend="reference")
        phase[0] = "backward"
        out.backward(problem.local(problem.dout, cp_rank))
    finally:
        ring._P2P.exchange = exchange
    return dict(
        sent,
        buffer_tokens=sched.buffer_tokens[cp_rank],
        kv_row_bytes=k.shape[1] * k.shape[2] * k.element_size(),
        q_row_bytes=q.shape[1] * q.shape[2] * q.element_size(),
    )


def worker(rank: int, world: int, have_planner: bool) -> dict:
    suite = suite_worker(rank, world, have_planner)
    mismatch_group = dist.new_group(MISMATCH_RANKS)
    mismatch = mismatch_checks(rank, mismatch_group) if rank in MISMATCH_RANKS else None
    wire = wire_bytes(rank, mismatch_group) if rank in MISMATCH_RANKS else None
    return {"suite": suite, "mismatch": mismatch, "chunked": dict(CHUNKED), "wire": wire}


def microbatch_swap(mb):
    """The same samples with rank shards exchanged: a different plan for the same data."""
    return type(mb)(samples=mb.samples, shards=tuple(reversed(mb.shards)), loss_tokens=mb.loss_tokens)


def _have_planner() -> bool:
    try:
        import ringpack.planner.epoch  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(scope="module")
def spawned():
    """One 4-process run serves every test of this module (spawning costs seconds per process)."""
    have_planner = _have_planner()
    return have_planner, run_processes(4, worker, have_planner)


def failing_rows(rows: list[tuple]) -> tuple[list, list]:
    """The report rows whose errors against the reference, or ring against all-gather, are not all
    finite and below TOL (a NaN or inf counts as an error: a comparison with NaN is false)."""
    bad = [
        (name, cp_rank, errors)
        for name, _, cp_rank, errors, _, _ in rows
        if not all(within(e, TOL) for e in errors.values())
    ]
    disagree = [(name, cp_rank, agree) for name, _, cp_rank, _, agree, _ in rows if not within(agree, TOL)]
    return bad, disagree


@pytest.mark.parametrize("where", ["out", "dq", "every tensor"])
def test_the_multiprocess_check_fails_on_nan(where):
    """The parent's check of the workers' report rows, fed a real run whose results hold a NaN
    (the output, a gradient beside a finite output, or everything)."""
    from tests.helpers.attention import run_all_ranks

    _, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "skip-rank")
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=1)
    ref = dense_reference(problem)
    results = run_all_ranks(problem)

    def rows() -> list[tuple]:
        report = []
        for r, got in enumerate(results):
            errors = max_errors(problem, r, ref, got)
            agree = {x: max_abs_error(got[x], got[x].clone()) for x in got}
            report.append(("skip-rank", 4, r, {"ring": errors, "allgather": errors}, agree, 1))
        return report

    assert failing_rows(rows()) == ([], [])
    for got in results:
        for tensor in got.values() if where == "every tensor" else [got[where]]:
            tensor.view(-1)[:1] = float("nan")
    bad, disagree = failing_rows(rows())
    assert len(bad) == len(results) and len(disagree) == len(results), (bad, disagree)


@pytest.mark.slow
def test_every_mode_matches_the_dense_reference_on_1_to_4_ranks(spawned):
    have_planner, results = spawned
    rows = [row for result in results for row in result["suite"]]
    expected = sum(cp for _, cp, *_ in build_cases(have_planner))
    assert len(rows) == expected, "every rank of every case reported"
    bad, disagree = failing_rows(rows)
    assert not bad, f"errors not below {TOL}: {bad[:5]}"
    assert not disagree, disagree[:5]
    assert any(steps > 0 for *_, steps in rows) and any(steps == 0 for *_, steps in rows)
    assert all("out_no_grad" in row[3]["ring-hybrid"] for row in rows), "the forward without gradients was checked"
    strided = {
        cp
        for _, cp, _, errors, _, _ in rows
        if all(f"{m}-head_major" in errors and f"{m}-fused" in errors for m in MODES)
    }
    assert strided == {1, 2, 3, 4}, f"strided q/k/v were checked on every group size, got {strided}"
    # without gradients remote dense blocks ran in row chunks; with gradients never
    chunked = [result["chunked"] for result in results]
    assert sum(c["no_grad"] for c in chunked) > 0 and sum(c["grad"] for c in chunked) == 0, chunked


@pytest.mark.slow
def test_mismatched_plans_raise_on_every_rank_instead_of_hanging(spawned):
    _, results = spawned
    checked = [results[r]["mismatch"] for r in MISMATCH_RANKS]
    for messages in checked:
        assert len(messages) == 7
        assert all(m.startswith("ScheduleMismatchError") for m in messages), messages
        assert "micro-batches" in messages[0] and "ranks [0]" in messages[0] and "ranks [1]" in messages[0]
        assert "cp rank" in messages[1]
        assert "modes" in messages[2]
        assert "ranks [1] got q/k/v" in messages[3]
        for grads in messages[4:6]:  # the ranks that would and would not run the backward, on both
            assert "whether the call needs gradients" in grads, grads
            assert "ranks [0]: with gradients; ranks [1]: without gradients" in grads, grads
        assert "micro-batches" in messages[6]
    assert "q has" in checked[1][3]  # the rank with the bad input says what is wrong


@pytest.mark.slow
def test_only_the_kv_heads_travel(spawned):
    """Bytes handed to the ring's sends: each rank's compact K/V once in forward, K/V and dK/dV once
    in backward, of the K/V heads only (here 1 of 4 query heads: a scheme that repeats K/V heads to
    the query heads would send 4x as much)."""
    _, results = spawned
    wire = [results[r]["wire"] for r in MISMATCH_RANKS]
    kv = sum(2 * w["buffer_tokens"] * w["kv_row_bytes"] for w in wire)
    assert kv == 2 * 7 * 1 * 4 * 8, "rank 0's 7 rows of K and V (1 head x 4 dims, fp64)"
    assert sum(w["forward"] for w in wire) == kv
    assert sum(w["backward"] for w in wire) == 2 * kv  # K/V again, and their dK/dV home
    assert all(w["q_row_bytes"] == 4 * w["kv_row_bytes"] for w in wire)
