"""Price-robust default plans: balanced whatever the true price of an attention pair.

A FLOP cost model prices an attention pair at a guess (on GPUs attention runs at about half the
FLOP rate of the linear layers). The default plan must stay close to what the planner achieves
when told the true price, for any price from a quarter to twice the model's, on several length
distributions; a measured model (unit seconds) is planned at its own prices only. Every CP split
keeps the token guard, since CP ranks synchronise phase by phase inside each layer.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import ringpack
from ringpack.analysis.robustness import PRICE_FACTORS, imbalance_across_prices
from ringpack.cost import CostModel
from ringpack.shard_plan import FLOP_PRICE_RANGE, NO_TOKEN_GUARD, ROBUST_TOKEN_SLACK, PlanConfig, PlanError

FLOPS = CostModel.preset("llama3-8b")


def mixes() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "pareto": np.clip((rng.pareto(1.1, 1500) * 500 + 1).astype(int), 1, 60_000),
        "lognormal": np.clip(rng.lognormal(7.0, 1.2, 1500).astype(int), 1, 60_000),
        "bimodal": np.concatenate([rng.integers(50, 800, 1300), rng.integers(6_000, 30_000, 200)]),
    }


def plan(lengths: np.ndarray, dp: int, cp: int, **options) -> ringpack.Plan:
    per_step = int(0.95 * dp * cp * 8192 / lengths.mean())
    return ringpack.plan(
        lengths, dp=dp, cp=cp, tokens_per_rank=8192, samples_per_step=per_step, overflow="split", **options
    )


#: planning at the model's prices alone: no price range, and tokens free to be traded for pairs
EXACT = dict(pair_price_range=(1, 1), cp_token_slack=NO_TOKEN_GUARD)


def losses(lengths: np.ndarray, dp: int, cp: int) -> tuple[np.ndarray, np.ndarray]:
    """The default plan's and the FLOP-exact plan's imbalance over what a plan told each true price gets."""
    told = np.array(
        [
            imbalance_across_prices(
                plan(lengths, dp, cp, cost=dataclasses.replace(FLOPS, pair=FLOPS.pair * f), **EXACT), [1.0]
            )[1.0]
            for f in PRICE_FACTORS
        ]
    )
    default = np.array(list(imbalance_across_prices(plan(lengths, dp, cp, cost=FLOPS)).values()))
    exact = np.array(list(imbalance_across_prices(plan(lengths, dp, cp, cost=FLOPS, **EXACT)).values()))
    return default / told - 1, exact / told - 1


@pytest.mark.parametrize("dp, cp, least_gain", [(1, 8, 0.05), (8, 1, 0.0), (2, 4, 0.05)])
def test_default_plan_is_close_to_the_told_price_plan_at_every_price(dp, cp, least_gain):
    gains = []
    for name, lengths in mixes().items():
        default, exact = losses(lengths, dp, cp)
        assert default.max() <= 0.045, f"{name} {dp}x{cp}: default loses {default.round(3)} against told prices"
        assert default.mean() <= 0.025, f"{name} {dp}x{cp}: default loses {default.round(3)} on average"
        assert default.max() <= exact.max() + 1e-9, f"{name} {dp}x{cp}: {default.round(3)} vs {exact.round(3)}"
        gains.append(exact.max() - default.max())
    # with CP, the plan balanced at the FLOP price alone is far worse at one end of the range or the other
    assert max(gains) >= least_gain, gains


def test_measured_models_are_planned_at_their_own_prices():
    measured = CostModel(token=2e-6, pair=1e-10, segment=1e-5, unit="s", name="measured")
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=4096, cost=measured)
    assert config.price_range == (1.0, 1.0) and config.token_slack == ROBUST_TOKEN_SLACK
    assert PlanConfig(dp=2, cp=2, tokens_per_rank=4096).price_range == FLOP_PRICE_RANGE
    assert PlanConfig(dp=2, cp=2, tokens_per_rank=4096).token_slack == ROBUST_TOKEN_SLACK
    lengths = mixes()["pareto"][:300]
    robust = ringpack.plan(lengths, dp=2, cp=2, tokens_per_rank=60_000, cost=measured, pair_price_range=(0.25, 2))
    exact = ringpack.plan(lengths, dp=2, cp=2, tokens_per_rank=60_000, cost=measured)
    assert exact.steps != robust.steps


def test_exact_prices_plan_as_the_model_alone_says():
    """With ``pair_price_range=(1, 1)`` and no token guard the plan balances the model's prices:
    its imbalance at the model's price is at most the robust plan's."""
    for lengths in mixes().values():
        exact = imbalance_across_prices(plan(lengths, 2, 4, **EXACT), [1.0])[1.0]
        robust = imbalance_across_prices(plan(lengths, 2, 4), [1.0])[1.0]
        assert exact <= robust + 1e-9


@pytest.mark.parametrize("bad", [(2.0, 3.0), (0.0, 1.0), (0.5, float("inf")), (1.0,), "wide"])
def test_bad_price_ranges_are_refused(bad):
    with pytest.raises(PlanError, match="pair_price_range"):
        PlanConfig(dp=1, cp=1, tokens_per_rank=10, pair_price_range=bad)


def test_price_range_round_trips_through_plan_files(tmp_path):
    p = plan(mixes()["lognormal"][:200], 2, 2, pair_price_range=(0.5, 1.5))
    p.save(tmp_path / "p.json")
    again = ringpack.Plan.load(tmp_path / "p.json")
    assert again.config.pair_price_range == (0.5, 1.5) and again.content_hash == p.content_hash
