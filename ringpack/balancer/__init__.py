"""The planner: cost model, plan types, packing + DP balance and CP split strategies."""

from ringpack.balancer.cost import PRESETS, CostModel, ModelShape
from ringpack.balancer.plan import MicroBatch, Piece, Plan, PlanConfig, PlanError, RankShard, Step

__all__ = ["CostModel", "ModelShape", "PRESETS", "MicroBatch", "Piece", "Plan", "PlanConfig", "PlanError", "RankShard", "Step", "make_plan"]


def make_plan(lengths, config: PlanConfig) -> Plan:  # replaced by the planner (issue 3)
    from ringpack.balancer.planner import make_plan as _make_plan

    return _make_plan(lengths, config)
