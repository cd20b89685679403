"""Streaming, both ways: data streams and plans streamed ahead of the loader.

Data streams: their lengths can be read, but ``PackedDataset`` refuses them in one line naming
what to do instead. A plan reorders samples across a whole epoch, so the loader needs random
access; the refusal names the two ways there (materialise the stream, or shard it once), and the
first is checked here to give exactly the tokens of the stream.

Plans: the sampler plans each epoch step by step, a few steps ahead, in the background; see below.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch

import ringpack.planner.stream as stream_module
from ringpack.cost import CostModel
from ringpack.data import BalancedBatchSampler, DataError, PackedCollator, PackedDataset
from ringpack.lengths import sample_lengths
from ringpack.planner import make_plan
from ringpack.planner.epoch import plan_step
from ringpack.shard_plan import PlanConfig, PlanError
from tests.helpers.data import Coverage, random_samples

ROOT = Path(__file__).resolve().parents[2]

DP, CP, T = 2, 2, 256


@pytest.fixture(scope="module")
def samples():
    return random_samples(60, seed=4)


@pytest.fixture(scope="module")
def stream(samples):
    rows = {"input_ids": [s.tolist() for s in samples], "length": [len(s) for s in samples]}
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=3)


def test_a_datasets_stream_is_refused_in_one_line(stream):
    with pytest.raises(DataError) as info:
        PackedDataset(stream)
    message = str(info.value)
    assert "\n" not in message and "datasets.IterableDataset is a stream" in message
    assert "Dataset.from_generator" in message and "ringpack shard" in message and "ShardReader" in message


def test_a_torch_stream_is_refused(samples):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(samples)

    with pytest.raises(DataError, match=r"torch IterableDataset \(Stream\)"):
        PackedDataset(Stream())


def test_the_named_alternative_gives_the_streams_tokens(stream, samples, tmp_path):
    lengths = sample_lengths(stream)  # a stream's lengths read in one pass, token ids first
    assert lengths.tolist() == [len(s) for s in samples]
    assert sample_lengths(stream.select_columns(["length"])).tolist() == lengths.tolist()
    materialised = datasets.Dataset.from_generator(
        lambda: (yield from stream), features=stream.features, cache_dir=str(tmp_path)
    )
    cov = Coverage(samples)
    for d in range(DP):
        for c in range(CP):
            sampler = BalancedBatchSampler(lengths, d, DP, CP, T, samples_per_step=20)
            dataset, collate = PackedDataset(materialised), PackedCollator(c, CP, schedule=False)
            cov.add_all([collate(dataset.__getitems__(ticket)) for ticket in sampler])
    cov.check_exactly_once()
    assert np.array_equal(materialised[7]["input_ids"], samples[7])


# ---------------------------------------------------------------------- plans streamed ahead
# The sampler plans each epoch step by step in a background thread, a few steps ahead of the
# loader (ringpack.planner.stream): what it yields equals the whole-epoch plan step for step.


def _sampler(lengths, dp_rank=0, **options):
    options = {"samples_per_step": 48, **options}
    return BalancedBatchSampler(lengths, dp_rank, 2, 2, 512, **options)


@pytest.fixture(scope="module")
def long_lengths():
    rng = np.random.default_rng(11)
    return np.clip(rng.lognormal(5.5, 1.1, 600).astype(np.int64), 1, 1024).tolist()


def _signature(tickets) -> list:
    return [(t.step, t.index, t.cursor, list(t), t.microbatch, t.step_loss_tokens) for t in tickets]


def test_streamed_tickets_equal_the_whole_epoch_plan(long_lengths):
    whole = make_plan(long_lengths, PlanConfig(dp=2, cp=2, tokens_per_rank=512, samples_per_step=48, epoch=2))
    for d in range(2):
        sampler = _sampler(long_lengths, d)
        sampler.set_epoch(2)
        tickets = list(sampler)
        want = [(s, i, mb) for s, step in enumerate(whole.steps) for i, mb in enumerate(step.microbatches[d])]
        assert [(t.step, t.index, t.microbatch) for t in tickets] == want
        assert [t.cursor for t in tickets] == list(range(1, len(want) + 1)) and len(sampler) == len(want)
        assert sampler.plan() == whole and sampler.plan_hash == whole.content_hash
        assert {t.plan_hash for t in tickets} == {sampler.plan_key}


def test_the_first_ticket_plans_only_the_window(long_lengths, monkeypatch):
    planned = []

    def counting(batches, index, config, length_list=None):
        planned.append(index)
        return plan_step(batches, index, config, length_list)

    monkeypatch.setattr(stream_module, "plan_step", counting)
    sampler = _sampler(long_lengths)
    assert sampler.num_steps > 8
    first = next(iter(sampler))
    assert first.step == 0 and planned[0] == 0
    time.sleep(0.2)  # the thread plans ahead, then waits
    assert sorted(planned) == list(range(sampler.lookahead_steps + 1)), planned


@pytest.mark.slow
def test_resume_at_every_position_is_exact(long_lengths):
    full = _signature(_sampler(long_lengths, 1))
    for k in range(len(full) + 1):
        first = _sampler(long_lengths, 1)
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))  # plain data
        resumed = _sampler(long_lengths, 1)
        resumed.load_state_dict(state)
        assert _signature(head) + _signature(resumed) == full, f"resume after {k}"


def test_a_cost_switch_plans_again_only_steps_not_handed_out(long_lengths):
    sampler = _sampler(long_lengths)
    before = sampler.plan()
    it = iter(sampler)
    handed = [next(it) for _ in range(5)]
    through = sampler.planned_through()
    switched = dataclasses.replace(sampler.config.cost, pair=sampler.config.cost.pair * 4)
    epoch, step = sampler.set_cost_model(switched, after=through, lead_steps=1)
    assert (epoch, step) == (0, through[1] + 2)
    rest = list(it)
    stream = sampler._epochs[0].stream
    assert sorted(set(stream.planned)) == list(range(sampler.num_steps))
    replanned = [s for s in stream.planned if stream.planned.count(s) > 1]
    assert replanned and min(replanned) >= step, f"steps re-planned: {sorted(set(replanned))}, switch at {step}"
    after = sampler.plan()
    assert after.steps[:step] == before.steps[:step] and after.steps[step:] != before.steps[step:]
    got = [t.microbatch for t in handed + rest]
    assert got == [mb for st in after.steps for mb in st.microbatches[0]], "what was streamed is the spliced plan"
    assert all(t.plan_hash != rest[-1].plan_hash for t in handed), "tickets after the switch carry the new key"


SNIPPET = """
import hashlib, json, sys
import numpy as np
from ringpack.data import BalancedBatchSampler
lengths = np.clip(np.random.default_rng(11).lognormal(5.5, 1.1, 600).astype(np.int64), 1, 1024).tolist()
out = {}
for d in range(2):
    s = BalancedBatchSampler(lengths, d, 2, 2, 512, samples_per_step=48, seed=5)
    s.set_epoch(1)
    text = repr([(t.step, t.index, list(t), [sh.pieces for sh in t.microbatch.shards]) for t in s])
    out[d] = hashlib.sha256(text.encode()).hexdigest()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_every_process_streams_the_same_plan():
    runs = [
        subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, cwd=ROOT, check=True)
        for _ in range(2)
    ]
    digests = [json.loads(r.stdout) for r in runs]
    assert digests[0] == digests[1] and digests[0]["0"] != digests[0]["1"]


