"""``ringpack report``: imbalance reports of plans, as a terminal table, JSON, PNG plots and one HTML page.

A report compares one or more plans of the same data (one per strategy, or any plan files). Every
figure comes from :mod:`ringpack.analysis.metrics` (the planner's cost code applied to the piece
table) and, for times that include communication, :mod:`ringpack.comm_model`.

The JSON document (``format: "ringpack-report"``, ``version: 1``) is the source of everything else:
the table and the plots are drawn from it, so ``ringpack report`` output can be re-plotted or
compared without re-planning. Its keys are listed in :data:`SUMMARY_KEYS` and :data:`STEP_KEYS`
(tests pin them: add keys, never rename).

See docs/analysis.md, "`ringpack report`".
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np

from ringpack.analysis import plots as plotting
from ringpack.analysis.metrics import PlanMetrics, evaluate_plan
from ringpack.analysis.plots import median_idle
from ringpack.analysis.robustness import imbalance_across_prices
from ringpack.comm_model import (
    HEAD_PARALLEL_MODES,
    CommModel,
    ExchangeInputs,
    exchange_inputs,
    microbatch_seconds,
    ring_fallback,
)
from ringpack.planner import make_plan
from ringpack.shard_plan import PACKINGS, STRATEGIES

__all__ = [
    "REPORT_FORMAT",
    "REPORT_VERSION",
    "DEFINITIONS",
    "SUMMARY_KEYS",
    "STEP_KEYS",
    "StrategyResult",
    "timed",
    "build_report",
    "length_summary",
    "format_table",
    "window_line",
    "format_ranks",
    "advice_lines",
    "median_idle",
    "write_report",
    "plan_strategies",
    "DEFAULT_VARIANTS",
]

REPORT_FORMAT = "ringpack-report"
REPORT_VERSION = 1

#: The plans ``ringpack report --lengths`` makes: (CP strategy, packing). The status quo -- token
#: count first-fit packing with a zigzag split -- is the baseline others are compared with.
DEFAULT_VARIANTS: tuple[tuple[str, str], ...] = tuple(
    (strategy, packing) for packing in PACKINGS for strategy in STRATEGIES
)
BASELINE = "zigzag/first_fit"

DEFINITIONS: dict[str, str] = {
    "rank cost": "token*tokens + pair*exact causal (query, key) pairs + segment*pieces of one CP rank's shard "
    "(CostModel.cost over piece_pairs: the planner's cost code)",
    "micro-batch time": "max over its CP ranks (they synchronise every attention layer)",
    "DP rank time": "sum over its micro-batches of the micro-batch times",
    "step time": "max over DP ranks (DP ranks synchronise once a step); seconds = cost / the cost model's FLOP/s",
    "busy": "a GPU's (dp, cp) own cost summed over the step's micro-batches",
    "idle fraction": "1 - sum(busy) / (dp*cp * step time): the share of GPU time spent waiting on the slowest rank",
    "imbalance": "step time / mean GPU busy (1.0 = perfect; 1 / (1 - idle fraction))",
    "max/mean": "busiest GPU's busy / mean GPU busy",
    "dp max/mean": "slowest DP rank time / mean DP rank time",
    "cp max/mean": "per micro-batch, slowest CP rank / mean CP rank, averaged over the step's micro-batches",
    "gap": "step time / the planner's proven lower bound of the step's documents - 1 (how far from the best any plan "
    "of them could do); a peer that moves documents between steps is measured against the bound of its own steps",
    "padding": "tokens the plan pads: always 0 for ringpack plans (no divisibility rule)",
    "zigzag-rule padding": "tokens a zigzag implementation requiring every sample to be a multiple of 2*cp "
    "(TransformerEngine, ring-flash-attention) would add to the same micro-batches: sum of (-L) mod 2cp",
    "K/V bytes": "bytes of K and V (all layers, one forward) of pieces some other CP rank needs, each counted once "
    "(ringpack.traffic); a ring passes each through cp-1 ranks, the backward sends K/V and dK/dV again",
    "step time with comm": "the same max/sum/max with each rank's time from the communication model "
    "(ring: per layer max(compute, latency + bytes/bandwidth) per ring step; "
    "all-gather: gather + reduce-scatter, exposed)",
    "idle saved": "idle GPU-seconds of the baseline minus this plan's, over the whole plan",
    "peers": "other systems run on the same documents with the same cost and communication models "
    "(ringpack.analysis.peers), each described under the table; '-' (null in JSON) marks a figure with no "
    "meaning for one",
}

SUMMARY_KEYS = (
    "steps",
    "microbatches",
    "samples",
    "tokens",
    "loss_tokens",
    "step_cost_total",
    "busy_cost_total",
    "idle_fraction",
    "idle_gpu_seconds",
    "imbalance_mean",
    "imbalance_worst",
    "max_mean_mean",
    "max_mean_worst",
    "dp_max_mean_mean",
    "cp_max_mean_mean",
    "gap_mean",
    "predicted_seconds",
    "tokens_per_second",
    "padding_tokens",
    "zigzag_rule_padding_tokens",
    "kv_bytes",
    "kv_ring_bytes",
    "predicted_seconds_comm",
    "tokens_per_second_comm",
    "idle_fraction_comm",
    "exposed_comm_seconds",
    "idle_gpu_seconds_saved",
    "speedup_vs_baseline",
    "imbalance_by_pair_price",
    "imbalance_price_worst",
    "partners_median",
    "partners_max",
    "partner_memory_bytes",
    "ring_fallback_microbatches",
)
STEP_KEYS = (
    "step",
    "microbatches_per_rank",
    "samples",
    "tokens",
    "step_cost",
    "step_seconds",
    "step_seconds_comm",
    "lower_bound",
    "gap",
    "imbalance",
    "max_mean",
    "dp_max_mean",
    "cp_max_mean",
    "idle_fraction",
    "idle_fraction_comm",
    "padding_tokens",
    "zigzag_rule_padding_tokens",
    "kv_bytes",
    "rank_busy",
    "dp_time",
    "microbatch_costs",
)


@dataclass
class StrategyResult:
    """One plan's metrics plus its times under a communication model (arrays over steps)."""

    metrics: PlanMetrics
    comm: CommModel
    lower_bound: np.ndarray  # (S,) NaN where unknown
    step_seconds_comm: np.ndarray  # (S,)
    exposed_comm_seconds: np.ndarray  # (S,) summed over GPUs
    config: dict[str, Any] | None = None
    plan_hash: str | None = None
    partners: np.ndarray | None = None  # (S, D, M, C) per micro-batch, None where not counted
    ring_fallback: int = 0  # micro-batches over the partner budget, run as the ring

    @property
    def name(self) -> str:
        return self.metrics.name

    @property
    def kv_bytes(self) -> np.ndarray:
        """(S,) forward K/V bytes crossing ranks, each needed piece once."""
        return self.metrics.kv_cross_tokens.sum(axis=(1, 2, 3)) * self.comm.kv_bytes_per_token

    @property
    def imbalance(self) -> np.ndarray:
        m = self.metrics
        mean = m.busy.reshape(m.num_steps, -1).mean(axis=1)
        return np.where(mean > 0, m.step_cost / np.where(mean > 0, mean, 1.0), 1.0)

    @property
    def gap(self) -> np.ndarray:
        lb = self.lower_bound
        ok = np.isfinite(lb) & (lb > 0)
        with np.errstate(over="ignore", divide="ignore"):
            gap = np.where(ok, self.metrics.step_cost / np.where(ok, lb, 1.0) - 1.0, np.nan)
        return np.where(np.isfinite(gap), gap, np.nan)

    @property
    def idle_fraction_comm(self) -> np.ndarray:
        m = self.metrics
        busy = m.model.seconds(m.busy.sum(axis=(1, 2)))
        capacity = m.dp * m.cp * self.step_seconds_comm
        return np.where(capacity > 0, 1.0 - busy / np.where(capacity > 0, capacity, 1.0), 0.0)

    def summary(self) -> dict[str, Any]:
        """The plan's summary figures, :data:`SUMMARY_KEYS` in order (:func:`summarise`)."""
        return summarise(self)

    def step_rows(self, detail: bool = True) -> list[dict[str, Any]]:
        """One row of :data:`STEP_KEYS` per step (:func:`step_rows`)."""
        return step_rows(self, detail=detail)


