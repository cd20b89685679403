"""A batch window through the data path: the sampler streams the whole-epoch plan's steps, resumes at
every step of a window, and balanced shards hold the same plan."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from ringpack.cost import CostModel
from ringpack.data import BalancedBatchSampler, DataError, PackedCollator, PackedDataset, ShardReader
from ringpack.data.shard_writer import write_shards
from ringpack.planner import make_plan
from ringpack.planner.epoch import global_batches
from ringpack.shard_plan import PlanConfig
from tests.helpers.data import Coverage, batch_signature

DP, CP, T = 2, 2, 2048
HEAVY = CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")
OPTS = dict(samples_per_step=20, batch_window=2, cost=HEAVY, seed=3)


@pytest.fixture(scope="module")
def samples():
    rng = np.random.default_rng(8)
    lens = np.clip(rng.lognormal(5.0, 1.3, 420).astype(np.int64), 1, CP * T)
    return [rng.integers(0, 1000, int(k)) for k in lens]


@pytest.fixture(scope="module")
def lengths(samples):
    return [len(s) for s in samples]


def config(**overrides) -> PlanConfig:
    return PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **{**OPTS, **overrides})


def signature(tickets) -> list:
    return [(t.step, t.index, t.cursor, list(t), t.microbatch, t.step_loss_tokens) for t in tickets]


def test_the_window_moves_samples_here(lengths):
    moves = global_batches(np.asarray(lengths), config()).moves()
    assert moves.count > 0 and moves.distances.max() <= 2


def test_the_sampler_streams_the_whole_epoch_plan(lengths):
    whole = make_plan(lengths, config(epoch=1))
    seen = []
    for d in range(DP):
        sampler = BalancedBatchSampler(lengths, d, DP, CP, T, **OPTS)
        sampler.set_epoch(1)
        tickets = list(sampler)
        want = [(s, i, mb) for s, step in enumerate(whole.steps) for i, mb in enumerate(step.microbatches[d])]
        assert [(t.step, t.index, t.microbatch) for t in tickets] == want
        assert sampler.plan() == whole
        seen += [x for t in tickets for x in t]
    assert sorted(seen) == list(range(len(lengths))), "every sample once per epoch across DP ranks"


def test_resume_at_every_step_of_a_window(lengths):
    full = signature(BalancedBatchSampler(lengths, 1, DP, CP, T, **OPTS))
    starts = sorted({t[2] - 1 for t in full if t[1] == 0})  # cursor before each step's first micro-batch
    block = OPTS["batch_window"] + 1
    steps = {t[0] for t in full}
    assert len(steps) > 2 * block, "the epoch spans several windows"
    mid = [starts[s] + 1 for s in range(0, len(starts), block) if starts[s] + 1 < starts[min(s + 1, len(starts) - 1)]]
    positions = [*starts, *mid, len(full)]  # every step's start, a mid-step position in each window, the end
    assert len(mid) >= 3
    for k in positions:
        first = BalancedBatchSampler(lengths, 1, DP, CP, T, **OPTS)
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = first.state_dict()
        resumed = BalancedBatchSampler(lengths, 1, DP, CP, T, **OPTS)  # a fresh process
        resumed.load_state_dict(state)
        assert signature(head) + signature(resumed) == full, f"resume after {k} micro-batches"


def test_a_window_is_part_of_the_state(lengths):
    sampler = BalancedBatchSampler(lengths, 0, DP, CP, T, **OPTS)
    it = iter(sampler)
    next(it)
    other = BalancedBatchSampler(lengths, 0, DP, CP, T, **{**OPTS, "batch_window": 0})
    with pytest.raises(DataError, match="batch_window=[0-9]+, this sampler has batch_window=0"):
        other.load_state_dict(sampler.state_dict())


def test_shards_hold_the_windowed_plan(samples, lengths, tmp_path):
    ds = datasets.Dataset.from_dict({"input_ids": [s.tolist() for s in samples]})
    cfg = config()
    write_shards(ds, tmp_path / "shards", cfg, progress=False)
    plan = make_plan(lengths, cfg)
    cov = Coverage(samples)
    for d in range(DP):
        for c in range(CP):
            reader = ShardReader(tmp_path / "shards", d, c, schedule=False)
            assert reader.plan == plan
            sampler = BalancedBatchSampler(lengths, d, DP, CP, T, **OPTS)
            collator = PackedCollator(c, CP, compile_schedules=False)
            from_loader = [batch_signature(collator(PackedDataset(ds).__getitems__(t))) for t in sampler]
            batches = list(reader)
            assert [batch_signature(b) for b in batches] == from_loader
            cov.add_all(batches)
    cov.check_exactly_once()
    reader = ShardReader(tmp_path / "shards", 1, 0, schedule=False)
    full = [batch_signature(b) for b in reader]
    for k in (1, len(full) // 2):
        first = ShardReader(tmp_path / "shards", 1, 0, schedule=False)
        it = iter(first)
        head = [batch_signature(next(it)) for _ in range(k)]
        resumed = ShardReader(tmp_path / "shards", 1, 0, schedule=False)
        resumed.load_state_dict(first.state_dict())
        assert head + [batch_signature(b) for b in resumed] == full
