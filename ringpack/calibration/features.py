"""What the calibration's cost models see of a rank shard: planner terms and kernel launches (docs/cost-model.md).

The profile model uses the planner's own terms (tokens, causal pairs, pieces); the kernel model
uses what the compiled schedule launches (varlen calls, tiles, the launch grid, remote rows,
dense calls: :func:`rank_features` lists them). Both are computed on the CPU from a
:class:`~ringpack.calibration.cases.Case`, so a stored report can be refitted without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack.attention.schedule import compile_schedule
from ringpack.calibration.cases import Case
from ringpack.cost import piece_pairs

# the profile model: what the planner's CostModel prices (tokens, pairs, pieces) plus two constants
# that are the same for every rank of a micro-batch (see :mod:`ringpack.calibration.run`)
PROFILE_FEATURES = ("overhead", "ring", "tokens", "pairs", "pieces")
# the kernel model: what the schedule's kernel launches do (a diagnostic; not expressible per piece)
KERNEL_FEATURES = (
    "overhead",
    "ring",
    "calls",
    "tokens",
    "tiles",
    "grid_q",
    "grid_k",
    "remote_rows",
    "buffer_tokens",
    "dense_calls",
    "dense_tiles",
)
BLOCKS = ((64, 64), (64, 128), (128, 64), (128, 128))
# The engine's schedule settings (compile_schedule's defaults, repeated here so this module does not
# import torch; a test checks they agree). LOCAL_REST: a split local call's short segments run as one
# varlen call per run between long segments ("runs"), not as one gathered call ("single").
LOCAL_REST = "runs"
DENSE_BUCKETS = 32
DENSE_BATCHES = True
DENSE_THRESHOLD = 2048


@dataclass(frozen=True)
class EngineSettings:
    """How the timed engine split a rank's kernel calls: what the kernel features must count.

    Attributes:
        local_rest: ``"runs"`` (a split local call's short segments as one varlen call per run
            between long segments) or ``"single"`` (one varlen call over all of the call's segments).
        dense_buckets, dense_batches, dense_threshold: ``compile_schedule``'s options of the same
            names (``dense_buckets=None``: exact dense shapes).
    """

    local_rest: str = LOCAL_REST
    dense_buckets: int | None = DENSE_BUCKETS
    dense_batches: bool = DENSE_BATCHES
    dense_threshold: int = DENSE_THRESHOLD

    @classmethod
    def of_report(cls, meta: dict[str, Any]) -> EngineSettings:
        """The settings a calibration report's ``meta`` records.

        A report that does not record a setting was timed by an engine without it: one gathered
        local call, exact dense shapes, no dense batching, a dense threshold of 4096.
        """
        return cls(
            local_rest=meta.get("local_rest", "single"),
            dense_buckets=meta.get("dense_buckets"),
            dense_batches=meta.get("dense_batches", False),
            dense_threshold=meta.get("dense_threshold", 4096),
        )


def planner_features(case: Case) -> np.ndarray:
    """``[1, tokens, exact causal pairs, pieces]`` of the rank shard (float64 ``[4]``): what the cost model sees."""
    starts = np.array([p.start for p in case.pieces], dtype=np.int64)
    stops = np.array([p.stop for p in case.pieces], dtype=np.int64)
    return np.array([1.0, (stops - starts).sum(), piece_pairs(starts, stops).sum(), len(starts)], dtype=np.float64)


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


_SCHEDULES: dict[tuple[int, EngineSettings], tuple[Case, Any]] = {}


def compiled_schedule(case: Case, settings: EngineSettings = EngineSettings()) -> Any:
    """The case's compiled schedule (CPU, torch), compiled once per case object and settings."""
    key = (id(case), settings)
    hit = _SCHEDULES.get(key)
    if hit is None or hit[0] is not case:
        if len(_SCHEDULES) > 4096:
            _SCHEDULES.clear()
        schedule = compile_schedule(
            case.microbatch,
            case.rank,
            dense_buckets=settings.dense_buckets,
            dense_batches=settings.dense_batches,
            dense_threshold=settings.dense_threshold,
        )
        hit = _SCHEDULES[key] = (case, schedule)
    return hit[1]


def schedule_calls(schedule) -> list:
    """The schedule's kernel calls in launch order: the local call (if any), then every remote step's."""
    calls = [] if schedule.local is None else [schedule.local]
    return calls + [c for step in schedule.steps for c in step.calls]


def rank_features(
    case: Case,
    hybrid: bool = False,
    block_q: int = 128,
    block_k: int = 128,
    settings: EngineSettings = EngineSettings(),
) -> dict[str, float]:
    """Every feature of a rank shard the profile and kernel models use.

    Args:
        case: the rank shard.
        hybrid: the backend runs long segments on a dense kernel (cuDNN).
        block_q, block_k: the flash kernel's tile shape.
        settings: how the engine whose times are fitted split its kernel calls.

    Returns:
        :data:`PROFILE_FEATURES` and :data:`KERNEL_FEATURES` by name (floats), plus ``segments``
        and ``dense_pairs`` (diagnostics). The kernel terms:

        * ``ring``: 1 when the micro-batch has remote steps (some sample is split). Every rank of the
          micro-batch then runs the ring path (K/V packing, float32 accumulators, merges), so it is a
          constant of the micro-batch, like ``overhead``.
        * ``calls``: varlen kernel calls (each a forward and a backward launch, plus prologues).
        * ``tiles``: ``block_q x block_k`` tiles the varlen calls compute (partial and masked tiles whole).
        * ``grid_q`` / ``grid_k``: the launch grid of the varlen calls. Flash-attention's varlen kernels
          launch ``ceil(max_seqlen / block)`` tiles for *every* segment of a call (forward and the
          backward's pre/post-processing over queries, the backward's main kernel over keys); tiles past a
          segment's end exit at once but still cost a block launch, so a call of many short segments and
          one long one pays ``segments x longest`` of them.
        * ``remote_rows``: query rows of the remote steps (gathered, merged by log-sum-exp, their dQ
          scattered back); ``buffer_tokens``: remote K/V rows a rank reads and accumulates dK/dV for.
        * ``dense_calls`` / ``dense_tiles``: with a hybrid backend, the long segments the schedule marked
          run one by one on the dense kernel, a launch each at their own tile rate, counted at their kernel
          shape (``q_run x k_run``, padding included, times ``batch``); a dense block's keys past ``k_run``
          count as a varlen call over the padded rows.
    """
    schedule = compiled_schedule(case, settings)
    f = planner_features(case)
    out = dict(
        overhead=1.0,
        ring=float(bool(schedule.steps)),
        tokens=float(f[1]),
        pairs=float(f[2]),
        pieces=float(f[3]),
        calls=0.0,
        segments=0.0,
        tiles=0.0,
        grid_q=0.0,
        grid_k=0.0,
        remote_rows=0.0,
        buffer_tokens=float(sum(schedule.buffer_tokens[schedule.source(step)] for step in schedule.steps)),
        dense_calls=0.0,
        dense_tiles=0.0,
        dense_pairs=0.0,
    )
    local = [] if schedule.local is None else [(False, schedule.local)]
    for remote, call in local + [(True, c) for step in schedule.steps for c in step.calls]:
        if remote:
            out["remote_rows"] += float(call.cu_seqlens_q[-1])
        if not (hybrid and call.dense):
            _add_varlen_call(out, call.cu_seqlens_q, call.cu_seqlens_k, call.causal, block_q, block_k)
        elif settings.local_rest == "single" and call.causal and call.rest:
            _add_dense_parts(out, call, block_q, block_k)
            _add_single_rest(out, call, block_q, block_k)
        else:
            _add_dense_parts(out, call, block_q, block_k)
            for part in call.rest:
                _add_varlen_call(out, part.cu_seqlens_q, part.cu_seqlens_k, part.causal, block_q, block_k)
            for d in call.dense:
                if d.k_run < d.k_len:  # the keys past the dense block: a varlen call beside it
                    _add_varlen_call(out, [0, d.q_run], [0, d.k_len - d.k_run], False, block_q, block_k)
    return out


def _add_varlen_call(out: dict[str, float], cu_q: Any, cu_k: Any, causal: bool, block_q: int, block_k: int) -> None:
    """Count one varlen kernel call over segments ``cu_q`` x ``cu_k`` (cumulative lengths) into ``out``."""
    lq = np.diff(np.asarray(cu_q, dtype=np.int64))
    lk = np.diff(np.asarray(cu_k, dtype=np.int64))
    work = (lq > 0) & (lk > 0)
    out["calls"] += 1
    out["segments"] += float(work.sum())
    out["tiles"] += float(segment_tiles(lq[work], lk[work], causal, block_q, block_k).sum())
    out["grid_q"] += float(lq.size * -(-max(int(lq.max()), 2) // block_q))
    out["grid_k"] += float(lk.size * -(-int(lk.max()) // block_k))


def _add_dense_parts(out: dict[str, float], call: Any, block_q: int, block_k: int) -> None:
    """Count a call's dense parts at the shape the dense kernel computes (padded, cut, batched)."""
    for d in call.dense:
        out["dense_calls"] += 1
        out["dense_tiles"] += d.batch * float(segment_tiles([d.q_run], [d.k_run], call.causal, block_q, block_k)[0])
        out["dense_pairs"] += d.batch * float(segment_pairs([d.q_run], [d.k_run], call.causal)[0])


def _add_single_rest(out: dict[str, float], call: Any, block_q: int, block_k: int) -> None:
    """A split local call's short segments as one varlen call (``local_rest="single"``): every
    segment of the call in its launch grid, the long ones without queries."""
    segments = call.cu_seqlens_q.numel() - 1
    for part in call.rest:
        lq = np.diff(part.cu_seqlens_q.cpu().numpy().astype(np.int64))
        out["segments"] += float(lq.size)
        out["tiles"] += float(segment_tiles(lq, lq, True, block_q, block_k).sum())
    out["calls"] += 1
    out["grid_q"] += float(segments * -(-max(max(p.max_seqlen_q for p in call.rest), 2) // block_q))
    out["grid_k"] += float(segments * -(-call.max_seqlen_k // block_k))


def feature_matrix(feats: Sequence[dict[str, float]], names: Sequence[str]) -> np.ndarray:
    """Rows of ``feats`` as a ``len(feats) x len(names)`` matrix of the named features (the fit's design matrix)."""
    return np.array([[f[name] for name in names] for f in feats], dtype=np.float64).reshape(len(feats), len(names))
