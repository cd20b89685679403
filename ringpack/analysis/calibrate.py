"""``ringpack calibrate``: fit the cost model to measured GPU kernel times (DESIGN.md sections 2 and 6).

The planner balances ``token*tokens + pair*pairs + segment*pieces`` per rank. Calibration replaces
the FLOP-derived coefficients by seconds measured on the GPU that will train, in four steps:

1. **Grid.** Rank shards built to span what plans produce: single samples of 128 to 64K tokens,
   packs of many short samples (64 to 2K, round and odd lengths), long samples split at several
   offsets over 2 CP ranks (so ranks hold suffix pieces: a causal diagonal *plus* full blocks), and
   zigzag splits over 2 and 4 ranks (several pieces per sample, several remote steps), and
   plan-shaped micro-batches (heavy-tailed mixes split by every strategy, seeds 1-2).
2. **Timer.** Each shard runs ringpack's own attention engine (:class:`ContextParallelAttention`
   on its compiled schedule, the chosen kernel backend) forward and backward, timed with CUDA
   events, median of a few repetitions; with ``timer="gpu"`` (default) the repetitions are queued
   behind a GPU sleep, so the events see the GPU's execution and not the host's launch pace. CP ranks are timed one at a time on one GPU: a transport
   without communication serves the remote K/V buffers from memory, so a rank's time is its
   compute (kernels, gathers, log-sum-exp merges); communication is the comm model's business.
   With ``mode="linear"`` (the default) the model's linear layers are timed too: the GEMMs of one
   decoder layer (q/k/v, o, gate/up, down) and the output head, forward (``x @ W``) and backward
   (``dY @ W^T``, ``X^T @ dY``), per token. Norms, activations and RoPE are not timed (they are
   memory-bound and small next to the GEMMs).
3. **Fit.** Non-negative least squares (Lawson-Hanson, numpy only), weighted by ``1 / measured`` so
   every shard counts by its *relative* error, of two models of the per-layer attention time:

   * the **profile model**, ``overhead + ring*[a sample of the micro-batch is split] + token*tokens
     + pair*pairs + segment*pieces``: the planner's three terms plus two constants that are equal
     on every rank of a micro-batch (the engine's fixed cost, and the ring path every rank runs
     once any sample is split), so they never change which rank is slowest. The constants are
     reported (``per_layer``), not put in the profile; ``predicted_s`` includes them.
   * the **kernel model** (:func:`rank_features`), a diagnostic on what the schedule launches:
     varlen calls, ``Bq x Bk`` tiles computed, the varlen *launch grid* (flash kernels launch
     ``ceil(max_seqlen / block)`` tiles for every segment of a call, so a call of many short
     segments and one long one pays ``segments x longest``), remote query rows and K/V rows (gather,
     merge, dK/dV accumulation) and, for hybrid backends, dense (cuDNN) calls and tiles at their own
     rate. The block size is chosen from 64/128 by fit. Its terms are per rank, not per piece,
     so the planner's additive cost cannot hold them; the gap between the two models' held-out
     errors is what per-piece pricing leaves on the table (on the first H200 runs: mostly zigzag
     ranks of many short pieces next to a long one, whose empty launched tiles cost milliseconds).

4. **Evaluation.** Held-out micro-batches (heavy-tailed Pareto mixes, split by ``contiguous``,
   ``zigzag`` and ``balanced`` over 2 CP ranks, with lengths and seeds the grid never saw): every
   rank's measured time against both models' predictions; Pearson correlation, largest and mean
   relative error and how often the slowest rank is predicted right, as a table and in the JSON
   report. ``ringpack calibrate --refit REPORT.json`` redoes steps 3-4 from a stored report's
   measurements without a GPU (the report stores every micro-batch's geometry).

The profile is a :class:`CostModel` in seconds for one forward+backward of the *whole model*
(attention coefficients x layers, plus the linear layers' per-token time in ``token``), saved with
:meth:`CostModel.save`; ``ringpack plan --cost-profile PATH``, ``--model PATH`` of
``report``/``simulate``/``shard`` and ``PlanConfig(cost=CostModel.load(PATH))`` use it. Its name is
the model preset's, because the communication model looks the K/V shape up by that name.

This module imports only numpy, torch, the balancer's cost/plan/split and the attention runtime,
so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ringpack.balancer.cost import PRESETS, CostModel, ModelShape, piece_pairs
from ringpack.balancer.plan import MicroBatch, Piece, microbatch_from_shards
from ringpack.balancer.split import split_balanced, split_contiguous, split_zigzag

__all__ = [
    "AttentionShape",
    "Case",
    "Calibration",
    "GRIDS",
    "add_arguments",
    "calibrate",
    "estimate_seconds",
    "eval_cases",
    "fit_nnls",
    "grid_cases",
    "kernel_features",
    "nnls",
    "pearson",
    "planner_features",
    "rank_features",
    "refit",
    "run",
    "segment_pairs",
    "segment_tiles",
]

GRIDS = ("full", "quick", "tiny")
PLANNER_FEATURES = ("const", "tokens", "pairs", "pieces")
# the profile model: what the planner's CostModel prices (tokens, pairs, pieces) plus two constants
# that are the same for every rank of a micro-batch (see the module docstring)
PROFILE_FEATURES = ("overhead", "ring", "tokens", "pairs", "pieces")
# the kernel model: what the schedule's kernel launches do (a diagnostic; not expressible per piece)
KERNEL_FEATURES = ("overhead", "ring", "calls", "tokens", "tiles", "grid_q", "grid_k", "remote_rows", "buffer_tokens",
                   "dense_calls", "dense_tiles")
BLOCKS = ((64, 64), (64, 128), (128, 64), (128, 128))
EVAL_STRATEGIES = ("contiguous", "zigzag", "balanced")
TIMERS = ("gpu", "wall")


@dataclass(frozen=True)
class AttentionShape:
    """Heads of one attention layer: ``heads`` query heads, ``kv_heads`` key/value heads of ``head_dim``."""

    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.heads, self.kv_heads, self.head_dim) < 1 or self.heads % self.kv_heads:
            raise ValueError(f"attention shape {self}: need positive sizes and heads a multiple of kv_heads")

    def flops_per_pair(self) -> float:
        """Forward+backward FLOPs of one (query, key) pair over all heads (DESIGN.md section 2)."""
        return 4.0 * self.head_dim * self.heads * 3.5


@dataclass(frozen=True)
class Case:
    """One timed rank shard: CP rank ``rank`` of ``microbatch`` (sample ``s`` has ``lengths[s]`` tokens)."""

    family: str
    label: str
    microbatch: MicroBatch
    rank: int
    lengths: tuple[int, ...]

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return self.microbatch.shards[self.rank].pieces


# ------------------------------------------------------------------------------------------ features


def planner_features(case: Case, tile: int = 1) -> np.ndarray:
    """``[1, tokens, exact causal pairs, pieces]`` of the rank shard: what the cost model sees.

    ``tile > 1`` is a diagnostic variant: each piece's pairs are counted as if its length were
    rounded up to a multiple of ``tile`` (``piece_pairs(start, start + ceil(len/tile)*tile)``),
    a cheap stand-in for partial kernel tiles that the cost model could adopt.
    """
    starts = np.array([p.start for p in case.pieces], dtype=np.int64)
    stops = np.array([p.stop for p in case.pieces], dtype=np.int64)
    rounded = starts + -(-(stops - starts) // tile) * tile
    return np.array([1.0, (stops - starts).sum(), piece_pairs(starts, rounded).sum(), len(starts)], dtype=np.float64)


def segment_pairs(len_q: Any, len_k: Any, causal: bool) -> np.ndarray:
    """Exact (query, key) pairs of varlen segments; causal masks align bottom-right (flash-attn >= 2.1).

    Query row ``i`` of a causal segment sees keys ``0 .. i + len_k - len_q`` (clipped to the segment).
    """
    lq = np.asarray(len_q, dtype=np.int64)
    lk = np.asarray(len_k, dtype=np.int64)
    if not causal:
        return lq * lk
    s = lk - lq
    # rows i in [i0, i1) see i + 1 + s keys (0 < that < lk); rows from max(i0, i1) on see all lk keys
    i0 = np.clip(-s, 0, lq)
    i1 = np.clip(lk - 1 - s, i0, lq)
    n = i1 - i0
    partial = n * (i0 + 1 + s) + n * (n - 1) // 2
    return partial + (lq - i1) * lk


def segment_tiles(len_q: Any, len_k: Any, causal: bool, block_q: int, block_k: int) -> np.ndarray:
    """Tiles of ``block_q x block_k`` a flash kernel computes per segment (partial or masked tiles count whole).

    Query tile ``i`` (rows ``i*block_q ..`` up to the segment's end) runs key tiles ``0 ..`` the tile
    of the last key its last row sees; non-causal segments run every tile.
    """
    lq = np.asarray(len_q, dtype=np.int64).ravel()
    lk = np.asarray(len_k, dtype=np.int64).ravel()
    q_tiles = -(-lq // block_q)
    k_tiles = -(-lk // block_k)
    if not causal:
        return q_tiles * k_tiles
    seg = np.repeat(np.arange(lq.size), q_tiles)
    first = np.cumsum(q_tiles) - q_tiles
    i = np.arange(seg.size) - first[seg]
    last_row = np.minimum((i + 1) * block_q, lq[seg]) - 1
    last_key = last_row + (lk - lq)[seg]
    n_k = np.clip(np.floor_divide(last_key, block_k) + 1, 0, k_tiles[seg])
    return np.bincount(seg, weights=n_k, minlength=lq.size).astype(np.int64)


_SCHEDULES: dict[int, tuple[Case, Any]] = {}


def _schedule(case: Case):
    """The case's compiled schedule (CPU), compiled once per case object."""
    from ringpack.attention.schedule import compile_schedule

    hit = _SCHEDULES.get(id(case))
    if hit is None or hit[0] is not case:
        if len(_SCHEDULES) > 4096:
            _SCHEDULES.clear()
        hit = _SCHEDULES[id(case)] = (case, compile_schedule(case.microbatch, case.rank))
    return hit[1]


def _calls(schedule) -> list:
    calls = [] if schedule.local is None else [schedule.local]
    return calls + [c for step in schedule.steps for c in step.calls]


def kernel_features(case: Case, block_q: int = 128, block_k: int = 128, schedule=None) -> dict[str, float]:
    """What the kernels of this rank actually run: calls, segments, exact pairs and whole-tile pairs."""
    schedule = _schedule(case) if schedule is None else schedule
    out = dict(calls=0.0, kernel_segments=0.0, kernel_pairs=0.0, tiles=0.0, tile_pairs=0.0, tokens=float(schedule.num_tokens))
    for call in _calls(schedule):
        lq = np.diff(call.cu_seqlens_q.cpu().numpy().astype(np.int64))
        lk = np.diff(call.cu_seqlens_k.cpu().numpy().astype(np.int64))
        work = (lq > 0) & (lk > 0)
        lq, lk = lq[work], lk[work]
        tiles = int(segment_tiles(lq, lk, call.causal, block_q, block_k).sum())
        out["calls"] += 1
        out["kernel_segments"] += lq.size
        out["kernel_pairs"] += float(segment_pairs(lq, lk, call.causal).sum())
        out["tiles"] += tiles
        out["tile_pairs"] += float(tiles * block_q * block_k)
    return out


def rank_features(case: Case, hybrid: bool = False, block_q: int = 128, block_k: int = 128, schedule=None) -> dict[str, float]:
    """Every feature of a rank shard the profile and kernel models use (:data:`PROFILE_FEATURES`, :data:`KERNEL_FEATURES`).

    * ``ring``: 1 when the micro-batch has remote steps (some sample is split). Every rank of the
      micro-batch then runs the ring path (K/V packing, float32 accumulators, merges), so it is a
      constant of the micro-batch, like ``overhead``.
    * ``calls``: varlen kernel calls (each is a forward and a backward launch, plus their prologues).
    * ``tiles``: ``block_q x block_k`` tiles the varlen calls compute (partial and masked tiles whole).
    * ``grid_q`` / ``grid_k``: the launch grid of the varlen calls. Flash-attention's varlen kernels
      launch ``ceil(max_seqlen / block)`` tiles for *every* segment of a call (forward and the
      backward's pre/post-processing over queries, the backward's main kernel over keys); tiles past
      a segment's end exit at once but still cost a block launch. A call of many short segments and
      one long one pays ``segments x longest`` of them.
    * ``remote_rows``: query rows of the remote steps (gathered, merged by log-sum-exp, their dQ
      scattered back); ``buffer_tokens``: remote K/V rows a rank reads and accumulates dK/dV for.
    * ``dense_calls`` / ``dense_tiles``: with a hybrid backend (``hybrid=True``) the long segments the
      schedule marked run one by one on the dense kernel (cuDNN): a launch each and their own tile rate.
    """
    schedule = _schedule(case) if schedule is None else schedule
    f = planner_features(case)
    out = dict(overhead=1.0, ring=float(bool(schedule.steps)), tokens=float(f[1]), pairs=float(f[2]), pieces=float(f[3]),
               calls=0.0, segments=0.0, tiles=0.0, grid_q=0.0, grid_k=0.0, remote_rows=0.0,
               buffer_tokens=float(sum(schedule.buffer_tokens[schedule.source(step)] for step in schedule.steps)),
               dense_calls=0.0, dense_tiles=0.0, dense_pairs=0.0)
    local = [] if schedule.local is None else [(False, schedule.local)]
    for remote, call in local + [(True, c) for step in schedule.steps for c in step.calls]:
        if remote:
            out["remote_rows"] += float(call.cu_seqlens_q[-1])
        if hybrid and call.dense:
            for _, nq, _, nk in call.dense:
                out["dense_calls"] += 1
                out["dense_tiles"] += float(segment_tiles([nq], [nk], call.causal, block_q, block_k)[0])
                out["dense_pairs"] += float(segment_pairs([nq], [nk], call.causal)[0])
            call = call.rest
            if call is None:
                continue
        lq = np.diff(call.cu_seqlens_q.cpu().numpy().astype(np.int64))
        lk = np.diff(call.cu_seqlens_k.cpu().numpy().astype(np.int64))
        work = (lq > 0) & (lk > 0)
        out["calls"] += 1
        out["segments"] += float(work.sum())
        out["tiles"] += float(segment_tiles(lq[work], lk[work], call.causal, block_q, block_k).sum())
        out["grid_q"] += float(lq.size * -(-max(call.max_seqlen_q, 2) // block_q))
        out["grid_k"] += float(lk.size * -(-call.max_seqlen_k // block_k))
    return out


def _matrix(feats: Sequence[dict[str, float]], names: Sequence[str]) -> np.ndarray:
    return np.array([[f[name] for name in names] for f in feats], dtype=np.float64).reshape(len(feats), len(names))


# ---------------------------------------------------------------------------------------------- grid


def _whole(family: str, lengths: Sequence[int], label: str) -> list[Case]:
    lengths = tuple(int(x) for x in lengths)
    samples = list(range(len(lengths)))
    mb = microbatch_from_shards(samples, [[Piece(s, 0, n) for s, n in enumerate(lengths)]], lengths)
    return [Case(family, label, mb, 0, lengths)]


def _ranks(family: str, mb: MicroBatch, lengths: Sequence[int], label: str) -> list[Case]:
    lengths = tuple(int(x) for x in lengths)
    return [Case(family, f"{label} r{r}", mb, r, lengths) for r in range(len(mb.shards)) if mb.shards[r].pieces]


def _cut(length: int, cut: int) -> list[Case]:
    mb = microbatch_from_shards([0], [[Piece(0, 0, cut)], [Piece(0, cut, length)]], [length])
    return _ranks("split", mb, [length], f"L={length} cut={cut}")


def _uniform_pack(rng: np.random.Generator, total: int, low: int, high: int) -> list[int]:
    out, used = [], 0
    while used < total:
        n = min(int(rng.integers(low, high + 1)), total - used)
        out.append(n)
        used += n
    return out


def pareto_mix(total: int, seed: int, scale: int = 128, alpha: float = 1.1) -> list[int]:
    """Heavy-tailed lengths filling exactly ``total`` tokens (``benchmarks/attention.py``'s mix)."""
    rng = np.random.default_rng(seed)
    cap = max(total // 2, 1)
    out, used = [], 0
    while used < total:
        n = min(int(min(cap, scale * (1 + rng.pareto(alpha)))), total - used)
        out.append(n)
        used += n
    return out


_GRID_SPEC: dict[str, dict[str, Any]] = {
    "full": dict(
        singles=(128, 512, 1000, 2048, 3000, 4096, 6000, 8192, 12000, 16384, 24000, 32768, 49152, 65536),
        packs=((64, 128, 256, 512, 1024, 2048), (4096, 16384, 32768)),
        odd_packs=((100, 300, 700, 1500), 16384),
        random_packs=((8192, 16384, 32768), 2),
        long_short=((4096, 16384), 32768),
        splits=((4096, 16384, 32768), (0.25, 0.5, 0.75)),
        zigzag=(([8192], [32768], [12000, 3000, 700]), 2),
        zigzag4=[32768],
        plans=((16384, 32768, 65536), (1, 2), 2, 1.0),
        eval=((16384, 32768, 65536), (101, 102, 103), 2, 1.0),
    ),
    "quick": dict(
        singles=(128, 1000, 2048, 4096, 8192, 16384, 32768),
        packs=((64, 256, 1024, 2048), (4096, 16384)),
        odd_packs=((300,), 8192),
        random_packs=((8192, 16384), 1),
        long_short=((4096,), 16384),
        splits=((4096, 16384), (0.25, 0.5)),
        zigzag=(([8192], [4000, 3000, 700]), 2),
        zigzag4=[16384],
        plans=((16384, 32768), (1,), 2, 1.0),
        eval=((16384, 32768), (101,), 2, 1.0),
    ),
    "tiny": dict(  # CPU dry run with the reference backend: O(T^2) memory, so a few hundred tokens
        singles=(16, 256),
        packs=((8,), (128,)),
        odd_packs=((13,), 128),
        random_packs=((256,), 1),
        long_short=((96,), 256),
        splits=((256,), (0.5,)),
        zigzag=(([200],), 2),
        zigzag4=[],
        plans=((), (), 2, 1 / 16),
        eval=((256,), (101,), 2, 1 / 16),
    ),
}


def grid_cases(grid: str = "full", seed: int = 0) -> list[Case]:
    """The rank shards timed for the fit (see the module docstring)."""
    if grid not in _GRID_SPEC:
        raise ValueError(f"unknown grid {grid!r}; choose one of {GRIDS}")
    spec = _GRID_SPEC[grid]
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    for n in spec["singles"]:
        cases += _whole("single", [n], f"L={n}")
    sizes, totals = spec["packs"]
    for size in sizes:
        for total in totals:
            cases += _whole("pack", [size] * (total // size), f"{total // size}x{size}")
    sizes, total = spec["odd_packs"]
    for size in sizes:
        cases += _whole("pack", [size] * (total // size), f"{total // size}x{size}")
    totals, draws = spec["random_packs"]
    low, high = (64, 2048) if grid != "tiny" else (4, 64)
    for total in totals:
        for d in range(draws):
            lengths = _uniform_pack(rng, total, low, high)
            cases += _whole("pack", lengths, f"uniform {low}-{high} T={total} #{d}")
    longs, total = spec["long_short"]
    for long in longs:
        lengths = [long] + _uniform_pack(rng, total - long, low, high)
        cases += _whole("mix", lengths, f"{long}+{len(lengths) - 1} short")
    lengths_, fractions = spec["splits"]
    for length in lengths_:
        cuts = sorted({int(length * f) for f in fractions} | {length // 2 + max(1, length // 200)})
        for cut in cuts:
            cases += _cut(length, cut)
    mixes, cp = spec["zigzag"]
    for lengths in mixes:
        mb = split_zigzag(list(range(len(lengths))), lengths, cp)
        cases += _ranks("zigzag", mb, lengths, f"zigzag cp={cp} {'+'.join(map(str, lengths))}")
    for length in spec["zigzag4"]:
        mb = split_zigzag([0], [length], 4)
        cases += _ranks("zigzag", mb, [length], f"zigzag cp=4 L={length}")
    for case in _plan_cases(spec["plans"], CostModel.preset("llama3-8b")):
        cases.append(dataclasses.replace(case, family="plan", label=f"{case.family} {case.label}"))
    return cases


def eval_cases(grid: str, cost: CostModel) -> list[Case]:
    """Held-out rank shards: Pareto mixes split by every strategy over 2 CP ranks (``balanced`` with ``cost``).

    The grid holds the same kind of micro-batches (``plan`` family) with other seeds: what plans
    produce is what the fit must get right, and these seeds are never seen by it.
    """
    return _plan_cases(_GRID_SPEC[grid]["eval"], cost)


def _plan_cases(spec: tuple, cost: CostModel) -> list[Case]:
    totals, seeds, cp, scale = spec
    cases = []
    for total in totals:
        for seed in seeds:
            lengths = pareto_mix(total, seed, scale=max(1, int(128 * scale)))
            samples = list(range(len(lengths)))
            for strategy in EVAL_STRATEGIES:
                if strategy == "balanced":
                    budget = int(-(-total // cp) * 1.125)
                    mb = split_balanced(samples, lengths, cp, budget, cost)
                elif strategy == "zigzag":
                    mb = split_zigzag(samples, lengths, cp)
                else:
                    mb = split_contiguous(samples, lengths, cp)
                cases += _ranks(strategy, mb, lengths, f"T={total} seed={seed}")
    return cases


def estimate_seconds(cases: Sequence[Case], shape: AttentionShape, reps: int = 5, warmup: int = 1,
                     flops: float = 2.5e14, overhead: float = 3e-4) -> float:
    """Rough GPU time of timing ``cases`` (FLOPs of whole tiles at ``flops`` plus a per-run overhead)."""
    total = 0.0
    for case in cases:
        pairs = kernel_features(case)["tile_pairs"]
        one = pairs * shape.flops_per_pair() / flops + overhead
        total += one * (warmup + max(1, reps if one < 0.05 else min(reps, 3)))
    return total


# -------------------------------------------------------------------------------------------- timing


class _ComputeOnlyTransport:
    """A :class:`~ringpack.attention.ring.KVTransport` without communication: remote K/V come from memory."""

    def __init__(self, buffers: list, home) -> None:
        self._buffers, self._home = buffers, home

    def begin(self, kv, grad_dtype=None) -> None:
        pass

    def buffer(self, i: int):
        return self._buffers[i]

    def push_grad(self, i: int, dkv) -> None:
        pass

    def finish(self):
        return self._home


class _Clock:
    """CUDA events on a GPU, ``perf_counter`` (after nothing to sync) on the CPU.

    ``queued=True`` (the ``gpu`` timer): before a batch of repetitions the GPU is put to sleep
    (``torch.cuda._sleep``) for longer than the host needs to launch them, so every repetition's
    kernels are already queued when its start event fires and the events measure the GPU's
    execution alone. Without it (the ``wall`` timer) a shard whose kernels finish before the host
    has launched the next ones is timed at the host's pace (~0.4 ms for one attention layer's
    forward+backward with ringpack's engine, ~1 ms with a ring step): a floor that the linear
    cost model cannot fit and that a training step, whose GPU queue the host keeps ahead of, does
    not see.
    """

    def __init__(self, device, queued: bool = True) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self._torch = torch
        self.queued = self.cuda and queued and hasattr(torch.cuda, "_sleep")
        self._hz = 0.0

    @property
    def kind(self) -> str:
        return "gpu" if self.queued else "wall" if self.cuda else "host"

    def _sleep(self, seconds: float) -> None:
        torch = self._torch
        if not self._hz:  # cycles per second of torch.cuda._sleep, measured once
            for _ in range(2):
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                torch.cuda._sleep(1_000_000)
                stop.record()
                stop.synchronize()
                self._hz = 1e6 / max(start.elapsed_time(stop) * 1e-3, 1e-6)
        torch.cuda._sleep(int(min(seconds, 2.0) * self._hz))

    def measure(self, fn: Callable[[], None], warmup: int, reps: int) -> list[float]:
        torch = self._torch
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            torch.cuda.synchronize()
            if self.queued:
                t0 = time.perf_counter()
                fn()  # the host's launch time of one repetition (its kernels run meanwhile)
                host = time.perf_counter() - t0
                torch.cuda.synchronize()
                self._sleep(1.5 * host * reps + 2e-4)
            for start, stop in events:
                start.record()
                fn()
                stop.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(stop) * 1e-3 for start, stop in events]
        else:
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times


def time_case(case: Case, shape: AttentionShape, backend: str, device, dtype, clock: _Clock, reps: int, warmup: int,
              generator=None) -> float:
    """Median seconds of one forward+backward of this rank's attention (compute only, no communication)."""
    import torch

    from ringpack.attention.kernels import accum_dtype
    from ringpack.attention.ring import ContextParallelAttention

    schedule = _schedule(case).to(device)
    t = schedule.num_tokens
    kw = dict(device=device, dtype=dtype, generator=generator)
    q = torch.randn(t, shape.heads, shape.head_dim, **kw).requires_grad_()
    k = torch.randn(t, shape.kv_heads, shape.head_dim, **kw).requires_grad_()
    v = torch.randn(t, shape.kv_heads, shape.head_dim, **kw).requires_grad_()
    dout = torch.randn(t, shape.heads, shape.head_dim, **kw)
    buffers = [torch.randn(2, schedule.buffer_tokens[schedule.source(step)], shape.kv_heads, shape.head_dim, **kw)
               for step in schedule.steps]
    own = schedule.buffer_tokens[schedule.cp_rank]
    home = torch.zeros(2, own, shape.kv_heads, shape.head_dim, device=device, dtype=accum_dtype(dtype)) if own else None
    transport = _ComputeOnlyTransport(buffers, home)
    scale = shape.head_dim ** -0.5

    def step() -> None:
        q.grad = k.grad = v.grad = None
        out = ContextParallelAttention.apply(q, k, v, schedule, lambda _: transport, scale, backend)
        out.backward(dout)

    first = clock.measure(step, warmup=warmup, reps=1)[0]
    more = (reps if first < 0.05 else min(reps, 3)) - 1  # long shards: 3 repetitions are plenty
    times = [first] + (clock.measure(step, warmup=0, reps=more) if more > 0 else [])
    return float(np.median(times))


def time_linear(model: ModelShape, tokens: int, device, dtype, clock: _Clock, reps: int, warmup: int) -> dict[str, float]:
    """Seconds per token of one decoder layer's GEMMs and of the output head, forward+backward.

    Each weight ``W [in, out]`` costs ``Y = X @ W``, ``dX = dY @ W^T`` and ``dW = X^T @ dY``.
    """
    import torch

    h, hd = model.hidden, model.head_dim
    layer = ((h, (model.heads + 2 * model.kv_heads) * hd), (model.heads * hd, h), (h, 2 * model.ffn), (model.ffn, h))
    head = ((h, model.vocab),) if model.vocab else ()

    def gemms(shapes) -> tuple[float, float]:
        if not shapes:
            return 0.0, 0.0
        mats = [(torch.randn(tokens, i, device=device, dtype=dtype), torch.randn(i, o, device=device, dtype=dtype),
                 torch.randn(tokens, o, device=device, dtype=dtype)) for i, o in shapes]

        def step() -> None:
            for x, w, dy in mats:
                torch.mm(x, w)
                torch.mm(dy, w.t())
                torch.mm(x.t(), dy)

        seconds = float(np.median(clock.measure(step, warmup, reps)))
        flops = sum(6.0 * tokens * i * o for i, o in shapes)
        return seconds / tokens, flops / seconds

    layer_s, layer_flops = gemms(layer)
    head_s, _ = gemms(head)
    return dict(layer_token_s=layer_s, head_token_s=head_s, gemm_tflops=layer_flops / 1e12, tokens=tokens)


# ----------------------------------------------------------------------------------------------- fit


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares ``min ||a x - b||, x >= 0`` (Lawson-Hanson active set; small problems)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.abs(a).sum(axis=0).max(initial=0.0) * max(m, n)
    w = a.T @ (b - a @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or np.max(np.where(passive, -np.inf, w)) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if z[passive].min() > 0:
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
        w = a.T @ (b - a @ x)
    return x


def fit_nnls(features: np.ndarray, times: np.ndarray, relative: bool = True) -> np.ndarray:
    """Non-negative coefficients ``c`` with ``features @ c ~ times``; ``relative`` weights rows by ``1/times``.

    Columns are scaled to unit norm first (pairs are ~1e9, the constant is 1), then unscaled.
    """
    a = np.asarray(features, dtype=np.float64)
    b = np.asarray(times, dtype=np.float64)
    if relative:
        if (b <= 0).any():
            raise ValueError("relative fit needs positive times")
        a, b = a / b[:, None], np.ones_like(b)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    return nnls(a / norms, b) / norms


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def quality(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
    """Pearson r, largest and mean relative error of predictions against measurements."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    rel = np.abs(p - m) / m
    return dict(n=int(m.size), r=pearson(m, p), max_rel_err=float(rel.max(initial=0.0)), mean_rel_err=float(rel.mean()) if m.size else 0.0)


def imbalance(cases: Sequence[tuple[Case, float]], measured: np.ndarray, predicted: np.ndarray) -> dict[str, float]:
    """Per micro-batch slowest-rank ratio (max / mean over its ranks), measured against predicted.

    What the planner acts on: ``imbalance_err`` is the largest ``|predicted - measured|`` of that
    ratio, ``slowest_rank_hit`` the fraction of micro-batches whose slowest rank is predicted right.
    """
    groups: dict[int, list[int]] = {}
    for i, (case, _) in enumerate(cases):
        groups.setdefault(id(case.microbatch), []).append(i)
    errs, hits = [], []
    for rows in groups.values():
        if len(rows) < 2:
            continue
        mm, pp = measured[rows], predicted[rows]
        errs.append(abs(pp.max() / pp.mean() - mm.max() / mm.mean()))
        hits.append(int(np.argmax(mm)) == int(np.argmax(pp)) or abs(mm.max() - np.sort(mm)[-2]) <= 0.01 * mm.max())
    return dict(microbatches=len(errs), imbalance_err=float(max(errs, default=0.0)),
                slowest_rank_hit=float(np.mean(hits)) if hits else float("nan"))


# ------------------------------------------------------------------------------------------- driver


@dataclass
class Calibration:
    """Everything one calibration measured and fitted; :meth:`to_dict` is the JSON report.

    ``per_layer``, ``train`` and ``held_out`` belong to the *profile model* (what the planner
    loads, plus the per-micro-batch constants ``overhead_s`` and ``ring_overhead_s``);
    ``kernel_model`` is the schedule-level diagnostic. ``microbatches`` holds the geometry of
    every timed micro-batch (rows point into it), so a report can be refitted without a GPU.
    """

    profile: CostModel
    meta: dict[str, Any]
    per_layer: dict[str, float]  # fitted attention coefficients of one layer (seconds)
    linear: dict[str, float]
    train: dict[str, float]
    held_out: dict[str, float]
    kernel_model: dict[str, Any]
    baseline: dict[str, Any]
    microbatches: list[dict[str, Any]] = field(default_factory=list)
    grid_rows: list[dict[str, Any]] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["profile"] = self.profile.to_dict()
        out["format"] = "ringpack-calibration"
        out["version"] = 2
        return out


def _geometry(case: Case) -> dict[str, Any]:
    return dict(lengths=[int(x) for x in case.lengths],
                shards=[[[int(p.sample), int(p.start), int(p.stop)] for p in shard.pieces] for shard in case.microbatch.shards])


def _cases_from_geometry(mbs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[Case]:
    built = {}
    out = []
    for row in rows:
        k = int(row["microbatch"])
        if k not in built:
            g = mbs[k]
            lengths = tuple(int(x) for x in g["lengths"])
            built[k] = (microbatch_from_shards(list(range(len(lengths))), [[Piece(*p) for p in shard] for shard in g["shards"]], lengths), lengths)
        mb, lengths = built[k]
        out.append(Case(row["family"], row["label"], mb, int(row["rank"]), lengths))
    return out


def _predict(feats: Sequence[dict[str, float]], names: Sequence[str], coef: np.ndarray) -> np.ndarray:
    return _matrix(feats, names) @ coef


def analyse(
    grid: Sequence[tuple[Case, float]],
    held: Sequence[tuple[Case, float]],
    *,
    hybrid: bool,
    layers: int,
    linear: dict[str, Any],
    name: str,
    meta: dict[str, Any],
    eval_strategy: Callable[[Case], str] = lambda c: c.family,
) -> Calibration:
    """Fit the profile and kernel models on the ``grid`` (case, seconds) pairs and evaluate both on ``held``.

    Pure numpy on measured times: :func:`calibrate` calls it after timing on the GPU, :func:`refit`
    on the rows of a stored report. The held-out rows are never fitted on.
    """
    if len(grid) < len(PROFILE_FEATURES) + 1:
        raise ValueError(f"calibration needs at least {len(PROFILE_FEATURES) + 1} grid rows, got {len(grid)}")
    times = np.array([t for _, t in grid], dtype=np.float64)
    m = np.array([t for _, t in held], dtype=np.float64)
    feats = {b: ([rank_features(c, hybrid, *b) for c, _ in grid], [rank_features(c, hybrid, *b) for c, _ in held]) for b in BLOCKS}
    fg, fe = feats[(128, 128)]

    # profile model: the planner's terms plus the per-micro-batch constants
    coef = fit_nnls(_matrix(fg, PROFILE_FEATURES), times)
    if coef[2] == 0 and coef[3] == 0:
        raise ValueError("calibration fit found neither a token nor a pair cost; the timings carry no signal")
    per_layer = dict(zip(("overhead_s", "ring_overhead_s", "token_s", "pair_s", "segment_s"), map(float, coef)))
    pred_g, pred = _predict(fg, PROFILE_FEATURES, coef), _predict(fe, PROFILE_FEATURES, coef)
    train = quality(times, pred_g)
    held_out = quality(m, pred)
    held_out.update(imbalance(held, m, pred))
    held_out["by_strategy"] = _by_group(held, m, pred, eval_strategy)
    profile = CostModel(
        token=layers * (per_layer["token_s"] + linear["layer_token_s"]) + linear["head_token_s"],
        pair=layers * per_layer["pair_s"],
        segment=layers * per_layer["segment_s"],
        unit="s",
        name=name,
    )

    # kernel model (diagnostic): the block size that fits the grid best
    scan = []
    for b in BLOCKS:
        ck = fit_nnls(_matrix(feats[b][0], KERNEL_FEATURES), times)
        scan.append(dict(block=list(b), coef=dict(zip(KERNEL_FEATURES, map(float, ck))),
                         train=quality(times, _predict(feats[b][0], KERNEL_FEATURES, ck))))
    best = min(scan, key=lambda x: (x["train"]["mean_rel_err"], x["train"]["max_rel_err"]))
    bk = tuple(best["block"])
    ck = np.array([best["coef"][n] for n in KERNEL_FEATURES])
    kpred_g, kpred = _predict(feats[bk][0], KERNEL_FEATURES, ck), _predict(feats[bk][1], KERNEL_FEATURES, ck)
    k_held = quality(m, kpred)
    k_held.update(imbalance(held, m, kpred))
    k_held["by_strategy"] = _by_group(held, m, kpred, eval_strategy)
    kernel_model = dict(best, held_out=k_held, scan=[dict(block=x["block"], train=x["train"]) for x in scan])

    # pairs-only baseline (the FLOP model's shape, best scalar): what calibration buys
    xp = _matrix(fg, ("pairs",))
    base_coef = fit_nnls(xp, times)
    baseline = dict(pair_s=float(base_coef[0]), train=quality(times, xp[:, 0] * base_coef[0]),
                    held_out=quality(m, _matrix(fe, ("pairs",))[:, 0] * base_coef[0]))

    mbs: list[dict[str, Any]] = []
    index: dict[int, int] = {}

    def row(case: Case, t: float, f: dict[str, float], p: float, kp: float) -> dict[str, Any]:
        k = index.get(id(case.microbatch))
        if k is None:
            k = index[id(case.microbatch)] = len(mbs)
            mbs.append(_geometry(case))
        return dict(family=case.family, label=case.label, rank=case.rank, microbatch=k, tokens=int(f["tokens"]),
                    pairs=int(f["pairs"]), pieces=int(f["pieces"]), calls=int(f["calls"]), kernel_segments=int(f["segments"]),
                    dense_calls=int(f["dense_calls"]), ring=int(f["ring"]), measured_s=float(t), predicted_s=float(p),
                    kernel_predicted_s=float(kp), rel_err=float((p - t) / t), kernel_rel_err=float((kp - t) / t))

    grid_rows = [row(c, t, f, p, kp) for (c, t), f, p, kp in zip(grid, fg, pred_g, kpred_g)]
    eval_rows = [dict(row(c, t, f, p, kp), strategy=eval_strategy(c)) for (c, t), f, p, kp in zip(held, fe, pred, kpred)]
    meta = dict(meta, layers=layers, note=(
        "per_layer and the rows are one attention layer's forward+backward, compute only. predicted_s is the profile "
        "model: token*tokens + pair*pairs + segment*pieces (what the planner's CostModel prices) plus overhead_s and, "
        "when the micro-batch splits a sample, ring_overhead_s; both constants are equal for every rank of a "
        "micro-batch, so they never change which rank is slowest, and the profile leaves them out. The profile is "
        "layers x per_layer (+ linear layers per token). kernel_predicted_s is the kernel model (a diagnostic)."))
    return Calibration(profile, meta, per_layer, linear, train, held_out, kernel_model, baseline, mbs, grid_rows, eval_rows)


def _by_group(held: Sequence[tuple[Case, float]], m: np.ndarray, p: np.ndarray, key: Callable[[Case], str]) -> dict[str, Any]:
    groups: dict[str, list[int]] = {}
    for i, (case, _) in enumerate(held):
        groups.setdefault(key(case), []).append(i)
    return {g: quality(m[rows], p[rows]) for g, rows in groups.items()}


def calibrate(
    shape: AttentionShape,
    model: ModelShape | None = None,
    *,
    layers: int = 1,
    mode: str = "linear",
    backend: str = "auto",
    device: str = "cuda",
    dtype=None,
    grid: str = "full",
    reps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    name: str = "calibrated",
    timer: str = "gpu",
    log: Callable[[str], None] = print,
) -> Calibration:
    """Time the grid, fit the per-layer attention model, time the linear layers, evaluate on held-out plans.

    ``mode="linear"`` adds the timed per-token cost of ``model``'s linear layers to the profile's
    token term; ``mode="attention"`` makes an attention-only profile. Returns a :class:`Calibration`
    whose ``profile`` covers ``layers`` layers' forward+backward. ``timer``: ``"gpu"`` (default)
    queues each shard's repetitions behind a GPU sleep so the host's launch time is hidden and
    the GPU's execution time is measured (what a training step that keeps the GPU busy sees);
    ``"wall"`` times from the first launch, host overhead included (the first reports' timer).
    """
    import torch

    from ringpack.attention.kernels import HYBRID_BACKENDS, resolve_backend

    if mode not in ("linear", "attention"):
        raise ValueError(f"mode must be 'linear' or 'attention', got {mode!r}")
    if mode == "linear" and model is None:
        raise ValueError("mode 'linear' needs a model shape for the linear layers' GEMMs")
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = resolve_backend(backend, torch.empty(1, 1, 1, device=device, dtype=dtype))
    clock = _Clock(device, queued=timer == "gpu")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(seed)

    def measure(cases: list[Case], what: str) -> list[tuple[Case, float]]:
        out = []
        t0 = time.perf_counter()
        for case in cases:
            out.append((case, time_case(case, shape, backend, device, dtype, clock, reps, warmup, gen)))
        log(f"  timed {len(cases)} {what} rank shards in {time.perf_counter() - t0:.1f} s")
        return out

    # warm the GPU clocks and the kernels' first launches on a mid-size case
    cases = grid_cases(grid, seed)
    if clock.cuda:
        warm = max(cases, key=lambda c: planner_features(c)[1] if planner_features(c)[1] <= 8192 else 0)
        time_case(warm, shape, backend, device, dtype, clock, reps=3, warmup=2, generator=gen)
    log(f"calibrating {backend} attention, {shape.heads} heads / {shape.kv_heads} kv / d={shape.head_dim}, "
        f"{dtype}, on {_device_name(device)} (grid {grid}, {len(cases)} shards, timer {clock.kind})")
    grid_timed = measure(cases, "grid")
    hybrid = backend in HYBRID_BACKENDS
    # the profile cuts the held-out micro-batches' balanced splits, so fit it first (same fit as analyse)
    times = np.array([t for _, t in grid_timed])
    coef = fit_nnls(_matrix([rank_features(c, hybrid) for c, _ in grid_timed], PROFILE_FEATURES), times)

    linear = dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)
    if mode == "linear":
        gemm_tokens = 8192 if device.type == "cuda" else 16
        linear = time_linear(model, gemm_tokens, device, dtype, clock, reps, warmup)
        log(f"  linear layers: {linear['layer_token_s'] * 1e9:.2f} ns/token/layer, head {linear['head_token_s'] * 1e9:.2f} "
            f"ns/token ({linear['gemm_tflops']:.0f} TFLOP/s)")
    cut_with = CostModel(token=layers * (coef[2] + linear["layer_token_s"]) + linear["head_token_s"],
                         pair=layers * coef[3], segment=layers * coef[4], unit="s", name=name)
    held = measure(eval_cases(grid, cut_with), "held-out")
    meta = dict(
        device=_device_name(device), backend=backend, dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
        grid=grid, reps=reps, warmup=warmup, seed=seed, mode=mode, timer=clock.kind,
        shape=dataclasses.asdict(shape), model=None if model is None else dataclasses.asdict(model),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), wall_s=time.perf_counter() - started,
    )
    return analyse(grid_timed, held, hybrid=hybrid, layers=layers, linear=linear, name=name, meta=meta)


def refit(report: dict[str, Any], log: Callable[[str], None] = print) -> Calibration:
    """Refit a stored calibration report from its measured rows, without a GPU.

    Reports from this version carry the geometry of every micro-batch (``microbatches``). Older
    reports (``tile_model`` instead of ``kernel_model``) do not: their grid and held-out shards are
    rebuilt from ``meta`` (grid, seed; the held-out balanced splits with the report's profile,
    which cut them) and matched to the rows by label, tokens, pairs and pieces; a row without a
    match (the planner changed since) is dropped and listed in ``meta["refit"]["dropped"]``.
    """
    from ringpack.attention.kernels import HYBRID_BACKENDS

    meta = dict(report["meta"])
    rows_g, rows_e = report["grid_rows"], report["eval_rows"]
    dropped: list[str] = []
    if report.get("microbatches"):
        cg = _cases_from_geometry(report["microbatches"], rows_g)
        ce = _cases_from_geometry(report["microbatches"], rows_e)
        grid = [(c, float(r["measured_s"])) for c, r in zip(cg, rows_g)]
        held = [(c, float(r["measured_s"])) for c, r in zip(ce, rows_e)]
    else:
        grid = _match(rows_g, grid_cases(meta["grid"], int(meta.get("seed", 0))), dropped)
        held = _match(rows_e, eval_cases(meta["grid"], CostModel.from_dict(report["profile"])), dropped)
        if dropped:
            log(f"refit: {len(dropped)} stored rows have no matching shard in this version's grid and were dropped: "
                + ", ".join(dropped))
    meta["refit"] = dict(source_date=meta.get("date"), date=time.strftime("%Y-%m-%d %H:%M:%S"), dropped=dropped,
                         source_format=report.get("version", 1))
    meta.setdefault("timer", "wall")  # reports before version 2 were timed from the first launch
    layers = int(meta.get("layers", 1))
    linear = report.get("linear") or dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)
    name = report["profile"]["name"]
    return analyse(grid, held, hybrid=meta.get("backend") in HYBRID_BACKENDS, layers=layers, linear=linear, name=name, meta=meta)


def _match(rows: Sequence[dict[str, Any]], cases: Sequence[Case], dropped: list[str]) -> list[tuple[Case, float]]:
    """Pair stored rows with rebuilt shards: same micro-batch label, tokens, pairs and pieces (ranks may be permuted)."""
    pool: dict[tuple, list[Case]] = {}
    for c in cases:
        f = planner_features(c)
        pool.setdefault((c.label.rsplit(" r", 1)[0], int(f[1]), int(f[2]), int(f[3])), []).append(c)
    out = []
    for r in rows:
        hit = pool.get((r["label"].rsplit(" r", 1)[0], int(r["tokens"]), int(r["pairs"]), int(r["pieces"])))
        if hit:
            out.append((hit.pop(0), float(r["measured_s"])))
        else:
            dropped.append(f"{r.get('strategy', r['family'])} {r['label']}")
    return out


def _device_name(device) -> str:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


# ----------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ringpack calibrate``."""
    p.add_argument("--out", default="ringpack-profile.json", help="profile JSON to write (default ringpack-profile.json)")
    p.add_argument("--report", help="calibration report JSON (default: the profile's name with .report.json)")
    p.add_argument("--model", default="llama3-8b", help=f"model preset for layers and linear layers ({', '.join(PRESETS)}; default llama3-8b)")
    p.add_argument("--heads", type=int, help="query heads (default: the preset's)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: the preset's)")
    p.add_argument("--head-dim", type=int, help="head dim (default: the preset's)")
    p.add_argument("--layers", type=int, help="layers the profile covers (default: the preset's)")
    p.add_argument("--mode", default="linear", choices=["linear", "attention"],
                   help="linear: also time the linear layers' GEMMs per token (default); attention: attention-only profile")
    p.add_argument("--backend", default="auto", help="attention kernel backend timed: auto (what training picks), or one of ringpack.attention.BACKENDS")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (default); cpu only for a dry run with --backend reference")
    p.add_argument("--grid", choices=GRIDS, help="shape grid (default full; quick with --quick; tiny on cpu)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a third of the time)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per shard, median taken (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per shard first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timer", default="gpu", choices=TIMERS,
                   help="gpu: each shard's GPU execution, host launch time hidden (default); wall: from the first launch, host overhead included")
    p.add_argument("--refit", metavar="REPORT",
                   help="no GPU: refit the models on the measurements of a stored calibration report and write a new profile and report")
    p.add_argument("--quiet", action="store_true", help="only the summary")


def run(args: argparse.Namespace) -> int:
    """``ringpack calibrate``: exit 0 with the profile written, 2 when no usable device."""
    import torch

    if getattr(args, "refit", None):
        return _run_refit(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("ringpack calibrate: error: calibration times GPU kernels and needs a CUDA device, and none is visible. "
              "Run it on the training GPU (or `--device cpu --backend reference` for a tiny dry run).", file=sys.stderr)
        return 2
    if args.device == "cpu" and args.backend not in ("reference", "reference_hybrid", "auto"):
        print(f"ringpack calibrate: error: --device cpu runs only --backend reference (a dry run), not {args.backend!r}",
              file=sys.stderr)
        return 2
    if args.model not in PRESETS:
        raise ValueError(f"--model {args.model!r} is not a preset ({', '.join(PRESETS)})")
    preset = PRESETS[args.model]
    shape = AttentionShape(args.heads or preset.heads, args.kv_heads or preset.kv_heads, args.head_dim or preset.head_dim)
    layers = args.layers or preset.layers
    same = (shape.heads, shape.kv_heads, shape.head_dim) == (preset.heads, preset.kv_heads, preset.head_dim)
    name = preset.name if same else f"{preset.name}-h{shape.heads}kv{shape.kv_heads}d{shape.head_dim}"
    grid = args.grid or ("tiny" if args.device == "cpu" else "quick" if args.quick else "full")
    log = (lambda _: None) if args.quiet else (lambda s: print(s, flush=True))
    result = calibrate(shape, preset, layers=layers, mode=args.mode, backend=args.backend, device=args.device,
                       grid=grid, reps=args.reps, warmup=args.warmup, seed=args.seed, name=name, timer=args.timer, log=log)
    _write(result, args)
    return 0


def _run_refit(args: argparse.Namespace) -> int:
    """``ringpack calibrate --refit REPORT``: the fit and the report again from stored measurements (CPU only)."""
    source = Path(args.refit)
    report = json.loads(source.read_text())
    if report.get("format") != "ringpack-calibration":
        raise ValueError(f"{source} is not a ringpack calibration report")
    result = refit(report, log=(lambda _: None) if args.quiet else print)
    out = Path(args.out)
    written = {out.resolve(), (Path(args.report) if args.report else out.with_name(out.stem + ".report.json")).resolve()}
    if source.resolve() in written:
        raise ValueError("--refit: --out/--report must not overwrite the measured report")
    _write(result, args)
    return 0


def _write(result: Calibration, args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.profile.save(out)
    report = Path(args.report) if args.report else out.with_name(out.stem + ".report.json")
    report.write_text(json.dumps(result.to_dict(), indent=1, default=_json_default) + "\n")
    print(format_summary(result, verbose=not args.quiet))
    print(f"wrote {out} (load with CostModel.load / `ringpack plan --cost-profile {out}`) and {report}")


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _pair_tflops(result: Calibration) -> float:
    pair_s = result.per_layer["pair_s"]
    return AttentionShape(**result.meta["shape"]).flops_per_pair() / pair_s / 1e12 if pair_s else float("nan")


def _fit_line(label: str, q: dict[str, Any]) -> str:
    line = f"{label}r={q['r']:.4f}  max error {_pct(q['max_rel_err'])}  mean {_pct(q['mean_rel_err'])}"
    if "slowest_rank_hit" in q:
        line += (f"  | slowest rank right in {_pct(q['slowest_rank_hit']).strip()} of {q['microbatches']} micro-batches, "
                 f"max/mean off by <= {q['imbalance_err']:.3f}")
    return line


def format_summary(result: Calibration, verbose: bool = True) -> str:
    """The held-out table (one row per CP rank) and the fit-quality lines."""
    lines = []
    if verbose:
        lines.append("held-out rank shards (cp=2), one attention layer forward+backward, compute only "
                     f"(timer {result.meta.get('timer', 'wall')}); predicted: profile model, kernel model:")
        lines.append(f"{'strategy':10s} {'micro-batch':22s} {'rank':>4s} {'tokens':>7s} {'pieces':>6s} {'pairs':>13s} "
                     f"{'measured':>11s} {'profile':>11s} {'error':>7s} {'kernel':>11s} {'error':>7s}")
        for r in result.eval_rows:
            mb = r["label"].rsplit(" r", 1)[0]
            lines.append(f"{r['strategy']:10s} {mb:22s} {r['rank']:>4d} {r['tokens']:>7d} {r['pieces']:>6d} {r['pairs']:>13,d} "
                         f"{r['measured_s'] * 1e3:>8.3f} ms {r['predicted_s'] * 1e3:>8.3f} ms {100 * r['rel_err']:>+6.1f}% "
                         f"{r['kernel_predicted_s'] * 1e3:>8.3f} ms {100 * r['kernel_rel_err']:>+6.1f}%")
    pl, t, h = result.per_layer, result.train, result.held_out
    km, base = result.kernel_model, result.baseline
    kc = km["coef"]
    lines += [
        f"profile model, per layer: {pl['token_s'] * 1e9:.3f} ns/token + {pl['pair_s'] * 1e12:.4f} ps/pair + "
        f"{pl['segment_s'] * 1e6:.2f} us/piece; pairs at {_pair_tflops(result):.0f} TFLOP/s",
        f"  + per micro-batch constants, the same on every rank (not in the profile: they never change which rank is "
        f"slowest): {pl['overhead_s'] * 1e6:.1f} us, + {pl['ring_overhead_s'] * 1e6:.1f} us when a sample is split (ring path)",
        _fit_line(f"  fit      (grid, n={t['n']:3d}):  ", t),
        _fit_line(f"  held-out (n={h['n']:3d}):        ", h),
        "  held-out by strategy: " + ", ".join(f"{g} max {_pct(q['max_rel_err']).strip()} mean {_pct(q['mean_rel_err']).strip()}"
                                              for g, q in h.get("by_strategy", {}).items()),
        f"kernel model {km['block'][0]}x{km['block'][1]} tiles (diagnostic, per schedule; not expressible per piece): "
        f"{kc['calls'] * 1e6:.1f} us/call, {kc['tiles'] * 1e6:.3f} us/tile, {kc['grid_q'] * 1e9:.0f}+{kc['grid_k'] * 1e9:.0f} ns "
        f"per launched q/k tile-row, {kc['dense_calls'] * 1e6:.1f} us/dense call, {kc['dense_tiles'] * 1e6:.3f} us/dense tile",
        _fit_line(f"  fit      (grid, n={km['train']['n']:3d}):  ", km["train"]),
        _fit_line(f"  held-out (n={km['held_out']['n']:3d}):        ", km["held_out"]),
        f"pairs-only baseline held-out:   r={base['held_out']['r']:.4f}  max error {_pct(base['held_out']['max_rel_err'])}  "
        f"mean {_pct(base['held_out']['mean_rel_err'])}",
        f"profile ({result.profile.name}, {result.meta['layers']} layers, mode {result.meta.get('mode')}): "
        f"token={result.profile.token:.4g} s, pair={result.profile.pair:.4g} s, segment={result.profile.segment:.4g} s; "
        f"wall {result.meta.get('wall_s', float('nan')):.1f} s",
    ]
    dropped = result.meta.get("refit", {}).get("dropped")
    if dropped:
        lines.append(f"refit: {len(dropped)} stored rows dropped (no matching shard in this version's grid)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ringpack.analysis.calibrate`` (same options as ``ringpack calibrate``)."""
    parser = argparse.ArgumentParser(prog="ringpack calibrate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"ringpack calibrate: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
