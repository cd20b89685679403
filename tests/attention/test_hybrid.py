"""Hybrid head-parallel CP (``mode="ulysses+p2p"`` and ``"ulysses+ring"``): the node layout and exactness.

Single-process tests check the node-level micro-batch and the node layout against a token-by-token
construction, and the one-line refusals. One spawn of 8 gloo processes (``slow``) runs both modes,
forward and backward, against the dense reference to 1e-10 in fp64 on CP groups of 4 (two of
them: DP 2 x CP 4), 6 and 8 ranks in nodes of 2, 3 and 4 GPUs (and, on the ranks a CP group of 6
leaves, one node of 2 and two nodes of 1), on the adversarial plans of the Ulysses tests; the
sub-groups are derived from the CP group, except for CP 8 in nodes of 4, whose groups are given
by a DeviceMesh with the CP dimension split in two.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringpack.attention import compile_schedule, ring_attention
from ringpack.attention.hybrid import node_groups, node_layout
from ringpack.attention.relayout import gathered_index
from ringpack.errors import DataError
from ringpack.modes import HYBRID_MODES
from tests.attention.test_ulysses import build_cases
from tests.helpers.attention import (
    Problem,
    dense_reference,
    handmade_microbatches,
    max_errors,
    random_microbatch,
    run_processes,
    targeted_microbatches,
    within,
)

TOL = 1e-10
MODES = tuple(HYBRID_MODES)

# ------------------------------------------------------------------------------------ the layout


def _node_tokens(mb, node: int, g: int) -> list[tuple[int, int]]:
    """(sample, position) of a node's tokens in node order: by the sample's listed position, then position."""
    slot = {s: j for j, s in enumerate(mb.samples)}
    tokens = [
        (p.sample, t)
        for r in range(node * g, (node + 1) * g)
        for p in mb.shards[r].pieces
        for t in range(p.start, p.stop)
    ]
    return sorted(tokens, key=lambda st: (slot[st[0]], st[1]))


def test_the_node_layout_matches_a_token_by_token_construction():
    rng = np.random.default_rng(11)
    cases = [(mb, lengths) for _, mb, lengths in handmade_microbatches() + targeted_microbatches()]
    cases += [random_microbatch(rng, cp, num_samples=int(rng.integers(1, 7))) for cp in (2, 4, 6, 8) for _ in range(3)]
    checked = 0
    for mb, _ in cases:
        cp = len(mb.shards)
        for g in (1, 2, 3, 4):
            if cp % g:
                assert compile_schedule(mb, 0, gpus_per_node=g, hybrid_layout=True).node_layout is None
                continue
            for rank in range(cp):
                layout = compile_schedule(mb, rank, gpus_per_node=g, hybrid_layout=True).node_layout
                node = rank // g
                received = [
                    (p.sample, t)
                    for r in range(node * g, (node + 1) * g)
                    for p in mb.shards[r].pieces
                    for t in range(p.start, p.stop)
                ]
                index = gathered_index(layout)
                order = range(len(received)) if index is None else index.tolist()
                assert [received[i] for i in order] == _node_tokens(mb, node, g)
                assert layout.rank_tokens == tuple(mb.shards[r].num_tokens for r in range(node * g, (node + 1) * g))
                assert (layout.node, layout.nodes, layout.cp_size) == (node, cp // g, g)
                assert layout.attention.cp_rank == node and layout.attention.num_tokens == layout.num_tokens
                checked += 1
    assert checked > 100


def test_the_node_level_microbatch_merges_pieces_that_continue_each_other():
    _, mb, _ = next(c for c in handmade_microbatches() if c[0] == "length-1-pieces")  # [0,1) [2,3) | [1,2) [3,4)
    layout = compile_schedule(mb, 1, gpus_per_node=2, hybrid_layout=True).node_layout
    assert layout.attention.local.cu_seqlens_q.tolist() == [0, 4], "one node: the sample whole, one causal segment"
    assert gathered_index(layout).tolist() == [0, 2, 1, 3]


def test_the_layout_travels_with_the_schedule():
    _, mb, _ = next(c for c in targeted_microbatches() if c[0] == "ranks-0-and-5-of-8")
    sched = compile_schedule(mb, 5, gpus_per_node=2, hybrid_layout=True)
    moved = sched.to("cpu")
    assert moved.node_layout.rank_tokens == sched.node_layout.rank_tokens
    assert torch.equal(moved.node_layout.run_source, sched.node_layout.run_source)
    assert moved.node_layout.attention.fingerprint == sched.node_layout.attention.fingerprint


@pytest.mark.parametrize("mode", MODES)
def test_a_cp_size_that_is_no_multiple_of_the_node_is_refused_in_one_line(mode):
    _, mb, _ = handmade_microbatches()[0]  # CP 1
    q = torch.zeros(mb.shards[0].num_tokens, 2, 4, dtype=torch.float64)
    with pytest.raises(DataError, match=r"CP size 1, gpus_per_node 2") as err:
        sched = compile_schedule(mb, 0, gpus_per_node=2, hybrid_layout=True)
        ring_attention(q, q, q, sched, mode=mode, backend="reference")
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"cp rank 0: mode='ulysses\+\w+' needs the node size: compile the schedule"):
        ring_attention(q, q, q, compile_schedule(mb, 0), mode=mode, backend="reference")


@pytest.mark.parametrize("mode", MODES)
def test_the_node_layout_is_compiled_only_when_asked_for(mode):
    """A schedule carries the node layout only with ``hybrid_layout`` (a sequence-mode run on a large
    pool does not pay for it); a hybrid mode without it is refused in one line saying what to pass."""
    _, mb, _ = next(c for c in targeted_microbatches() if len(c[1].shards) % 2 == 0)
    assert compile_schedule(mb, 0, gpus_per_node=2).node_layout is None
    assert compile_schedule(mb, 0, gpus_per_node=2, hybrid_layout=True).node_layout is not None
    with pytest.raises(DataError, match=r"runs on the node layout.*ScheduleOptions\(hybrid_layout=True\)") as err:
        node_layout(compile_schedule(mb, 0, gpus_per_node=2), mode)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode", MODES)
def test_one_node_of_one_gpu_is_plain_attention(mode):
    _, mb, lengths = handmade_microbatches()[0]
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=3)
    ref = dense_reference(problem)
    q, k, v = (problem.local(x, 0).requires_grad_() for x in (problem.q, problem.k, problem.v))
    sched = compile_schedule(mb, 0, gpus_per_node=1, hybrid_layout=True)
    out = ring_attention(q, k, v, sched, mode=mode, backend="reference")
    out.backward(problem.local(problem.dout, 0))
    errors = max_errors(problem, 0, ref, {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad})
    assert within(errors, TOL), errors


# ------------------------------------------------------------------------------- multi-process

# (CP size, node size) -> the CP groups (global ranks) tiling the 8 processes, each with its node size
CONFIGS = {
    (4, 2): [([0, 1, 2, 3], 2), ([4, 5, 6, 7], 2)],
    (6, 2): [([0, 1, 2, 3, 4, 5], 2), ([6, 7], 2)],
    (6, 3): [([0, 1, 2, 3, 4, 5], 3), ([6, 7], 1)],
    (8, 2): [(list(range(8)), 2)],
    (8, 4): [(list(range(8)), 4)],
}
HEADS = {1: [(4, 2)], 2: [(4, 2), (2, 1)], 3: [(6, 2), (3, 3)], 4: [(8, 2), (4, 1)]}


def hybrid_cases(cp: int, g: int) -> list[tuple[str, object, dict, int, int]]:
    """(name, micro-batch, lengths, heads, kv_heads): the Ulysses tests' plans of CP size ``cp``, heads for ``g``."""
    cases = []
    for name, mb, lengths, *_ in build_cases():
        if len(mb.shards) == cp:
            cases += [(f"{name}|{h}x{h_kv}", mb, lengths, h, h_kv) for h, h_kv in HEADS[g]]
    return cases


