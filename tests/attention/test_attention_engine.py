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

from ringpack.attention import compile_schedule
from ringpack.attention.ring import _attention_backward, _attention_forward, pack_kv
from ringpack.attention.schedule import Schedule
from tests.attention.attn_testlib import Problem, dense_reference, handmade_microbatches, max_errors, random_microbatch, strategy_microbatch

TOL = 1e-10


class LoopbackWorld:
    """Shared state of all simulated ranks: compact K/V buffers in, dK/dV contributions out."""

    def __init__(self, schedules: list[Schedule], k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        self.kv = [pack_kv(k[r], v[r], s.send_index) for r, s in enumerate(schedules)]
        self.dkv = [torch.zeros(buf.shape, dtype=torch.float64) for buf in self.kv]

    def transport(self, schedule: Schedule) -> "LoopbackTransport":
        return LoopbackTransport(schedule, self)


class LoopbackTransport:
    def __init__(self, schedule: Schedule, world: LoopbackWorld) -> None:
        self.origins = [schedule.source(step) for step in schedule.steps]
        self.world = world

    def begin(self, kv, grad_dtype=None):
        pass

    def buffer(self, i):
        return self.world.kv[self.origins[i]]

    def push_grad(self, i, dkv):
        if dkv is not None:
            self.world.dkv[self.origins[i]] += dkv

    def finish(self):
        return None


def run_all_ranks(problem: Problem, heads_scale: float | None = None) -> list[dict[str, torch.Tensor]]:
    mb = problem.mb
    cp = len(mb.shards)
    schedules = [compile_schedule(mb, r) for r in range(cp)]
    q = [problem.local(problem.q, r) for r in range(cp)]
    k = [problem.local(problem.k, r) for r in range(cp)]
    v = [problem.local(problem.v, r) for r in range(cp)]
    dout = [problem.local(problem.dout, r) for r in range(cp)]
    world = LoopbackWorld(schedules, k, v)
    scale = q[0].shape[-1] ** -0.5 if heads_scale is None else heads_scale
    results = []
    for r in range(cp):
        out, lse = _attention_forward(q[r], k[r], v[r], schedules[r], world.transport, scale, "reference")
        dq, dk, dv = _attention_backward(dout[r], q[r], k[r], v[r], out, lse, schedules[r], world.transport, scale, "reference")
        results.append({"out": out, "dq": dq, "dk": dk.clone(), "dv": dv.clone()})
    for r, sched in enumerate(schedules):  # what the transport's finish() would bring home
        results[r]["dk"].index_add_(0, sched.send_index, world.dkv[r][0])
        results[r]["dv"].index_add_(0, sched.send_index, world.dkv[r][1])
    return results


def assert_exact(problem: Problem, scale: float | None = None) -> None:
    ref = dense_reference(problem, scale)
    for r, got in enumerate(run_all_ranks(problem, scale)):
        errors = max_errors(problem, r, ref, got)
        assert max(errors.values()) < TOL, f"rank {r}: {errors}"


@pytest.mark.parametrize("name,mb,lengths", handmade_microbatches(), ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 1)])
def test_handmade_plans_are_exact(name, mb, lengths, heads, kv_heads):
    assert_exact(Problem.make(mb, lengths, heads, kv_heads, 8, seed=3))


@pytest.mark.parametrize("strategy", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_strategy_plans_are_exact(strategy, cp):
    if strategy == "balanced":
        pytest.importorskip("ringpack.balancer.planner")
    rng = np.random.default_rng(10 + cp)
    for _ in range(3):
        mb, lengths = strategy_microbatch(strategy, rng, cp, num_samples=int(rng.integers(1, 7)))
        assert_exact(Problem.make(mb, lengths, 4, 2, 8, seed=int(rng.integers(1 << 30))))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cp=st.integers(1, 5), n=st.integers(1, 5), gqa=st.sampled_from([(2, 2), (4, 2), (3, 1)]))
def test_random_plans_are_exact(seed, cp, n, gqa):
    rng = np.random.default_rng(seed)
    mb, lengths = random_microbatch(rng, cp, num_samples=n, max_len=20)
    assert_exact(Problem.make(mb, lengths, gqa[0], gqa[1], 4, seed=seed % 1000), scale=0.7)