def timed(
    metrics: PlanMetrics,
    comm: CommModel,
    lower_bound: Sequence[float | None] | None = None,
    inputs: ExchangeInputs | None = None,
    **extra: Any,
) -> StrategyResult:
    """Attach communication-model times (and the planner's lower bounds) to a plan's metrics.

    ``inputs``: the plan's :func:`~ringpack.comm_model.exchange_inputs` under ``comm``, which the
    targeted exchange and the hybrid modes need (the other modes read the metrics only).

    Raises:
        ValueError: such a mode without ``inputs``, or a head-parallel mode the CP size or the
            model's heads cannot run.
    """
    m = metrics
    inputs = inputs if inputs is not None else ExchangeInputs()
    cross = inputs.kv_cross if HEAD_PARALLEL_MODES.get(comm.mode) else m.kv_cross_tokens
    seconds, exposed = microbatch_seconds(m.tokens, m.pairs, m.segments, cross, m.model, comm, inputs.volumes)
    if inputs.fallback is not None and inputs.fallback.any():  # over the partner budget: the ring runs
        args = (m.tokens, m.pairs, m.segments, m.kv_cross_tokens, m.model, comm)
        seconds, exposed = ring_fallback(seconds, exposed, inputs.fallback, *args)
    seconds = np.where(m.mb_exists[..., None], seconds, 0.0)
    exposed = np.where(m.mb_exists[..., None], exposed, 0.0)
    extra.setdefault("partners", _partners_of(m, comm, inputs))
    extra.setdefault("ring_fallback", int(inputs.fallback.sum()) if inputs.fallback is not None else 0)
    step_seconds = seconds.max(axis=3).sum(axis=2).max(axis=1) if m.num_steps else np.zeros(0)
    if lower_bound is None:
        lb = np.full(m.num_steps, np.nan)
    else:
        lb = np.array([np.nan if x is None else float(x) for x in lower_bound], dtype=np.float64)
    return StrategyResult(
        metrics=m,
        comm=comm,
        lower_bound=lb,
        step_seconds_comm=step_seconds,
        exposed_comm_seconds=exposed.sum(axis=(1, 2, 3)),
        **extra,
    )


