"""Megatron-Core's dynamic context parallelism, modelled: where each sample runs, how long a step takes.

See docs/analysis.md, "Peers".

Dynamic CP has no fixed CP groups, so no plan describes it. Per global batch
(:func:`~ringpack.planner.epoch.global_batches`: the documents and batches ringpack plans), a
sample of ``L`` tokens runs on a CP sub-group of ``ceil(L / tokens_per_rank)`` GPUs rounded up
to a size the ``dp * cp`` pool offers (:func:`group_sizes`), split zigzag inside it
(:func:`zigzag_shares`, each rank priced by the cost model, K/V that crosses timed as a ring);
sub-groups are aligned GPU blocks filled largest size first, costliest sample first onto the
least-loaded block (:func:`dcp_schedule`), and the step time is the latest GPU's finish
(:func:`timed_schedule`). The model is optimistic for the peer: its scheduler prices samples
with the true cost model, rounds cost no barrier, padding costs no compute and re-forming
sub-groups costs nothing. Figures without a meaning for it (micro-batches, DP and CP max/mean,
the gap to the planner's bound) are ``None``.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringpack.analysis.packed import zigzag_shares
from ringpack.analysis.peers.base import PeerPart
from ringpack.analysis.report import STEP_KEYS, SUMMARY_KEYS
from ringpack.analysis.robustness import PRICE_FACTORS
from ringpack.comm_model import CommModel, microbatch_seconds
from ringpack.cost import CostModel
from ringpack.planner.epoch import global_batches
from ringpack.shard_plan import PlanConfig

__all__ = [
    "DCP",
    "SYSTEM",
    "MegatronDynamicCP",
    "valid_group_sizes",
    "group_sizes",
    "zigzag_shares",
    "JobClass",
    "DynamicCPSchedule",
    "dcp_schedule",
    "concat_schedules",
    "ScheduleResult",
    "timed_schedule",
]

DCP = "megatron-dcp"


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
            "partners_median": None,
            "partners_max": None,
            "partner_memory_bytes": None,
            "ring_fallback_microbatches": 0,
        }
        return {k: out[k] for k in SUMMARY_KEYS}

    def step_rows(self, detail: bool = True) -> list[dict[str, Any]]:
        """The report's step rows; ``None`` where a figure has no meaning (``rank_busy[d][c]``: GPU ``d*cp + c``)."""
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


class MegatronDynamicCP:
    """Megatron-Core's dynamic CP as a :class:`~ringpack.analysis.peers.base.PeerSystem` (modelled)."""

    name = DCP
    description = (
        "Megatron-Core dynamic context parallelism, modelled (optimistic for it): each sample on a CP sub-group of "
        "ceil_pow2(L / tokens_per_rank) GPUs of the DP x CP pool, split zigzag inside it, sub-groups placed LPT onto "
        "aligned GPU blocks (step = latest GPU). Each step holds the documents of ringpack's; no gap (the lower bound "
        "assumes fixed CP groups)"
    )

    def measure(self, lengths: Any, config: PlanConfig) -> PeerPart:
        schedule = dcp_schedule(lengths, config)
        return PeerPart(DCP, schedule, [None] * schedule.num_steps, schedule.config)

    def join(self, parts: Sequence[PeerPart]) -> DynamicCPSchedule:
        return concat_schedules([p.metrics for p in parts])

    def timed(self, part: PeerPart, comm: CommModel) -> ScheduleResult:
        return timed_schedule(part.metrics, comm)


SYSTEM = MegatronDynamicCP()
