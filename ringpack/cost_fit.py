"""Fit the cost model's prices to measured times: non-negative least squares, pure numpy (docs/cost-model.md).

:func:`fit_nnls` fits non-negative coefficients to features and times (relative error by default,
columns scaled so counts near ``1e9`` and a constant fit together). :func:`fit_rank_times` fits
``token``, ``pair`` and ``segment`` prices and a per-micro-batch overhead to observation rows
(:data:`ROW`) of ranks timed while training: a micro-batch whose CP ranks exchange K/V is one
observation, its predicted slowest rank against its longest time; outliers are dropped, and rows
no fit can use (:func:`usable_rows`) are left out and counted. The run-time learner
(:mod:`ringpack.training.cost_learner`) and the step calibration both fit this way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ringpack.cost import CostModel, piece_pairs
from ringpack.shard_plan import MicroBatch

__all__ = [
    "MAX_COUNT",
    "MIN_SECONDS",
    "ROW",
    "FitResult",
    "fit_nnls",
    "fit_problem",
    "fit_rank_times",
    "microbatch_features",
    "nnls",
    "price_change",
    "usable_rows",
    "without_microbatches",
]

#: Columns of an observation row (float64): where it was measured, what the rank held, how long it took.
ROW = ("step", "dp", "microbatch", "cp", "tokens", "pairs", "pieces", "coupled", "seconds")
_FEATURES = slice(4, 7)
#: a fitted term below this share of every observation's time is set to exactly zero
NEGLIGIBLE = 1e-9
#: The shortest time an observation may report. A micro-batch's forward + backward never takes less
#: (CUDA events resolve about 0.5 us); a shorter time is a clock artefact, and dividing counts by it
#: in the relative fit would overflow.
MIN_SECONDS = 1e-9
#: The largest count (tokens, pairs, pieces) an observation may hold: what a plan's int64 can count.
MAX_COUNT = float(2**63)


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

    Raises:
        ValueError: a feature or time that is not finite, a time that is not positive (``relative``),
            or a relative weighting that overflows (a time too small for its features).
    """
    a = np.asarray(features, dtype=np.float64)
    b = np.asarray(times, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("the fit needs finite features and times (a NaN or an infinity is not a measurement)")
    if relative:
        if (b <= 0).any():
            raise ValueError(f"relative fit needs positive times ({int((b <= 0).sum())} of {b.size} are not)")
        with np.errstate(over="ignore"):
            a, b = a / b[:, None], np.ones_like(b)
        if not np.isfinite(a).all():
            raise ValueError("relative fit overflows: a time is too small for its features")
    peak = np.abs(a).max(axis=0, initial=0.0)
    peak[peak == 0] = 1.0
    norms = peak * np.linalg.norm(a / peak, axis=0)  # scaled first: the squares of counts near 1e200 overflow
    norms[norms == 0] = 1.0
    return nnls(a / norms, b) / norms


@dataclass(frozen=True)
class FitResult:
    """A fitted model and how well it explains the observations it was fitted on.

    ``model`` is in seconds per token / pair / piece (``unit="s"``); ``overhead`` the fitted seconds
    per micro-batch and rank (equal on every rank, so the planner ignores it); ``rms_error`` and
    ``max_error`` are relative; ``used`` / ``dropped`` count observations kept and outliers;
    ``unusable`` counts rows left out before the fit (:func:`usable_rows`: a time or count that is
    not finite, not positive or out of range, or another rank of the same coupled micro-batch with
    one).
    """

    model: CostModel
    overhead: float
    rms_error: float
    max_error: float
    used: int
    dropped: int
    unusable: int = 0


def microbatch_features(mb: MicroBatch) -> tuple[np.ndarray, bool]:
    """``([cp, 3] float64 tokens/pairs/pieces of every CP rank, coupled)`` of one micro-batch.

    ``coupled``: some sample has pieces on two ranks, so the ranks exchange K/V and wait on each other.
    """
    feats = np.zeros((len(mb.shards), 3))
    owner: dict[int, int] = {}
    coupled = False
    for c, shard in enumerate(mb.shards):
        starts = np.fromiter((p.start for p in shard.pieces), dtype=np.int64, count=len(shard.pieces))
        stops = np.fromiter((p.stop for p in shard.pieces), dtype=np.int64, count=len(shard.pieces))
        feats[c] = (stops - starts).sum(), piece_pairs(starts, stops).sum(), len(shard.pieces)
        for p in shard.pieces:
            coupled |= owner.setdefault(p.sample, c) != c
    return feats, coupled


def usable_rows(rows: np.ndarray) -> np.ndarray:
    """Which observation rows a fit can use (``[n]`` bool).

    A usable row is finite everywhere; its ``step``, ``dp``, ``microbatch`` and ``cp`` are whole
    numbers in ``[0, MAX_COUNT)``, ``coupled`` is 0 or 1, its counts lie in ``[0, MAX_COUNT]`` and
    its time is at least :data:`MIN_SECONDS`. Anything else (a time of 0, a negative time from a
    clock that stepped back, NaN, infinity, a count that overflows the fit) is a bad observation.
    A finite time that is merely far off (a clock that jumped ahead) is usable: the fit's outlier
    guard drops it.

    Args:
        rows: ``[n, 9]`` float64 rows with the columns of :data:`ROW`.
    """
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, len(ROW))
    keys, feats = rows[:, :4], rows[:, _FEATURES]
    return (
        np.isfinite(rows).all(axis=1)
        & ((keys >= 0) & (keys < MAX_COUNT) & (keys == np.floor(keys))).all(axis=1)
        & ((rows[:, 7] == 0) | (rows[:, 7] == 1))
        & ((feats >= 0) & (feats <= MAX_COUNT)).all(axis=1)
        & (rows[:, 8] >= MIN_SECONDS)
    )


