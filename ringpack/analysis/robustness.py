"""How a plan's balance holds up when the cost model's price of an attention pair is wrong.

A plan is balanced for the prices it was planned with. On a GPU the real price of an attention
pair relative to a token differs from the FLOP model's (often by 2x), so what matters is the plan's
imbalance over a *range* of prices: for a factor ``f`` a rank costs
``token * tokens + f * pair * pairs + segment * pieces``, and the plan's imbalance at ``f`` is its
time (the sum over steps of the critical path) over the time of a perfectly balanced plan of the
same work (the sum over steps of the mean GPU's busy cost), both at that price. Each rank's cost is
linear in ``f``, so a plan balanced at both ends of a range is close to balanced inside it.

See docs/cost-model.md, "Why FLOPs misprice attention".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringpack.analysis.metrics import PlanMetrics, evaluate_plan
from ringpack.shard_plan import Plan

__all__ = ["PRICE_FACTORS", "imbalance_across_prices"]

#: Pair-price factors a plan is judged over: a quarter to twice the model's price of a pair.
PRICE_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0)


def imbalance_across_prices(plan: Plan | PlanMetrics, factors: Sequence[float] = PRICE_FACTORS) -> dict[float, float]:
    """``{factor: imbalance}`` of a plan when the true price of a pair is ``factor`` times the model's.

    Args:
        plan: a plan (its ``config.cost`` gives the nominal prices) or its :class:`PlanMetrics`.
        factors: pair-price factors, positive and finite.

    Returns:
        For each factor, the plan's time over the time of a perfectly balanced plan of the same
        work, both at that price (>= 1.0; 1.0 is perfect).

    Raises:
        ValueError: a factor that is not positive and finite.
    """
    if any(not np.isfinite(f) or f <= 0 for f in factors):
        raise ValueError(f"price factors must be positive and finite, got {list(factors)}")
    metrics = plan if isinstance(plan, PlanMetrics) else evaluate_plan(plan)
    return {float(f): metrics.imbalance_at_pair_price(f) for f in factors}
