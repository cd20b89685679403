"""``batch_window``: costly samples gathered across neighbouring global batches, by swaps.

The epoch's global batches are taken in blocks of ``batch_window + 1``. In a block, the step
holding the costliest sample receives the block's costliest samples (priced by ``config.cost``),
each swapping places with one of its other samples in shuffled order; of the candidate gatherings
(the samples above each threshold) the one saving the most predicted time (the steps' lower bounds
plus the micro-batch charge) net of a price per moved sample is made, and the next round starts
from the costliest sample of the steps not yet receiving, until no gathering pays. Every batch
keeps its size, no sample leaves its block (so none moves more than ``batch_window`` steps, and the
epoch's last block drains itself), and a block is a pure function of its batches, the lengths and
the config, balanced on first use: a stream plans its first step after one block.

See docs/planner.md, "Balancing across global batches".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from ringpack.shard_plan import PlanConfig

__all__ = ["BalancedWindows", "WindowMoves", "GATHER_THRESHOLDS", "MOVE_PRICE"]

#: A block's candidate gatherings: the samples costlier than each of these multiples of a DP
#: rank's mean load per step (the block's cost over ``steps * dp``) move into the receiving step.
GATHER_THRESHOLDS = tuple(4.0 * 2 ** (-k / 2) for k in range(13))  # 4 down to 1/16, by sqrt(2)
#: What moving one sample costs, in mean samples' time (the block's predicted time as drawn over its
#: samples; a swap moves two): the block keeps the gathering that saves the most predicted time net
#: of that price (the fewest moves on a tie), and none unless one saves more than it costs.
MOVE_PRICE = 1.0


@dataclass(frozen=True)
class WindowMoves:
    """What the window did to an epoch's global batches (:attr:`BalancedWindows.moves`).

    Attributes:
        sample: int64 ``[k]``, ascending: the documents planned in another step than the shuffle
            drew them in.
        drawn: int64 ``[k]``, the step each was drawn in.
        step: int64 ``[k]``, the step each is planned in (``|step - drawn| <= batch_window``).
        predicted_drawn: float64 ``[S]``, each step's predicted cost (its lower bound plus the
            micro-batch charge, in the cost model's unit) with the batches as drawn.
        predicted: float64 ``[S]``, the same with the batches as balanced.
    """

    sample: np.ndarray
    drawn: np.ndarray
    step: np.ndarray
    predicted_drawn: np.ndarray
    predicted: np.ndarray

    @property
    def count(self) -> int:
        """Documents moved."""
        return int(self.sample.size)

    @property
    def distances(self) -> np.ndarray:
        """int64 ``[k]``: how many global batches each moved document moved."""
        return np.abs(self.step - self.drawn)

    def summary(self, config: PlanConfig, samples: int, tokens: int) -> dict[str, float | int]:
        """What the window moved and bought, as plain numbers (``ringpack plan`` and ``report`` print them).

        Args:
            config: the plan config (its ``batch_window`` and cost model).
            samples, tokens: the epoch's planned documents and their tokens.

        Returns:
            ``batch_window``, ``moved``, ``moved_fraction`` (of ``samples``), ``max_distance`` and
            ``mean_distance`` (global batches), ``predicted_seconds`` and
            ``predicted_seconds_without`` (the sum of the steps' predicted costs with and without
            the window, in seconds) and ``tokens_per_second`` / ``tokens_per_second_without``.
        """
        d = self.distances
        with_s = float(config.cost.seconds(math.fsum(self.predicted.tolist())))
        without_s = float(config.cost.seconds(math.fsum(self.predicted_drawn.tolist())))
        return {
            "batch_window": config.batch_window,
            "moved": self.count,
            "moved_fraction": self.count / samples if samples else 0.0,
            "max_distance": int(d.max()) if d.size else 0,
            "mean_distance": float(d.mean()) if d.size else 0.0,
            "predicted_seconds": with_s,
            "predicted_seconds_without": without_s,
            "tokens_per_second": tokens / with_s if with_s > 0 else 0.0,
            "tokens_per_second_without": tokens / without_s if without_s > 0 else 0.0,
        }


class BalancedWindows(Sequence):
    """An epoch's global batches with ``config.batch_window`` applied, one block at a time, on first use.

    Args:
        drawn: one int64 array of document ids per step, in shuffled order (as the shuffle cut them).
        lengths: int64 ``[D]``, every document's length (ids index it).
        config: ``batch_window`` (>= 1), the mesh, the token budget, ``microbatches_per_rank`` and
            the cost model that prices samples.

    Indexing gives step ``s``'s ids (int64, shuffled order, with the block's swaps); a block is
    computed once, by whichever thread asks first (two threads asking at once compute the same
    arrays). Each batch keeps its size. With ``microbatches_per_rank`` set no batch gets more
    tokens than the fullest batch of its block as drawn; without it a batch's tokens stay within
    half of what ``samples // dp`` micro-batches per DP rank hold, so it can always be packed.
    """

    def __init__(self, drawn: list[np.ndarray], lengths: np.ndarray, config: PlanConfig) -> None:
        if config.batch_window < 1:
            raise ValueError(f"BalancedWindows needs batch_window >= 1, got {config.batch_window}")
        self.drawn = drawn
        self.lengths = lengths
        self.config = config
        self.block_steps = config.batch_window + 1
        self._blocks: dict[int, tuple[list[np.ndarray], np.ndarray, np.ndarray]] = {}
        self._weights: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.drawn)

    @overload
    def __getitem__(self, s: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, s: slice) -> list[np.ndarray]: ...
    def __getitem__(self, s):
        if isinstance(s, slice):
            return [self[i] for i in range(*s.indices(len(self)))]
        n = len(self.drawn)
        if not -n <= s < n:
            raise IndexError(f"step {s} outside [0, {n})")
        s = s % n
        first = s - s % self.block_steps
        return self._block(first)[0][s - first]

    def moves(self) -> WindowMoves:
        """Every block's moves and predicted step costs (computes the blocks not computed yet)."""
        drawn_of = np.full(self.lengths.size, -1, dtype=np.int64)
        planned_of = np.full(self.lengths.size, -1, dtype=np.int64)
        for s, ids in enumerate(self.drawn):
            drawn_of[ids] = s
            planned_of[self[s]] = s
        sample = np.flatnonzero(drawn_of != planned_of)
        blocks = [self._block(first) for first in range(0, len(self.drawn), self.block_steps)]
        return WindowMoves(
            sample,
            drawn_of[sample],
            planned_of[sample],
            np.concatenate([b[1] for b in blocks]),
            np.concatenate([b[2] for b in blocks]),
        )

    def _block(self, first: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """Block starting at step ``first``: ``(windows, predicted cost per step as drawn, as balanced)``."""
        block = self._blocks.get(first)
        if block is None:
            if self._weights is None:
                self._weights = self.config.cost.sample_cost(self.lengths)
            block = _balance_block(
                self.drawn[first : first + self.block_steps], self.lengths, self._weights, self.config
            )
            self._blocks[first] = block
        return block


def _balance_block(
    windows: list[np.ndarray], lengths: np.ndarray, weights: np.ndarray, config: PlanConfig
) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """One block: ``(windows, predicted cost of each step as drawn, as balanced)``.

    Rounds: the step holding the costliest sample of the steps still open receives; of the
    gatherings into it (the open samples above each threshold), the one saving the most predicted
    time net of the moves' price is made and the receiver closes; the rounds stop when none pays.
    """
    sizes = np.array([w.size for w in windows], dtype=np.int64)
    steps = sizes.size
    flat = np.concatenate(windows).astype(np.int64)
    position_step = np.repeat(np.arange(steps, dtype=np.int16 if steps < 2**15 else np.int64), sizes)
    order = np.lexsort((np.arange(flat.size), -weights[flat]))  # costliest first, ties by position
    ranked = _Ranked(weights[flat][order], lengths[flat][order], steps, config)
    base = ranked.estimates(position_step[order])
    if steps < 2:
        return windows, base, base
    rank_at = np.empty(flat.size, dtype=np.int64)  # rank of the sample at each position
    rank_at[order] = np.arange(flat.size)
    thresholds = np.asarray(GATHER_THRESHOLDS) * (math.fsum(ranked.weights.tolist()) / (steps * config.dp))
    price = MOVE_PRICE * math.fsum(base.tolist()) / flat.size  # one sample moved costs this much time
    drawn_tokens = np.bincount(position_step, weights=lengths[flat], minlength=steps)
    open_steps = np.ones(steps, dtype=bool)
    est, total = base, math.fsum(base.tolist())
    while open_steps.sum() > 1:
        rank_step = np.empty(flat.size, dtype=position_step.dtype)
        rank_step[rank_at] = position_step
        free = np.flatnonzero(open_steps[rank_step])  # ranks in open steps, costliest first
        receiver = int(rank_step[free[0]])
        cap = _token_cap(drawn_tokens, int(sizes[receiver]), config)
        counts = np.minimum(np.searchsorted(-ranked.weights[free], -thresholds, side="left"), sizes[receiver])
        best = None  # (net time saved, incoming, partners, estimates, total)
        for k in sorted(set(counts.tolist()) - {0}):
            swap = _gather(free[:k], rank_at, position_step, receiver, flat, lengths, cap)
            if swap is None:
                continue
            incoming, partners = swap
            new_step = rank_step.copy()
            new_step[rank_at[incoming]] = receiver
            new_step[rank_at[partners]] = position_step[incoming]
            trial = ranked.estimates(new_step)
            trial_total = math.fsum(trial.tolist())
            net = total - trial_total - price * 2 * incoming.size
            if net > 0 and (best is None or net > best[0]):
                best = (net, incoming, partners, trial, trial_total)
        if best is None:
            break
        _, incoming, partners, est, total = best
        flat[incoming], flat[partners] = flat[partners], flat[incoming]
        rank_at[incoming], rank_at[partners] = rank_at[partners], rank_at[incoming]
        open_steps[receiver] = False
    if est is base:
        return windows, base, base
    return np.split(flat, np.cumsum(sizes)[:-1]), base, est


def _gather(
    top: np.ndarray,
    rank_at: np.ndarray,
    position_step: np.ndarray,
    receiver: int,
    flat: np.ndarray,
    lengths: np.ndarray,
    cap: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions of the samples of ranks ``top`` outside step ``receiver`` and of the receiver's
    other samples they swap with (its first ones in shuffled order); ``None`` when none moves, the
    receiver lacks partners or it would hold more than ``cap`` tokens."""
    chosen = np.zeros(flat.size, dtype=bool)
    chosen[top] = True
    at_chosen = chosen[rank_at]  # by position
    incoming = np.flatnonzero(at_chosen & (position_step != receiver))
    mine = np.flatnonzero(position_step == receiver)
    partners = mine[~at_chosen[mine]][: incoming.size]
    if not incoming.size or partners.size < incoming.size:
        return None
    tokens = int(lengths[flat[mine]].sum() + lengths[flat[incoming]].sum() - lengths[flat[partners]].sum())
    return None if tokens > cap else (incoming, partners)


def _token_cap(drawn_tokens: np.ndarray, size: int, config: PlanConfig) -> int:
    """The most tokens a receiving step of ``size`` samples may hold (see :class:`BalancedWindows`)."""
    if config.microbatches_per_rank:
        return min(int(drawn_tokens.max()), config.dp * config.microbatches_per_rank * config.group_capacity)
    return (size // config.dp) * config.dp * config.group_capacity // 2


class _Ranked:
    """A block's samples, costliest first, priced per step for any assignment of samples to steps."""

    def __init__(self, weights: np.ndarray, lengths: np.ndarray, steps: int, config: PlanConfig) -> None:
        self.weights = weights
        self.lengths = lengths.astype(np.float64)
        self.steps = steps
        self.config = config

    def estimates(self, rank_step: np.ndarray) -> np.ndarray:
        """float64 ``[steps]``: each step's lower bound plus micro-batch charge, sample ``j`` (by
        rank) in step ``rank_step[j]``.

        The bound is :func:`~ringpack.planner.bounds.step_lower_bound`'s (the mean, the pigeonhole
        sums, the longest sample's last token), for all steps at once; the charge is the cost
        model's ``microbatch`` times ``microbatches_per_rank`` or the fewest micro-batches per DP
        rank that hold the step's tokens.
        """
        config, steps = self.config, self.steps
        dp, cp, cost = config.dp, config.cp, config.cost
        perm = np.argsort(rank_step, kind="stable")  # by step, costliest first within each
        ws = self.weights[perm]
        counts = np.bincount(rank_step, minlength=steps)
        starts = np.concatenate([[0], np.cumsum(counts)])
        cs = np.concatenate([[0.0], np.cumsum(ws)])
        mean = (cs[starts[1:]] - cs[starts[:-1]]) / (dp * cp)
        # pigeonhole: some DP rank holds k+1 of the k*dp+1 costliest samples of a step
        ks = np.where(counts > 0, (counts - 1) // dp + 1, 0)
        step_of_k = np.repeat(np.arange(steps), ks)
        k = np.arange(step_of_k.size) - np.repeat(np.cumsum(ks) - ks, ks)
        a = starts[step_of_k]
        pigeon = np.zeros(steps)
        np.maximum.at(pigeon, step_of_k, (cs[a + k * dp + 1] - cs[a + k * dp - k]) / cp)
        longest = np.where(counts > 0, self.lengths[perm][np.minimum(starts[:-1], perm.size - 1)], 0.0)
        last_token = cost.token + cost.pair * longest + cost.segment
        tokens = np.bincount(rank_step, weights=self.lengths, minlength=steps)
        m = config.microbatches_per_rank or np.maximum(1.0, np.ceil(tokens / (dp * config.group_capacity)))
        return np.maximum(np.maximum(mean, pigeon), last_token) + m * cost.microbatch