def _errors(problem: Problem, sched, rank: int, group, mode: str, ref) -> dict[str, float]:
    q, k, v = (problem.local(x, rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
    out = ring_attention(q, k, v, sched, group=group, mode=mode, backend="reference")
    out.backward(problem.local(problem.dout, rank))
    return max_errors(problem, rank, ref, {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})


def _refusal(group, cp_rank: int) -> str:
    """The message every rank of a CP group of 4 in nodes of 2 gets for 3 query heads (then a healthy call)."""
    _, mb, lengths = next(c for c in handmade_microbatches() if c[0] == "skip-rank")
    sched = compile_schedule(mb, cp_rank, gpus_per_node=2, hybrid_layout=True)
    problem = Problem.make(mb, lengths, 3, 1, 4, seed=1)
    q, k = problem.local(problem.q, cp_rank), problem.local(problem.k, cp_rank)
    try:
        ring_attention(q, k, k, sched, group=group, mode="ulysses+p2p", backend="reference")
        message = "no error"
    except DataError as exc:
        message = str(exc)
    ring_attention(q[:, :2].contiguous(), k, k, sched, group=group, mode="ulysses+p2p", backend="reference")
    return message


def worker(rank: int, world: int) -> dict:
    made = {}
    for groups in CONFIGS.values():  # every CP group, created by every process in one order
        for ranks, _ in groups:
            if len(ranks) < world and tuple(ranks) not in made:
                made[tuple(ranks)] = dist.new_group(ranks)
    report, refusal = [], None
    for (cp, g), groups in CONFIGS.items():
        ranks, my_g = next((r, n) for r, n in groups if rank in r)
        group = made.get(tuple(ranks))  # None: the world
        if (cp, g) == (8, 4):  # given groups, of a mesh with the CP dimension split: nodes 0-3 and 4-7
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("cp_node", "cp_gpu"))
            node_groups(group, g, within=mesh["cp_gpu"], across=mesh["cp_node"])
        else:
            node_groups(group, my_g)  # derived: collective over the world, each process with its own group
        cp_rank = dist.get_rank(group)
        for name, mb, lengths, heads, kv_heads in hybrid_cases(len(ranks), my_g):
            sched = compile_schedule(mb, cp_rank, gpus_per_node=my_g, hybrid_layout=True)
            problem = Problem.make(mb, lengths, heads, kv_heads, 4, seed=zlib.crc32(name.encode()) % 10_000)
            ref = dense_reference(problem)
            for mode in MODES:
                errors = _errors(problem, sched, cp_rank, group, mode, ref)
                report.append((f"{name}:{mode}", len(ranks), my_g, cp_rank, errors))
        if (cp, g) == (4, 2):
            refusal = _refusal(group, cp_rank)
    return {"report": report, "refusal": refusal}


@pytest.fixture(scope="module")
def spawned():
    return run_processes(8, worker)


@pytest.mark.slow
def test_the_hybrid_modes_are_exact_on_4_6_and_8_ranks(spawned):
    rows = [row for result in spawned for row in result["report"]]
    want = sum(
        len(ranks) * len(hybrid_cases(len(ranks), g)) * len(MODES) for groups in CONFIGS.values() for ranks, g in groups
    )
    assert len(rows) == want, "every rank of every case reported"
    assert {(cp, g) for _, cp, g, _, _ in rows} == {(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (2, 2), (2, 1)}
    bad = [(name, cp, g, r, e) for name, cp, g, r, e in rows if not within(e, TOL)]
    assert not bad, bad[:5]


@pytest.mark.slow
def test_heads_that_do_not_split_over_a_node_raise_on_every_rank_in_one_line(spawned):
    for r in range(4):
        message = spawned[r]["refusal"]
        assert message.startswith("mode='ulysses+p2p' splits the 3 query heads over the 2 GPUs of a node"), message
        assert "\n" not in message
