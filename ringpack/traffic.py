"""Which K/V pieces cross CP ranks, and how many bytes: one implementation for the runtime, the planner,
benchmarks and reports (docs/planner.md, "CP split strategies").

A query at position ``q`` of a sample attends the keys ``0..q`` of that sample wherever they live,
so a piece ``[start, stop)`` of sample ``X`` held by CP rank ``r`` is **needed** by rank ``r' != r``
iff ``r'`` holds a piece of ``X`` with ``start' >= stop`` (:func:`needed_pieces`). The runtime sends
exactly the needed pieces, compacted into one buffer per rank; :func:`kv_traffic` and
:func:`plan_kv_traffic` count their bytes (:class:`KVTraffic`), forward pass only, with
:func:`kv_bytes_per_token` giving what one token's K and V weigh (``bytes_per_token=1`` counts tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ringpack.cost import ModelShape
    from ringpack.shard_plan import MicroBatch, Plan

__all__ = ["KVTraffic", "kv_bytes_per_token", "needed_pieces", "kv_traffic", "plan_kv_traffic"]


@dataclass(frozen=True)
class KVTraffic:
    """Bytes of K/V crossing the CP ranks of a micro-batch (``tokens * bytes_per_token``), forward pass only.

    Attributes:
        unique: tokens of pieces some other rank needs, each counted once (the compacted buffers).
        p2p: each needed piece counted once per rank that needs it (point-to-point sends).
        ring: what a ring relays: every rank's compacted buffer through all ``cp - 1`` other ranks,
            ``(cp - 1) * unique``. The backward sends K/V again plus dK/dV (about twice the forward).
    """

    unique: int
    p2p: int
    ring: int


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, layers: int | None = None) -> int:
    """Bytes of K and V of one token over ``layers`` layers (default: all of ``shape``'s) of one forward."""
    layers = shape.layers if layers is None else layers
    return 2 * shape.kv_heads * shape.head_dim * dtype_bytes * layers


def needed_pieces(
    group: np.ndarray, cp: np.ndarray, sample: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """For every piece, how many *other* CP ranks of its micro-batch need it (0: it stays local).

    Vectorised over any number of micro-batches. Every argument is an integer array of shape
    ``[n]``, one entry per piece: ``group`` its micro-batch (any integers), ``cp`` its CP rank,
    ``sample`` its sample (any integers), ``start``/``stop`` its tokens.

    Returns:
        int64 ``[n]``; ``needed > 0`` marks the pieces of the compacted send buffers.
    """
    group = np.asarray(group, dtype=np.int64)
    cp = np.asarray(cp, dtype=np.int64)
    sample = np.asarray(sample, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    stop = np.asarray(stop, dtype=np.int64)
    n = len(start)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    # dense id of (group, sample) and of (group, sample, rank)
    _, gx = np.unique(np.stack([group, sample]), axis=1, return_inverse=True)
    gx = gx.reshape(-1)
    keys = np.stack([gx, cp])
    uniq, gxr = np.unique(keys, axis=1, return_inverse=True)
    gxr = gxr.reshape(-1)
    # latest start of each (group, sample, rank)
    rank_max = np.full(uniq.shape[1], -1, dtype=np.int64)
    np.maximum.at(rank_max, gxr, start)
    owner_gx = uniq[0]
    # for each piece: count ranks r' of the same (group, sample) with rank_max >= stop, minus its own
    span = int(max(stop.max(), rank_max.max())) + 2
    composite = owner_gx * span + rank_max
    composite.sort()
    hi = np.searchsorted(composite, gx * span + span - 1, side="right")
    lo = np.searchsorted(composite, gx * span + stop, side="left")
    count = hi - lo
    count -= (rank_max[gxr] >= stop).astype(np.int64)
    return count


def _traffic_arrays(group, cp_rank, sample, start, stop, cp: int, bytes_per_token: int, num_groups: int):
    need = needed_pieces(group, cp_rank, sample, start, stop)
    tokens = np.asarray(stop, dtype=np.int64) - np.asarray(start, dtype=np.int64)
    unique = np.bincount(group, weights=tokens * (need > 0), minlength=num_groups).astype(np.int64) * bytes_per_token
    p2p = np.bincount(group, weights=tokens * need, minlength=num_groups).astype(np.int64) * bytes_per_token
    return unique, p2p, unique * (cp - 1)


def kv_traffic(mb: MicroBatch, bytes_per_token: int = 1) -> KVTraffic:
    """K/V bytes crossing the CP ranks of one micro-batch."""
    rows = [(c, p.sample, p.start, p.stop) for c, shard in enumerate(mb.shards) for p in shard.pieces]
    if not rows:
        return KVTraffic(0, 0, 0)
    arr = np.array(rows, dtype=np.int64)
    group = np.zeros(len(arr), dtype=np.int64)
    u, p, r = _traffic_arrays(group, arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], len(mb.shards), bytes_per_token, 1)
    return KVTraffic(int(u[0]), int(p[0]), int(r[0]))


def plan_kv_traffic(plan: Plan, bytes_per_token: int = 1) -> dict[str, np.ndarray]:
    """Per micro-batch K/V traffic of a whole plan, vectorised over its piece table.

    Returns int64 arrays, one row per micro-batch in plan order: ``step``, ``dp``, ``microbatch``,
    ``unique``, ``p2p``, ``ring``. Per-step totals: ``np.bincount(out["step"], out["ring"])``.
    """
    a = plan.piece_arrays
    keys = np.stack([a["step"], a["dp"], a["microbatch"]])
    uniq, group = np.unique(keys, axis=1, return_inverse=True)
    group = group.reshape(-1)
    u, p, r = _traffic_arrays(
        group, a["cp"], a["sample"], a["start"], a["stop"], plan.config.cp, bytes_per_token, uniq.shape[1]
    )
    return {"step": uniq[0], "dp": uniq[1], "microbatch": uniq[2], "unique": u, "p2p": p, "ring": r}
