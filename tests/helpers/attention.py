"""Attention test helpers: micro-batches, inputs, an independent dense reference, a process harness.

The dense reference is built from first principles (a full ``[N, N]`` mask from sample ids and
positions, plain softmax, autograd for the gradients) and shares no code with the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ringpack.planner.split import split_contiguous, split_zigzag
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

# ------------------------------------------------------------------------------------------ plans


def random_microbatch(
    rng: np.random.Generator, cp: int, num_samples: int = 5, max_len: int = 24, max_pieces: int = 5
) -> tuple[MicroBatch, dict[int, int]]:
    """An adversarial valid micro-batch: random cuts, random rank per piece (interleaved pieces of one
    sample on one rank, non-contiguous rank subsets), length-1 samples, sometimes an idle rank, and
    sample ids that differ from their slots."""
    ids = rng.choice(1000, size=num_samples, replace=False).tolist()
    lengths = {s: int(rng.integers(1, max_len + 1)) for s in ids}
    lengths[ids[int(rng.integers(num_samples))]] = 1
    usable = list(range(cp))
    if cp > 1 and rng.random() < 0.3:
        usable.remove(int(rng.integers(cp)))  # an idle rank
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    for s in ids:
        length = lengths[s]
        k = int(rng.integers(1, min(length, max_pieces) + 1))
        cuts = np.sort(rng.choice(np.arange(1, length), size=k - 1, replace=False)) if k > 1 else np.zeros(0, int)
        bounds = [0, *cuts.tolist(), length]
        for a, b in zip(bounds, bounds[1:]):
            shards[int(rng.choice(usable))].append(Piece(s, a, b))
    return microbatch_from_shards(ids, shards, lengths), lengths


def strategy_microbatch(
    strategy: str, rng: np.random.Generator, cp: int, num_samples: int = 6, max_len: int = 40
) -> tuple[MicroBatch, dict[int, int]]:
    """A micro-batch cut by one of the balancer's split strategies (``balanced`` needs the planner)."""
    lengths_arr = rng.integers(1, max_len + 1, size=num_samples)
    lengths_arr[0] = 1
    samples = list(range(num_samples))
    if strategy == "contiguous":
        mb = split_contiguous(samples, lengths_arr.tolist(), cp)
    elif strategy == "zigzag":
        mb = split_zigzag(samples, lengths_arr.tolist(), cp)
    elif strategy == "balanced":
        from ringpack.planner.epoch import split_microbatch
        from ringpack.shard_plan import PlanConfig

        budget = int(np.ceil(lengths_arr.sum() / cp)) + int(rng.integers(0, 8))
        mb = split_microbatch(samples, lengths_arr.tolist(), PlanConfig(dp=1, cp=cp, tokens_per_rank=budget))
    else:
        raise ValueError(strategy)
    return mb, {s: int(lengths_arr[s]) for s in samples}


def handmade_microbatches() -> list[tuple[str, MicroBatch, dict[int, int]]]:
    """Named corner cases: (name, micro-batch, lengths by sample id)."""
    P = Piece
    cases = []

    def add(name: str, samples: Sequence[int], lengths: dict[int, int], shards: list[list[Piece]]) -> None:
        cases.append((name, microbatch_from_shards(samples, shards, lengths), lengths))

    add("cp1", [7, 3], {7: 5, 3: 1}, [[P(7, 0, 5), P(3, 0, 1)]])
    add("no-split", [0, 1, 2], {0: 4, 1: 1, 2: 6}, [[P(0, 0, 4)], [P(1, 0, 1), P(2, 0, 6)]])
    add("empty-rank", [0, 1], {0: 9, 1: 3}, [[P(0, 0, 4)], [], [P(0, 4, 9), P(1, 0, 3)]])
    add("all-on-last", [0], {0: 6}, [[], [], [P(0, 0, 6)]])
    add("length-1-pieces", [0], {0: 4}, [[P(0, 0, 1), P(0, 2, 3)], [P(0, 1, 2), P(0, 3, 4)]])
    # a sample longer than any rank's share, spread over a non-contiguous subset (ranks 0, 2, 3)
    add("skip-rank", [5, 6], {5: 13, 6: 2}, [[P(5, 0, 3)], [P(6, 0, 2)], [P(5, 3, 10)], [P(5, 10, 13)]])
    # interleaved pieces of one sample on two ranks: nested key prefixes -> several calls per step
    add(
        "interleaved",
        [0, 1],
        {0: 10, 1: 4},
        [[P(0, 0, 2), P(0, 4, 5), P(0, 8, 10), P(1, 2, 4)], [P(0, 2, 4), P(0, 5, 8), P(1, 0, 2)]],
    )
    # reverse placement: early tokens on the last rank, so the ring goes "backwards"
    add("reverse", [0], {0: 9}, [[P(0, 6, 9)], [P(0, 3, 6)], [P(0, 0, 3)]])
    # 'balanced'-like: short samples whole, one long sample split unevenly over ranks 1 and 3 only
    add(
        "balanced-like",
        [0, 1, 2, 3],
        {0: 5, 1: 17, 2: 3, 3: 4},
        [[P(0, 0, 5), P(2, 0, 3)], [P(1, 0, 11)], [P(3, 0, 4)], [P(1, 11, 17)]],
    )
    return cases


