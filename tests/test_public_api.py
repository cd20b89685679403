"""``import ringpack`` gives the public API, loads names on first use, and needs no torch to import."""

from __future__ import annotations

import subprocess
import sys

import ringpack

PUBLIC = {
    "plan": "ringpack.planner.api",
    "make_plan": "ringpack.planner.epoch",
    "Plan": "ringpack.shard_plan",
    "PlanConfig": "ringpack.plan_config",
    "PlanError": "ringpack.errors",
    "DataError": "ringpack.errors",
    "CostModel": "ringpack.cost",
    "compile_schedule": "ringpack.attention.schedule",
    "ring_attention": "ringpack.attention.api",
    "RingAttention": "ringpack.attention.api",
    "BalancedBatchSampler": "ringpack.data.sampler",
    "PackedCollator": "ringpack.data.collator",
    "PackedDataset": "ringpack.data.collator",
    "ShardReader": "ringpack.data.shard_reader",
    "CostLearner": "ringpack.training.cost_learner",
}


def test_every_public_name_resolves_to_its_module():
    assert set(PUBLIC) <= set(ringpack.__all__) and set(PUBLIC) <= set(dir(ringpack))
    for name, module in PUBLIC.items():
        assert getattr(ringpack, name).__module__ == module, name


def test_import_is_cheap_and_an_unknown_name_is_an_attribute_error():
    code = "import sys, ringpack; print(sorted(m for m in ('torch', 'ortools', 'datasets') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    try:
        ringpack.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown attribute must raise")
