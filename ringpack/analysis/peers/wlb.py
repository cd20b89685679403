"""Plans of the packings users compare ringpack with, on the same data and the same global batches.

:func:`make_wlb_plan` is WLB-LLM's workload-aware variable-length packing (Wang et al., OSDI 2025)
as a valid :class:`~ringpack.shard_plan.Plan`: outlier documents wait in per-level queues
(:attr:`WLBConfig.outlier_fractions`) and are released one per micro-batch; the step's documents,
longest first, go to the micro-batch with the least workload that has room; micro-batches are
split over the CP group by ``config.strategy``. It starts from the documents and global batches
:func:`make_plan` sees (:func:`~ringpack.planner.epoch.global_batches`), and every document is
planned exactly once per epoch.

See docs/analysis.md, "Peers: Megatron-Core dynamic CP and WLB-LLM", for the rules and the
differences from the paper.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack.analysis.metrics import concat_metrics
from ringpack.analysis.packed import PackedSteps, evaluate_packed
from ringpack.analysis.peers.base import PeerPart
from ringpack.analysis.report import StrategyResult, timed
from ringpack.comm_model import CommModel
from ringpack.planner.epoch import GlobalBatches, _microbatch_groups, global_batches, split_step, step_lower_bound
from ringpack.shard_plan import Plan, PlanConfig, PlanError

__all__ = [
    "SYSTEM",
    "WLB",
    "WLBLLM",
    "WLBConfig",
    "WLBStep",
    "WLBPacking",
    "wlb_packing",
    "make_wlb_plan",
]


@dataclass(frozen=True)
class WLBConfig:
    """WLB-LLM's knobs.

    Attributes:
        outlier_fractions: a document longer than ``fraction * cp * tokens_per_rank`` is an outlier
            of the level of the largest such fraction; one FIFO queue per level. ``()``: no delay.
    """

    outlier_fractions: tuple[float, ...] = (0.5, 0.25)

    def __post_init__(self) -> None:
        fractions = tuple(float(f) for f in self.outlier_fractions)
        if any(not 0 < f <= 1 for f in fractions) or len(set(fractions)) != len(fractions):
            raise ValueError(f"WLBConfig.outlier_fractions must be distinct numbers in (0, 1], got {fractions}")
        object.__setattr__(self, "outlier_fractions", tuple(sorted(fractions, reverse=True)))


class _OutlierQueues:
    """One FIFO queue of document ids per outlier level, levels from the longest documents down."""

    def __init__(self, thresholds: Sequence[float]) -> None:
        self.thresholds = np.asarray(thresholds, dtype=np.float64)  # descending
        self.levels: list[deque[int]] = [deque() for _ in thresholds]

    def level_of(self, lengths: np.ndarray) -> np.ndarray:
        """int64 ``[n]``: each length's level, ``-1`` for a regular document."""
        exceeded = (lengths[:, None] > self.thresholds[None, :]).sum(axis=1)  # thresholds descend
        return np.where(exceeded > 0, len(self.thresholds) - exceeded, -1)

    def hold(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Queue the outliers among ``ids`` (in order) and return the regular ones."""
        level = self.level_of(lengths[ids])
        for i, lv in zip(ids[level >= 0].tolist(), level[level >= 0].tolist()):
            self.levels[lv].append(i)
        return ids[level < 0]

    def release(self, num_bins: int, everything: bool) -> list[int]:
        """Every level holding ``num_bins`` documents gives that many, oldest first (all with ``everything``)."""
        out: list[int] = []
        for queue in self.levels:
            count = len(queue) if everything else (len(queue) // num_bins) * num_bins
            out.extend(queue.popleft() for _ in range(count))
        return out

    def take(self, count: int) -> list[int]:
        """The ``count`` oldest documents of the longest levels (to fill a step the delay left short)."""
        out: list[int] = []
        for queue in self.levels:
            while queue and len(out) < count:
                out.append(queue.popleft())
        return out


@dataclass(frozen=True)
class WLBStep:
    """One step of WLB packing: documents ``ids`` in micro-batch ``bins`` (DP rank ``bin // m``, index ``bin % m``)."""

    ids: np.ndarray  # int64 [n], the step's documents in their (window) order
    bins: np.ndarray  # int64 [n], each document's micro-batch in [0, dp * m)
    m: int
    lower_bound: float

    def groups(self, dp: int) -> list[list[int]]:
        """The documents of every micro-batch, in order, each in window order."""
        return _microbatch_groups(self.ids, self.bins, dp * self.m)


@dataclass(frozen=True)
class WLBPacking:
    """WLB packing of an epoch (:func:`wlb_packing`): the documents of :func:`global_batches` and every step."""

    batches: GlobalBatches
    steps: list[WLBStep]


def wlb_packing(lengths: Any, config: PlanConfig, wlb: WLBConfig | None = None) -> WLBPacking:
    """WLB-LLM's packing of ``lengths`` (docs/analysis.md, "Peers"), before any CP split.

    Args:
        lengths: tokens of every sample, a 1-D integer sequence or array, each >= 1.
        config: the mesh, token budget, cost model, global batch, seed and epoch.
        wlb: the outlier levels (default :class:`WLBConfig`).

    Returns:
        :class:`WLBPacking`: one step per global batch, every document in exactly one step (or
        dropped by ``overflow="drop"``).

    Raises:
        PlanError: as :func:`global_batches`, or a step whose documents cannot give every
            micro-batch one while fitting the token budget.
    """
    wlb = wlb or WLBConfig()
    batches = global_batches(lengths, config)
    L = batches.lengths
    weights = config.cost.sample_cost(L)
    queues = _OutlierQueues([f * config.group_capacity for f in wlb.outlier_fractions])
    deferred = np.zeros(0, dtype=np.int64)
    steps = []
    last = len(batches.windows) - 1
    for s, window in enumerate(batches.windows):
        num_bins = config.dp * _microbatches(int(L[window].sum()), config)
        regular = queues.hold(window, L)
        released = np.asarray(queues.release(num_bins, everything=s == last), dtype=np.int64)
        ids = np.concatenate([deferred, regular, released]).astype(np.int64)
        if ids.size < num_bins:
            ids = np.concatenate([ids, np.asarray(queues.take(num_bins - ids.size), dtype=np.int64)])
        step, deferred = _wlb_step(s, ids, L, weights, config, s == last)
        steps.append(step)
    return WLBPacking(batches, steps)


def make_wlb_plan(lengths: Any, config: PlanConfig, wlb: WLBConfig | None = None) -> Plan:
    """WLB-LLM's packing of ``lengths`` (:func:`wlb_packing`), each micro-batch split by ``config.strategy``.

    Args:
        lengths: tokens of every sample, a 1-D integer sequence or array, each >= 1.
        config: as :func:`wlb_packing`, plus the CP split ``strategy``; ``config.packing`` is not
            used (the returned plan carries ``config`` unchanged).
        wlb: the outlier levels (default :class:`WLBConfig`).

    Returns:
        A valid plan: one step per global batch, each with its lower bound.

    Raises:
        PlanError: as :func:`wlb_packing`.
    """
    packing = wlb_packing(lengths, config, wlb)
    L = packing.batches.lengths
    length_list = L.tolist()
    steps = [split_step(s.ids, s.bins, s.m, L, config, length_list, s.lower_bound) for s in packing.steps]
    batches = packing.batches
    return Plan(config, tuple(length_list), tuple(steps), dropped=batches.dropped, origins=batches.origins)


def _microbatches(tokens: int, config: PlanConfig) -> int:
    """Micro-batches per DP rank for a step of ``tokens``: the config's, or the fewest that hold them."""
    return config.microbatches_per_rank or max(1, math.ceil(tokens / (config.dp * config.group_capacity)))


def _wlb_step(
    index: int, ids: np.ndarray, L: np.ndarray, weights: np.ndarray, config: PlanConfig, last: bool
) -> tuple[WLBStep, np.ndarray]:
    """Step ``index`` of documents ``ids``: WLB packing; ``(step, deferred ids)``.

    The last step defers nothing: it takes one more micro-batch per DP rank until everything fits.
    """
    m = _microbatches(int(L[ids].sum()), config)
    while True:
        if ids.size < config.dp * m:
            raise PlanError(
                f"step {index}: {ids.size} documents cannot fill dp={config.dp} x {m} micro-batches of "
                f"{config.group_capacity} tokens; use more samples per step or a larger tokens_per_rank"
            )
        bins = _pack_least_workload(L[ids], weights[ids], config.dp * m, config.group_capacity)
        if not last or (bins >= 0).all() or config.microbatches_per_rank:
            break
        m += 1
    if last and (bins < 0).any():
        raise PlanError(
            f"step {index}: the last step's documents do not fit dp={config.dp} x {m} micro-batches "
            f"of {config.group_capacity} tokens; raise microbatches_per_rank or tokens_per_rank"
        )
    placed = bins >= 0
    kept = ids[placed]
    bound = step_lower_bound(weights[kept], L[kept], config.dp, config.cp, config.cost)
    return WLBStep(kept, bins[placed], m, bound), ids[~placed]


def _pack_least_workload(tokens: np.ndarray, weights: np.ndarray, num_bins: int, capacity: int) -> np.ndarray:
    """Longest document first, each to the least-loaded bin with room: int64 bin per document, -1 if none has room.

    Ties (equal lengths, equal loads) go to the earlier document and the lower bin, so the result
    is deterministic. With at least ``num_bins`` documents every bin gets one (the first
    ``num_bins`` documents each open an empty bin).

    Documents come longest first, so a bin with room for one has room for every later one until
    it takes one: ``open`` (a heap by ``(load, bin)``) holds exactly the bins with room for the
    current document, and ``full`` (a heap by free room, largest first) the others, each moved
    back to ``open`` once the documents are short enough. ``O(n log bins)``.
    """
    order = np.lexsort((np.arange(tokens.size), -tokens))
    free = [capacity] * num_bins
    open_bins: list[tuple[float, int]] = []
    full = [(-capacity, b, 0.0) for b in range(num_bins)]  # (-free room, bin, load); a valid heap
    bins = np.full(tokens.size, -1, dtype=np.int64)
    pop, push = heapq.heappop, heapq.heappush
    for i, t, w in zip(order.tolist(), tokens[order].tolist(), weights[order].tolist()):
        while full and -full[0][0] >= t:
            _, b, load = pop(full)
            push(open_bins, (load, b))
        if not open_bins:
            continue
        load, b = pop(open_bins)
        bins[i] = b
        free[b] -= t
        if free[b] >= t:  # later documents are no longer than this one
            push(open_bins, (load + w, b))
        else:
            push(full, (-free[b], b, load + w))
    return bins


WLB = "wlb"


class WLBLLM:
    """WLB-LLM as a :class:`~ringpack.analysis.peers.base.PeerSystem`: a real plan, measured as ringpack's are."""

    name = WLB
    description = (
        "WLB-LLM, a real plan: workload-aware packing (least-workload micro-batch, longest document first), "
        "per-document zigzag, and outlier delay queues that move long documents into later global batches. So its "
        "steps hold other documents than ringpack's, which trains each global batch as drawn (without --batch-window): "
        "its step figures (imbal, gap) are not the same work per step, while epoch time and tok/s cover the same "
        "documents in another order. Its gap is against the lower bound of the documents it put in each step"
    )

    def measure(self, lengths: Any, config: PlanConfig) -> PeerPart:
        """WLB packing with per-document zigzag, measured from its piece table (:func:`make_wlb_plan`'s plan)."""
        wlb = WLBConfig()
        cfg = dataclasses.replace(config, strategy="zigzag")
        packing = wlb_packing(lengths, cfg, wlb)
        packed = PackedSteps.of([(s.ids, s.bins, s.m) for s in packing.steps], packing.batches.lengths, cfg.dp)
        metrics, _ = evaluate_packed(
            packed, "zigzag", cp=cfg.cp, tokens_per_rank=cfg.tokens_per_rank, model=cfg.cost, name=WLB
        )
        described = {**cfg.to_dict(), "packing": WLB, "peer": WLB, "wlb": dataclasses.asdict(wlb)}
        return PeerPart(WLB, metrics, [step.lower_bound for step in packing.steps], described)

    def join(self, parts: Sequence[PeerPart]) -> Any:
        return concat_metrics([p.metrics for p in parts], parts[0].name)

    def timed(self, part: PeerPart, comm: CommModel) -> StrategyResult:
        return timed(part.metrics, comm, part.bounds, config=part.config, plan_hash=part.plan_hash)


SYSTEM = WLBLLM()