def _partners_of(m: PlanMetrics, comm: CommModel, inputs: ExchangeInputs) -> np.ndarray | None:
    """Each rank's point-to-point partners per micro-batch under ``comm``'s mode, ``(S, D, M, C)``:
    the targeted exchange's from ``inputs`` (the ring's 2 where it falls back), the ring's 2 for the
    ring and the all-gather, the rest of the group for ``ulysses``; None for the hybrids."""
    if comm.mode == "p2p":
        return inputs.partners
    count = {"ring": min(2, m.cp - 1), "allgather": min(2, m.cp - 1), "ulysses": m.cp - 1}.get(comm.mode)
    return None if count is None else np.full(m.tokens.shape, count, dtype=np.int64)


def result_of_plan(plan, comm: CommModel, name: str | None = None) -> StrategyResult:
    """:func:`timed` metrics of a :class:`~ringpack.shard_plan.Plan`, with its exchange inputs where
    ``comm`` needs them."""
    metrics = evaluate_plan(plan, name=name)
    comm = dataclasses.replace(comm, max_partners=plan.config.max_partners)
    inputs = exchange_inputs(plan.piece_arrays, plan.config.cp, metrics.tokens.shape[:3], comm)
    bounds = [s.lower_bound for s in plan.steps]
    return timed(metrics, comm, bounds, inputs, config=plan.config.to_dict(), plan_hash=plan.content_hash)


