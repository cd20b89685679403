"""ringpack: cost-balanced packing and sharding of variable-length samples for DP x CP training,
plus a varlen ring-attention runtime that executes the resulting shard plans exactly.

Importing ``ringpack`` is cheap and needs neither ortools nor datasets; ``ringpack.plan`` loads the
planner on first use.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["plan", "__version__"]


def plan(lengths: Any, **config: Any) -> Any:
    """Plan ``lengths`` into a validated :class:`ringpack.balancer.plan.Plan`.

    Keyword arguments are :class:`ringpack.balancer.plan.PlanConfig` fields
    (``dp``, ``cp``, ``tokens_per_rank``, ``strategy``, ...). See ``ringpack.balancer.make_plan``.
    """
    from ringpack.balancer import make_plan
    from ringpack.balancer.plan import PlanConfig

    return make_plan(lengths, PlanConfig(**config))
