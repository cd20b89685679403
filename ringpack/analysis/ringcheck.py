"""The demo's correctness check: the ring runtime on 2 CPU processes equals single-process attention.

One micro-batch planned by the balancer (``balanced`` strategy, CP=2) is executed by
:func:`ringpack.attention.ring_attention` on two spawned CPU processes joined by a gloo group, in
float64 with the reference kernels, forward and backward. The same attention is computed in this
process as plain dense causal attention per sample (no ringpack code), and outputs and q/k/v
gradients are compared token by token.

See docs/analysis.md, "`ringpack demo`".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack._spawn import run_ranks
from ringpack.attention import compile_schedule, ring_attention
from ringpack.planner import make_plan
from ringpack.shard_plan import PlanConfig
from ringpack.traffic import needed_pieces

__all__ = ["RingCheck", "pick_microbatch", "run_ring_check"]

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16


@dataclass
class RingCheck:
    samples: int
    tokens: int
    split_samples: int
    kv_cross_tokens: int
    ring_steps: int
    max_error: float
    seconds: float
    ok: bool


def pick_microbatch(lengths: np.ndarray, cp: int = 2, budget: int = 1024, seed: int = 0):
    """A balanced-strategy micro-batch of real corpus lengths that nearly fills ``cp * budget`` tokens.

    It holds one sample longer than a rank's budget, so the plan must cut it across ranks and the
    runtime must move K/V; the rest are short samples the balancer keeps whole.
    """
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int64)
    # one sample longer than a rank holds (the balancer must cut it, so K/V crosses ranks) ...
    long = np.flatnonzero((lengths > 1.2 * budget) & (lengths < 1.8 * budget))
    picked = [int(rng.choice(long))] if long.size else []
    total = int(lengths[picked].sum())
    # ... and short samples until the group is nearly full
    pool = np.flatnonzero((lengths >= 16) & (lengths <= budget // 2))
    rng.shuffle(pool)
    for i in pool:
        if total + lengths[i] <= cp * budget:
            picked.append(int(i))
            total += int(lengths[i])
        if total > 0.97 * cp * budget:
            break
    sub = lengths[picked]
    plan = make_plan(sub, PlanConfig(dp=1, cp=cp, tokens_per_rank=budget, strategy="balanced"))
    mb = max((m for _, _, _, m in plan.iter_microbatches()), key=lambda m: m.num_tokens)
    return mb, [int(x) for x in sub]


def _dense_reference(mb, lengths: list[int], seed: int):
    """Single-process attention: each sample's full causal attention, then each rank's rows of it."""
    import torch

    out = {}
    q_all, k_all, v_all, dout_all = _inputs(mb, lengths, seed)
    for s in mb.samples:
        q = q_all[s].clone().requires_grad_()
        k = k_all[s].clone().requires_grad_()
        v = v_all[s].clone().requires_grad_()
        L = q.shape[0]
        kk = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        vv = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * HEAD_DIM**-0.5
        mask = torch.ones(L, L, dtype=torch.bool).tril()
        p = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        o = torch.einsum("hqk,khd->qhd", p, vv)
        o.backward(dout_all[s])
        out[s] = {"out": o.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return out


def _inputs(mb, lengths: list[int], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    q, k, v, d = {}, {}, {}, {}
    for s in mb.samples:
        L = lengths[s]
        q[s] = torch.randn(L, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
        k[s] = torch.randn(L, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
        v[s] = torch.randn(L, KV_HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
        d[s] = torch.randn(L, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    return q, k, v, d


def _local(t: dict, shard) -> Any:
    import torch

    return torch.cat([t[p.sample][p.start : p.stop] for p in shard.pieces]) if shard.pieces else None


def _worker(rank: int, world: int, mb, lengths: list[int], seed: int) -> dict:
    """One CP rank (in a process of its own, gloo group joined by :func:`ringpack._spawn.run_ranks`)."""
    q_all, k_all, v_all, d_all = _inputs(mb, lengths, seed)
    shard = mb.shards[rank]
    sched = compile_schedule(mb, rank)
    q = _local(q_all, shard).requires_grad_()
    k = _local(k_all, shard).requires_grad_()
    v = _local(v_all, shard).requires_grad_()
    out = ring_attention(q, k, v, sched, mode="ring", backend="reference")
    out.backward(_local(d_all, shard))
    return {
        "out": out.detach().numpy(),
        "dq": q.grad.numpy(),
        "dk": k.grad.numpy(),
        "dv": v.grad.numpy(),
        "steps": len(sched.steps),
    }


def run_ring_check(mb, lengths: list[int], seed: int = 0, timeout_s: float = 120.0, tol: float = 1e-9) -> RingCheck:
    """Run ``mb`` on ``len(mb.shards)`` gloo processes and compare with :func:`_dense_reference`."""
    t0 = time.perf_counter()
    results = run_ranks(
        _worker,
        len(mb.shards),
        (mb, lengths, seed),
        timeout_s=60.0,
        join_s=timeout_s,
        start_method="spawn",
        name="ring check",
    )
    ref = _dense_reference(mb, lengths, seed)
    worst = 0.0
    for r, shard in enumerate(mb.shards):
        for key in ("out", "dq", "dk", "dv"):
            want = _local({s: ref[s][key] for s in ref}, shard)
            if want is None:
                continue
            worst = max(worst, float(np.abs(results[r][key] - want.numpy()).max()))
    rows = [(c, p.sample, p.start, p.stop) for c, sh in enumerate(mb.shards) for p in sh.pieces]
    arr = np.array(rows, dtype=np.int64)
    need = needed_pieces(np.zeros(len(arr), dtype=np.int64), arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])
    split = len({p.sample for sh in mb.shards for p in sh.pieces if p.start > 0})
    return RingCheck(
        samples=len(mb.samples),
        tokens=mb.num_tokens,
        split_samples=split,
        kv_cross_tokens=int(((arr[:, 3] - arr[:, 2]) * (need > 0)).sum()),
        ring_steps=max(r["steps"] for r in results),
        max_error=worst,
        seconds=time.perf_counter() - t0,
        ok=worst <= tol,
    )
