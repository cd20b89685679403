"""Every figure a report prints, computed from a plan's piece table in a few numpy passes (docs/analysis.md).

One implementation of cost: per-piece tokens and exact causal pairs come from
:func:`ringpack.cost.piece_pairs` and are priced by :meth:`CostModel.cost`, the code the planner
balances with, applied to :attr:`Plan.piece_arrays` columns with no Python loop over pieces.
:class:`PlanMetrics` holds per step, DP rank, micro-batch and CP rank: a rank's cost; a
micro-batch's time (the max over its CP ranks); a DP rank's time (the sum over its micro-batches);
the step time (the max over DP ranks); each GPU's busy cost; the K/V crossing ranks
(:func:`ringpack.comm_model.kv_cross_tokens`); and the padding a zigzag that needs every
sample to be a multiple of ``2*cp`` would add (:func:`zigzag_rule_padding`; ringpack pads nothing).
The figures derived from them (idle fraction, max/mean, imbalance) are defined in docs/analysis.md,
"The figures". :func:`concat_metrics` stacks the steps of several parts of one plan.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ringpack.comm_model import kv_cross_tokens
from ringpack.cost import CostModel, piece_pairs
from ringpack.planner.bounds import critical_path, rank_grid

__all__ = [
    "PlanMetrics",
    "concat_metrics",
    "evaluate",
    "evaluate_plan",
    "zigzag_rule_padding",
    "plan_label",
    "BLOCK_ENTRIES",
    "sample_blocks",
    "from_rank_sums",
]


@dataclass
class PlanMetrics:
    """Per step / DP rank / micro-batch / CP rank figures of one plan (arrays, cost unit of ``model``).

    Shapes: ``S`` steps, ``D`` DP ranks, ``M`` the most micro-batches any step gives a DP rank,
    ``C`` CP ranks. Micro-batch slots a step does not use hold zeros (``mb_exists`` is False).
    """

    name: str
    dp: int
    cp: int
    model: CostModel
    mb_exists: np.ndarray  # (S, D, M) bool
    tokens: np.ndarray  # (S, D, M, C) int64
    pairs: np.ndarray  # (S, D, M, C) int64
    segments: np.ndarray  # (S, D, M, C) int64
    cost: np.ndarray  # (S, D, M, C) float64
    kv_cross_tokens: np.ndarray  # (S, D, M, C) int64: tokens of this rank's K/V some other CP rank needs
    zigzag_padding: np.ndarray  # (S, D, M, C) int64: tokens the 2*cp-rule zigzag would pad onto this rank
    samples: np.ndarray  # (S,) samples planned per step
    loss_tokens: np.ndarray  # (S,) int64

    # ---------------------------------------------------------------- derived, all vectorised
    @property
    def num_steps(self) -> int:
        return int(self.cost.shape[0])

    @property
    def dp_time(self) -> np.ndarray:
        """(S, D): each DP rank's time, the sum of its micro-batches' times (the planner's definition)."""
        return critical_path(self.cost)[0]

    @property
    def step_cost(self) -> np.ndarray:
        """(S,): the slowest DP rank's time."""
        return critical_path(self.cost)[1]

    @property
    def busy(self) -> np.ndarray:
        """(S, D, C): each GPU's own work over the step."""
        return self.cost.sum(axis=2)

    def imbalance_at_pair_price(self, factor: float) -> float:
        """Whole-plan imbalance if a pair truly cost ``factor`` times the model's price: the sum over
        steps of the critical path over the sum of the mean GPU's busy cost, both at that price."""
        m = self.model
        cost = m.token * self.tokens + factor * m.pair * self.pairs + m.segment * self.segments
        busy = cost.sum() / (self.dp * self.cp)
        return float(critical_path(cost)[1].sum() / busy) if busy > 0 else 1.0

    @property
    def step_tokens(self) -> np.ndarray:
        return self.tokens.sum(axis=(1, 2, 3))

    @property
    def idle_fraction(self) -> np.ndarray:
        """(S,): ``1 - sum(busy) / (D*C*step time)``."""
        total = self.busy.sum(axis=(1, 2))
        capacity = self.dp * self.cp * self.step_cost
        return np.where(capacity > 0, 1.0 - total / np.where(capacity > 0, capacity, 1.0), 0.0)

    @property
    def max_mean(self) -> np.ndarray:
        """(S,): busiest GPU over mean GPU busy cost."""
        busy = self.busy.reshape(self.num_steps, -1)
        mean = busy.mean(axis=1)
        return np.where(mean > 0, busy.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)

    @property
    def dp_max_mean(self) -> np.ndarray:
        """(S,): slowest DP rank's time over the mean DP rank's."""
        t = self.dp_time
        mean = t.mean(axis=1)
        return np.where(mean > 0, t.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)

    @property
    def cp_max_mean(self) -> np.ndarray:
        """(S,): mean over the step's micro-batches of (slowest CP rank / mean CP rank)."""
        mean = self.cost.mean(axis=3)
        ratio = np.where(mean > 0, self.cost.max(axis=3) / np.where(mean > 0, mean, 1.0), 1.0)
        count = self.mb_exists.sum(axis=(1, 2))
        return np.where(count > 0, (ratio * self.mb_exists).sum(axis=(1, 2)) / np.maximum(count, 1), 1.0)

    @property
    def step_seconds(self) -> np.ndarray:
        """(S,): predicted compute time of each step (cost model; no communication)."""
        return self.model.seconds(self.step_cost)

    def kv_bytes(self, bytes_per_token: float) -> np.ndarray:
        """(S, D, M, C): K/V bytes each rank's pieces put on the wire (``bytes_per_token`` all layers)."""
        return self.kv_cross_tokens * float(bytes_per_token)

    def summary(self) -> dict[str, float]:
        """Epoch-level figures (sums over steps; ratios of sums)."""
        step_cost = self.step_cost
        total_busy = float(self.busy.sum())
        total_capacity = float(self.dp * self.cp * step_cost.sum())
        tokens = int(self.tokens.sum())
        seconds = float(self.model.seconds(step_cost.sum()))
        return {
            "steps": self.num_steps,
            "microbatches": int(self.mb_exists.sum()),
            "samples": int(self.samples.sum()),
            "tokens": tokens,
            "loss_tokens": int(self.loss_tokens.sum()),
            "step_cost_total": float(step_cost.sum()),
            "busy_cost_total": total_busy,
            "idle_fraction": 1.0 - total_busy / total_capacity if total_capacity > 0 else 0.0,
            "idle_gpu_seconds": float(self.model.seconds(total_capacity - total_busy)),
            "max_mean_mean": float(self.max_mean.mean()) if self.num_steps else 1.0,
            "max_mean_worst": float(self.max_mean.max()) if self.num_steps else 1.0,
            "dp_max_mean_mean": float(self.dp_max_mean.mean()) if self.num_steps else 1.0,
            "cp_max_mean_mean": float(self.cp_max_mean.mean()) if self.num_steps else 1.0,
            "predicted_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "padding_tokens": 0,
            "zigzag_rule_padding_tokens": int(self.zigzag_padding.sum()),
            "kv_cross_tokens": int(self.kv_cross_tokens.sum()),
        }


def concat_metrics(parts: Sequence[PlanMetrics], name: str) -> PlanMetrics:
    """Stack the steps of several metrics of one strategy (micro-batch axis padded to the widest)."""
    M = max(p.cost.shape[2] for p in parts)

    def pad(a: np.ndarray) -> np.ndarray:
        if a.shape[2] == M:
            return a
        width = [(0, 0)] * a.ndim
        width[2] = (0, M - a.shape[2])
        return np.pad(a, width)

    first = parts[0]
    fields = ("mb_exists", "tokens", "pairs", "segments", "cost", "kv_cross_tokens", "zigzag_padding")
    stacked = {f: np.concatenate([pad(getattr(p, f)) for p in parts], axis=0) for f in fields}
    return PlanMetrics(
        name=name,
        dp=first.dp,
        cp=first.cp,
        model=first.model,
        samples=np.concatenate([p.samples for p in parts]),
        loss_tokens=np.concatenate([p.loss_tokens for p in parts]),
        **stacked,
    )


def zigzag_rule_padding(lengths: np.ndarray, cp: int) -> np.ndarray:
    """(N, C) padding tokens each CP rank gets when each sample is padded to a multiple of ``2*cp``.

    The padded sample (length ``P = L + ((-L) mod 2cp)``) is cut into ``2*cp`` chunks of ``P/2cp``
    tokens, rank ``r`` takes chunks ``r`` and ``2cp-1-r``, and the padding is the tail ``[L, P)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    two_c = 2 * cp
    padded = lengths + (-lengths) % two_c
    chunk = padded // two_c
    r = np.arange(cp, dtype=np.int64)[None, :]
    out = np.zeros((lengths.size, cp), dtype=np.int64)
    for first in (r, two_c - 1 - r):  # two chunks per rank: a loop of 2, vectorised over samples
        lo = first * chunk[:, None]
        hi = lo + chunk[:, None]
        out += np.clip(hi - np.maximum(lo, lengths[:, None]), 0, None)
    return out


def evaluate(
    arrays: Mapping[str, np.ndarray],
    lengths: np.ndarray,
    *,
    dp: int,
    cp: int,
    model: CostModel,
    name: str = "plan",
    shape: tuple[int, int, int] | None = None,
) -> PlanMetrics:
    """Metrics of a plan given as piece columns and its sample lengths.

    Args:
        arrays: the plan's piece table (``Plan.piece_arrays``): int64 columns ``[P]`` named
            ``step, dp, microbatch, cp, slot, sample, start, stop``, one row per piece.
        lengths: int64 ``[N]``, the planned samples' lengths.
        dp, cp: the mesh the plan is for.
        model: the cost model that prices each rank's tokens, pairs and pieces.
        name: the plan's label in reports.
        shape: ``(S, D, M)``: steps, DP ranks and the widest micro-batch count (``None``: from
            the columns).

    Returns:
        :class:`PlanMetrics` with ``(S, D, M, C)`` arrays (zeros in unused micro-batch slots).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    per_rank, cell, grid = rank_grid(arrays, dp, cp, shape)
    start, stop, sample = (np.asarray(arrays[k], dtype=np.int64) for k in ("start", "stop", "sample"))
    kv = np.asarray(kv_cross_tokens(arrays, shape=grid), dtype=np.int64)
    sums = (per_rank(stop - start), per_rank(piece_pairs(start, stop)), per_rank(None), per_rank(kv))
    # one row per (micro-batch, sample): the piece with start == 0 is unique for each sample
    first = start == 0
    return from_rank_sums(sums, cell[first], lengths[sample[first]], grid=grid, cp=cp, model=model, name=name)


def _zigzag_padding_grid(
    sample_cell: np.ndarray, sample_length: np.ndarray, cp: int, grid: tuple[int, int, int]
) -> np.ndarray:
    """(S, D, M, C): the 2*cp-rule zigzag padding of each micro-batch's samples, per CP rank.

    Samples go through in blocks of :data:`BLOCK_ENTRIES` ``(sample, rank)`` entries, so memory
    stays bounded at any CP size.
    """
    padding = np.zeros((int(np.prod(grid)), cp), dtype=np.int64)
    for lo, hi in sample_blocks(sample_cell.size, cp):
        np.add.at(padding, sample_cell[lo:hi], zigzag_rule_padding(sample_length[lo:hi], cp))
    return padding.reshape(*grid, cp)


#: Entries of the largest ``(samples, ranks)`` or ``(samples, chunks)`` array a metric builds at a time:
#: work over more samples goes in blocks, so memory is bounded whatever the CP size.
BLOCK_ENTRIES = 1 << 20


def sample_blocks(n: int, width: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``range(n)`` with at most :data:`BLOCK_ENTRIES` ``// width`` items each."""
    step = max(1, BLOCK_ENTRIES // max(width, 1))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _per_step_samples(
    sample_cell: np.ndarray, sample_length: np.ndarray, grid: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(S,) samples and (S,) loss tokens (``length - 1`` each) of every step."""
    steps, dp, microbatches = grid
    step_of_sample = sample_cell // (dp * microbatches)
    samples = np.bincount(step_of_sample, minlength=steps)
    loss = np.bincount(step_of_sample, weights=(sample_length - 1).astype(np.float64), minlength=steps)
    return samples, loss.astype(np.int64)


def evaluate_plan(plan, name: str | None = None) -> PlanMetrics:
    """:func:`evaluate` of a :class:`~ringpack.shard_plan.Plan` (its config's dp, cp and cost model)."""
    cfg = plan.config
    if name is None:
        name = plan_label(cfg)
    S = plan.num_steps
    M = max((len(rank) for step in plan.steps for rank in step.microbatches), default=0)
    return evaluate(
        plan.piece_arrays,
        np.asarray(plan.lengths),
        dp=cfg.dp,
        cp=cfg.cp,
        model=cfg.cost,
        name=name,
        shape=(S, cfg.dp, M),
    )


def plan_label(cfg) -> str:
    """``strategy/packing``, the name reports give a plan."""
    return f"{cfg.strategy}/{cfg.packing}"


def from_rank_sums(
    sums: Sequence[np.ndarray],
    sample_cell: np.ndarray,
    sample_length: np.ndarray,
    *,
    grid: tuple[int, int, int],
    cp: int,
    model: CostModel,
    name: str,
) -> PlanMetrics:
    """:class:`PlanMetrics` of a plan given its rank sums and where its samples are, as :func:`evaluate` builds it.

    Args:
        sums: tokens, pairs, segments and K/V-crossing tokens per rank, int64 ``[S*D*M, C]``.
        sample_cell: int64 ``[N]``, each sample's flat ``(step, dp rank, micro-batch)`` cell.
        sample_length: int64 ``[N]``, each sample's length.
        grid: ``(S, D, M)``.
        cp, model, name: the CP size, the cost model, the plan's label.
    """
    tokens, pairs, segments, kv = (np.asarray(x).reshape(*grid, cp) for x in sums)
    exists = np.zeros(int(np.prod(grid)), dtype=bool)
    exists[sample_cell] = True
    samples, loss = _per_step_samples(sample_cell, sample_length, grid)
    return PlanMetrics(
        name=name,
        dp=grid[1],
        cp=cp,
        model=model,
        mb_exists=exists.reshape(grid),
        tokens=tokens,
        pairs=pairs,
        segments=segments,
        cost=model.cost(tokens, pairs, segments),
        kv_cross_tokens=kv,
        zigzag_padding=_zigzag_padding_grid(sample_cell, sample_length, cp, grid),
        samples=samples,
        loss_tokens=loss,
    )