def without_microbatches(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``[n]`` bool: rows that are not a coupled rank of one of the micro-batches ``keys`` (``[m, 3]``
    finite step, dp, micro-batch). A coupled micro-batch is one observation of all its ranks: without
    one rank's time, the others' cannot say which rank was slowest."""
    if not len(keys):
        return np.ones(len(rows), dtype=bool)
    keys = np.asarray(keys, dtype=np.float64).reshape(-1, 3)
    _, ids = np.unique(np.concatenate([keys, np.nan_to_num(rows[:, :3], nan=-1.0)]), axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    return ~(np.isin(ids[len(keys) :], ids[: len(keys)]) & (rows[:, 7] != 0))


def fit_rank_times(rows: np.ndarray, prior: CostModel, iterations: int = 6) -> FitResult | None:
    """Fit ``seconds ~ token*tokens + pair*pairs + segment*pieces + overhead`` to observation rows.

    Args:
        rows: ``[n, 9]`` float64 rows with the columns of :data:`ROW` (any order; every rank of a
            micro-batch present once). Rows :func:`usable_rows` refuses are left out, with every
            other rank of their micro-batch when it is coupled, and counted in ``unusable``.
        prior: the model in use; it picks the slowest rank of coupled micro-batches in the first
            iteration.
        iterations: fixed-point iterations over which rank of a coupled micro-batch is slowest.

    Returns:
        The fit, or ``None`` when there are fewer than five usable observations, or when the fit
        prices both tokens and pairs at zero.
        Deterministic: the same rows in any order give the same result.

    Raises:
        ValueError: ``rows`` is not an ``[n, 9]`` array of numbers.
    """
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != len(ROW):
        raise ValueError(f"fit_rank_times: rows must be [n, {len(ROW)}] ({', '.join(ROW)}), got {rows.shape}")
    ok = usable_rows(rows)
    ok &= without_microbatches(rows, rows[~ok & np.isfinite(rows[:, :3]).all(axis=1), :3])
    unusable = int((~ok).sum())
    rows = rows[ok]
    rows = rows[np.lexsort(rows[:, ::-1].T)]  # canonical order: results do not depend on gather order
    model, overhead = prior, 0.0
    keep = np.ones(0, dtype=bool)
    for _ in range(iterations):
        feats, times = _observations(rows, model, overhead)
        if len(times) < 5:
            return None
        keep = _inliers(feats, times, model, overhead) if keep.size == len(times) else np.ones(len(times), bool)
        design = np.column_stack([feats[keep], np.ones(keep.sum())])
        coef = fit_nnls(design, times[keep])
        coef[(design * coef <= NEGLIGIBLE * times[keep, None]).all(axis=0)] = 0.0  # rounding residue, not a price
        if not np.isfinite(coef).all() or (coef[0] == 0 and coef[1] == 0):
            return None
        new = CostModel(token=float(coef[0]), pair=float(coef[1]), segment=float(coef[2]), unit="s", name="learned")
        settled = new == model and coef[3] == overhead
        model, overhead = new, float(coef[3])
        if settled:
            break
    feats, times = _observations(rows, model, overhead)
    keep = _inliers(feats, times, model, overhead)
    err = (model.cost(*feats[keep].T) + overhead) / times[keep] - 1
    model = dataclasses.replace(model, microbatch=overhead)
    return FitResult(
        model,
        overhead,
        float(np.sqrt(np.mean(err**2))),
        float(np.abs(err).max()),
        int(keep.sum()),
        int((~keep).sum()),
        unusable,
    )


def _observations(rows: np.ndarray, model: CostModel, overhead: float) -> tuple[np.ndarray, np.ndarray]:
    """Features and times to fit: every rank of an uncoupled micro-batch; the predicted slowest
    rank of a coupled one, against the longest time any of its ranks measured."""
    alone = rows[:, 7] == 0
    feats, times = [rows[alone, _FEATURES]], [rows[alone, 8]]
    coupled = rows[~alone]
    if len(coupled):
        keys = coupled[:, :3]
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
        predicted = model.cost(*coupled[:, _FEATURES].T) + overhead
        slowest = [s + int(np.argmax(predicted[s:e])) for s, e in zip(starts, np.r_[starts[1:], len(coupled)])]
        feats.append(coupled[slowest, _FEATURES])
        times.append(np.maximum.reduceat(coupled[:, 8], starts))
    return np.concatenate(feats), np.concatenate(times)


def _inliers(feats: np.ndarray, times: np.ndarray, model: CostModel, overhead: float) -> np.ndarray:
    """Observations whose relative residual is within 4 robust sigmas (at least 5%) of the median."""
    err = (model.cost(*feats.T) + overhead) / times - 1
    mad = 1.4826 * np.median(np.abs(err - np.median(err)))
    return np.abs(err - np.median(err)) <= max(4 * mad, 0.05)


def fit_problem(result: FitResult, max_error: float) -> str | None:
    """Why the planner must not use ``result`` (one line), or ``None`` when it may.

    A zero token or pair price means the observations could not tell the two apart (every rank
    held the same tokens and pairs, as zigzag splits make them): such a fit explains the timings
    but would price any other plan wrongly. A relative RMS error above ``max_error`` explains too
    little.
    """
    m = result.model
    if m.token <= 0 or m.pair <= 0:
        return f"the fit prices {'tokens' if m.token <= 0 else 'attention pairs'} at zero"
    if result.rms_error > max_error:
        return f"the fit's error is {result.rms_error:.0%} RMS (at most {max_error:.0%})"
    return None


def price_change(old: CostModel, new: CostModel) -> float:
    """How far ``new``'s relative prices (pair and piece, per token) move from ``old``'s (a fraction)."""

    def ratios(m: CostModel) -> np.ndarray:
        return np.array([m.pair, m.segment]) / m.token  # inf (or nan) for a free token: any change is total

    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        a, b = ratios(old), ratios(new)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        change = np.where(same, 0.0, np.abs(b - a) / np.maximum(a, 1e-300))
    return float(np.nan_to_num(change, nan=np.inf).max())
