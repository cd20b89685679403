"""The calibration's fit: the profile and kernel models, and how well they predict (docs/cost-model.md).

Pure numpy on measured times, fitted by the NNLS of :mod:`ringpack.cost_fit`: :func:`analyse` is
shared by a fresh calibration (after timing on the GPU) and by a refit of a stored report, so both
produce the same :class:`Calibration`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringpack.calibration.cases import Case, microbatch_geometry
from ringpack.calibration.features import (
    BLOCKS,
    KERNEL_FEATURES,
    PROFILE_FEATURES,
    EngineSettings,
    feature_matrix,
    rank_features,
)
from ringpack.cost import CostModel
from ringpack.cost_fit import fit_nnls


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def quality(measured: Sequence[float], predicted: Sequence[float]) -> dict[str, float]:
    """Pearson r, largest and mean relative error of predictions against measurements."""
    m, p = np.asarray(measured, dtype=np.float64), np.asarray(predicted, dtype=np.float64)
    rel = np.abs(p - m) / m
    return dict(
        n=int(m.size),
        r=pearson(m, p),
        max_rel_err=float(rel.max(initial=0.0)),
        mean_rel_err=float(rel.mean()) if m.size else 0.0,
    )


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
    return dict(
        microbatches=len(errs),
        imbalance_err=float(max(errs, default=0.0)),
        slowest_rank_hit=float(np.mean(hits)) if hits else float("nan"),
    )


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
        out["version"] = REPORT_VERSION
        return out


#: Format version of the JSON report (:meth:`Calibration.to_dict`); ``refit`` reads this version only.
REPORT_VERSION = 2
#: Names of the profile model's coefficients, in :data:`PROFILE_FEATURES` order (seconds, one layer).
PER_LAYER_KEYS = ("overhead_s", "ring_overhead_s", "token_s", "pair_s", "segment_s")
_NOTE = (
    "per_layer and the rows are one attention layer's forward+backward, compute only. predicted_s is the profile "
    "model: token*tokens + pair*pairs + segment*pieces (what the planner's CostModel prices) plus overhead_s and, "
    "when the micro-batch splits a sample, ring_overhead_s; both constants are equal for every rank of a "
    "micro-batch, so they never change which rank is slowest, and the profile leaves them out. The profile is "
    "layers x per_layer (+ linear layers per token). kernel_predicted_s is the kernel model (a diagnostic)."
)


def fit_profile(features: Sequence[dict[str, float]], times: np.ndarray) -> dict[str, float]:
    """The profile model's per-layer coefficients (:data:`PER_LAYER_KEYS`) fitted to ``times``.

    Args:
        features: :func:`rank_features` of each timed rank shard (128x128 tiles).
        times: float64 ``[n]`` measured seconds of one layer's forward+backward, same order.

    Raises:
        ValueError: the fit found neither a token nor a pair cost (the timings carry no signal).
    """
    coef = fit_nnls(feature_matrix(features, PROFILE_FEATURES), times)
    per_layer = dict(zip(PER_LAYER_KEYS, map(float, coef)))
    if per_layer["token_s"] == 0 and per_layer["pair_s"] == 0:
        raise ValueError("calibration fit found neither a token nor a pair cost; the timings carry no signal")
    return per_layer


def profile_model(per_layer: dict[str, float], layers: int, linear: dict[str, Any], name: str) -> CostModel:
    """The planner's cost model in seconds: ``layers`` attention layers plus the timed linear layers per token.

    The per-micro-batch constants (``overhead_s``, ``ring_overhead_s``) are left out: they are
    equal on every rank of a micro-batch, so they never change which rank is slowest.
    """
    return CostModel(
        token=layers * (per_layer["token_s"] + linear["layer_token_s"]) + linear["head_token_s"],
        pair=layers * per_layer["pair_s"],
        segment=layers * per_layer["segment_s"],
        unit="s",
        name=name,
    )


def _predict(feats: Sequence[dict[str, float]], names: Sequence[str], coef: np.ndarray) -> np.ndarray:
    return feature_matrix(feats, names) @ coef


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
    on the rows of a stored report. The held-out rows are never fitted on. The kernel features
    count what the engine recorded in ``meta`` ran (:meth:`EngineSettings.of_report`).

    Raises:
        ValueError: fewer grid rows than the profile model has terms, or timings without signal.
    """
    if len(grid) < len(PROFILE_FEATURES) + 1:
        raise ValueError(f"calibration needs at least {len(PROFILE_FEATURES) + 1} grid rows, got {len(grid)}")
    times = np.array([t for _, t in grid], dtype=np.float64)
    measured = np.array([t for _, t in held], dtype=np.float64)
    settings = EngineSettings.of_report(meta)
    feats = {
        b: (
            [rank_features(c, hybrid, *b, settings) for c, _ in grid],
            [rank_features(c, hybrid, *b, settings) for c, _ in held],
        )
        for b in BLOCKS
    }
    fg, fe = feats[(128, 128)]

    # the profile model: the planner's terms plus the per-micro-batch constants
    per_layer = fit_profile(fg, times)
    coef = np.array([per_layer[k] for k in PER_LAYER_KEYS])
    pred_g, pred = _predict(fg, PROFILE_FEATURES, coef), _predict(fe, PROFILE_FEATURES, coef)
    held_out = _held_out_quality(held, measured, pred, eval_strategy)
    kernel_model, kpred_g, kpred = _fit_kernel_model(feats, times, held, measured, eval_strategy)

    rows = _RowWriter()
    grid_rows = [rows.row(c, t, f, p, kp) for (c, t), f, p, kp in zip(grid, fg, pred_g, kpred_g)]
    eval_rows = [
        dict(rows.row(c, t, f, p, kp), strategy=eval_strategy(c)) for (c, t), f, p, kp in zip(held, fe, pred, kpred)
    ]
    return Calibration(
        profile=profile_model(per_layer, layers, linear, name),
        meta=dict(meta, layers=layers, note=_NOTE),
        per_layer=per_layer,
        linear=linear,
        train=quality(times, pred_g),
        held_out=held_out,
        kernel_model=kernel_model,
        baseline=_pairs_only_baseline(fg, fe, times, measured),
        microbatches=rows.microbatches,
        grid_rows=grid_rows,
        eval_rows=eval_rows,
    )


