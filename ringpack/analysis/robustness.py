"""How a plan's balance holds up when the cost model's prices are wrong.

A plan is balanced for the prices it was planned with. On a GPU the real price of an attention
pair relative to a token differs from the FLOP model's (often by 2x), so what matters is the plan's
imbalance over a *range* of prices. For a price factor ``f`` the rank cost is
``token * tokens + f * pair * pairs + segment * pieces``; the plan's imbalance at ``f`` is the sum
over steps of the critical path (max over DP ranks of the sum over micro-batches of the max over
CP ranks) divided by the sum over steps of the mean GPU's busy cost: the time the plan takes over
the time a perfectly balanced plan of the same work would take.

Since each rank's cost is linear in ``f``, a plan balanced at both ends of a range is close to
balanced everywhere inside it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringpack.cost import piece_pairs
from ringpack.planner.bounds import critical_path, rank_grid
from ringpack.shard_plan import Plan

__all__ = ["PRICE_FACTORS", "RankTerms", "imbalance_across_prices", "rank_terms"]

#: Pair-price factors a plan is judged over: a quarter to twice the model's price of a pair.
PRICE_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0)


class RankTerms:
    """Per-rank cost terms of a plan: ``tokens``, ``pairs``, ``pieces`` as ``[S, D, M, C]`` int64 grids."""

    def __init__(self, plan: Plan) -> None:
        cfg = plan.config
        a = plan.piece_arrays
        m = max((len(step.microbatches[0]) for step in plan.steps), default=0)
        per_rank, _, _ = rank_grid(a, cfg.dp, cfg.cp, shape=(plan.num_steps, cfg.dp, max(m, 1)))
        self.tokens = per_rank(a["stop"] - a["start"])
        self.pairs = per_rank(piece_pairs(a["start"], a["stop"]))
        self.pieces = per_rank(None)
        self.cost = cfg.cost

    def imbalance(self, factor: float = 1.0) -> float:
        """Total critical path / total mean busy cost, with the pair price scaled by ``factor``."""
        c = self.cost
        mb_rank = c.token * self.tokens + factor * c.pair * self.pairs + c.segment * self.pieces
        _, step_cost = critical_path(mb_rank)
        busy = mb_rank.sum(axis=(1, 2, 3)) / (mb_rank.shape[1] * mb_rank.shape[3])
        return float(step_cost.sum() / busy.sum()) if busy.sum() > 0 else 1.0


def rank_terms(plan: Plan) -> RankTerms:
    """The per-rank cost terms of ``plan`` (computed once, priced many times)."""
    return RankTerms(plan)


def imbalance_across_prices(plan: Plan, factors: Sequence[float] = PRICE_FACTORS) -> dict[float, float]:
    """``{factor: imbalance}`` of ``plan`` when the true price of a pair is ``factor`` times the model's.

    Args:
        plan: any plan; its ``config.cost`` gives the nominal prices.
        factors: pair-price factors (positive floats).

    Returns:
        For each factor, the plan's time over the time of a perfectly balanced plan of the same
        work, both at that price (>= 1.0; 1.0 is perfect).
    """
    if any(not np.isfinite(f) or f <= 0 for f in factors):
        raise ValueError(f"price factors must be positive and finite, got {list(factors)}")
    terms = rank_terms(plan)
    return {float(f): terms.imbalance(f) for f in factors}
