"""Costs of a plan, vectorised over its piece table: what the planner balances and the benchmark reports.

Definitions (the same as :mod:`ringpack.planner.epoch`; all in the plan's cost unit):

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

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from ringpack.cost import piece_pairs

if TYPE_CHECKING:
    from ringpack.shard_plan import Plan

__all__ = ["plan_costs", "cell_index", "rank_grid", "critical_path"]


def cell_index(
    arrays: Mapping[str, np.ndarray], dp: int, shape: tuple[int, int, int] | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Map each piece row to its (step, dp, micro-batch) cell of a dense ``(S, D, M)`` grid.

    ``arrays``: the plan's piece table (``step``, ``dp``, ``microbatch`` columns, one row per
    piece); ``shape``: the grid, by default just large enough. Returns ``(int64 cell per row,
    shape)``. Raises ``ValueError`` when a row names a DP rank outside ``[0, dp)``.
    """
    step, d, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    if shape is None:
        shape = (int(step.max()) + 1, dp, int(mb.max()) + 1) if step.size else (0, dp, 0)
    if d.size and (d.min() < 0 or d.max() >= dp):
        raise ValueError(f"plan names DP rank {int(d.max())}, config has dp={dp}")
    return (step * shape[1] + d) * shape[2] + mb, shape


def rank_grid(
    arrays: Mapping[str, np.ndarray], dp: int, cp: int, shape: tuple[int, int, int] | None = None
) -> tuple[Callable[[np.ndarray | None], np.ndarray], np.ndarray, tuple[int, int, int]]:
    """Sum per-piece quantities into ``(S, D, M, C)`` rank cells, exactly (int64 when given ints).

    Returns ``(per_rank, cell, shape)``: ``per_rank(values)`` sums one value per piece row into its
    rank's cell (``None`` counts pieces); ``cell`` is each row's (step, dp, micro-batch) cell.
    Raises ``ValueError`` when a row names a DP or CP rank outside the config's.
    """
    cell, (S, D, M) = cell_index(arrays, dp, shape)
    c = np.asarray(arrays["cp"], dtype=np.int64)
    if c.size and (c.min() < 0 or c.max() >= cp):
        raise ValueError(f"plan names CP rank {int(c.max())}, config has cp={cp}")
    flat = cell * cp + c

    def per_rank(values: np.ndarray | None) -> np.ndarray:
        """``values`` (one per piece row; ``None``: 1 each) summed into ``(S, D, M, C)`` rank cells."""
        values = np.ones(flat.size, dtype=np.int64) if values is None else np.asarray(values)
        out = np.zeros(S * D * M * cp, dtype=values.dtype)
        np.add.at(out, flat, values)
        return out.reshape(S, D, M, cp)

    return per_rank, cell, (S, D, M)


def critical_path(rank_cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dp_cost[S, D], step_cost[S])`` of ``(S, D, M, C)`` rank costs: the definitions above."""
    dp_cost = rank_cost.max(axis=3).sum(axis=2)
    return dp_cost, dp_cost.max(axis=1)


def plan_costs(plan: Plan) -> dict[str, np.ndarray]:
    """Per-step cost arrays of ``plan`` (see the module docstring), plus ``imbalance`` and ``gap``."""
    cfg = plan.config
    a = plan.piece_arrays
    m = max((len(step.microbatches[0]) for step in plan.steps), default=0)
    per_rank, _, _ = rank_grid(a, cfg.dp, cfg.cp, shape=(plan.num_steps, cfg.dp, max(m, 1)))
    tokens = per_rank(a["stop"] - a["start"])
    mb_rank = cfg.cost.cost(tokens, per_rank(piece_pairs(a["start"], a["stop"])), per_rank(None))
    rank_cost = mb_rank.sum(axis=2)
    dp_cost, step_cost = critical_path(mb_rank)
    mean = rank_cost.reshape(plan.num_steps, -1).mean(axis=1)
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
