"""StepStream: an epoch's steps planned ahead in a background thread, equal to make_plan's step for step."""

from __future__ import annotations

import dataclasses
import gc
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ringpack.planner.stream as stream_module
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import global_batches, plan_step
from ringpack.planner.stream import StepStream, step_digest
from ringpack.shard_plan import PlanConfig

ROOT = Path(__file__).resolve().parents[2]


def lengths(n: int = 1200, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.5, 1.2, n).astype(np.int64), 1, 6000)


CONFIGS = {
    "robust default": dict(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=96),
    "exact prices, zigzag": dict(dp=2, cp=2, tokens_per_rank=4096, samples_per_step=64, strategy="zigzag",
                                 pair_price_range=(1, 1)),
    "split long samples": dict(dp=3, cp=2, tokens_per_rank=1024, samples_per_step=80, overflow="split"),
    "first fit, fixed micro-batches": dict(dp=2, cp=4, tokens_per_rank=8192, samples_per_step=50, packing="first_fit",
                                           microbatches_per_rank=2),
}  # fmt: skip


@pytest.mark.parametrize("name", CONFIGS)
def test_streamed_steps_equal_the_whole_epoch_plan(name):
    config = PlanConfig(**CONFIGS[name], seed=3, epoch=1)
    whole = make_plan(lengths(), config)
    stream = StepStream(lengths(), config)
    assert stream.num_steps == whole.num_steps > 3
    for s in range(stream.num_steps):
        assert stream.get(s) == whole.steps[s], f"step {s}"
        assert stream.counts[s] == len(whole.steps[s].microbatches[0])
        assert stream.digest(s) == step_digest(whole.steps[s])
    assert stream.planned == list(range(whole.num_steps)), "every step planned once, in order"


def test_only_a_window_of_steps_is_kept():
    config = PlanConfig(**CONFIGS["robust default"])
    stream = StepStream(lengths(), config, lookahead=2)
    for s in range(stream.num_steps):
        stream.get(s)
        assert set(stream._steps) <= set(range(s, s + 3)), f"steps held after asking for {s}: {sorted(stream._steps)}"
    assert len(stream.counts) == stream.num_steps, "counts of every step stay"


def test_steps_behind_the_window_are_planned_again_in_the_callers_thread():
    config = PlanConfig(**CONFIGS["robust default"])
    whole = make_plan(lengths(), config)
    stream = StepStream(lengths(), config)
    stream.get(5)
    assert stream.peek(1) == whole.steps[1]
    assert stream._first == 5 and 1 not in stream._steps, "peek leaves the window where it is"
    assert stream.get(0) == whole.steps[0], "asking for an earlier step moves the window back"


def test_a_planning_error_is_raised_in_the_caller_as_the_same_object(monkeypatch):
    config = PlanConfig(**CONFIGS["robust default"])
    raised = []

    def failing(batches, index, cfg, length_list=None):
        if index == 3:
            raised.append(ValueError(f"cannot plan step {index}"))
            raise raised[-1]
        return plan_step(batches, index, cfg, length_list)

    monkeypatch.setattr(stream_module, "plan_step", failing)
    stream = StepStream(lengths(), config)
    for s in range(3):
        stream.get(s)  # planned before the failing step: delivered
    with pytest.raises(ValueError, match="cannot plan step 3") as info:
        stream.get(3)
    assert info.value is raised[0]
    stream.thread.join(5)
    assert not stream.thread.is_alive(), "the planning thread stops at a failure"
    assert stream.planned == [0, 1, 2, 3], "nothing planned past it"
    with pytest.raises(ValueError, match="cannot plan step 3") as again:
        stream.get(3)
    assert again.value is raised[0] and len(raised) == 1, "asked again: the same error, not planned again"


def test_a_cost_switch_plans_again_only_the_steps_from_it():
    config = PlanConfig(**CONFIGS["robust default"])
    other = dataclasses.replace(config.cost, pair=config.cost.pair * 3)
    stream = StepStream(lengths(), config, lookahead=3)
    handed_out = [stream.get(s) for s in range(2)]
    while len(stream.planned) < 5:  # the thread planned ahead: steps 2, 3, 4 with the old model
        time.sleep(0.01)
    stream.set_costs([(0, config.cost), (3, other)])
    later = [stream.get(s) for s in range(2, stream.num_steps)]
    replanned = stream.planned[5:]
    assert replanned[0] == 3 and 0 not in replanned and 1 not in replanned and 2 not in replanned
    batches = global_batches(lengths(), config)
    assert handed_out == [plan_step(batches, s, config) for s in range(2)]
    assert later[0] == plan_step(batches, 2, config), "the step before the switch keeps its plan"
    switched = dataclasses.replace(config, cost=other)
    assert later[1:] == [plan_step(batches, s, switched) for s in range(3, stream.num_steps)]
    assert stream.cost_at(2) == config.cost and stream.cost_at(3) == other


def test_the_thread_ends_with_the_epoch_and_with_the_stream():
    config = PlanConfig(**CONFIGS["robust default"])
    stream = StepStream(lengths(), config)
    for s in range(stream.num_steps):
        stream.get(s)
    stream.thread.join(5)
    assert not stream.thread.is_alive(), "nothing left to plan: the thread is gone"

    unused = StepStream(lengths(), config, lookahead=1)
    unused.get(0)
    thread = unused.thread
    del unused
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "a stream nobody holds takes its thread with it"


def test_a_closed_stream_says_so():
    stream = StepStream(lengths(), PlanConfig(**CONFIGS["robust default"]))
    stream.get(0)
    stream.close(join_s=5)
    assert not stream.thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        stream.get(1)


def test_the_interpreter_exits_cleanly_while_a_stream_plans_ahead():
    snippet = (
        "import numpy as np\n"
        "from ringpack.planner.stream import StepStream\n"
        "from ringpack.shard_plan import PlanConfig\n"
        "L = np.random.default_rng(0).integers(1, 4000, 4000)\n"
        "s = StepStream(L, PlanConfig(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=200), lookahead=8)\n"
        "s.get(0)\n"
        "print('planned', s.thread.is_alive())\n"
    )
    t0 = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("planned") and run.stderr == "", run.stderr
    assert time.perf_counter() - t0 < 60


def test_cost_models_follow_the_schedule():
    config = PlanConfig(**CONFIGS["exact prices, zigzag"])
    measured = CostModel(token=1e-6, pair=2e-10, unit="s", name="measured")
    stream = StepStream(lengths(), config, [(2, measured)])
    assert stream.cost_at(0) == stream.cost_at(1) == config.cost and stream.cost_at(2) == measured
    with pytest.raises(IndexError, match="outside"):
        stream.get(stream.num_steps)
