"""The public API without a process group (CP=1), the module form, input errors, and whole plans from make_plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringpack.attention import RingAttention, compile_schedule, ring_attention
from tests.helpers.attention import Problem, assert_within, dense_reference, max_errors, run_all_ranks


def _single_rank_problem():
    from ringpack.shard_plan import Piece, microbatch_from_shards

    lengths = {4: 6, 9: 1, 2: 11}
    mb = microbatch_from_shards([4, 9, 2], [[Piece(4, 0, 6), Piece(9, 0, 1), Piece(2, 0, 11)]], lengths)
    return Problem.make(mb, lengths, 4, 2, 8, seed=5)


@pytest.mark.parametrize("use_module", [False, True])
def test_cp1_needs_no_process_group_and_is_exact(use_module):
    problem = _single_rank_problem()
    sched = compile_schedule(problem.mb, 0)
    q, k, v = (problem.local(t, 0).requires_grad_() for t in (problem.q, problem.k, problem.v))
    attn = RingAttention(backend="reference") if use_module else None
    out = attn(q, k, v, sched) if use_module else ring_attention(q, k, v, sched, backend="reference")
    out.backward(problem.local(problem.dout, 0))
    errors = max_errors(
        problem, 0, dense_reference(problem), {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    )
    assert_within(errors, 1e-10, "cp=1")


def test_non_contiguous_heads_layout_is_accepted():
    problem = _single_rank_problem()
    sched = compile_schedule(problem.mb, 0)
    q, k, v = (
        problem.local(t, 0).transpose(0, 1).contiguous().transpose(0, 1) for t in (problem.q, problem.k, problem.v)
    )
    assert not q.is_contiguous()
    want = ring_attention(*(x.contiguous() for x in (q, k, v)), sched, backend="reference")
    torch.testing.assert_close(ring_attention(q, k, v, sched, backend="reference"), want, rtol=0, atol=0)


def test_input_errors_are_clear():
    problem = _single_rank_problem()
    sched = compile_schedule(problem.mb, 0)
    q, k = problem.local(problem.q, 0), problem.local(problem.k, 0)
    with pytest.raises(NotImplementedError, match="causal"):
        ring_attention(q, k, k, sched, causal=False)
    with pytest.raises(ValueError, match="mode"):
        ring_attention(q, k, k, sched, mode="tree")
    with pytest.raises(ValueError, match="q has 17 tokens"):
        ring_attention(q[:-1], k[:-1], k[:-1], sched)
    with pytest.raises(ValueError, match="multiple"):
        ring_attention(q[:, :3], k, k, sched)


@pytest.mark.parametrize("strategy", ["balanced", "zigzag", "contiguous"])
def test_whole_plans_from_make_plan_are_exact(strategy):
    """Every micro-batch of a real plan (dp=2, cp=3) through the engine, all CP ranks in this process."""
    from ringpack.planner import make_plan
    from ringpack.shard_plan import PlanConfig

    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 60, size=24).tolist()
    lengths[3] = 1
    plan = make_plan(
        lengths, PlanConfig(dp=2, cp=3, tokens_per_rank=48, strategy=strategy, samples_per_step=12)
    ).validate()
    checked = 0
    for _, _, _, mb in plan.iter_microbatches():
        problem = Problem.make(mb, {s: lengths[s] for s in mb.samples}, 2, 1, 4, seed=checked)
        ref = dense_reference(problem)
        for r, got in enumerate(run_all_ranks(problem)):
            assert_within(max_errors(problem, r, ref, got), 1e-10, f"{strategy} rank {r}")
        checked += 1
    assert checked >= 2
