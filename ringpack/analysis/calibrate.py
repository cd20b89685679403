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
   events, median of a few repetitions. CP ranks are timed one at a time on one GPU: a transport
   without communication serves the remote K/V buffers from memory, so a rank's time is its
   compute (kernels, gathers, log-sum-exp merges); communication is the comm model's business.
   With ``mode="linear"`` (the default) the model's linear layers are timed too: the GEMMs of one
   decoder layer (q/k/v, o, gate/up, down) and the output head, forward (``x @ W``) and backward
   (``dY @ W^T``, ``X^T @ dY``), per token. Norms, activations and RoPE are not timed (they are
   memory-bound and small next to the GEMMs).
3. **Fit.** Non-negative least squares (Lawson-Hanson, numpy only) of the per-layer attention time
   on ``[1, tokens, pairs, pieces]``, weighted by ``1 / measured`` so every shard counts by its
   *relative* error (the planner compares ranks by ratios). The constant is a per-rank launch
   overhead that does not change which rank is slowest; it is reported, not put in the profile.

   *Tile effects.* Flash kernels compute whole ``Bq x Bk`` tiles: a causal segment of ``L``
   tokens costs about ``L^2/2 + L*Bk/2`` pairs on its diagonal tiles, plus ``(Bq - L mod Bq) * L``
   for a partial last query tile (about ``Bq/2`` per token on average), plus ``O(Bq*Bk)`` per
   segment. These are per-token and per-segment terms, so a fit on ``[tokens, pairs, pieces]``
   absorbs them in the token and segment coefficients: no new cost-model field is needed. To
   check that folding is good enough, a second, kernel-level model is fitted as a diagnostic on
   ``[1, kernel calls, tokens, tile_pairs, kernel segments]`` where ``tile_pairs`` counts every
   tile a call touches as full (:func:`segment_tiles`); the block size is chosen from 64/128 by
   fit. Both models' held-out errors are reported; if the tile model were much better, the cost
   model would need a tile feature. A third diagnostic counts each piece's pairs with its length
   rounded up to a tile (16..128): the one-line change to ``cost.py`` that would capture most of
   the partial-tile waste, reported so the GPU numbers decide whether it is worth making.
4. **Evaluation.** Held-out micro-batches (heavy-tailed Pareto mixes, split by ``contiguous``,
   ``zigzag`` and ``balanced`` over 2 CP ranks, with lengths and seeds the grid never saw): every
   rank's measured time against the profile's prediction; Pearson correlation and largest
   relative error, as a table and in the JSON report.

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
    "run",
    "segment_pairs",
    "segment_tiles",
]

GRIDS = ("full", "quick", "tiny")
PLANNER_FEATURES = ("const", "tokens", "pairs", "pieces")
KERNEL_FEATURES = ("const", "calls", "tokens", "tile_pairs", "kernel_segments")
BLOCKS = ((64, 64), (64, 128), (128, 64), (128, 128))
ROUNDING_TILES = (16, 32, 64, 128)
EVAL_STRATEGIES = ("contiguous", "zigzag", "balanced")


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