# ----------------------------------------------------------------------------------------- summary
def length_summary(lengths: np.ndarray, bins: int = 40) -> dict[str, Any]:
    """Statistics and a log-spaced histogram of sample lengths (tokens)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    q = np.percentile(lengths, [50, 90, 99]) if lengths.size else np.zeros(3)
    hi = max(int(lengths.max()) if lengths.size else 1, 2)
    edges = np.unique(np.round(np.logspace(0, np.log10(hi + 1), bins + 1)).astype(np.int64))
    counts, _ = np.histogram(lengths, bins=edges)
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum()),
        "min": int(lengths.min()) if lengths.size else 0,
        "median": float(q[0]),
        "mean": float(lengths.mean()) if lengths.size else 0.0,
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()) if lengths.size else 0,
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def _f(x: Any) -> float | None:
    """JSON-safe float (NaN -> None)."""
    x = float(x)
    return None if not np.isfinite(x) else x


def summarise(result: StrategyResult) -> dict[str, Any]:
    m = result.metrics
    base = m.summary()
    seconds_comm = float(result.step_seconds_comm.sum())
    busy_seconds = float(m.model.seconds(base["busy_cost_total"]))
    gpus = m.dp * m.cp
    kv = result.kv_bytes
    out = dict(base)
    imbalance = result.imbalance
    gap = result.gap
    out.update(
        imbalance_mean=float(imbalance.mean()) if imbalance.size else 1.0,
        imbalance_worst=float(imbalance.max()) if imbalance.size else 1.0,
        gap_mean=_f(np.nanmean(gap)) if np.isfinite(gap).any() else None,
        kv_bytes=float(kv.sum()),
        kv_ring_bytes=float(kv.sum() * (m.cp - 1)),
        predicted_seconds_comm=seconds_comm,
        tokens_per_second_comm=base["tokens"] / seconds_comm if seconds_comm > 0 else 0.0,
        idle_fraction_comm=1.0 - busy_seconds / (gpus * seconds_comm) if seconds_comm > 0 else 0.0,
        exposed_comm_seconds=float(result.exposed_comm_seconds.sum()),
        idle_gpu_seconds_saved=0.0,
        speedup_vs_baseline=1.0,
        imbalance_by_pair_price={str(f): v for f, v in imbalance_across_prices(m).items()},
    )
    out["imbalance_price_worst"] = max(out["imbalance_by_pair_price"].values())
    out.update(partner_summary(result.partners, m.mb_exists, result.comm.partner_buffer_bytes))
    out["ring_fallback_microbatches"] = result.ring_fallback
    return {k: out[k] for k in SUMMARY_KEYS}


def partner_summary(partners: np.ndarray | None, exists: np.ndarray, buffer_bytes: float) -> dict[str, Any]:
    """``partners_median`` / ``partners_max`` (over every rank of every micro-batch that exists) and
    the NCCL buffer memory the most imply (``partner_memory_bytes``); None where not counted."""
    if partners is None or not exists.any():
        return {"partners_median": None, "partners_max": None, "partner_memory_bytes": None}
    held = partners[exists]
    return {
        "partners_median": float(np.median(held)),
        "partners_max": int(held.max()),
        "partner_memory_bytes": float(held.max()) * buffer_bytes,
    }


def step_rows(result: StrategyResult, detail: bool = True) -> list[dict[str, Any]]:
    """One JSON row per step; ``detail`` adds per-GPU busy, per-DP-rank time and per-micro-batch costs."""
    m = result.metrics
    rows = []
    imbalance, gap, idle_comm, kv = result.imbalance, result.gap, result.idle_fraction_comm, result.kv_bytes
    max_mean, dp_mm, cp_mm, idle = m.max_mean, m.dp_max_mean, m.cp_max_mean, m.idle_fraction
    step_cost, step_seconds, tokens = m.step_cost, m.step_seconds, m.step_tokens
    zz = m.zigzag_padding.sum(axis=(1, 2, 3))
    busy, dp_time = m.busy, m.dp_time
    per_rank = m.mb_exists.any(axis=1).sum(axis=1)
    for s in range(m.num_steps):
        row = {
            "step": s,
            "microbatches_per_rank": int(per_rank[s]),
            "samples": int(m.samples[s]),
            "tokens": int(tokens[s]),
            "step_cost": float(step_cost[s]),
            "step_seconds": float(step_seconds[s]),
            "step_seconds_comm": float(result.step_seconds_comm[s]),
            "lower_bound": _f(result.lower_bound[s]),
            "gap": _f(gap[s]),
            "imbalance": float(imbalance[s]),
            "max_mean": float(max_mean[s]),
            "dp_max_mean": float(dp_mm[s]),
            "cp_max_mean": float(cp_mm[s]),
            "idle_fraction": float(idle[s]),
            "idle_fraction_comm": float(idle_comm[s]),
            "padding_tokens": 0,
            "zigzag_rule_padding_tokens": int(zz[s]),
            "kv_bytes": float(kv[s]),
            "rank_busy": busy[s].tolist() if detail else None,
            "dp_time": dp_time[s].tolist() if detail else None,
            "microbatch_costs": (
                [[m.cost[s, d, i].tolist() for i in range(int(per_rank[s]))] for d in range(m.dp)] if detail else None
            ),
        }
        rows.append(row)
    return rows


def build_report(
    results: Sequence[StrategyResult],
    lengths: np.ndarray | None = None,
    baseline: str | None = None,
    detail: bool = True,
    title: str = "ringpack imbalance report",
    extra: dict[str, Any] | None = None,
    peers: Sequence[Any] = (),
) -> dict[str, Any]:
    """The report document (JSON-able): definitions, models, length statistics, and per plan its summary and steps.

    ``peers`` (:class:`ringpack.analysis.peers.Peer`: ``name``, ``description`` and a ``result``
    with ``summary()`` and ``step_rows(detail)``) land in ``doc["peers"]``, entries shaped like the
    plans' plus their ``description``; a figure with no meaning for a peer is ``None``. The
    baseline may be a plan or a peer.
    """
    if not results:
        raise ValueError("a report needs at least one plan")
    rows = [*results, *(p.result for p in peers)]
    names = [r.name for r in rows]
    if len(set(names)) != len(names):
        raise ValueError(f"plan names must be unique, got {names}")
    if baseline is None:
        baseline = BASELINE if BASELINE in names else names[0]
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not one of the plans {names}")
    first = results[0].metrics
    summaries = {r.name: r.summary() for r in rows}
    for summary in summaries.values():
        _compare_with_baseline(summary, summaries[baseline])

    def entry(r: Any) -> dict[str, Any]:
        steps = r.step_rows(detail=detail)
        return {"name": r.name, "hash": r.plan_hash, "config": r.config, "summary": summaries[r.name], "steps": steps}

    plans = [entry(r) for r in results]
    doc = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "title": title,
        "dp": first.dp,
        "cp": first.cp,
        "gpus": first.dp * first.cp,
        "cost_model": first.model.to_dict(),
        "cost_unit": first.model.unit,
        "comm_model": {
            **results[0].comm.to_dict(),
            "kv_bytes_per_token": results[0].comm.kv_bytes_per_token,
            "description": results[0].comm.describe(),
        },
        "baseline": baseline,
        "definitions": {**DEFINITIONS, **{f"{p.name} (peer)": p.description for p in peers}},
        "lengths": length_summary(lengths) if lengths is not None else None,
        "plans": plans,
        "peers": [{"name": p.name, "description": p.description, **entry(p.result)} for p in peers],
    }
    if extra:
        doc.update(extra)
    return doc


def _compare_with_baseline(summary: dict[str, Any], base: dict[str, Any]) -> None:
    """Fill ``summary``'s idle seconds saved and speedup against the baseline's summary ``base``."""
    summary["idle_gpu_seconds_saved"] = base["idle_gpu_seconds"] - summary["idle_gpu_seconds"]
    if summary["predicted_seconds_comm"] > 0 and summary["tokens"] == base["tokens"]:
        summary["speedup_vs_baseline"] = base["predicted_seconds_comm"] / summary["predicted_seconds_comm"]
    else:
        summary["speedup_vs_baseline"] = None


# ------------------------------------------------------------------------------------------ table
def _fmt_seconds(x: float) -> str:
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    if x >= 1:
        return f"{x:.2f} s"
    return f"{x * 1e3:.1f} ms"


def _fmt_bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:.0f} B"


def _fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A plain-text table: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    align = align or "l" + "r" * (len(header) - 1)

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if a == "l" else str(c).rjust(w) for c, w, a in zip(cells, widths, align)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def _optional(fmt: Callable[[float], str], key: str) -> Callable[[dict[str, Any]], str]:
    """A cell formatter printing ``-`` where ``row[key]`` is ``None``."""
    return lambda row: "-" if row[key] is None else fmt(row[key])


#: Columns of the summary table (one row per plan): header and cell of a plan's ``summary``.
_SUMMARY_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("steps", lambda s: str(s["steps"])),
    ("imbal", lambda s: f"{s['imbalance_mean']:.3f}"),
    ("x.25-2", lambda s: f"{s['imbalance_price_worst']:.3f}"),
    ("idle", lambda s: f"{100 * s['idle_fraction']:.1f}%"),
    ("idle+comm", lambda s: f"{100 * s['idle_fraction_comm']:.1f}%"),
    ("dp m/m", _optional(lambda x: f"{x:.3f}", "dp_max_mean_mean")),
    ("cp m/m", _optional(lambda x: f"{x:.3f}", "cp_max_mean_mean")),
    ("gap", _optional(lambda x: f"{100 * x:.1f}%", "gap_mean")),
    ("epoch time", lambda s: _fmt_seconds(s["predicted_seconds"])),
    ("+comm", lambda s: _fmt_seconds(s["predicted_seconds_comm"])),
    ("tok/s", lambda s: _fmt_count(s["tokens_per_second_comm"])),
    ("speedup", _optional(lambda x: f"{x:.2f}x", "speedup_vs_baseline")),
    ("K/V moved", lambda s: _fmt_bytes(s["kv_bytes"])),
    ("partners", lambda s: "-" if s.get("partners_max") is None else f"{s['partners_median']:.0f}/{s['partners_max']}"),
    (
        "NCCL GiB",
        lambda s: "-" if s.get("partner_memory_bytes") is None else f"{s['partner_memory_bytes'] / 2**30:.2f}",
    ),
    ("pad", lambda s: str(s["padding_tokens"])),
    ("2cp-pad", lambda s: _fmt_count(s["zigzag_rule_padding_tokens"])),
)
#: Columns of a plan's step table: header and cell of one of its ``steps`` rows.
_STEP_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("step", lambda r: str(r["step"])),
    ("mb/rank", _optional(str, "microbatches_per_rank")),
    ("samples", lambda r: str(r["samples"])),
    ("tokens", lambda r: _fmt_count(r["tokens"])),
    ("step time", lambda r: _fmt_seconds(r["step_seconds"])),
    ("+comm", lambda r: _fmt_seconds(r["step_seconds_comm"])),
    ("imbal", lambda r: f"{r['imbalance']:.3f}"),
    ("idle", lambda r: f"{100 * r['idle_fraction']:.1f}%"),
    ("dp m/m", _optional(lambda x: f"{x:.3f}", "dp_max_mean")),
    ("cp m/m", _optional(lambda x: f"{x:.3f}", "cp_max_mean")),
    ("K/V moved", lambda r: _fmt_bytes(r["kv_bytes"])),
    ("2cp-pad", lambda r: str(r["zigzag_rule_padding_tokens"])),
)
_SUMMARY_LEGEND = (
    "(* baseline; imbal = step time / mean GPU busy, averaged over steps; x.25-2 = the worst whole-plan "
    "imbalance if a pair truly costs 0.25x to 2x the model's price; idle = share of GPU time waiting "
    "on the slowest rank; gap = above the planner's lower bound; +comm = with the communication model; "
    "partners = point-to-point partners of a GPU in one micro-batch, median/max (within the partner budget: "
    "micro-batches over it run the ring); NCCL GiB = the buffers the most imply, about 24 MiB a partner; "
    "pad = padding the plan needs; 2cp-pad = padding a zigzag with the 2*CP rule would add; (peer) = another "
    "system on the same data and models, described below, '-' where a figure has no meaning for it)"
)


#: Width the notes under the summary table wrap at.
_NOTE_WIDTH = 110


def format_table(doc: dict[str, Any], steps_shown: int = 0, advice: bool = True) -> str:
    """The terminal view: one summary row per plan, then (``steps_shown > 0``) the first steps of each plan.

    With ``advice`` and a document that has ``"advice"`` (:func:`~ringpack.analysis.advice.advise`),
    its headline is the first line and its remedies follow the summary table.
    """
    advice_doc = doc.get("advice") if advice else None
    out = [advice_doc["headline"], ""] if advice_doc else []
    out += _table_heading(doc)
    rows = []
    for p in _rows(doc):
        mark = (" (peer)" if "description" in p else "") + (" *" if p["name"] == doc["baseline"] else "")
        rows.append([p["name"] + mark, *(cell(p["summary"]) for _, cell in _SUMMARY_COLUMNS)])
    out += ["", text_table(["plan", *(h for h, _ in _SUMMARY_COLUMNS)], rows), _SUMMARY_LEGEND]
    out += _window_notes(doc)
    out += _peer_notes(doc)
    if advice_doc:
        out += ["", "== what would help ==", *advice_lines(advice_doc)[2:]]
    if steps_shown > 0:
        for p in _rows(doc):
            out.append("")
            out.append(f"{p['name']}: first {min(steps_shown, len(p['steps']))} of {len(p['steps'])} steps")
            header = [h for h, _ in _STEP_COLUMNS]
            rows = [[cell(r) for _, cell in _STEP_COLUMNS] for r in p["steps"][:steps_shown]]
            out.append(text_table(header, rows, align="r" * len(header)))
    return "\n".join(out)


def window_line(window: dict[str, Any]) -> str:
    """What a plan's ``batch_window`` moved and what it bought by the steps' lower bounds, one line.

    ``window``: :meth:`~ringpack.planner.batch_window.WindowMoves.summary`'s numbers.
    """
    w = window
    ratio = w["predicted_seconds_without"] / w["predicted_seconds"] if w["predicted_seconds"] > 0 else 1.0
    return (
        f"batch window {w['batch_window']}: {w['moved']:,} samples ({w['moved_fraction']:.2%}) planned in another "
        f"global batch than drawn, at most {w['max_distance']} and on average {w['mean_distance']:.2f} batches away; "
        f"predicted by the steps' lower bounds: {_fmt_seconds(w['predicted_seconds'])}, "
        f"{_fmt_count(w['tokens_per_second'])} tokens/s with it, {_fmt_seconds(w['predicted_seconds_without'])}, "
        f"{_fmt_count(w['tokens_per_second_without'])} without ({ratio:.2f}x)"
    )


def advice_lines(advice: dict[str, Any]) -> list[str]:
    """``doc["advice"]`` (:func:`~ringpack.analysis.advice.advise`) as text: the headline, one row per
    remedy (flag, tokens/s, idle, gain), the causes, the basis."""
    cur = advice["current"]
    rows = [["(current)", _fmt_count(cur["tokens_per_second"]), f"{cur['idle_fraction']:.1%}", "1.00x"]]
    for r in advice["remedies"]:
        if r["gain"] is None:
            rows.append([r["flag"], "-", "-", f"cannot plan: {r.get('note', '')}"])
        else:
            rows.append(
                [r["flag"], _fmt_count(r["tokens_per_second"]), f"{r['idle_fraction']:.1%}", f"{r['gain']:.2f}x"]
            )
    out = [advice["headline"], "", text_table(["remedy", "tok/s", "idle+comm", "gain"], rows)]
    out += [f"- {c['text']}" for c in advice["causes"]]
    out.append(f"(the {advice['plan']} plan; {advice['basis']}; gain = tokens/s over the current setting's)")
    return out


def _window_notes(doc: dict[str, Any]) -> list[str]:
    """The batch window's line (:func:`window_line`) and, with a plan made without it, the two plans' tokens/s."""
    w = doc.get("batch_window")
    if not w:
        return []
    out = [window_line(w)]
    rows = {p["name"]: p["summary"] for p in doc["plans"]}
    if w.get("without") in rows and w.get("plan") in rows:
        with_s, without = rows[w["plan"]], rows[w["without"]]
        ratio = without["predicted_seconds_comm"] / with_s["predicted_seconds_comm"]
        out.append(
            f"{w['plan']}: {_fmt_count(with_s['tokens_per_second_comm'])} tokens/s with the window, "
            f"{_fmt_count(without['tokens_per_second_comm'])} without (the '{w['without']}' row): {ratio:.2f}x"
        )
    return [textwrap.fill(line, width=_NOTE_WIDTH, subsequent_indent="    ") for line in out]


def _peer_notes(doc: dict[str, Any]) -> list[str]:
    """What each peer row is and how its figures compare with the plans' (its description), wrapped."""
    return [
        textwrap.fill(
            f"{p['name']} (peer): {p['description']}",
            width=_NOTE_WIDTH,
            subsequent_indent="    ",
            break_on_hyphens=False,
        )
        for p in doc.get("peers", [])
    ]