def _held_out_quality(
    held: Sequence[tuple[Case, float]], measured: np.ndarray, predicted: np.ndarray, key: Callable[[Case], str]
) -> dict[str, Any]:
    """:func:`quality` and :func:`imbalance` of held-out predictions, and quality per ``key`` group."""
    out: dict[str, Any] = quality(measured, predicted)
    out.update(imbalance(held, measured, predicted))
    out["by_strategy"] = _by_group(held, measured, predicted, key)
    return out


def _fit_kernel_model(
    feats: dict[tuple[int, int], tuple[list, list]],
    times: np.ndarray,
    held: Sequence[tuple[Case, float]],
    measured: np.ndarray,
    eval_strategy: Callable[[Case], str],
) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The kernel model (diagnostic) at the block size that fits the grid best.

    Returns the model's report entry and its predictions on the grid and on the held-out shards.
    """
    scan = []
    for b in BLOCKS:
        ck = fit_nnls(feature_matrix(feats[b][0], KERNEL_FEATURES), times)
        scan.append(
            dict(
                block=list(b),
                coef=dict(zip(KERNEL_FEATURES, map(float, ck))),
                train=quality(times, _predict(feats[b][0], KERNEL_FEATURES, ck)),
            )
        )
    best = min(scan, key=lambda x: (x["train"]["mean_rel_err"], x["train"]["max_rel_err"]))
    grid_feats, held_feats = feats[tuple(best["block"])]
    ck = np.array([best["coef"][n] for n in KERNEL_FEATURES])
    kpred_g, kpred = _predict(grid_feats, KERNEL_FEATURES, ck), _predict(held_feats, KERNEL_FEATURES, ck)
    k_held = _held_out_quality(held, measured, kpred, eval_strategy)
    model = dict(best, held_out=k_held, scan=[dict(block=x["block"], train=x["train"]) for x in scan])
    return model, kpred_g, kpred


def _pairs_only_baseline(
    fg: Sequence[dict[str, float]], fe: Sequence[dict[str, float]], times: np.ndarray, measured: np.ndarray
) -> dict[str, Any]:
    """The FLOP model's shape (pairs only, best scalar): what calibration buys over it."""
    xp = feature_matrix(fg, ("pairs",))
    pair_s = fit_nnls(xp, times)[0]
    return dict(
        pair_s=float(pair_s),
        train=quality(times, xp[:, 0] * pair_s),
        held_out=quality(measured, feature_matrix(fe, ("pairs",))[:, 0] * pair_s),
    )


class _RowWriter:
    """Report rows of timed rank shards; each micro-batch's geometry is stored once, rows point to it."""

    def __init__(self) -> None:
        self.microbatches: list[dict[str, Any]] = []
        self._index: dict[int, int] = {}

    def row(self, case: Case, t: float, f: dict[str, float], p: float, kp: float) -> dict[str, Any]:
        """The row of ``case``: measured ``t`` seconds, features ``f``, predictions ``p`` (profile), ``kp`` (kernel)."""
        k = self._index.get(id(case.microbatch))
        if k is None:
            k = self._index[id(case.microbatch)] = len(self.microbatches)
            self.microbatches.append(microbatch_geometry(case))
        return dict(
            family=case.family,
            label=case.label,
            rank=case.rank,
            microbatch=k,
            tokens=int(f["tokens"]),
            pairs=int(f["pairs"]),
            pieces=int(f["pieces"]),
            calls=int(f["calls"]),
            kernel_segments=int(f["segments"]),
            dense_calls=int(f["dense_calls"]),
            ring=int(f["ring"]),
            measured_s=float(t),
            predicted_s=float(p),
            kernel_predicted_s=float(kp),
            rel_err=float((p - t) / t),
            kernel_rel_err=float((kp - t) / t),
        )


def _by_group(
    held: Sequence[tuple[Case, float]], m: np.ndarray, p: np.ndarray, key: Callable[[Case], str]
) -> dict[str, Any]:
    groups: dict[str, list[int]] = {}
    for i, (case, _) in enumerate(held):
        groups.setdefault(key(case), []).append(i)
    return {g: quality(m[rows], p[rows]) for g, rows in groups.items()}