def _kernel_matrix(feats: Sequence[dict[str, float]]) -> np.ndarray:
    return np.array([[1.0] + [f[name] for name in KERNEL_FEATURES[1:]] for f in feats], dtype=np.float64)


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
    """CUDA events on a GPU, ``perf_counter`` (after nothing to sync) on the CPU."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = torch.device(device).type == "cuda"
        self._torch = torch

    def measure(self, fn: Callable[[], None], warmup: int, reps: int) -> list[float]:
        torch = self._torch
        for _ in range(warmup):
            fn()
        times = []
        if self.cuda:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            torch.cuda.synchronize()
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
    """Everything one calibration measured and fitted; :meth:`to_dict` is the JSON report."""

    profile: CostModel
    meta: dict[str, Any]
    per_layer: dict[str, float]  # fitted attention coefficients of one layer (seconds)
    linear: dict[str, float]
    train: dict[str, float]
    held_out: dict[str, float]
    tile_model: dict[str, Any]
    baseline: dict[str, Any]
    grid_rows: list[dict[str, Any]] = field(default_factory=list)
    eval_rows: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["profile"] = self.profile.to_dict()
        out["format"] = "ringpack-calibration"
        return out


def _row(case: Case, measured: float, kfeat: dict[str, float]) -> dict[str, Any]:
    f = planner_features(case)
    return dict(family=case.family, label=case.label, rank=case.rank, tokens=int(f[1]), pairs=int(f[2]), pieces=int(f[3]),
                calls=int(kfeat["calls"]), kernel_segments=int(kfeat["kernel_segments"]), measured_s=measured)


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
    log: Callable[[str], None] = print,
) -> Calibration:
    """Time the grid, fit the per-layer attention model, time the linear layers, evaluate on held-out plans.

    ``mode="linear"`` adds the timed per-token cost of ``model``'s linear layers to the profile's
    token term; ``mode="attention"`` makes an attention-only profile. Returns a :class:`Calibration`
    whose ``profile`` covers ``layers`` layers' forward+backward.
    """
    import torch

    from ringpack.attention.kernels import resolve_backend

    if mode not in ("linear", "attention"):
        raise ValueError(f"mode must be 'linear' or 'attention', got {mode!r}")
    if mode == "linear" and model is None:
        raise ValueError("mode 'linear' needs a model shape for the linear layers' GEMMs")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = resolve_backend(backend, torch.empty(1, 1, 1, device=device, dtype=dtype))
    clock = _Clock(device)
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
        f"{dtype}, on {_device_name(device)} (grid {grid}, {len(cases)} shards)")
    grid_timed = measure(cases, "grid")
    kfeat = {(id(c)): kernel_features(c, 128, 128) for c, _ in grid_timed}
    times = np.array([t for _, t in grid_timed])
    x = np.stack([planner_features(c) for c, _ in grid_timed])
    coef = fit_nnls(x, times)
    if coef[1] == 0 and coef[2] == 0:
        raise ValueError("calibration fit found neither a token nor a pair cost; the timings carry no signal")
    per_layer = dict(zip(("overhead_s", "token_s", "pair_s", "segment_s"), map(float, coef)))
    train = quality(times, x @ coef)

    # tile model (diagnostic): choose the block size that fits the grid best
    scan = []
    for bq, bk in BLOCKS:
        feats = [kernel_features(c, bq, bk) for c, _ in grid_timed]
        xk = _kernel_matrix(feats)
        ck = fit_nnls(xk, times)
        scan.append(dict(block=[bq, bk], coef=dict(zip(KERNEL_FEATURES, map(float, ck))), train=quality(times, xk @ ck)))
    best_tile = min(scan, key=lambda s: (s["train"]["mean_rel_err"], s["train"]["max_rel_err"]))
    # pairs-only baseline (the FLOP model's shape, best scalar): what calibration buys
    base_coef = fit_nnls(x[:, 2:3], times)

    linear = dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)
    if mode == "linear":
        gemm_tokens = 8192 if device.type == "cuda" else 16
        linear = time_linear(model, gemm_tokens, device, dtype, clock, reps, warmup)
        log(f"  linear layers: {linear['layer_token_s'] * 1e9:.2f} ns/token/layer, head {linear['head_token_s'] * 1e9:.2f} "
            f"ns/token ({linear['gemm_tflops']:.0f} TFLOP/s)")
    profile = CostModel(
        token=layers * (per_layer["token_s"] + linear["layer_token_s"]) + linear["head_token_s"],
        pair=layers * per_layer["pair_s"],
        segment=layers * per_layer["segment_s"],
        unit="s",
        name=name,
    )

    # held-out evaluation
    held = measure(eval_cases(grid, profile), "held-out")
    m = np.array([t for _, t in held])
    xe = np.stack([planner_features(c) for c, _ in held])
    pred = xe @ coef
    held_out = quality(m, pred)
    held_out.update(imbalance(held, m, pred))
    bq, bk = best_tile["block"]
    xke = _kernel_matrix([kernel_features(c, bq, bk) for c, _ in held])
    ck = np.array([best_tile["coef"][n] for n in KERNEL_FEATURES])
    tile_model = dict(best_tile, held_out=quality(m, xke @ ck), scan=scan)
    baseline = dict(pair_s=float(base_coef[0]), train=quality(times, x[:, 2] * base_coef[0]),
                    held_out=quality(m, xe[:, 2] * base_coef[0]))
    rounded = []  # would rounding pieces up to a tile in the cost model's pair count pay off?
    for tile in ROUNDING_TILES:
        xr = np.stack([planner_features(c, tile) for c, _ in grid_timed])
        cr = fit_nnls(xr, times)
        xre = np.stack([planner_features(c, tile) for c, _ in held])
        rounded.append(dict(tile=tile, coef=dict(zip(PLANNER_FEATURES, map(float, cr))), train=quality(times, xr @ cr),
                            held_out=quality(m, xre @ cr)))
    tile_model["rounded_pieces"] = rounded

    grid_rows = [dict(_row(c, t, kfeat[id(c)]), predicted_s=float(p)) for (c, t), p in zip(grid_timed, x @ coef)]
    eval_rows = []
    for (c, t), p in zip(held, pred):
        eval_rows.append(dict(_row(c, t, kernel_features(c)), strategy=c.family, predicted_s=float(p), rel_err=float((p - t) / t)))
    meta = dict(
        device=_device_name(device), backend=backend, dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
        grid=grid, reps=reps, warmup=warmup, seed=seed, mode=mode, layers=layers,
        shape=dataclasses.asdict(shape), model=None if model is None else dataclasses.asdict(model),
        date=time.strftime("%Y-%m-%d %H:%M:%S"), wall_s=time.perf_counter() - started,
        note="per_layer and the rows are one attention layer's forward+backward, compute only; "
        "the profile is layers x per_layer (+ linear layers per token), without the per-rank overhead",
    )
    return Calibration(profile, meta, per_layer, linear, train, held_out, tile_model, baseline, grid_rows, eval_rows)


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
    p.add_argument("--quiet", action="store_true", help="only the summary")


def run(args: argparse.Namespace) -> int:
    """``ringpack calibrate``: exit 0 with the profile written, 2 when no usable device."""
    import torch

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
                       grid=grid, reps=args.reps, warmup=args.warmup, seed=args.seed, name=name, log=log)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.profile.save(out)
    report = Path(args.report) if args.report else out.with_name(out.stem + ".report.json")
    report.write_text(json.dumps(result.to_dict(), indent=1, default=_json_default) + "\n")
    print(format_summary(result, verbose=not args.quiet))
    print(f"wrote {out} (load with CostModel.load / `ringpack plan --cost-profile {out}`) and {report}")
    return 0


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _pair_tflops(result: Calibration) -> float:
    pair_s = result.per_layer["pair_s"]
    return AttentionShape(**result.meta["shape"]).flops_per_pair() / pair_s / 1e12 if pair_s else float("nan")


def format_summary(result: Calibration, verbose: bool = True) -> str:
    """The held-out table (one row per CP rank) and the fit-quality lines."""
    lines = []
    if verbose:
        lines.append("held-out rank shards (cp=2), one attention layer forward+backward, compute only:")
        lines.append(f"{'strategy':10s} {'micro-batch':22s} {'rank':>4s} {'tokens':>7s} {'pieces':>6s} {'pairs':>13s} "
                     f"{'measured':>11s} {'predicted':>11s} {'error':>7s}")
        for r in result.eval_rows:
            mb = r["label"].rsplit(" r", 1)[0]
            lines.append(f"{r['strategy']:10s} {mb:22s} {r['rank']:>4d} {r['tokens']:>7d} {r['pieces']:>6d} {r['pairs']:>13,d} "
                         f"{r['measured_s'] * 1e3:>8.3f} ms {r['predicted_s'] * 1e3:>8.3f} ms {100 * r['rel_err']:>+6.1f}%")
    pl, t, h = result.per_layer, result.train, result.held_out
    tm, base = result.tile_model, result.baseline
    lines += [
        f"per layer: {pl['token_s'] * 1e9:.3f} ns/token + {pl['pair_s'] * 1e12:.4f} ps/pair + {pl['segment_s'] * 1e6:.2f} us/piece "
        f"(+ {pl['overhead_s'] * 1e6:.1f} us per rank, not in the profile); pairs at {_pair_tflops(result):.0f} TFLOP/s",
        f"fit      (grid, n={t['n']:3d}):  r={t['r']:.4f}  max error {_pct(t['max_rel_err'])}  mean {_pct(t['mean_rel_err'])}",
        f"held-out (n={h['n']:3d}):        r={h['r']:.4f}  max error {_pct(h['max_rel_err'])}  mean {_pct(h['mean_rel_err'])}"
        f"  | per micro-batch max/mean off by <= {h['imbalance_err']:.3f}, slowest rank right in "
        f"{_pct(h['slowest_rank_hit']).strip()} (ties within 1% count)",
        f"  tile model {tm['block'][0]}x{tm['block'][1]} held-out: r={tm['held_out']['r']:.4f}  "
        f"max error {_pct(tm['held_out']['max_rel_err'])}  mean {_pct(tm['held_out']['mean_rel_err'])}",
        *(f"  pieces rounded up to {x['tile']:3d} (a cost.py option) held-out: r={x['held_out']['r']:.4f}  "
          f"max error {_pct(x['held_out']['max_rel_err'])}  mean {_pct(x['held_out']['mean_rel_err'])}"
          for x in tm.get("rounded_pieces", ())),
        f"  pairs-only baseline held-out:  r={base['held_out']['r']:.4f}  max error {_pct(base['held_out']['max_rel_err'])}  "
        f"mean {_pct(base['held_out']['mean_rel_err'])}",
        f"profile ({result.profile.name}, {result.meta['layers']} layers, mode {result.meta['mode']}): "
        f"token={result.profile.token:.4g} s, pair={result.profile.pair:.4g} s, segment={result.profile.segment:.4g} s; "
        f"wall {result.meta['wall_s']:.1f} s",
    ]
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
