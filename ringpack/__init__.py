"""ringpack: long-context training on packed data, with no slow rank (README.md; docs/plan.md is the contract).

The planner packs variable-length samples into micro-batches and splits them across data-parallel
(DP) and context-parallel (CP) ranks by a cost model of causal attention; the attention runtime
executes any such plan exactly; the data loaders feed it to a training loop.

The public API, importable from here::

    plan, Plan, PlanConfig, PlanError, DataError, CostModel       # the plan contract and the planner
    compile_schedule, ring_attention, RingAttention             # the attention runtime (torch)
    BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader   # data loading (torch)
    CostLearner                                                 # the cost model learned from the run

Names load on first use, so ``import ringpack`` is quick and needs neither torch, ortools nor
datasets. Where transformers is installed, ``attn_implementation="ringpack"`` works once ringpack is
imported (:mod:`ringpack.integrations.autoregister`), without importing transformers here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringpack._lazy import lazy_face
from ringpack.integrations import autoregister as _autoregister

__version__ = "0.1.0"

_EXPORTS = {
    "plan": "ringpack.planner.api",
    "Plan": "ringpack.shard_plan",
    "PlanConfig": "ringpack.plan_config",
    "PlanError": "ringpack.errors",
    "DataError": "ringpack.errors",
    "CostModel": "ringpack.cost",
    "make_plan": "ringpack.planner",
    "compile_schedule": "ringpack.attention",
    "ring_attention": "ringpack.attention",
    "RingAttention": "ringpack.attention",
    "BalancedBatchSampler": "ringpack.data",
    "PackedCollator": "ringpack.data",
    "PackedDataset": "ringpack.data",
    "ShardReader": "ringpack.data",
    "CostLearner": "ringpack.training.cost_learner",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from ringpack.attention import RingAttention, compile_schedule, ring_attention  # noqa: F401
    from ringpack.cost import CostModel  # noqa: F401
    from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader  # noqa: F401
    from ringpack.errors import DataError, PlanError  # noqa: F401
    from ringpack.plan_config import PlanConfig  # noqa: F401
    from ringpack.planner import make_plan  # noqa: F401
    from ringpack.planner.api import plan  # noqa: F401
    from ringpack.shard_plan import Plan  # noqa: F401
    from ringpack.training.cost_learner import CostLearner  # noqa: F401

_autoregister.install()  # attn_implementation="ringpack" once transformers' models load

__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
