"""Costs of a plan, vectorised over its piece table: what the planner balances and the benchmark reports.

Definitions (the same as :mod:`ringpack.balancer.planner`; all in the plan's cost unit):

* ``mb_rank_cost[s, d, i, c]`` -- cost of CP rank ``c`` in micro-batch ``i`` of DP rank ``d`` at
  step ``s``: ``CostModel.cost(tokens, exact causal pairs, segments)`` of its pieces (0 where
  a DP rank runs fewer micro-batches than the step's maximum, which never happens in valid plans);
* ``rank_cost[s, d, c]`` -- the sum over micro-batches: the work of GPU ``(d, c)`` in step ``s``;
* ``dp_cost[s, d]`` -- the sum over micro-batches of the max over CP ranks: DP rank ``d``'s time,
  since the CP ranks of a micro-batch wait on each other every layer;
* ``step_cost[s]`` -- the max over DP ranks (DP ranks synchronise once a step): the critical path.

``imbalance = step_cost / mean(rank_cost)`` is the "max/mean" the benchmark reports (1.0 is perfect;
it is >= the plain ``max(rank_cost) / mean(rank_cost)``), and ``gap = step_cost / lower_bound - 1``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ringpack.balancer.cost import piece_pairs

if TYPE_CHECKING:
    from ringpack.balancer.plan import Plan

__all__ = ["plan_costs"]


def plan_costs(plan: "Plan") -> dict[str, np.ndarray]:
    """Per-step cost arrays of ``plan`` (see the module docstring), plus ``imbalance`` and ``gap``."""
    cfg = plan.config
    a = plan.piece_arrays
    steps = plan.num_steps
    m = max((len(step.microbatches[0]) for step in plan.steps), default=0)
    piece_cost = cfg.cost.cost(a["stop"] - a["start"], piece_pairs(a["start"], a["stop"]), np.ones_like(a["start"]))
    mb_rank = np.zeros((steps, cfg.dp, max(m, 1), cfg.cp), dtype=np.float64)
    np.add.at(mb_rank, (a["step"], a["dp"], a["microbatch"], a["cp"]), piece_cost)
    rank_cost = mb_rank.sum(axis=2)
    dp_cost = mb_rank.max(axis=3).sum(axis=2)
    step_cost = dp_cost.max(axis=1)
    mean = rank_cost.reshape(steps, -1).mean(axis=1)
    bounds = np.array([np.nan if s.lower_bound is None else s.lower_bound for s in plan.steps], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        imbalance = step_cost / mean
        gap = step_cost / bounds - 1.0
    return {
        "mb_rank_cost": mb_rank,
        "rank_cost": rank_cost,
        "dp_cost": dp_cost,
        "step_cost": step_cost,
        "mean_rank_cost": mean,
        "lower_bound": bounds,
        "imbalance": imbalance,
        "gap": gap,
    }