def test_a_planning_error_surfaces_in_the_training_loop(long_lengths, monkeypatch):
    def failing(batches, index, config, length_list=None):
        if index == 3:
            raise PlanError(f"step {index}: planted failure")
        return plan_step(batches, index, config, length_list)

    monkeypatch.setattr(stream_module, "plan_step", failing)
    sampler = _sampler(long_lengths)
    loader = torch.utils.data.DataLoader(
        PackedDataset([np.zeros(n, dtype=np.int64) for n in long_lengths]),
        batch_sampler=sampler,
        collate_fn=PackedCollator(0, 2, schedule=False),
    )
    steps = []
    with pytest.raises(PlanError, match="step 3: planted failure"):
        for batch in loader:
            steps.append(batch["step"])
    assert sorted(set(steps)) == [0, 1, 2], "the steps before the failure were delivered"


def test_a_failed_load_installs_nothing(long_lengths):
    source = _sampler(long_lengths)
    it = iter(source)
    for _ in range(4):
        next(it)
    measured = CostModel(token=2e-6, pair=1e-10, unit="s", name="measured")
    source.set_cost_model(measured, after=source.planned_through(), lead_steps=1)
    good = source.state_dict()
    target = _sampler(long_lengths)
    cost, key = target.config.cost, target.plan_key
    for bad in (
        {**good, "step_hash": "0" * 64},  # another plan of the step
        {**good, "cursor": good["cursor"] + 50},  # not in its step
        {**good, "plan_key": "f" * 64},
        {**good, "step": "2"},
    ):
        with pytest.raises(DataError):
            target.load_state_dict(bad)
        assert target.config.cost == cost and target._switches == [] and target.plan_key == key
        assert (target.epoch, target.state_dict()["cursor"]) == (0, 0)
    assert _signature(target) == _signature(_sampler(long_lengths)), "the sampler plans as if never touched"
    target.load_state_dict(good)
    assert target.config.cost == measured and _signature(target) == _signature(it)


