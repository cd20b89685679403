"""StepStream under stress: many streams, a cost switch at every step, early stops, resumes, collected streams.

Every consumer runs in a thread of its own and must finish within a deadline: a hang fails the
test (naming the consumer) instead of stopping the suite. Every step handed out is checked against
``plan_step`` with the cost model the stream says plans that step.
"""

from __future__ import annotations

import dataclasses
import gc
import random
import threading
import time

import numpy as np
import pytest

from ringpack.planner.epoch import global_batches, plan_step
from ringpack.planner.stream import StepStream
from ringpack.shard_plan import PlanConfig

DEADLINE_S = 30.0
CONFIG = PlanConfig(dp=2, cp=2, tokens_per_rank=1024, samples_per_step=16, seed=1)
LENGTHS = np.clip(np.random.default_rng(7).lognormal(5.5, 1.0, 240).astype(np.int64), 1, 2048)
MODELS = (CONFIG.cost, dataclasses.replace(CONFIG.cost, pair=CONFIG.cost.pair * 4))


@pytest.fixture(scope="module")
def expected():
    """Every step's plan under each of the two cost models."""
    batches = global_batches(LENGTHS, CONFIG)
    return batches, {
        (s, m): plan_step(batches, s, dataclasses.replace(CONFIG, cost=model))
        for s in range(len(batches.windows))
        for m, model in enumerate(MODELS)
    }


def _model_index(stream: StepStream, s: int) -> int:
    return MODELS.index(stream.cost_at(s))


def _consume(seed: int, batches, plans, failures: list[str]) -> None:
    """One consumer: asks for steps in order, switches the cost model from a step a little ahead at
    every step, and now and then stops early, jumps (a resume), peeks or drops the stream."""
    rng = random.Random(seed)
    stream = StepStream(LENGTHS, CONFIG, lookahead=rng.randint(0, 3), batches=batches)
    s = 0
    while s < stream.num_steps:
        got = stream.get(s)
        want = plans[(s, _model_index(stream, s))]
        if got != want:
            failures.append(f"consumer {seed}: step {s} differs from plan_step under its cost model")
            return
        ahead = s + rng.randint(0, 4)
        stream.set_costs([(0, MODELS[0]), (ahead, MODELS[rng.randint(0, 1)])])
        roll = rng.random()
        if roll < 0.05:
            stream.close(join_s=1.0)  # a consumer that stops early
            return
        if roll < 0.10:  # a resume: a fresh stream seeks to a later step
            stream = StepStream(LENGTHS, CONFIG, lookahead=rng.randint(0, 3), batches=batches)
            s = min(stream.num_steps - 1, s + rng.randint(1, 3))
            continue
        if roll < 0.15:
            peeked = rng.randrange(stream.num_steps)
            if stream.peek(peeked) != plans[(peeked, _model_index(stream, peeked))]:
                failures.append(f"consumer {seed}: peek({peeked}) differs")
                return
        if roll < 0.20:  # dropped while its thread plans ahead: collected, the thread ends
            thread = stream.thread
            del stream
            gc.collect()
            if thread is not None:
                thread.join(5.0)
                if thread.is_alive():
                    failures.append(f"consumer {seed}: a collected stream's thread still runs")
            return
        s += 1
    stream.close(join_s=1.0)


@pytest.mark.slow  # seconds of many threaded streams: the stress run belongs to the slow suite
def test_many_streams_with_a_cost_switch_at_every_step_finish_in_time(expected):
    batches, plans = expected
    failures: list[str] = []
    errors: list[BaseException] = []

    def run(seed: int) -> None:
        try:
            _consume(seed, batches, plans, failures)
        except BaseException as exc:  # reported below with the consumer's seed
            errors.append(exc)
            failures.append(f"consumer {seed}: {type(exc).__name__}: {exc}")

    consumers = [threading.Thread(target=run, args=(seed,), daemon=True) for seed in range(24)]
    start = time.monotonic()
    for t in consumers:
        t.start()
    for seed, t in enumerate(consumers):
        t.join(max(0.0, DEADLINE_S - (time.monotonic() - start)))
        assert not t.is_alive(), f"consumer {seed} still waits after {DEADLINE_S:.0f} s: a stream hung"
    assert not failures, failures


def test_a_switch_behind_the_step_being_planned_keeps_it(expected):
    """A switch from a step after the one being planned leaves that step's plan valid: it is
    kept, not dropped: nothing would plan it again and its consumer would wait forever."""
    batches, plans = expected
    for first_changed in range(1, 6):
        stream = StepStream(LENGTHS, CONFIG, lookahead=3, batches=batches)
        stream.get(0)
        stream.set_costs([(0, MODELS[0]), (first_changed, MODELS[1])])
        done: list = []
        reader = threading.Thread(target=lambda: done.extend(stream.get(s) for s in range(6)), daemon=True)
        reader.start()
        reader.join(DEADLINE_S)
        assert not reader.is_alive(), f"switch at step {first_changed}: the consumer hung"
        assert done == [plans[(s, int(s >= first_changed))] for s in range(6)]
        stream.close(join_s=1.0)
