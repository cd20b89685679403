"""StepStream with planner="process": a forked process plans, equal to make_plan's step for step.

Every test that forks a planner process is ``slow``; the first ones check the choice of planner
and the rank parts without starting one. Consumers that could hang run in a thread under a
deadline, so a hang fails the test naming it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ringpack.planner.stream as stream_module
from ringpack.errors import PlanError
from ringpack.planner import make_plan
from ringpack.planner.epoch import global_batches, plan_step
from ringpack.planner.stream import (
    PROCESS_FROM_SAMPLES,
    PackedMicroBatch,
    PlannerDied,
    RankStep,
    StepStream,
    step_digest,
)
from ringpack.shard_plan import PlanConfig, _piece_columns
from tests.helpers import deadline
from tests.planner.test_stream import ROOT, lengths

DEADLINE_S = 60.0


CONFIGS = {
    "robust default": dict(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=96),
    "exact prices, zigzag": dict(dp=2, cp=2, tokens_per_rank=4096, samples_per_step=64, strategy="zigzag",
                                 pair_price_range=(1, 1)),
    "split long samples": dict(dp=3, cp=2, tokens_per_rank=1024, samples_per_step=80, overflow="split"),
    "batch window": dict(dp=2, cp=4, tokens_per_rank=4096, samples_per_step=64, batch_window=2),
}  # fmt: skip
BASE = PlanConfig(**CONFIGS["robust default"])


def within(fn, deadline_s: float = DEADLINE_S):
    """``fn()`` within the test's deadline (:func:`tests.helpers.deadline.within`)."""
    return deadline.within(fn, deadline_s)


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether process ``pid`` ends (or is a zombie) within ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------ the choice, without a process
def test_auto_plans_large_global_batches_in_a_process_and_small_ones_in_the_thread():
    small = StepStream(lengths(), BASE)
    assert small.planner == "thread" and small.process_pid is None
    many = np.full(3 * PROCESS_FROM_SAMPLES, 100)
    large = StepStream(many, PlanConfig(dp=4, cp=4, tokens_per_rank=65536, samples_per_step=PROCESS_FROM_SAMPLES))
    assert large.planner == ("process" if sys.platform.startswith("linux") else "thread")
    assert StepStream(many, large.config, planner="thread").planner == "thread"
    assert StepStream(lengths(), BASE, planner="process").planner == "process"
    for stream in (small, large):
        stream.close()


def test_bad_planner_options_are_refused():
    with pytest.raises(PlanError, match="planner must be one of"):
        StepStream(lengths(), BASE, planner="processes")
    with pytest.raises(PlanError, match=r"rank must be a DP rank in \[0, 4\)"):
        StepStream(lengths(), BASE, rank=4)
    stream = StepStream(lengths(), BASE, planner="process", rank=1)
    with pytest.raises(RuntimeError, match="get_rank"):
        stream.get(0)
    with pytest.raises(RuntimeError, match="without rank"):
        StepStream(lengths(), BASE).get_rank(0)


def test_a_rank_part_is_the_ranks_microbatches_of_the_step():
    whole = make_plan(lengths(), BASE)
    stream = StepStream(lengths(), BASE, planner="thread", rank=2)
    for s in (0, 1):
        part = stream.get_rank(s)
        step = whole.steps[s]
        assert (part.index, part.rank, part.count) == (s, 2, len(step.microbatches[0]))
        assert part.microbatches == step.microbatches[2] and part.parts == step.microbatches[2], "unpacked"
        assert (part.loss_tokens, part.digest) == (step.loss_tokens, step_digest(step))
        packed = RankStep.of(step, s, 2, part.digest, pack=True)
        assert all(isinstance(p, PackedMicroBatch) for p in packed.parts)
        assert packed.microbatches == step.microbatches[2], "packed and unpacked: the same micro-batches"
        for got, want in zip(packed.microbatches, step.microbatches[2]):  # the columns come with them
            read = _piece_columns(want.shards)
            assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got.piece_columns, read))
    stream.close(join_s=5)


# ------------------------------------------------------------------ the process
@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_process_streamed_steps_equal_the_whole_epoch_plan(name):
    config = PlanConfig(**CONFIGS[name], seed=3, epoch=1)
    whole = make_plan(lengths(), config)
    stream = StepStream(lengths(), config, planner="process")
    parts = StepStream(lengths(), config, planner="process", rank=config.dp - 1)
    steps = within(lambda: [stream.get(s) for s in range(stream.num_steps)])
    got = within(lambda: [parts.get_rank(s) for s in range(parts.num_steps)])
    assert steps == list(whole.steps)
    assert [p.microbatches for p in got] == [step.microbatches[-1] for step in whole.steps]
    assert [p.digest for p in got] == [step_digest(step) for step in whole.steps]
    assert [p.loss_tokens for p in got] == [step.loss_tokens for step in whole.steps]
    assert stream.planned == list(range(whole.num_steps)), "every step planned once, in order"
    assert parts.peek(2) == whole.steps[2], "the whole step of a rank stream, planned here"
    pids = [stream.process_pid, parts.process_pid]
    for st in (stream, parts):
        st.thread.join(10)
        assert not st.thread.is_alive()
    assert all(gone(pid) for pid in pids), "the planner process ends with the epoch"


