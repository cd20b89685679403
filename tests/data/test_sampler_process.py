"""BalancedBatchSampler with planner="process": the same tickets as the thread, resume, cost switches,
DataLoader workers, and a planner process that dies.

Tests that fork a planner process are ``slow``; the option's checks are not.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time

import numpy as np
import pytest
from torch.utils.data import DataLoader

from ringpack.data import BalancedBatchSampler, DataError, PackedCollator, PackedDataset
from ringpack.piece_table import TABLE_SLOT, piece_table
from ringpack.planner.stream import PackedMicroBatch, PlannerDied
from ringpack.shard_plan import PlanConfig, PlanError
from tests.helpers import deadline
from tests.helpers.data import batch_signature, random_samples

CONFIG = PlanConfig(dp=2, cp=2, tokens_per_rank=256, samples_per_step=40, seed=2)
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def samples():
    return random_samples(160, seed=1)


def lengths_of(samples) -> list[int]:
    return [len(s) for s in samples]


def signature(tickets) -> list:
    return [
        (t.epoch, t.step, t.index, t.cursor, list(t), t.microbatch, t.step_loss_tokens, t.plan_hash) for t in tickets
    ]


def within(fn, deadline_s: float = DEADLINE_S):
    """``fn()`` within the test's deadline (:func:`tests.helpers.deadline.within`)."""
    return deadline.within(fn, deadline_s)


def test_the_planner_option_is_checked_and_kept(samples):
    with pytest.raises(DataError, match="planner must be one of"):
        BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner="fork")
    sampler = BalancedBatchSampler(lengths_of(samples), CONFIG, 1, planner="thread")
    assert sampler.planner == "thread"
    assert sampler._steps_of(0).stream.planner == "thread" and sampler._steps_of(0).stream.rank == 1
    assert BalancedBatchSampler(lengths_of(samples), CONFIG, 0).planner == "auto"


def test_a_ticket_of_a_packed_microbatch_unpacks_on_first_use_and_pickles_packed(samples):
    sampler = BalancedBatchSampler(lengths_of(samples), CONFIG, 1, planner="thread")
    step = sampler.plan().steps[0]
    mb = step.microbatches[1][0]
    ticket = sampler._ticket((PackedMicroBatch.of(mb),), step.loss_tokens, 0, 0, 0, 0)
    copy = pickle.loads(pickle.dumps(ticket))
    assert b"ringpack.planner" not in pickle.dumps(ticket), "plain data: arrays and integers"
    assert copy._microbatch is None and copy.microbatch == mb == ticket.microbatch
    assert list(copy) == list(ticket) == list(mb.samples) and signature([copy]) == signature([ticket])
    # what the planner process computed travels to the worker: fingerprint, piece table
    assert "fingerprint" in vars(copy.microbatch) and TABLE_SLOT in vars(copy.microbatch)
    assert piece_table(copy.microbatch).distances == piece_table(mb).distances


def test_collating_a_delivered_microbatch_builds_only_its_ranks_pieces(samples):
    sampler = BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner="thread")
    step = sampler.plan().steps[0]
    mb = step.microbatches[0][0]
    ticket = pickle.loads(pickle.dumps(sampler._ticket((PackedMicroBatch.of(mb),), step.loss_tokens, 0, 0, 0, 0)))
    expected = PackedCollator(1, CONFIG.cp).collate(mb, [samples[k] for k in mb.samples])
    batch = PackedCollator(1, CONFIG.cp).collate(ticket.microbatch, [samples[k] for k in mb.samples])
    assert set(ticket.microbatch.shards._built) == {1}, "rank 1's pieces built as objects, no other rank's"
    assert batch.keys() == expected.keys() and batch["schedule"].fingerprint == expected["schedule"].fingerprint
    for key in ("input_ids", "position_ids", "cu_seqlens"):
        assert batch[key].tolist() == expected[key].tolist(), key


@pytest.mark.slow
def test_process_tickets_equal_thread_tickets_on_every_rank(samples):
    for d in range(CONFIG.dp):
        thread = BalancedBatchSampler(lengths_of(samples), CONFIG, d, planner="thread")
        process = BalancedBatchSampler(lengths_of(samples), CONFIG, d, planner="process")
        for epoch in (0, 1):
            thread.set_epoch(epoch)
            process.set_epoch(epoch)
            assert within(lambda: signature(process)) == signature(thread)
        assert process._epochs[1].stream.planner == "process"
        assert process.plan() == thread.plan() and len(process) == len(thread)


@pytest.mark.slow
def test_a_process_sampler_resumes_exactly(samples):
    full = signature(BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner="thread"))
    for k in (1, 4, len(full) - 1):
        first = BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner="process")
        it = iter(first)
        head = within(lambda: [next(it) for _ in range(k)])
        state = first.state_dict()
        resumed = BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner="process")
        resumed.load_state_dict(state)
        assert signature(head) + within(lambda: signature(resumed)) == full, f"resumed after {k}"


@pytest.mark.slow
def test_a_cost_switch_in_a_process_sampler_equals_the_thread(samples):
    def run(planner: str) -> list:
        sampler = BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner=planner)
        it = iter(sampler)
        handed = [next(it) for _ in range(3)]
        switched = dataclasses.replace(CONFIG.cost, pair=CONFIG.cost.pair * 4)
        sampler.set_cost_model(switched, after=sampler.planned_through(), lead_steps=0)
        return signature(handed + list(it))

    thread = run("thread")
    assert within(lambda: run("process")) == thread
    assert len({t[-1] for t in thread}) == 2, "tickets after the switch carry the new key"


@pytest.mark.slow
def test_dataloader_workers_forked_beside_the_planner_process(samples):
    def batches(planner: str, workers: int) -> list:
        sampler = BalancedBatchSampler(lengths_of(samples), CONFIG, 0, planner=planner)
        loader = DataLoader(
            PackedDataset(samples),
            batch_sampler=sampler,
            collate_fn=PackedCollator(1, CONFIG.cp, compile_schedules=False),
            num_workers=workers,
            prefetch_factor=2 if workers else None,
            multiprocessing_context="fork" if workers else None,
        )
        return [batch_signature(b) for b in loader]

    assert within(lambda: batches("process", 2)) == batches("thread", 0)


@pytest.mark.slow
def test_a_killed_planner_process_stops_the_loop_with_one_line():
    lengths = np.clip(np.random.default_rng(3).lognormal(5.5, 1.0, 800).astype(np.int64), 1, 256)
    sampler = BalancedBatchSampler(lengths, CONFIG, 0, planner="process")
    sampler.lookahead_steps = 1
    loader = DataLoader(
        PackedDataset([np.zeros(n, dtype=np.int64) for n in lengths]),
        batch_sampler=sampler,
        collate_fn=PackedCollator(0, CONFIG.cp, compile_schedules=False),
    )
    steps: list[int] = []

    def loop() -> None:
        for batch in loader:
            steps.append(int(batch["step"]))
            if len(steps) == 1:
                os.kill(sampler._epochs[0].stream.process_pid, signal.SIGKILL)
            time.sleep(0.01)

    t0 = time.monotonic()
    with pytest.raises(PlannerDied) as info:
        within(loop, deadline_s=30)
    assert time.monotonic() - t0 < 30
    assert isinstance(info.value, PlanError) and "\n" not in str(info.value)
    assert "was killed by SIGKILL" in str(info.value) and steps and max(steps) < sampler.num_steps - 1