@pytest.mark.parametrize(
    "key", ["epoch", "cursor", "seed", "dp_size", "cp_size", "tokens_per_rank", "num_samples", "plan_key", "step",
            "step_start", "step_hash"]
)  # fmt: skip
def test_missing_or_ill_typed_state_keys_are_named(long_lengths, key):
    sampler = _sampler(long_lengths)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    with pytest.raises(DataError, match=f"'{key}'") as missing:
        sampler.load_state_dict({k: v for k, v in state.items() if k != key})
    assert "\n" not in str(missing.value)
    wrong = [1.5] if isinstance(state[key], str) else "7"
    with pytest.raises(DataError, match=f"'{key}'"):
        sampler.load_state_dict({**state, key: wrong})
    with pytest.raises(DataError, match="cost_switches"):
        sampler.load_state_dict({**state, "cost_switches": {"not": "a list"}})
    with pytest.raises(DataError, match="version"):
        sampler.load_state_dict({**state, "version": 99})


def test_a_version_1_state_still_resumes(long_lengths):
    sampler = _sampler(long_lengths)
    full = _signature(_sampler(long_lengths))
    it = iter(sampler)
    head = [next(it) for _ in range(7)]
    old = {
        "version": 1,
        "epoch": 0,
        "cursor": 7,
        "seed": 0,
        "dp_size": 2,
        "cp_size": 2,
        "tokens_per_rank": 512,
        "num_samples": len(long_lengths),
        "plan_hash": sampler.plan_hash,
        "cost_switches": [],
    }
    resumed = _sampler(long_lengths)
    resumed.load_state_dict(old)
    assert _signature(head) + _signature(resumed) == full
    with pytest.raises(DataError, match="plan"):
        _sampler(long_lengths).load_state_dict({**old, "plan_hash": "0" * 64})


def test_no_planning_thread_outlives_its_epoch(long_lengths):
    sampler = _sampler(long_lengths)
    list(sampler)
    thread = sampler._epochs[0].stream.thread
    thread.join(5)
    assert not thread.is_alive()
    other = _sampler(long_lengths)
    next(iter(other))
    thread = other._epochs[0].stream.thread
    del other
    gc.collect()
    thread.join(5)
    assert not thread.is_alive(), "a dropped sampler takes its planning thread with it"
    assert not [t for t in threading.enumerate() if t.name == "ringpack-planner" and t.is_alive()]
