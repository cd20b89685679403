"""A sampler state keeps what decides its plan: a state of another plan is refused naming what differs."""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.cost import CostModel
from ringpack.data import BalancedBatchSampler, DataError

LENGTHS = np.random.default_rng(3).integers(1, 400, size=96)


def sampler(lengths=LENGTHS, **options) -> BalancedBatchSampler:
    return BalancedBatchSampler(lengths, 0, 2, 2, 512, **{"samples_per_step": 24, **options})


@pytest.mark.parametrize(
    "options, named",
    [
        ({"batch_window": 2}, "batch_window=2, this sampler has batch_window=0"),
        ({"strategy": "zigzag"}, "strategy='zigzag', this sampler has strategy='balanced'"),
        ({"packing": "first_fit"}, "packing='first_fit', this sampler has packing='balanced'"),
        ({"overflow": "split"}, "overflow='split', this sampler has overflow='error'"),
        ({"pair_price_range": (0.5, 1.5)}, "pair_price_range=[0.5, 1.5], this sampler has pair_price_range=None"),
        ({"cp_token_slack": 0.5}, "cp_token_slack=0.5, this sampler has cp_token_slack=None"),
        ({"microbatches_per_rank": 3}, "microbatches_per_rank=3, this sampler has microbatches_per_rank=0"),
        ({"gpus_per_node": 1}, "gpus_per_node=1, this sampler has gpus_per_node=None"),
        ({"samples_per_step": 12}, "samples_per_step=12, this sampler has samples_per_step=24"),
        ({"cost": CostModel.preset("tiny")}, "another cost model: 'tiny' has"),
    ],
)
def test_a_state_of_other_plan_options_names_the_option(options, named):
    state = sampler(**options).state_dict()
    target = sampler()
    with pytest.raises(DataError) as refused:
        target.load_state_dict(state)
    message = str(refused.value)
    assert named in message and "\n" not in message, message
    assert target.state_dict() == sampler().state_dict(), "a refused state changes nothing"


def test_a_state_of_other_lengths_says_so():
    other = LENGTHS.copy()
    other[5] += 1
    with pytest.raises(DataError, match="for other lengths .*the same number of samples"):
        sampler().load_state_dict(sampler(other).state_dict())


def test_a_state_of_another_cost_model_of_the_same_name_names_the_entry():
    tuned = CostModel(token=1.0, pair=0.01, unit="s", name="measured")
    state = sampler(cost=tuned).state_dict()
    with pytest.raises(DataError, match="'measured' has pair=0.01, this sampler's 'measured' has pair=0.02"):
        sampler(cost=CostModel(token=1.0, pair=0.02, unit="s", name="measured")).load_state_dict(state)


def test_a_state_made_before_it_kept_the_plan_inputs_still_loads_and_is_still_checked():
    source = sampler()
    ticket = next(iter(source))
    old = {k: v for k, v in source.state_dict(cursor=ticket.cursor).items() if k != "plan_inputs"}
    target = sampler()
    target.load_state_dict(old)
    assert next(iter(target)).cursor == ticket.cursor + 1
    with pytest.raises(DataError, match="plan options or cost models changed"):
        sampler(batch_window=2).load_state_dict(old)


def test_edited_plan_inputs_are_refused():
    state = sampler().state_dict()
    state["plan_inputs"] = {**state["plan_inputs"], "config": {**state["plan_inputs"]["config"], "seed": 5}}
    with pytest.raises(DataError, match="'plan_inputs' is not what its plan_key"):
        sampler().load_state_dict(state)
    with pytest.raises(DataError, match="'plan_inputs'"):
        sampler().load_state_dict({**state, "plan_inputs": ["not", "a", "dict"]})