def targeted_microbatches() -> list[tuple[str, MicroBatch, dict[int, int]]]:
    """Corner cases of the targeted exchange on up to 8 ranks: (name, micro-batch, lengths by sample id)."""
    P = Piece
    cases = []

    def add(name: str, lengths: dict[int, int], shards: list[list[Piece]]) -> None:
        cases.append((name, microbatch_from_shards(list(lengths), shards, lengths), lengths))

    # a sample over ranks 0 and 5 only of 8: rank 0 only sends, rank 5 only receives, 4 ranks idle
    add(
        "ranks-0-and-5-of-8",
        {0: 12, 1: 5, 2: 3, 3: 7},
        [[P(0, 0, 7)], [P(1, 0, 5)], [], [P(2, 0, 3)], [], [P(0, 7, 12), P(3, 0, 7)], [], []],
    )
    # rank 3 needs pieces from all 7 others (a sample each, the first of them a length-1 piece)
    others = [0, 1, 2, 4, 5, 6, 7]
    lengths = {10 + j: 3 + j for j in range(7)} | {1: 4}
    shards: list[list[Piece]] = [[] for _ in range(8)]
    for j, q in enumerate(others):
        shards[q].append(P(10 + j, 0, 1 if j == 0 else 2))
        shards[3].append(P(10 + j, 1 if j == 0 else 2, 3 + j))
    shards[3].append(P(1, 0, 4))
    add("all-to-one-of-8", lengths, shards)
    # rank 6's pieces are needed by all 7 others (a sample each)
    lengths = {20 + j: 2 + j for j in range(7)}
    shards = [[] for _ in range(8)]
    for j, q in enumerate([0, 1, 2, 3, 4, 5, 7]):
        shards[6].append(P(20 + j, 0, 1 + j % 2))
        shards[q].append(P(20 + j, 1 + j % 2, 2 + j))
    add("one-to-all-of-8", lengths, shards)
    # interleaved pieces of one sample on three ranks (nested prefixes: several calls per step), an idle rank
    add(
        "interleaved-of-5",
        {0: 20, 1: 6},
        [
            [P(0, 0, 2), P(0, 9, 11), P(0, 18, 20)],
            [P(0, 2, 5), P(0, 11, 14)],
            [P(1, 0, 3)],
            [P(0, 5, 9), P(0, 14, 18), P(1, 3, 6)],
            [],
        ],
    )
    # length-1 pieces, placed in reverse rank order: every rank needs every later rank's piece
    add(
        "length-1-reverse-of-6",
        {0: 6, 1: 1},
        [[P(0, 5 - r, 6 - r)] + ([P(1, 0, 1)] if r == 2 else []) for r in range(6)],
    )
    # no split sample at all (no exchange), idle ranks
    add(
        "no-split-of-8",
        {0: 3, 1: 1, 2: 4, 3: 2},
        [[P(0, 0, 3)], [], [P(1, 0, 1), P(2, 0, 4)], [], [], [P(3, 0, 2)], [], []],
    )
    # a chain over 7 ranks and a sample from rank 6 back to rank 2: every rank sends and receives
    add(
        "chain-of-7",
        {0: 14, 1: 5, 2: 3},
        [
            [P(0, 2 * r, 2 * r + 2)]
            + ([P(1, 3, 5)] if r == 2 else [])
            + ([P(1, 0, 3)] if r == 6 else [])
            + ([P(2, 0, 3)] if r == 4 else [])
            for r in range(7)
        ],
    )
    # pairs exchanging both ways (ranks 1 and 4), and a pair at the group's ends (0 and 5)
    add(
        "pairs-of-6",
        {0: 9, 1: 7, 2: 4},
        [[P(2, 0, 1)], [P(0, 0, 5), P(1, 4, 7)], [], [], [P(0, 5, 9), P(1, 0, 4)], [P(2, 1, 4)]],
    )
    # in nodes of 2 (ranks 0-1, 2-3): rank 1's samples 0, 1, 2 go on to ranks 2 (0 and 2) and 3 (1);
    # its proxy there is rank 3, which forwards rank 2 two runs of what it takes (rows 0-2 and 4-6)
    add(
        "two-runs-via-a-proxy-of-4",
        {0: 4, 1: 5, 2: 6, 3: 2},
        [[P(3, 0, 2)], [P(0, 0, 2), P(1, 0, 2), P(2, 0, 2)], [P(0, 2, 4), P(2, 2, 6)], [P(1, 2, 5)]],
    )
    return cases


