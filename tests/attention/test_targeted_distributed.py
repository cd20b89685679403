"""The targeted exchange (``mode="p2p"``) over real process groups: gloo, CPU, fp64, 2 to 8 ranks.

One spawn of 8 processes serves every group size: sub-groups of 2 to 7 ranks on scattered global
ranks, and the world. Every rank walks the same case list and runs the cases of its groups. Each
case runs forward and backward (and a forward without gradients) against the dense reference to
1e-10 (the corner cases in ring and all-gather mode too), and counts what the targeted transport
posts: the bytes of its sends (which must add up to the ``p2p`` traffic of the micro-batch: each
needed piece once per rank that needs it; the backward sends the K/V again and returns as many
dK/dV), its batches (one per pass and direction) and its transfers (two per partner and batch:
K and V, or dK and dV). Node-relayed (``gpus_per_node`` 2 and 3) the same cases run again: exact, and
sending the tokens :func:`ringpack.traffic.exchange_tokens` counts, in two batches per pass.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ringpack
from ringpack.attention import compile_schedule, ring_attention
from ringpack.shard_plan import MicroBatch
from ringpack.traffic import exchange_tokens, kv_traffic
from tests.helpers.attention import (
    Problem,
    dense_reference,
    handmade_microbatches,
    max_errors,
    random_microbatch,
    run_processes,
    strategy_microbatch,
    targeted_microbatches,
    within,
)

TOL = 1e-10
WORLD = 8
GROUPS = {
    1: [4],
    2: [1, 6],
    3: [2, 5, 7],
    4: [0, 3, 4, 6],
    5: [1, 2, 4, 5, 7],
    6: [0, 1, 2, 3, 5, 7],
    7: [0, 1, 2, 3, 4, 5, 6],
    8: list(range(WORLD)),
}
HEADS = [(4, 2), (4, 1), (3, 3), (2, 1)]
CORNER_CASES = {name for name, _, _ in targeted_microbatches()}
NODE_SIZES = (2, 3)  # the relayed runs
#: Pool plans of nodes of 2 GPUs whose samples that fit a node cross nodes: (name, lengths, cp,
#: tokens per rank). "no-node-packing": the samples fit no packing into the nodes, so the micro-batch
#: is one group of every node; "contiguous": a group whose split left a gap, split contiguously.
POOL_PLANS = [("no-node-packing", [4, 5, 7, 6], 6, 4), ("contiguous", [7, 13, 1, 4], 8, 4)]


def build_cases() -> list[tuple[str, object, dict[int, int], int, int]]:
    """(name, micro-batch, lengths, heads, kv_heads), identical on every rank."""
    cases = []
    for j, (name, mb, lengths) in enumerate(targeted_microbatches() + handmade_microbatches()):
        cases.append((name, mb, lengths, *HEADS[j % len(HEADS)]))
    rng = np.random.default_rng(4321)
    for cp in range(2, WORLD + 1):
        for j in range(2):
            mb, lengths = random_microbatch(rng, cp, num_samples=int(rng.integers(1, 7)))
            cases.append((f"random:cp{cp}:{j}", mb, lengths, *HEADS[(cp + j) % len(HEADS)]))
        mb, lengths = strategy_microbatch("zigzag", rng, cp, num_samples=3)
        cases.append((f"zigzag:cp{cp}", mb, lengths, 4, 2))
    for name, lengths, cp, tpr in POOL_PLANS:
        cases.append((f"pool:{name}", pool_microbatch(lengths, cp, tpr), dict(enumerate(lengths)), 4, 2))
    return cases


def pool_microbatch(lengths: list[int], cp: int, tokens_per_rank: int) -> MicroBatch:
    """The one micro-batch of a pool plan of ``lengths`` over ``cp`` ranks in nodes of 2."""
    plan = ringpack.plan(
        lengths, world=cp, gpus_per_node=2, tokens_per_rank=tokens_per_rank, samples_per_step=0, microbatches_per_rank=1
    )
    return plan.steps[0].microbatches[0][0]


POSTED: list[dict] = []  # per batch: phase, bytes sent, transfers


def _count_posts() -> None:
    """Record, in this worker process, every batch the targeted transport posts."""
    from ringpack.attention import p2p

    post = p2p._post

    def counted(ops, *args):
        sent = sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        POSTED.append({"sent": sent, "ops": len(ops)})
        return post(ops, *args)

    p2p._post = counted


def _run(problem: Problem, sched, rank: int, group, mode: str = "p2p") -> tuple[dict, list]:
    """Forward and backward; the batches each posted (by the targeted transport)."""
    q, k, v = (problem.local(x, rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
    start = len(POSTED)
    out = ring_attention(q, k, v, sched, group=group, mode=mode, backend="reference")
    forward = POSTED[start:]
    out.backward(problem.local(problem.dout, rank))
    backward = POSTED[start + len(forward) :]
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, [forward, backward]


def worker(rank: int, world: int) -> list[dict]:
    groups = {cp: dist.new_group(ranks) for cp, ranks in GROUPS.items()}  # collective: same order everywhere
    _count_posts()
    report = []
    for name, mb, lengths, heads, kv_heads in build_cases():
        cp = len(mb.shards)
        if rank not in GROUPS[cp]:
            continue
        group = groups[cp]
        cp_rank = dist.get_rank(group)
        problem = Problem.make(mb, lengths, heads, kv_heads, 4, seed=zlib.crc32(name.encode()) % 10_000)
        ref = dense_reference(problem)
        sched = compile_schedule(mb, cp_rank)
        got, (forward, backward) = _run(problem, sched, cp_rank, group)
        errors = max_errors(problem, cp_rank, ref, got)
        with torch.no_grad():  # the forward without gradients (remote blocks in row chunks)
            q, k, v = (problem.local(x, cp_rank) for x in (problem.q, problem.k, problem.v))
            out = ring_attention(q, k, v, sched, group=group, mode="p2p", backend="reference")
        errors["out_no_grad"] = max_errors(problem, cp_rank, ref, {"out": out})["out"]
        if name in CORNER_CASES:  # the other modes on the same plans
            for mode in ("ring", "allgather"):
                other = max_errors(problem, cp_rank, ref, _run(problem, sched, cp_rank, group, mode)[0])
                errors.update({f"{mode}:{x}": e for x, e in other.items()})
        ex = sched.exchange
        row = {
            "name": name,
            "cp": cp,
            "cp_rank": cp_rank,
            "errors": errors,
            "forward": forward,
            "backward": backward,
            "links": len(ex.sources) + len(ex.dests),  # a partner that sends and receives counts twice
            "kv_row_bytes": kv_heads * 4 * 8,
            "relayed": {},
        }
        for node in NODE_SIZES if cp > 2 else ():
            relayed = compile_schedule(mb, cp_rank, gpus_per_node=node)
            got, (forward, backward) = _run(problem, relayed, cp_rank, group)
            row["relayed"][node] = {
                "errors": max_errors(problem, cp_rank, ref, got),
                "forward": forward,
                "backward": backward,
                "two_stages": relayed.exchange.relayed,
            }
        report.append(row)
    return report


@pytest.fixture(scope="module")
def spawned() -> list[dict]:
    """One 8-process run serves every test of this module."""
    results = run_processes(WORLD, worker, join_s=300.0)
    return [row for result in results for row in result]


def test_the_cases_cover_every_group_size_and_the_corner_cases():
    cases = build_cases()
    sizes = {len(mb.shards) for _, mb, *_ in cases}
    assert sizes == set(range(1, WORLD + 1)) <= set(GROUPS)
    assert all(sorted(GROUPS[cp]) == GROUPS[cp] and len(GROUPS[cp]) == cp for cp in GROUPS)
    names = {name for name, *_ in cases}
    assert {"ranks-0-and-5-of-8", "all-to-one-of-8", "one-to-all-of-8", "no-split-of-8"} <= names


def test_the_pool_cases_hold_samples_that_fit_a_node_and_cross_nodes():
    """Each pool case holds a sample of at most a node's tokens on several (consecutive) nodes."""
    for _, lengths, cp, tpr in POOL_PLANS:
        mb = pool_microbatch(lengths, cp, tpr)
        nodes: dict[int, set[int]] = {}
        for c, shard in enumerate(mb.shards):
            for piece in shard.pieces:
                nodes.setdefault(piece.sample, set()).add(c // 2)
        crossing = [s for s, held in nodes.items() if len(held) > 1 and lengths[s] <= 2 * tpr]
        assert crossing, (lengths, nodes)
        assert all(max(held) - min(held) + 1 == len(held) for held in nodes.values()), nodes


@pytest.mark.slow
def test_p2p_matches_the_dense_reference_on_2_to_8_ranks(spawned):
    """Every rank of every case, and ring and all-gather on the corner cases."""
    expected = sum(len(mb.shards) for _, mb, *_ in build_cases())
    assert len(spawned) == expected, "every rank of every case reported"
    bad = [(row["name"], row["cp_rank"], row["errors"]) for row in spawned if not within(row["errors"], TOL)]
    assert not bad, f"errors not below {TOL}: {bad[:5]}"
    assert {row["cp"] for row in spawned if row["links"]} == set(range(2, WORLD + 1)), "exchanges at every size"
    assert all(
        "ring:dk" in row["errors"] and "allgather:dv" in row["errors"] for row in spawned if row["name"] in CORNER_CASES
    )


@pytest.mark.slow
def test_the_bytes_sent_are_the_p2p_traffic(spawned):
    """Forward: each needed piece's K and V once per rank that needs it (counted on the sends
    posted); backward: the K/V again and one dK/dV return of each."""
    cases = {name: mb for name, mb, *_ in build_cases()}
    rows: dict[str, list[dict]] = {}
    for row in spawned:
        rows.setdefault(row["name"], []).append(row)
    for name, ranks in rows.items():
        per_token = 2 * ranks[0]["kv_row_bytes"]
        want = kv_traffic(cases[name], bytes_per_token=per_token).p2p
        forward = sum(batch["sent"] for row in ranks for batch in row["forward"])
        backward = sum(batch["sent"] for row in ranks for batch in row["backward"])
        assert forward == want, (name, forward, want)
        assert backward == 2 * want, (name, backward, want)
    assert any(kv_traffic(mb).p2p for mb in cases.values()) and any(not kv_traffic(mb).p2p for mb in cases.values())


@pytest.mark.slow
def test_one_batch_per_pass_and_direction_with_the_partners_only(spawned):
    """A rank posts one batch in forward and two in backward (K/V, then dK/dV), each of two
    transfers per source and per destination, and nothing at all without partners: host work in
    the partners, not the group size."""
    for row in spawned:
        links = row["links"]
        forward, backward = row["forward"], row["backward"]
        if not links:
            assert forward == [] and backward == [], row["name"]
            continue
        assert [batch["ops"] for batch in forward] == [2 * links], (row["name"], row["cp_rank"], forward)
        assert [batch["ops"] for batch in backward] == [2 * links] * 2, (row["name"], row["cp_rank"], backward)


@pytest.mark.slow
def test_the_node_relayed_exchange_is_exact_and_sends_what_the_model_counts(spawned):
    """With nodes of 2 and 3 ranks: every rank exact; forward sends per case the direct, crossing
    and relayed tokens of :func:`exchange_tokens`, the backward twice that (K/V again, dK/dV home);
    a rank with relays posts two K/V batches per pass, the others one."""
    cases = {name: mb for name, mb, *_ in build_cases()}
    by_case: dict[tuple[str, int], list[dict]] = {}
    for row in spawned:
        for node, run in row["relayed"].items():
            assert within(run["errors"], TOL), (row["name"], node, row["cp_rank"], run["errors"])
            by_case.setdefault((row["name"], node), []).append(row | {"run": run})
    assert {node for _, node in by_case} == set(NODE_SIZES)
    stages = 0
    for (name, node), ranks in by_case.items():
        mb = cases[name]
        rows = [(c, p.sample, p.start, p.stop) for c, shard in enumerate(mb.shards) for p in shard.pieces]
        c, sample, start, stop = (np.array(col, dtype=np.int64) for col in zip(*rows))
        moved = exchange_tokens(np.zeros(len(c), dtype=np.int64), c, sample, start, stop, 1, len(mb.shards), node)
        tokens = sum(int(moved[k].sum()) for k in ("send_intra", "send_inter", "relay_send"))
        per_token = 2 * ranks[0]["kv_row_bytes"]
        forward = sum(batch["sent"] for row in ranks for batch in row["run"]["forward"])
        backward = sum(batch["sent"] for row in ranks for batch in row["run"]["backward"])
        assert (forward, backward) == (tokens * per_token, 2 * tokens * per_token), (name, node)
        for row in ranks:
            run = row["run"]
            if run["two_stages"]:
                stages += 1
                assert len(run["forward"]) == 2, (name, node, row["cp_rank"], run["forward"])
    assert stages, "some rank relays"
