"""Head-parallel (Ulysses) CP: the gathered layout, the relayout functions and ``mode="ulysses"``.

Single-process tests check the layout arithmetic against a token-by-token construction, the GQA
head split, CP=1 and the refusals. One spawn of 8 gloo processes (``slow``) serves the exactness
tests on CP groups of 2, 3, 4, 6 and 8 ranks: out/dq/dk/dv against the dense reference to 1e-10,
the relayout against the gathered micro-batch built by hand (exact), on plans with a sample over
ranks 0 and 5 only, idle ranks, ranks holding only pieces of others' samples, ``H_kv < cp``,
replicated K/V heads and one query head per rank; a NaN in the input must fail the check.
"""

from __future__ import annotations

import math
import pickle
import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringpack.attention import compile_schedule, heads_to_sequence, ring_attention, sequence_to_heads
from ringpack.attention.relayout import gathered_index
from ringpack.attention.ulysses import HeadSplit
from ringpack.errors import DataError
from ringpack.shard_plan import Piece, microbatch_from_shards
from tests.helpers.attention import (
    Problem,
    dense_reference,
    handmade_microbatches,
    max_abs_error,
    max_errors,
    random_microbatch,
    run_processes,
    targeted_microbatches,
    within,
)

TOL = 1e-10

# ------------------------------------------------------------------------------------ the layout


def _received_tokens(mb) -> list[tuple[int, int]]:
    """(sample, position) of every row the all-to-all delivers, rank by rank, each in canonical order."""
    return [(p.sample, pos) for shard in mb.shards for p in shard.pieces for pos in range(p.start, p.stop)]


def _gathered_tokens(mb, lengths) -> list[tuple[int, int]]:
    """(sample, position) of the gathered layout: the listed samples, each whole."""
    return [(s, pos) for s in mb.samples for pos in range(lengths[s])]


def test_the_gathered_layout_matches_a_token_by_token_construction():
    rng = np.random.default_rng(7)
    cases = [(name, mb, lengths) for name, mb, lengths in handmade_microbatches() + targeted_microbatches()]
    for cp in (1, 2, 3, 5, 8):
        for _ in range(3):
            mb, lengths = random_microbatch(rng, cp, num_samples=int(rng.integers(1, 7)))
            cases.append((f"random-{cp}", mb, lengths))
    for name, mb, lengths in cases:
        received, gathered = _received_tokens(mb), _gathered_tokens(mb, lengths)
        for rank in sorted({0, len(mb.shards) - 1}):  # the layout is the micro-batch's, the same on every rank
            layout = compile_schedule(mb, rank).head_layout
            index = gathered_index(layout)
            order = list(range(len(received))) if index is None else index.tolist()
            assert [received[i] for i in order] == gathered, name
            assert layout.in_order == (received == gathered), name
            assert layout.rank_tokens == tuple(shard.num_tokens for shard in mb.shards), name
            assert layout.samples == tuple(mb.samples), name
            want_cu = np.cumsum([0] + [lengths[s] for s in mb.samples])
            assert layout.cu_seqlens.dtype == torch.int32 and layout.cu_seqlens.tolist() == want_cu.tolist(), name
            assert layout.max_seqlen == max(lengths[s] for s in mb.samples), name
            local = layout.attention.local
            assert layout.attention.cp_size == 1 and local.causal and local.cu_seqlens_q.tolist() == want_cu.tolist()