@pytest.mark.slow
def test_a_cost_switch_plans_again_only_the_steps_from_it():
    config = BASE
    other = dataclasses.replace(config.cost, pair=config.cost.pair * 3)
    stream = StepStream(lengths(), config, lookahead=3, planner="process", rank=0)
    handed_out = within(lambda: [stream.get_rank(s) for s in range(2)])
    end = time.monotonic() + DEADLINE_S
    while len(stream.planned) < 5 and time.monotonic() < end:  # planned ahead: steps 2, 3, 4 with the old model
        time.sleep(0.01)
    stream.set_costs([(0, config.cost), (3, other)])
    later = within(lambda: [stream.get_rank(s) for s in range(2, stream.num_steps)])
    replanned = stream.planned[5:]
    assert replanned[0] == 3 and not {0, 1, 2} & set(replanned)
    batches = global_batches(lengths(), config)
    switched = dataclasses.replace(config, cost=other)
    want = [plan_step(batches, s, config if s < 3 else switched) for s in range(stream.num_steps)]
    got = handed_out + later
    assert [p.microbatches for p in got] == [step.microbatches[0] for step in want]
    assert [p.digest for p in got] == [step_digest(step) for step in want]
    stream.close(join_s=10)


@pytest.mark.slow
def test_a_planning_error_in_the_process_is_raised_in_the_consumer(monkeypatch):
    def failing(batches, index, cfg, length_list=None):
        if index == 3:
            raise PlanError(f"cannot plan step {index}")
        return plan_step(batches, index, cfg, length_list)

    monkeypatch.setattr(stream_module, "plan_step", failing)  # the forked process has it too
    stream = StepStream(lengths(), BASE, planner="process")
    within(lambda: [stream.get(s) for s in range(3)])
    with pytest.raises(PlanError, match="cannot plan step 3"):
        within(lambda: stream.get(3))
    stream.thread.join(10)
    assert stream.planned == [0, 1, 2, 3], "nothing planned past it"


@pytest.mark.slow
def test_a_killed_planner_process_is_one_line_in_the_consumer_never_a_hang():
    stream = StepStream(lengths(), BASE, lookahead=1, planner="process", rank=0)
    within(lambda: stream.get_rank(0))
    pid = stream.process_pid
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PlannerDied) as info:
        within(lambda: [stream.get_rank(s) for s in range(stream.num_steps)], deadline_s=20)
    assert time.monotonic() - t0 < 20
    message = str(info.value)
    assert "\n" not in message and f"planner process {pid} was killed by SIGKILL" in message, message
    assert "while planning step" in message and "planner='thread'" in message
    assert isinstance(info.value, PlanError)
    failed = int(re.search(r"while planning step (\d+)", message).group(1))
    with pytest.raises(PlannerDied) as again:
        within(lambda: stream.get_rank(failed), deadline_s=20)
    assert again.value is info.value, "asked again: the same error"
    last = within(lambda: stream.get_rank(stream.num_steps - 1))
    assert last.index == stream.num_steps - 1 and stream.process_pid != pid, "a jump past it plans in a new process"
    stream.close(join_s=10)


@pytest.mark.slow
def test_a_stopped_planner_process_is_killed_and_named(monkeypatch):
    monkeypatch.setenv("RINGPACK_WORKER_STALL_S", "1.5")

    def stopping(batches, index, cfg, length_list=None):
        if index == 2:
            os.kill(os.getpid(), signal.SIGSTOP)  # the process stops itself mid-step
        return plan_step(batches, index, cfg, length_list)

    monkeypatch.setattr(stream_module, "plan_step", stopping)
    stream = StepStream(lengths(), BASE, lookahead=0, planner="process")
    within(lambda: [stream.get(s) for s in range(2)])
    pid = stream.process_pid
    with pytest.raises(PlannerDied, match=r"sent no heartbeat for 1.5 s \(it is stopped") as info:
        within(lambda: stream.get(2), deadline_s=30)
    assert "\n" not in str(info.value)
    assert gone(pid), "the stopped process was killed"


@pytest.mark.slow
def test_the_planner_process_dies_with_its_parent():
    snippet = (
        "import sys, time, numpy as np\n"
        "from ringpack.planner.stream import StepStream\n"
        "from ringpack.shard_plan import PlanConfig\n"
        "L = np.random.default_rng(0).integers(1, 4000, 4000)\n"
        "s = StepStream(L, PlanConfig(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=200), planner='process')\n"
        "s.get(0)\n"
        "print(s.process_pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", snippet], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        pid = int(parent.stdout.readline())
        assert not gone(pid, timeout_s=0.5), "the planner runs while its parent does"
    finally:
        parent.kill()
        parent.wait(30)
    assert gone(pid), "the planner process outlived its parent"


@pytest.mark.slow
def test_the_interpreter_exits_cleanly_while_a_planner_process_plans_ahead():
    snippet = (
        "import numpy as np\n"
        "from ringpack.planner.stream import StepStream\n"
        "from ringpack.shard_plan import PlanConfig\n"
        "L = np.random.default_rng(0).integers(1, 4000, 4000)\n"
        "s = StepStream(L, PlanConfig(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=200), lookahead=8,\n"
        "               planner='process')\n"
        "s.get(0)\n"
        "print(s.process_pid, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert gone(int(run.stdout)), "the planner process outlived the interpreter"