def zigzag_case(cp: int, lengths: Sequence[int]) -> MicroBatch:
    return split_zigzag(list(range(len(lengths))), list(lengths), cp)


# ----------------------------------------------------------------------------------------- inputs


@dataclass
class Problem:
    """Per-sample inputs of one micro-batch: q/k/v/dout ``[L, heads, head_dim]`` by sample id."""

    mb: MicroBatch
    lengths: dict[int, int]
    q: dict[int, torch.Tensor]
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    dout: dict[int, torch.Tensor]

    @classmethod
    def make(
        cls,
        mb: MicroBatch,
        lengths: dict[int, int],
        heads: int,
        kv_heads: int,
        dim: int,
        seed: int,
        dtype=torch.float64,
        device="cpu",
    ) -> Problem:
        gen = torch.Generator().manual_seed(seed)
        make = lambda n, h: torch.randn(n, h, dim, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
        q, k, v, dout = {}, {}, {}, {}
        for s in mb.samples:
            n = lengths[s]
            q[s], k[s], v[s], dout[s] = make(n, heads), make(n, kv_heads), make(n, kv_heads), make(n, heads)
        return cls(mb, lengths, q, k, v, dout)

    def local(self, which: dict[int, torch.Tensor], rank: int) -> torch.Tensor:
        """A rank's tokens: its pieces concatenated in canonical order."""
        pieces = self.mb.shards[rank].pieces
        any_t = next(iter(which.values()))
        if not pieces:
            return any_t.new_zeros((0, *any_t.shape[1:]))
        return torch.cat([which[p.sample][p.start : p.stop] for p in pieces])


def dense_reference(problem: Problem, scale: float | None = None) -> dict[str, dict[int, torch.Tensor]]:
    """Single-process causal attention with a per-sample mask over the whole packed micro-batch (fp64, autograd)."""
    samples = list(problem.mb.samples)
    q = torch.cat([problem.q[s] for s in samples]).double().requires_grad_()
    k = torch.cat([problem.k[s] for s in samples]).double().requires_grad_()
    v = torch.cat([problem.v[s] for s in samples]).double().requires_grad_()
    dout = torch.cat([problem.dout[s] for s in samples]).double()
    sid = torch.cat([torch.full((problem.lengths[s],), j) for j, s in enumerate(samples)])
    pos = torch.cat([torch.arange(problem.lengths[s]) for s in samples])
    mask = (sid[:, None] == sid[None, :]) & (pos[None, :] <= pos[:, None])
    heads, kv_heads = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(heads // kv_heads, dim=1)
    vv = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("ihd,jhd->hij", q, kk) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hij,jhd->ihd", probs, vv)
    (out * dout).sum().backward()
    bounds = np.cumsum([0] + [problem.lengths[s] for s in samples])
    split = lambda t: {s: t[bounds[j] : bounds[j + 1]].detach() for j, s in enumerate(samples)}
    return {"out": split(out), "dq": split(q.grad), "dk": split(k.grad), "dv": split(v.grad)}


def max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want|`` as a float: ``inf`` when the shapes differ or either holds a NaN or an
    infinity, so a broken result can never pass ``error < tol`` (every comparison with NaN is false,
    and Python's ``max`` over values with a NaN in them returns whatever came first)."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    if not want.numel():
        return 0.0
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if not (bool(torch.isfinite(got).all()) and bool(torch.isfinite(want).all())):
        return math.inf
    return float((got - want).abs().max())


def max_errors(
    problem: Problem, rank: int, ref: dict[str, dict[int, torch.Tensor]], got: dict[str, torch.Tensor]
) -> dict[str, float]:
    """Max abs error of a rank's out/dq/dk/dv against the dense reference's slices (:func:`max_abs_error`)."""
    return {name: max_abs_error(value, problem.local(ref[name], rank)) for name, value in got.items()}


def within(errors: dict[str, float], tol: float) -> bool:
    """Whether every error is a finite number below ``tol`` (NaN and inf are not)."""
    return all(math.isfinite(e) and e < tol for e in errors.values())


def assert_within(errors: dict[str, float], tol: float, where: str = "") -> None:
    """Fail naming every error that is not a finite number below ``tol``."""
    bad = {name: e for name, e in errors.items() if not (math.isfinite(e) and e < tol)}
    assert not bad, f"{where}: errors not below {tol}: {bad} (all: {errors})"


# --------------------------------------------------------------------------------------- loopback


class LoopbackWorld:
    """All CP ranks in one process: hands each rank the others' compact K/V, collects their dK/dV."""

    def __init__(self, schedules: list, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        from ringpack.attention.engine import pack_kv
        from ringpack.attention.kernels import accum_dtype

        self.kv = [pack_kv(k[r], v[r], s.send_index) for r, s in enumerate(schedules)]
        self.dkv = [torch.zeros(buf.shape, dtype=accum_dtype(buf.dtype), device=buf.device) for buf in self.kv]

    def transport(self, schedule) -> LoopbackTransport:
        return LoopbackTransport(schedule, self)


class LoopbackTransport:
    """A KVTransport without a process group (see ringpack.attention.kv_transport.KVTransport)."""

    send_capacity = None

    def __init__(self, schedule, world: LoopbackWorld) -> None:
        self.origins = [schedule.source(step) for step in schedule.steps]
        self.world = world

    def begin(self, kv, grad_dtype=None):
        pass

    def start(self):
        pass

    def buffer(self, i):
        return self.world.kv[self.origins[i]]

    def push_grad(self, i, dkv):
        if dkv is not None:
            for j, grad in enumerate(dkv):
                self.world.dkv[self.origins[i]][j] += grad

    def finish(self):
        return None


class LoopbackTargeted:
    """A transport factory for the targeted exchange without a process group: each rank's step
    reads the rows of its source's compact buffer that the exchange maps route to it (straight, or
    through the source's proxy and its forwards), and its dK/dV go back to those rows."""

    def __init__(self, world: LoopbackWorld, schedules: list) -> None:
        self.world, self.schedules = world, schedules

    def pass_schedule(self, schedule):
        from ringpack.attention.p2p import targeted_schedule

        return targeted_schedule(schedule)

    def sent(self, src: int, dst: int) -> torch.Tensor:
        """The rows of ``src``'s compact buffer that its exchange map sends ``dst`` (stage one)."""
        ex = self.schedules[src].exchange
        j = ex.dests.index(dst)
        rows = ex.send_ranges[j]
        return torch.arange(*rows) if rows is not None else ex.send_index[j].cpu()

    def rows(self, rank: int, i: int) -> torch.Tensor:
        """The rows of source ``i``'s compact buffer in ``rank``'s buffer of it, following the maps."""
        ex = self.schedules[rank].exchange
        src, via = ex.sources[i], ex.via_of(i)
        if via == src:
            return self.sent(src, rank)
        job = next(job for job in self.schedules[via].exchange.proxied if job.source == src)
        proxied = self.sent(src, via)
        assert len(proxied) == job.tokens, "the source sends its proxy every row the node needs"
        parts = job.own if via == rank else [(u, n, o) for d, u, n, o in job.forwards if d == rank]
        if via != rank:  # the forwards this rank expects are the ones its proxy sends
            expected = [(o, n) for j, frm, o, n in ex.relay_in if j == i]
            assert sorted(expected) == sorted((o, n) for _, n, o in parts), (rank, src, via)
        out = torch.full((ex.recv_tokens[i],), -1, dtype=torch.int64)
        for u, n, offset in parts:
            out[offset : offset + n] = proxied[u : u + n]
        assert (out >= 0).all(), "every row of the buffer arrives"
        return out

    def __call__(self, schedule) -> LoopbackTargetedTransport:
        return LoopbackTargetedTransport(schedule, self)


class LoopbackTargetedTransport:
    """A KVTransport of the targeted exchange without a process group."""

    send_capacity = None

    def __init__(self, schedule, factory: LoopbackTargeted) -> None:
        self.rank, self.exchange, self.factory = schedule.cp_rank, schedule.exchange, factory

    def begin(self, kv, grad_dtype=None):
        pass

    def start(self):
        pass

    def buffer(self, i):
        kv = self.factory.world.kv
        if i >= len(self.exchange.sources):  # a rank that only sends
            return kv[self.rank][:, :0]
        src = self.exchange.sources[i]
        buf = kv[src][:, self.factory.rows(self.rank, i).to(kv[src].device)]
        assert buf.shape[1] == self.exchange.recv_tokens[i], "the sender's rows are what the receiver expects"
        return buf

    def push_grad(self, i, dkv):
        if dkv is None or i >= len(self.exchange.sources):
            return
        src = self.exchange.sources[i]
        acc = self.factory.world.dkv[src]
        rows = self.factory.rows(self.rank, i).to(acc.device)
        for j, grad in enumerate(dkv):
            acc[j].index_add_(0, rows, grad.to(acc.dtype))

    def finish(self):
        return None


def run_all_ranks(
    problem: Problem,
    scale: float | None = None,
    backend: str = "reference",
    device: str | torch.device = "cpu",
    dense_threshold: int | None = 4096,
    dense_buckets: int | None = 8,
    part_rows: int | None = None,
    mode: str = "ring",
    gpus_per_node: int | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Forward and backward of every CP rank of ``problem`` in this process, through the real engine
    (``part_rows``: the forward's row chunks of remote dense blocks, as without gradients;
    ``mode="p2p"``: the targeted exchange's steps and rows, node-relayed with ``gpus_per_node``)."""
    from ringpack.attention import compile_schedule
    from ringpack.attention.engine import PassConfig, attention_backward, attention_forward

    cp = len(problem.mb.shards)
    schedules = [
        compile_schedule(
            problem.mb, r, dense_threshold=dense_threshold, dense_buckets=dense_buckets, gpus_per_node=gpus_per_node
        ).to(device)
        for r in range(cp)
    ]
    q, k, v, dout = ([problem.local(t, r) for r in range(cp)] for t in (problem.q, problem.k, problem.v, problem.dout))
    world = LoopbackWorld(schedules, k, v)
    make_transport = LoopbackTargeted(world, schedules) if mode == "p2p" else world.transport
    scale = q[0].shape[-1] ** -0.5 if scale is None else scale
    config = PassConfig(scale, backend, make_transport, part_rows)
    results = []
    for r in range(cp):
        out, lse = attention_forward(q[r], k[r], v[r], schedules[r], config)
        dq, dk, dv = attention_backward(dout[r], q[r], k[r], v[r], out, lse, schedules[r], config)
        results.append(
            {
                "out": out,
                "dq": dq,
                "dk": dk.float() if dk.dtype != torch.float64 else dk.clone(),
                "dv": dv.float() if dv.dtype != torch.float64 else dv.clone(),
            }
        )
    for r, sched in enumerate(schedules):  # what the transport's finish() would bring home
        results[r]["dk"].index_add_(0, sched.send_index, world.dkv[r][0].to(results[r]["dk"].dtype))
        results[r]["dv"].index_add_(0, sched.send_index, world.dkv[r][1].to(results[r]["dv"].dtype))
    return results


# ---------------------------------------------------------------------------------------- harness


def run_processes(world: int, fn: Callable, *args: Any, timeout_s: float = 60.0, join_s: float = 240.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined by a gloo group; return their results.

    Every collective has ``timeout_s``; the whole run is killed after ``join_s`` (a hang fails the
    test instead of stalling the suite). A child's exception is re-raised here with its traceback.
    """
    from ringpack._spawn import run_ranks

    # forkserver: one fresh server process imports torch and ringpack once, then forks each rank
    # (spawn would import them once per rank; plain fork would inherit the parent's thread pools)
    return run_ranks(
        fn,
        world,
        args,
        timeout_s=timeout_s,
        join_s=join_s,
        start_method="forkserver",
        preload=["torch", "torch.distributed", "numpy", "ringpack.attention", __name__],
    )
