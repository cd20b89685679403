"""What the peer tests share: hand-checkable cost models, an instant link, a small config."""

from __future__ import annotations

from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.shard_plan import PlanConfig

#: One cost unit per token: step times by hand.
PER_TOKEN = CostModel(token=1.0, pair=0.0, unit="s")
#: A model with every term, for brute-force checks.
FULL = CostModel(token=3.0, pair=0.5, segment=7.0, unit="s")
#: A link so fast that communication adds nothing measurable.
INSTANT = CommModel(bandwidth=1e30, latency=0.0, kv_bytes_per_token_layer=1.0, layers=1)


def config(**kw) -> PlanConfig:
    base = dict(dp=2, cp=2, tokens_per_rank=500, samples_per_step=20, overflow="split", cost=FULL)
    base.update(kw)
    return PlanConfig(**base)