def test_the_layout_travels_with_the_schedule():
    _, mb, _ = next(c for c in targeted_microbatches() if c[0] == "ranks-0-and-5-of-8")
    sched = compile_schedule(mb, 5)
    for copy in (sched.to("cpu"), pickle.loads(pickle.dumps(sched))):
        layout = copy.head_layout
        assert layout.rank_tokens == sched.head_layout.rank_tokens
        assert torch.equal(gathered_index(layout), gathered_index(sched.head_layout))
        assert torch.equal(layout.attention.local.cu_seqlens_q, sched.head_layout.attention.local.cu_seqlens_q)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "cp", "replicas", "rank_kv"),
    [(8, 8, 4, 1, 2), (8, 2, 4, 2, 1), (8, 1, 8, 8, 1), (12, 4, 6, 3, 2), (12, 6, 4, 2, 3), (6, 3, 3, 1, 1)],
)
def test_the_head_split_gives_every_rank_the_kv_heads_of_its_query_heads(heads, kv_heads, cp, replicas, rank_kv):
    split = HeadSplit(heads=heads, kv_heads=kv_heads, cp=cp)
    assert (split.replicas, split.rank_kv_heads, split.rank_heads) == (replicas, rank_kv, heads // cp)
    kv_of = np.arange(heads) // (heads // kv_heads)  # the K/V head each query head reads
    sent = np.repeat(np.arange(kv_heads), replicas)  # K/V heads after replication, in send order
    for rank in range(cp):
        mine = sent[rank * rank_kv : (rank + 1) * rank_kv]
        queries = np.arange(rank * split.rank_heads, (rank + 1) * split.rank_heads)
        local_group = split.rank_heads // rank_kv
        assert (mine[np.arange(split.rank_heads) // local_group] == kv_of[queries]).all()


def test_query_heads_that_do_not_split_evenly_are_refused_in_one_line():
    with pytest.raises(DataError, match=r"^mode='ulysses' splits the 6 query heads over the CP size 4") as err:
        HeadSplit(heads=6, kv_heads=2, cp=4)
    assert "\n" not in str(err.value)


def test_cp1_ulysses_matches_the_dense_reference():
    rng = np.random.default_rng(3)
    cases = [handmade_microbatches()[0][1:]] + [random_microbatch(rng, 1, num_samples=4) for _ in range(3)]
    for j, (mb, lengths) in enumerate(cases):
        problem = Problem.make(mb, lengths, 4, 2, 8, seed=j)
        ref = dense_reference(problem)
        q, k, v = (problem.local(x, 0).requires_grad_() for x in (problem.q, problem.k, problem.v))
        out = ring_attention(q, k, v, compile_schedule(mb, 0), mode="ulysses", backend="reference")
        out.backward(problem.local(problem.dout, 0))
        errors = max_errors(problem, 0, ref, {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad})
        assert within(errors, TOL), errors
        x = torch.randn(q.shape[0], 6, dtype=torch.float64)
        sched = compile_schedule(mb, 0)
        assert torch.equal(heads_to_sequence(sequence_to_heads(x, sched), sched), x)


def test_a_nan_input_fails_the_exactness_check():
    _, mb, lengths = handmade_microbatches()[0]
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=0)
    ref = dense_reference(problem)
    problem.k[mb.samples[0]][0, 0, 0] = float("nan")
    q, k, v = (problem.local(x, 0).requires_grad_() for x in (problem.q, problem.k, problem.v))
    out = ring_attention(q, k, v, compile_schedule(mb, 0), mode="ulysses", backend="reference")
    out.backward(problem.local(problem.dout, 0))
    errors = max_errors(problem, 0, ref, {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad})
    assert not within(errors, TOL) and math.isinf(errors["out"]), errors


def test_relayout_names_a_bad_input():
    _, mb, _ = handmade_microbatches()[0]
    sched = compile_schedule(mb, 0)
    with pytest.raises(DataError, match=r"cp rank 0: x has 5 rows but this rank's tokens number 6"):
        sequence_to_heads(torch.zeros(5, 4), sched)
    with pytest.raises(DataError, match=r"x must be \(tokens, channels\)"):
        sequence_to_heads(torch.zeros(6), sched)


# ------------------------------------------------------------------------------- multi-process

GROUPS = {2: [1, 6], 3: [0, 2, 5], 4: [4, 5, 6, 7], 6: [0, 1, 2, 3, 4, 5], 8: list(range(8))}


def build_cases() -> list[tuple[str, object, dict, int, int]]:
    """(name, micro-batch, lengths, heads, kv_heads), identical on every rank; the CP size is the micro-batch's."""
    heads_by_cp = {2: [(4, 2), (2, 1)], 3: [(6, 2), (3, 3)], 4: [(8, 2), (12, 6)], 6: [(12, 4), (6, 1)]}
    heads_by_cp[8] = [(8, 1), (16, 4), (8, 8)]
    rng = np.random.default_rng(2024)
    cases = []
    for name, mb, lengths in handmade_microbatches() + targeted_microbatches():
        cp = len(mb.shards)
        for heads, kv_heads in heads_by_cp.get(cp, []):
            cases.append((f"{name}:{heads}x{kv_heads}", mb, lengths, heads, kv_heads))
    # a sample on ranks 0 and 5 only, ranks 1-4 holding only pieces of samples that start on rank 0 or 7
    P = Piece
    lengths = {0: 9, 1: 6, 2: 5, 3: 4}
    shards = [[P(0, 0, 4), P(1, 0, 2)], [P(1, 2, 4)], [P(1, 4, 6)], [P(2, 2, 5)], [P(3, 1, 4)], [P(0, 4, 9)], []]
    shards.append([P(2, 0, 2), P(3, 0, 1)])
    cases.append(("pieces-of-others-of-8:8x1", microbatch_from_shards(list(lengths), shards, lengths), lengths, 8, 1))
    for cp in GROUPS:
        for j in range(2):
            mb, lengths = random_microbatch(rng, cp, num_samples=int(rng.integers(2, 7)))
            heads, kv_heads = heads_by_cp[cp][j % len(heads_by_cp[cp])]
            cases.append((f"random:cp{cp}:{j}:{heads}x{kv_heads}", mb, lengths, heads, kv_heads))
    return cases


def _attention_errors(problem: Problem, sched, rank: int, group, ref) -> dict[str, float]:
    q, k, v = (problem.local(x, rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
    out = ring_attention(q, k, v, sched, group=group, mode="ulysses", backend="reference")
    out.backward(problem.local(problem.dout, rank))
    return max_errors(problem, rank, ref, {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})


def _relayout_errors(problem: Problem, sched, rank: int, group) -> dict[str, float]:
    """Errors of the relayout against the gathered micro-batch built by hand (exact: 0.0), for
    (T, C) channels and (T, H, D) heads: forward, round trip and the gradients of both directions."""
    cp, mb = sched.cp_size, problem.mb
    errors = {}
    for name, data in (("channels", {s: t.flatten(1) for s, t in problem.q.items()}), ("heads", problem.q)):
        weights = {s: t * 3 + 1 for s, t in data.items()}
        whole = torch.cat([data[s] for s in mb.samples])
        width = whole.shape[1] // cp
        block = slice(rank * width, (rank + 1) * width)
        x = problem.local(data, rank).requires_grad_()
        y = sequence_to_heads(x, sched, group)
        (y * torch.cat([weights[s] for s in mb.samples])[:, block]).sum().backward()
        errors[f"{name}:to_heads"] = max_abs_error(y, whole[:, block])
        errors[f"{name}:to_heads_grad"] = max_abs_error(x.grad, problem.local(weights, rank))
        y2 = whole[:, block].clone().requires_grad_()
        back = heads_to_sequence(y2, sched, group)
        (back * problem.local(weights, rank)).sum().backward()
        errors[f"{name}:round_trip"] = max_abs_error(back, x.detach())
        errors[f"{name}:to_sequence_grad"] = max_abs_error(
            y2.grad, torch.cat([weights[s] for s in mb.samples])[:, block]
        )
    return errors


def _refusals(rank: int, group) -> list[str]:
    """Messages of the one-line refusals on a 4-rank group (every rank raises), each followed by a healthy call."""
    cp_rank = dist.get_rank(group)
    _, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "skip-rank")
    sched = compile_schedule(mb, cp_rank)
    problem = Problem.make(mb, lengths, 6, 2, 4, seed=1)
    q, k = problem.local(problem.q, cp_rank), problem.local(problem.k, cp_rank)
    messages = []
    for attempt in (
        lambda: ring_attention(q, k, k, sched, group=group, mode="ulysses", backend="reference"),
        lambda: sequence_to_heads(q.flatten(1)[:, :6], sched, group),
    ):
        try:
            attempt()
            messages.append("no error")
        except ValueError as exc:
            messages.append(f"{type(exc).__name__}: {exc}")
        sequence_to_heads(q.flatten(1)[:, :8], sched, group)  # the group still works
    return messages


def worker(rank: int, world: int) -> dict:
    groups = {cp: dist.new_group(ranks) for cp, ranks in GROUPS.items()}  # collective: same order everywhere
    report = []
    for name, mb, lengths, heads, kv_heads in build_cases():
        cp = len(mb.shards)
        if rank not in GROUPS[cp]:
            continue
        group = groups[cp]
        cp_rank = dist.get_rank(group)
        problem = Problem.make(mb, lengths, heads, kv_heads, 4, seed=zlib.crc32(name.encode()) % 10_000)
        sched = compile_schedule(mb, cp_rank)
        ref = dense_reference(problem)
        errors = {"attention": _attention_errors(problem, sched, cp_rank, group, ref)}
        errors["relayout"] = _relayout_errors(problem, sched, cp_rank, group)
        if name == "ranks-0-and-5-of-8:8x1":  # a NaN in one rank's K must fail the check somewhere
            problem.k[0][1, 0, 0] = float("nan")
            errors["nan"] = _attention_errors(problem, sched, cp_rank, group, ref)
        report.append((name, cp, cp_rank, errors))
    refusals = _refusals(rank, groups[4]) if rank in GROUPS[4] else None
    return {"report": report, "refusals": refusals}


@pytest.fixture(scope="module")
def spawned():
    return run_processes(8, worker)


@pytest.mark.slow
def test_ulysses_and_the_relayout_are_exact_on_2_to_8_ranks(spawned):
    rows = [row for result in spawned for row in result["report"]]
    assert len(rows) == sum(len(mb.shards) for _, mb, *_ in build_cases()), "every rank of every case reported"
    assert {cp for _, cp, _, _ in rows} == set(GROUPS)
    bad = [
        (name, r, e) for name, _, r, errors in rows for key, e in errors.items() if key != "nan" and not within(e, TOL)
    ]
    assert not bad, bad[:5]
    assert all(max(errors["relayout"].values()) == 0.0 for *_, errors in rows), "the relayout moves values exactly"
    nan = [errors["nan"] for *_, errors in rows if "nan" in errors]
    assert len(nan) == 8 and not all(within(e, TOL) for e in nan), "a NaN input fails the check"


@pytest.mark.slow
def test_bad_heads_and_channels_raise_on_every_rank_in_one_line(spawned):
    for r in GROUPS[4]:
        heads, channels = spawned[r]["refusals"]
        assert heads.startswith("DataError: mode='ulysses' splits the 6 query heads over the CP size 4"), heads
        assert "x has 6 channels, not a multiple of the CP size 4" in channels, channels
        assert "\n" not in heads + channels