def _rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The document's plans, then its peers (documents written before peers existed have none)."""
    return [*doc["plans"], *doc.get("peers", [])]


def _table_heading(doc: dict[str, Any]) -> list[str]:
    """The lines above the summary table: length statistics, the mesh and the models."""
    out = []
    lengths = doc.get("lengths")
    if lengths:
        out.append(
            "lengths (tokens): {samples:,} samples, {tokens:,} tokens, median {median:.0f}, mean {mean:.0f}, "
            "p99 {p99:.0f}, max {max:,}".format(**lengths)
        )
    cm = doc["cost_model"]
    out.append(
        f"DP={doc['dp']} x CP={doc['cp']} ({doc['gpus']} GPUs); cost model {cm['name']} "
        f"({cm['flops_per_second'] / 1e12:.0f} TFLOP/s achieved); comm {doc['comm_model']['description']}"
    )
    return out


def format_ranks(doc: dict[str, Any], plan: str, step: int) -> str:
    """Per-GPU busy time of one step of one plan: a DP x CP grid (compute, predicted), with the plan's median idle."""
    p = next(x for x in _rows(doc) if x["name"] == plan)
    row = p["steps"][min(step, len(p["steps"]) - 1)]
    if row["rank_busy"] is None:
        return ""
    to_s = 1.0 / doc["cost_model"]["flops_per_second"] if doc["cost_unit"] == "flop" else 1.0
    unit, scale = ("s", 1.0) if row["step_seconds"] >= 2 else ("ms", 1e-3)
    header = ["dp \\ cp", *(str(c) for c in range(doc["cp"])), "DP time"]
    rows = []
    for d, busy in enumerate(row["rank_busy"]):
        dp_time = "-" if row["dp_time"] is None else f"{row['dp_time'][d] * to_s / scale:.2f}"
        rows.append([str(d), *(f"{b * to_s / scale:.2f}" for b in busy), dp_time])
    return (
        f"{plan}, step {row['step']}: busy time per GPU ({unit}, compute); step time "
        f"{row['step_seconds'] / scale:.2f} {unit}, idle {100 * row['idle_fraction']:.1f}% "
        f"(median step of the plan: {100 * median_idle(p):.1f}%)\n" + text_table(header, rows, align="r" * len(header))
    )


