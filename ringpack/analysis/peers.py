"""The systems users compare ringpack with, priced by ringpack's cost and communication models on the same data.

Both peers run the documents and global batches ringpack's plans run
(:func:`ringpack.planner.epoch.global_batches`: the same overflow rule, shuffle and cut), so every
row of a report computes the same tokens and the same exact causal pairs:

* ``wlb``: WLB-LLM's workload-aware variable-length packing with outlier delay and per-document
  (zigzag) sharding, a real :class:`~ringpack.shard_plan.Plan`
  (:func:`ringpack.planner.peers.make_wlb_plan`), measured exactly as ringpack's plans are.
* ``megatron-dcp``: Megatron-Core's dynamic context parallelism, modelled here: it has no fixed
  CP groups, so no plan describes it.

**How dynamic CP runs.** Its scheduler sees the sequence lengths of the whole global batch. A
sequence of ``L`` tokens needs ``ceil(L / max_seqlen_per_rank)`` GPUs rounded up to a power of
two, and runs on a CP sub-group of that size carved out of the DP x CP pool (sizes that divide the
pool, or the whole pool). Longest sequences first, sequences are placed on the least-loaded
sub-group of their size, or on a new one of free GPUs, until the pool is balanced; such a round
is one micro-batch on every GPU, and the pool re-forms its sub-groups for the next round. Inside a
sub-group each sequence is split zigzag (TransformerEngine's THD layout: ``2g`` chunks, rank ``r``
takes chunks ``r`` and ``2g-1-r``, lengths padded to a multiple of ``2g``) and K/V travels in a
ring of the sub-group's ranks.

**The model of it** (:func:`dcp_schedule`), per global batch:

1. sample ``i`` gets group size ``g_i``: the smallest valid size at least
   ``ceil(L_i / tokens_per_rank)`` rounded up to a power of two;
2. its work is split zigzag over its ``g_i`` ranks, each rank priced by the cost model (exact
   pairs); K/V of chunks another rank needs crosses (the rule of :mod:`ringpack.traffic`), timed
   as a ring of ``g_i`` ranks by the communication model;
3. groups are aligned blocks of ``g`` GPUs: the largest size first, each size's samples costliest
   first onto the least-loaded block of that size (LPT). Every block of a size has one history,
   so its GPUs are free together: a sample starts when its block is free and holds the block for
   its slowest rank's time;
4. a GPU is busy for its own ranks' costs; the step time is the latest GPU's finish.

The model is optimistic for the peer: its scheduler prices samples with the true cost model
(Megatron-Core's estimates attention alone, ``L^2 / g``), rounds cost no barrier, padding costs no
compute, and changing sub-groups costs nothing. Its figures are an upper bound on dynamic CP's
speed under these models. Figures without a meaning for it are ``None``: micro-batches, DP and
CP max/mean, and the gap (the planner's lower bound assumes fixed CP groups).
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringpack.analysis.comm_model import CommModel, microbatch_seconds
from ringpack.analysis.robustness import PRICE_FACTORS
from ringpack.cost import CostModel, piece_pairs
from ringpack.shard_plan import PlanConfig

__all__ = [
    "DCP",
    "WLB",
    "PEERS",
    "PEER_DESCRIPTIONS",
    "valid_group_sizes",
    "group_sizes",
    "zigzag_shares",
    "JobClass",
    "DynamicCPSchedule",
    "dcp_schedule",
    "concat_schedules",
    "ScheduleResult",
    "timed_schedule",
    "PeerPart",
    "PeerJob",
    "Peer",
    "parse_peers",
    "measure_peer",
    "try_measure_peer",
    "join_peer_parts",
    "time_peer",
    "peer_rows",
]

logger = logging.getLogger(__name__)

DCP = "megatron-dcp"
WLB = "wlb"
#: The peers ``ringpack report`` and ``ringpack simulate`` can add, in report order.
PEERS: tuple[str, ...] = (DCP, WLB)
PEER_DESCRIPTIONS: dict[str, str] = {
    DCP: "Megatron-Core dynamic context parallelism, modelled (optimistic for it): each sample on a CP sub-group of "
    "ceil_pow2(L / tokens_per_rank) GPUs of the DP x CP pool, split zigzag inside it, sub-groups placed LPT onto "
    "aligned GPU blocks (step = latest GPU). Each step holds the documents of ringpack's; no gap (the lower bound "
    "assumes fixed CP groups)",
    WLB: "WLB-LLM, a real plan: workload-aware packing (least-workload micro-batch, longest document first), "
    "per-document zigzag, and outlier delay queues that move long documents into later global batches. So its "
    "steps hold other documents than ringpack's, which trains each global batch as drawn: its step figures (imbal, "
    "gap) are not the same work per step, while epoch time and tok/s cover the same documents in another order. Its "
    "gap is against the lower bound of the documents it put in each step",
}


# ------------------------------------------------------------------------------------ group sizes
def valid_group_sizes(gpus: int) -> np.ndarray:
    """int64, ascending: the CP sub-group sizes a pool of ``gpus`` offers (powers of two dividing it, and ``gpus``).

    Each size divides every larger one, so aligned blocks of a size nest inside blocks of the next.
    """
    sizes = [1 << k for k in range(int(gpus).bit_length()) if gpus % (1 << k) == 0]
    return np.unique(np.asarray([*sizes, gpus], dtype=np.int64))


def group_sizes(lengths: np.ndarray, tokens_per_rank: int, gpus: int) -> np.ndarray:
    """int64 ``[n]``: the sub-group size of every sample under dynamic CP.

    Args:
        lengths: int64 ``[n]`` sample lengths.
        tokens_per_rank: one rank's token capacity in one micro-batch.
        gpus: the DP x CP pool.

    Raises:
        ValueError: a sample longer than the whole pool holds.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    needed = -(-lengths // tokens_per_rank)
    if needed.size and needed.max() > gpus:
        raise ValueError(f"a sample of {int(lengths.max())} tokens needs more than the {gpus} GPUs of the pool")
    sizes = valid_group_sizes(gpus)  # powers of two, then the pool: the first >= needed is the rounded-up one
    return sizes[np.searchsorted(sizes, needed)]


def zigzag_shares(lengths: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's share of samples split zigzag over ``g`` ranks (cuts at ``floor(k*L/(2g))``, as ``split_zigzag``).

    Returns ``(tokens, pairs, segments, kv_cross)``, int64 ``[n, g]``: rank ``r`` holds chunks
    ``r`` and ``2g-1-r``; ``kv_cross`` counts its tokens another rank needs (:func:`needed_pieces`).
    """
    from ringpack.traffic import needed_pieces

    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    cuts = (np.arange(2 * g + 1, dtype=np.int64)[None, :] * lengths[:, None]) // (2 * g)
    start, stop = cuts[:, :-1].ravel(), cuts[:, 1:].ravel()
    chunk = np.tile(np.arange(2 * g, dtype=np.int64), n)
    owner = np.minimum(chunk, 2 * g - 1 - chunk)
    sample = np.repeat(np.arange(n, dtype=np.int64), 2 * g)
    keep = stop > start
    sample, owner, start, stop = sample[keep], owner[keep], start[keep], stop[keep]
    need = needed_pieces(sample, owner, sample, start, stop) if g > 1 else np.zeros(sample.size, dtype=np.int64)
    cell = sample * g + owner

    def per_rank(values: np.ndarray) -> np.ndarray:
        return np.bincount(cell, weights=values, minlength=n * g).astype(np.int64).reshape(n, g)

    tokens = stop - start
    pairs = np.zeros(n * g, dtype=np.int64)
    np.add.at(pairs, cell, piece_pairs(start, stop))  # exact: bincount's float64 would round big counts
    return (
        per_rank(tokens),
        pairs.reshape(n, g),
        per_rank(np.ones_like(tokens)),
        per_rank(np.where(need > 0, tokens, 0)),
    )


# -------------------------------------------------------------------------------------- schedule
@dataclass
class JobClass:
    """The samples of one sub-group size over a schedule, and where they ran.

    Shapes: ``n`` samples, ``g`` ranks. ``first_gpu`` is the first GPU of the aligned block the
    sample ran on (GPUs ``first_gpu .. first_gpu + g - 1``, rank ``r`` on ``first_gpu + r``).
    """

    size: int
    step: np.ndarray  # (n,) int64
    first_gpu: np.ndarray  # (n,) int64
    lengths: np.ndarray  # (n,) int64
    tokens: np.ndarray  # (n, g) int64
    pairs: np.ndarray  # (n, g) int64
    segments: np.ndarray  # (n, g) int64
    kv_cross: np.ndarray  # (n, g) int64

    def rank_cost(self, model: CostModel, pair_factor: float = 1.0) -> np.ndarray:
        """(n, g) float64: each rank's cost, a pair priced ``pair_factor`` times the model's."""
        return model.token * self.tokens + pair_factor * model.pair * self.pairs + model.segment * self.segments


@dataclass
class DynamicCPSchedule:
    """Where every sample of an epoch ran under dynamic CP (:func:`dcp_schedule`), and the figures derived from it.

    ``S`` steps, ``G = dp * cp`` GPUs. ``classes`` holds one :class:`JobClass` per sub-group size.
    """

    name: str
    dp: int
    cp: int
    model: CostModel
    num_steps: int
    classes: list[JobClass]
    samples: np.ndarray  # (S,) int64
    loss_tokens: np.ndarray  # (S,) int64
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.dp * self.cp

    def gpu_sum(self, per_rank: Sequence[np.ndarray]) -> np.ndarray:
        """(S, G): per-rank values (one ``(n, g)`` array per class) summed onto the GPUs that ran them."""
        out = np.zeros(self.num_steps * self.gpus, dtype=np.result_type(*per_rank, np.int64))
        for jobs, values in zip(self.classes, per_rank):
            cell = (jobs.step * self.gpus + jobs.first_gpu)[:, None] + np.arange(jobs.size)
            np.add.at(out, cell.ravel(), np.asarray(values).ravel())
        return out.reshape(self.num_steps, self.gpus)

    def finish(self, job_times: Sequence[np.ndarray]) -> np.ndarray:
        """(S, G): each GPU's finish time when every sample holds its block for ``job_times`` (``(n,)`` per class)."""
        return self.gpu_sum([np.broadcast_to(t[:, None], (t.size, c.size)) for c, t in zip(self.classes, job_times)])

    def busy(self, pair_factor: float = 1.0) -> np.ndarray:
        """(S, G): each GPU's own compute cost."""
        return self.gpu_sum([c.rank_cost(self.model, pair_factor) for c in self.classes])

    def compute_finish(self, pair_factor: float = 1.0) -> np.ndarray:
        """(S, G): finish times with compute only (a sample holds its block for its slowest rank)."""
        return self.finish([c.rank_cost(self.model, pair_factor).max(axis=1) for c in self.classes])

    def imbalance_at_pair_price(self, factor: float) -> float:
        """Sum over steps of the step time over the sum of the mean GPU's busy cost, a pair at ``factor`` x price."""
        busy = self.busy(factor).sum() / self.gpus
        return float(self.compute_finish(factor).max(axis=1).sum() / busy) if busy > 0 else 1.0

    def per_step(self, values: Sequence[np.ndarray]) -> np.ndarray:
        """(S,): per-sample values (one ``(n,)`` per class) summed per step."""
        out = np.zeros(self.num_steps, dtype=np.result_type(*values, np.int64))
        for jobs, v in zip(self.classes, values):
            np.add.at(out, jobs.step, v)
        return out


def dcp_schedule(lengths: Any, config: PlanConfig, name: str = DCP) -> DynamicCPSchedule:
    """Dynamic CP's schedule of ``lengths`` on the ``dp * cp`` pool of ``config`` (see the module docstring).

    Args:
        lengths: sample lengths (1-D integers >= 1), planned as :func:`make_plan` would: the same
            overflow rule, shuffle and global batches.
        config: the mesh, ``tokens_per_rank`` (one rank's capacity), the cost model, the global batch.
        name: the row's name in reports.

    Returns:
        :class:`DynamicCPSchedule` with one step per global batch.

    Raises:
        PlanError: as :func:`~ringpack.planner.epoch.global_batches`.
    """
    from ringpack.planner.epoch import global_batches

    batches = global_batches(lengths, config)
    gpus = config.dp * config.cp
    ids = np.concatenate(batches.windows)
    step = np.repeat(np.arange(len(batches.windows), dtype=np.int64), [w.size for w in batches.windows])
    L = batches.lengths[ids]
    size = group_sizes(L, config.tokens_per_rank, gpus)
    classes = []
    for g in np.unique(size)[::-1].tolist():  # largest first: the order blocks are filled in
        pick = np.flatnonzero(size == g)
        tokens, pairs, segments, kv = zigzag_shares(L[pick], g)
        classes.append(
            JobClass(g, step[pick], np.zeros(pick.size, dtype=np.int64), L[pick], tokens, pairs, segments, kv)
        )
    _place(classes, len(batches.windows), gpus, config.cost)
    loss = np.bincount(step, weights=(L - 1).astype(np.float64), minlength=len(batches.windows)).astype(np.int64)
    return DynamicCPSchedule(
        name=name,
        dp=config.dp,
        cp=config.cp,
        model=config.cost,
        num_steps=len(batches.windows),
        classes=classes,
        samples=np.bincount(step, minlength=len(batches.windows)),
        loss_tokens=loss,
        config={**config.to_dict(), "strategy": "zigzag", "packing": DCP, "peer": DCP},
    )


def _place(classes: list[JobClass], num_steps: int, gpus: int, model: CostModel) -> None:
    """Fill every class's ``first_gpu``: per step, sizes largest first, LPT onto aligned blocks of the size."""
    times = [c.rank_cost(model).max(axis=1) for c in classes]
    by_step = [np.argsort(c.step, kind="stable") for c in classes]
    edges = [np.searchsorted(c.step[o], np.arange(num_steps + 1)) for c, o in zip(classes, by_step)]
    for s in range(num_steps):
        load = np.zeros(gpus)  # every GPU's finish time so far in the step
        for c, t, order, e in zip(classes, times, by_step, edges):
            jobs = order[e[s] : e[s + 1]]
            if not jobs.size:
                continue
            block_load = load[:: c.size].copy()  # blocks of this size are uniform (larger sizes went first)
            blocks = _lpt(t[jobs], block_load)
            c.first_gpu[jobs] = blocks * c.size
            load = np.repeat(block_load, c.size)


def _lpt(times: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """Costliest job first onto the least-loaded machine (ties: the earlier job, the lower machine).

    ``loads`` (float64 ``[M]``) is updated in place; returns int64 ``[n]``, each job's machine.
    """
    order = np.lexsort((np.arange(times.size), -times))
    heap = [(float(x), b) for b, x in enumerate(loads.tolist())]
    heapq.heapify(heap)
    machine = np.empty(times.size, dtype=np.int64)
    replace = heapq.heapreplace
    for i, t in zip(order.tolist(), times[order].tolist()):
        load, b = heap[0]
        machine[i] = b
        replace(heap, (load + t, b))
    for load, b in heap:
        loads[b] = load
    return machine


def concat_schedules(parts: Sequence[DynamicCPSchedule]) -> DynamicCPSchedule:
    """The steps of several schedules of one mesh, one after the other (simulate's chunks)."""
    first = parts[0]
    offsets = np.cumsum([0, *(p.num_steps for p in parts[:-1])])
    merged: dict[int, list[JobClass]] = {}
    for part, offset in zip(parts, offsets):
        for c in part.classes:
            merged.setdefault(c.size, []).append(dataclasses.replace(c, step=c.step + offset))
    classes = []
    for g in sorted(merged, reverse=True):
        group = merged[g]
        arrays = {f: np.concatenate([getattr(c, f) for c in group]) for f in _JOB_ARRAYS}
        classes.append(JobClass(size=g, **arrays))
    return dataclasses.replace(
        first,
        num_steps=int(sum(p.num_steps for p in parts)),
        classes=classes,
        samples=np.concatenate([p.samples for p in parts]),
        loss_tokens=np.concatenate([p.loss_tokens for p in parts]),
    )


_JOB_ARRAYS = ("step", "first_gpu", "lengths", "tokens", "pairs", "segments", "kv_cross")


# ---------------------------------------------------------------------------------------- figures
@dataclass
class ScheduleResult:
    """A dynamic-CP schedule's figures under one communication model: what a report row needs.

    Arrays over ``S`` steps and ``G`` GPUs, in the cost model's unit unless named seconds.
    """

    metrics: DynamicCPSchedule
    comm: CommModel
    busy: np.ndarray  # (S, G) each GPU's own compute cost
    finish: np.ndarray  # (S, G) each GPU's finish time, compute only
    step_seconds_comm: np.ndarray  # (S,) with the communication model
    exposed_comm_seconds: np.ndarray  # (S,) summed over GPUs
    kv_tokens: np.ndarray  # (S,) tokens whose K/V another rank needs, each once
    kv_ring_tokens: np.ndarray  # (S,) the same, times the ranks a ring relays them through
    padding: np.ndarray  # (S,) tokens TransformerEngine's zigzag pads split samples with (multiple of 2g)
    plan_hash: str | None = None

    @property
    def name(self) -> str:
        return self.metrics.name

    @property
    def config(self) -> dict[str, Any]:
        return self.metrics.config

    @property
    def step_cost(self) -> np.ndarray:
        """(S,): the latest GPU's finish time."""
        return self.finish.max(axis=1)

    @property
    def imbalance(self) -> np.ndarray:
        """(S,): step time over the mean GPU's busy cost."""
        return self.step_cost / np.maximum(self.busy.mean(axis=1), np.finfo(float).tiny)

    def summary(self) -> dict[str, Any]:
        """The report's summary keys; ``None`` where a figure has no meaning for dynamic CP."""
        from ringpack.analysis.report import SUMMARY_KEYS

        m, model, gpus = self.metrics, self.metrics.model, self.metrics.gpus
        step_cost, busy_total = self.step_cost, float(self.busy.sum())
        capacity = gpus * float(step_cost.sum())
        tokens = int(sum(int(c.lengths.sum()) for c in m.classes))
        seconds, seconds_comm = float(model.seconds(step_cost.sum())), float(self.step_seconds_comm.sum())
        max_mean = self.busy.max(axis=1) / np.maximum(self.busy.mean(axis=1), np.finfo(float).tiny)
        by_price = {str(f): m.imbalance_at_pair_price(f) for f in PRICE_FACTORS}
        bytes_per_token = self.comm.kv_bytes_per_token
        out = {
            "steps": m.num_steps,
            "microbatches": None,
            "samples": int(m.samples.sum()),
            "tokens": tokens,
            "loss_tokens": int(m.loss_tokens.sum()),
            "step_cost_total": float(step_cost.sum()),
            "busy_cost_total": busy_total,
            "idle_fraction": 1.0 - busy_total / capacity if capacity > 0 else 0.0,
            "idle_gpu_seconds": float(model.seconds(capacity - busy_total)),
            "imbalance_mean": float(self.imbalance.mean()),
            "imbalance_worst": float(self.imbalance.max()),
            "max_mean_mean": float(max_mean.mean()),
            "max_mean_worst": float(max_mean.max()),
            "dp_max_mean_mean": None,
            "cp_max_mean_mean": None,
            "gap_mean": None,
            "predicted_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "padding_tokens": int(self.padding.sum()),
            "zigzag_rule_padding_tokens": int(self.padding.sum()),
            "kv_bytes": float(self.kv_tokens.sum() * bytes_per_token),
            "kv_ring_bytes": float(self.kv_ring_tokens.sum() * bytes_per_token),
            "predicted_seconds_comm": seconds_comm,
            "tokens_per_second_comm": tokens / seconds_comm if seconds_comm > 0 else 0.0,
            "idle_fraction_comm": 1.0 - float(model.seconds(busy_total)) / (gpus * seconds_comm)
            if seconds_comm > 0
            else 0.0,
            "exposed_comm_seconds": float(self.exposed_comm_seconds.sum()),
            "idle_gpu_seconds_saved": 0.0,
            "speedup_vs_baseline": 1.0,
            "imbalance_by_pair_price": by_price,
            "imbalance_price_worst": max(by_price.values()),
        }
        return {k: out[k] for k in SUMMARY_KEYS}

    def step_rows(self, detail: bool = True) -> list[dict[str, Any]]:
        """The report's step rows; ``None`` where a figure has no meaning (``rank_busy[d][c]``: GPU ``d*cp + c``)."""
        from ringpack.analysis.report import STEP_KEYS

        m, model = self.metrics, self.metrics.model
        step_cost, mean_busy = self.step_cost, self.busy.mean(axis=1)
        tokens = m.per_step([c.lengths for c in m.classes])
        seconds = model.seconds(step_cost)
        busy_seconds = model.seconds(self.busy.sum(axis=1))
        idle = np.where(step_cost > 0, 1.0 - mean_busy / np.where(step_cost > 0, step_cost, 1.0), 0.0)
        comm_capacity = m.gpus * self.step_seconds_comm
        idle_comm = np.where(comm_capacity > 0, 1.0 - busy_seconds / np.where(comm_capacity > 0, comm_capacity, 1), 0)
        max_mean = self.busy.max(axis=1) / np.maximum(mean_busy, np.finfo(float).tiny)
        rows = []
        for s in range(m.num_steps):
            row = {
                "step": s,
                "samples": int(m.samples[s]),
                "tokens": int(tokens[s]),
                "step_cost": float(step_cost[s]),
                "step_seconds": float(seconds[s]),
                "step_seconds_comm": float(self.step_seconds_comm[s]),
                "imbalance": float(self.imbalance[s]),
                "max_mean": float(max_mean[s]),
                "idle_fraction": float(idle[s]),
                "idle_fraction_comm": float(idle_comm[s]),
                "padding_tokens": int(self.padding[s]),
                "zigzag_rule_padding_tokens": int(self.padding[s]),
                "kv_bytes": float(self.kv_tokens[s] * self.comm.kv_bytes_per_token),
                "rank_busy": self.busy[s].reshape(m.dp, m.cp).tolist() if detail else None,
            }
            rows.append({k: row.get(k) for k in STEP_KEYS})
        return rows


def timed_schedule(schedule: DynamicCPSchedule, comm: CommModel) -> ScheduleResult:
    """A schedule's figures: compute costs from the cost model, times with ``comm`` (each sub-group a ring of ``g``).

    Args:
        schedule: :func:`dcp_schedule`'s result.
        comm: the communication model; a sample's ranks form a ring (or all-gather group) of its size.

    Returns:
        :class:`ScheduleResult`.
    """
    model, classes = schedule.model, schedule.classes
    job_seconds, exposed = [], []
    for c in classes:
        seconds, hidden = microbatch_seconds(c.tokens, c.pairs, c.segments, c.kv_cross, model, comm)
        job_seconds.append(seconds.max(axis=1))
        exposed.append(hidden.sum(axis=1))
    kv = [c.kv_cross.sum(axis=1) for c in classes]
    return ScheduleResult(
        metrics=schedule,
        comm=comm,
        busy=schedule.busy(),
        finish=schedule.compute_finish(),
        step_seconds_comm=schedule.finish(job_seconds).max(axis=1),
        exposed_comm_seconds=schedule.per_step(exposed),
        kv_tokens=schedule.per_step(kv),
        kv_ring_tokens=schedule.per_step([k * (c.size - 1) for k, c in zip(kv, classes)]),
        padding=schedule.per_step([(-c.lengths) % (2 * c.size) * (c.size > 1) for c in classes]),
    )


# -------------------------------------------------------------------------------- peers in reports
@dataclass
class PeerPart:
    """A peer measured on (a chunk of) an epoch, before any communication model.

    ``metrics`` is a :class:`~ringpack.analysis.metrics.PlanMetrics` (``wlb``: a real plan, with
    ``bounds`` its steps' lower bounds) or a :class:`DynamicCPSchedule` (``megatron-dcp``).
    """

    name: str
    metrics: Any
    bounds: list[float | None]
    config: dict[str, Any]
    plan_hash: str | None = None


@dataclass(frozen=True)
class PeerJob:
    """What a worker needs to measure peer ``name`` on a chunk of lengths (simulate's tasks)."""

    name: str
    config: PlanConfig


@dataclass
class Peer:
    """One peer's report row: its name, what it is, and its figures (``result.summary()``, ``result.step_rows()``)."""

    name: str
    description: str
    result: Any  # report.StrategyResult (wlb) or ScheduleResult (megatron-dcp)


def parse_peers(text: str) -> list[str]:
    """``--peers``: ``none``, or a comma-separated list of :data:`PEERS` (``ValueError`` naming an unknown one)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return []
    unknown = [x for x in items if x not in PEERS]
    if unknown or not items or len(set(items)) != len(items):
        raise ValueError(f"--peers: {text!r}: give 'none' or distinct names of {', '.join(PEERS)}")
    return [p for p in PEERS if p in items]


def measure_peer(name: str, lengths: Any, config: PlanConfig) -> PeerPart:
    """Plan or schedule ``lengths`` as peer ``name`` on ``config``'s mesh, budget, cost model and global batches.

    Raises:
        ValueError: an unknown peer; :class:`~ringpack.errors.PlanError` as the peer's planner.
    """
    if name == DCP:
        schedule = dcp_schedule(lengths, config)
        return PeerPart(DCP, schedule, [None] * schedule.num_steps, schedule.config)
    if name == WLB:
        return _measure_wlb(lengths, config)
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


def try_measure_peer(name: str, lengths: Any, config: PlanConfig) -> PeerPart | None:
    """:func:`measure_peer`, or ``None`` with a warning when the peer cannot plan the data (a :class:`PlanError`).

    A peer is an extra row: data ringpack plans but a peer cannot (a fixed ``microbatches_per_rank``
    too small for WLB's deferred documents, say) leaves the row out rather than failing the report.
    """
    from ringpack.errors import PlanError

    try:
        return measure_peer(name, lengths, config)
    except PlanError as exc:
        logger.warning("peer %s left out: %s", name, exc)
        return None


def _measure_wlb(lengths: Any, config: PlanConfig) -> PeerPart:
    """WLB packing with per-document zigzag, measured from its piece table (the plan :func:`make_wlb_plan` makes)."""
    from ringpack.analysis.metrics import evaluate
    from ringpack.planner.peers import WLBConfig, wlb_packing, wlb_zigzag_table

    wlb = WLBConfig()
    cfg = dataclasses.replace(config, strategy="zigzag")
    packing = wlb_packing(lengths, cfg, wlb)
    shape = (len(packing.steps), cfg.dp, max(step.m for step in packing.steps))
    metrics = evaluate(
        wlb_zigzag_table(packing, cfg),
        packing.batches.lengths,
        dp=cfg.dp,
        cp=cfg.cp,
        model=cfg.cost,
        name=WLB,
        shape=shape,
    )
    described = {**cfg.to_dict(), "packing": WLB, "peer": WLB, "wlb": dataclasses.asdict(wlb)}
    return PeerPart(WLB, metrics, [step.lower_bound for step in packing.steps], described)


def join_peer_parts(parts: Sequence[PeerPart | None]) -> PeerPart | None:
    """One peer's chunks (simulate) as one part, steps in chunk order; ``None`` if any chunk is ``None``."""
    from ringpack.analysis.simulate import concat_metrics

    if any(p is None for p in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first.metrics, DynamicCPSchedule):
        metrics = concat_schedules([p.metrics for p in parts])
    else:
        metrics = concat_metrics([p.metrics for p in parts], first.name)
    return PeerPart(first.name, metrics, [b for p in parts for b in p.bounds], first.config)


def time_peer(part: PeerPart, comm: CommModel) -> Peer:
    """The report row of a measured peer under ``comm``."""
    from ringpack.analysis.report import timed

    if isinstance(part.metrics, DynamicCPSchedule):
        result = timed_schedule(part.metrics, comm)
    else:
        result = timed(part.metrics, comm, part.bounds, config=part.config, plan_hash=part.plan_hash)
    return Peer(part.name, PEER_DESCRIPTIONS[part.name], result)


def peer_rows(lengths: Any, config: PlanConfig, comm: CommModel, names: Sequence[str] = PEERS) -> list[Peer]:
    """Report rows of the peers ``names`` on ``lengths`` (as :func:`make_plan` plans them) under ``comm``.

    Args:
        lengths: sample lengths, 1-D integers >= 1.
        config: the plan config ringpack's rows use (mesh, budget, cost model, global batch, overflow).
        comm: the communication model of the report's headline times.
        names: peers of :data:`PEERS`.

    Returns:
        One :class:`Peer` per name, in order; a peer that cannot plan the data is left out with a
        warning (:func:`try_measure_peer`).
    """
    parts = [try_measure_peer(name, lengths, config) for name in names]
    return [time_peer(part, comm) for part in parts if part is not None]