# ----------------------------------------------------------------------------------------- writing
def write_report(
    doc: dict[str, Any], out_dir: str | Path, plots: bool = True, rank_step: int | None = None, progress: Any = None
) -> dict[str, Path]:
    """Write ``report.json``, the PNG plots, ``report.html`` (plots embedded) and ``report.md`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    paths["json"] = out / "report.json"
    paths["json"].write_text(json.dumps(doc, indent=1) + "\n")
    figures: dict[str, Path] = {}
    if plots:
        figures = plotting.draw_all({**doc, "plans": _rows(doc)}, out, rank_step=rank_step, progress=progress)
        paths.update(figures)
    paths["html"] = out / "report.html"
    paths["html"].write_text(render_html(doc, figures))
    paths["md"] = out / "report.md"
    paths["md"].write_text(render_markdown(doc, figures))
    return paths


FIGURE_CAPTIONS = {
    "lengths": "Sample lengths: how many samples of each length (log-log). "
    "Dashed lines: one rank's and one CP group's token budget.",
    "rank_costs": "Busy time of every GPU in one step, per plan: by default a typical step, the one nearest every "
    "plan's median idle share (each title gives the step's idle share and the plan's median); "
    "the dashed line is the step time, so the gap above each bar is idle time.",
    "imbalance": "Per step: imbalance (step time / mean GPU busy) and the share of GPU time spent idle, per plan; "
    "each plan has its own marker, and a plan whose line lies on another's is dotted and says so in the legend.",
    "idle_saved": "Idle GPU time per plan over all steps, and predicted throughput with communication.",
    "throughput": "Predicted tokens/s and idle share per strategy.",
}


def render_markdown(doc: dict[str, Any], figures: dict[str, Path]) -> str:
    """The report as Markdown: the table in a code block, the plots, the definitions.

    Everything quoted from the document is escaped: the code block's fence is longer than any
    run of backticks in the table (so no name can close it), and text outside it is HTML-escaped
    and kept on one line (so no name can inject markup).
    """
    table = format_table(doc)
    fence = "`" * max(3, _longest_backtick_run(table) + 1)
    lines = [f"# {_md_text(doc['title'])}", "", fence, table, fence, ""]
    for key, path in figures.items():
        lines += [f"![{_md_text(key)}]({quote(path.name)})", "", FIGURE_CAPTIONS.get(key, ""), ""]
    lines += ["## Definitions", ""]
    lines += [f"- **{_md_text(k)}**: {_md_text(v)}" for k, v in doc["definitions"].items()]
    return "\n".join(lines) + "\n"


def _md_text(text: Any) -> str:
    """``text`` safe in Markdown outside code: ``&``, ``<`` and ``>`` HTML-escaped, one line, Markdown's
    link and emphasis marks backslash-escaped. Quotes stay as they are: outside a tag they are plain
    text, and an entity for them would meet the ``#`` escape (``&\\#x27;``) and show as typed."""
    escaped = html.escape(" ".join(str(text).split()), quote=False)
    return "".join("\\" + c if c in "\\`*_[]|#" else c for c in escaped)


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def render_html(doc: dict[str, Any], figures: dict[str, Path]) -> str:
    """One self-contained page: the table, the plots as base64 PNGs, the definitions."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(doc['title'])}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:13px}img{max-width:100%;border:1px solid #ddd}"
        "figcaption{color:#555;margin:.3em 0 2em}dt{font-weight:600;margin-top:.5em}"
        "td,th{padding:.2em .8em;text-align:right}td:first-child,th:first-child{text-align:left}</style></head><body>",
        f"<h1>{html.escape(doc['title'])}</h1>",
        *_advice_html(doc.get("advice")),
        f"<pre>{html.escape(format_table(doc, steps_shown=0, advice=False))}</pre>",
    ]
    for key, path in figures.items():
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(
            f"<figure><img alt='{key}' src='data:image/png;base64,{data}'>"
            f"<figcaption>{html.escape(FIGURE_CAPTIONS.get(key, ''))}</figcaption></figure>"
        )
    parts.append("<h2>Definitions</h2><dl>")
    for k, v in doc["definitions"].items():
        parts.append(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>")
    parts.append("</dl></body></html>")
    return "\n".join(parts)


def _advice_html(advice: dict[str, Any] | None) -> list[str]:
    """The "what would help" section: the headline, a table of the remedies, the causes and the basis."""
    if not advice:
        return []
    e = html.escape
    cur = advice["current"]
    rows = [("(current)", cur["tokens_per_second"], cur["idle_fraction"], 1.0, "")]
    rows += [
        (r["flag"], r["tokens_per_second"], r["idle_fraction"], r["gain"], r.get("note", ""))
        for r in advice["remedies"]
    ]
    cells = []
    for flag, tps, idle, gain, note in rows:
        figures = (
            f"<td>{_fmt_count(tps)}</td><td>{100 * idle:.1f}%</td><td>{gain:.2f}x</td>"
            if gain is not None
            else f"<td colspan='3'>cannot plan: {e(note)}</td>"
        )
        cells.append(f"<tr><td><code>{e(flag)}</code></td>{figures}</tr>")
    return [
        "<section id='advice'><h2>What would help</h2>",
        f"<p><strong>{e(advice['headline'])}</strong></p>",
        "<table><tr><th>remedy</th><th>tok/s</th><th>idle+comm</th><th>gain</th></tr>",
        *cells,
        "</table><ul>",
        *(f"<li>{e(c['text'])}</li>" for c in advice["causes"]),
        f"</ul><p>The {e(advice['plan'])} plan; {e(advice['basis'])}.</p></section>",
    ]


# ------------------------------------------------------------------------------------- planning
def plan_strategies(
    lengths: np.ndarray, config, variants: Sequence[tuple[str, str]] = DEFAULT_VARIANTS, progress: Any = None
) -> list:
    """Plan ``lengths`` once per (strategy, packing) variant of ``config`` with the balancer's ``make_plan``.

    ``progress``: a :class:`~ringpack.progress.Progress` counting the steps planned over all variants.
    """
    plans = []
    for k, (strategy, packing) in enumerate(variants):
        cfg = dataclasses.replace(config, strategy=strategy, packing=packing)
        steps = None if progress is None else progress.part(k, len(variants))
        plans.append(make_plan(lengths, cfg, progress=steps))
    return plans
