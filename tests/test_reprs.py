"""Reprs of plans and schedules stay short whatever their size, and say what the object is."""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.attention import compile_schedule
from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.data import ShardReader
from ringpack.planner import make_plan
from ringpack.shard_plan import PlanConfig
from tests.helpers.cli import token_rows, write_jsonl


@pytest.fixture(scope="module")
def big_plan():
    lengths = np.random.default_rng(0).integers(1, 3000, size=4000)
    config = PlanConfig(dp=4, cp=4, tokens_per_rank=8192, samples_per_step=400, cost=CostModel.preset("tiny"))
    return make_plan(lengths, config)


def test_plan_repr_is_a_summary(big_plan):
    text = repr(big_plan)
    assert len(text) < 300, len(text)
    microbatches = sum(len(rank) for step in big_plan.steps for rank in step.microbatches)
    for part in (
        "dp=4",
        "cp=4",
        "tokens_per_rank=8192",
        f"steps={big_plan.num_steps}",
        f"microbatches={microbatches}",
        "samples=4000",
        f"tokens={sum(big_plan.lengths)}",
        f"hash={big_plan.content_hash[:12]}",
    ):
        assert part in text, (part, text)
    assert str(big_plan) == text


def test_step_microbatch_and_shard_reprs_are_bounded(big_plan):
    step = big_plan.steps[0]
    text = repr(step)
    assert len(text) < 200 and "dp=4" in text and f"loss_tokens={step.loss_tokens}" in text
    mb = max((mb for rank in step.microbatches for mb in rank), key=lambda m: len(m.samples))
    assert len(mb.samples) > 4  # enough samples to be elided
    text = repr(mb)
    assert len(text) < 200 and f"samples={len(mb.samples)}: [" in text and "..." in text
    assert f"tokens={mb.num_tokens}" in text and "cp=4" in text
    shard = max(mb.shards, key=lambda s: len(s.pieces))
    assert len(repr(shard)) < 150 and f"tokens={shard.num_tokens}" in repr(shard)


def test_small_objects_list_their_contents():
    plan = make_plan([5, 6, 7], PlanConfig(dp=1, cp=2, tokens_per_rank=16))
    mb = plan.steps[0].microbatches[0][0]
    assert repr(mb).startswith(f"MicroBatch(samples=[{', '.join(map(str, mb.samples))}]")
    piece = mb.shards[0].pieces[0]
    assert f"{piece.sample}[{piece.start}:{piece.stop}]" in repr(mb.shards[0])


def test_schedule_repr_is_bounded(big_plan):
    mb = max((mb for step in big_plan.steps for rank in step.microbatches for mb in rank), key=lambda m: m.num_tokens)
    schedule = compile_schedule(mb, 1)
    text = repr(schedule)
    assert len(text) < 300, text
    assert "cp_rank=1 of 4" in text and f"tokens={schedule.num_tokens}" in text
    assert f"kernel_calls={schedule.num_kernel_calls}" in text and "device=cpu" in text
    assert len(str(schedule.steps)) < 200 * max(1, sum(len(s.calls) for s in schedule.steps))


def test_shard_reader_repr_names_its_folder_ranks_steps_and_files(tmp_path):
    data = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": row} for row in token_rows(30)])
    argv = ["shard", data, "--out", tmp_path / "shards", "--dp", "2", "--cp", "2", "--tokens-per-rank", "256"]
    assert main([str(a) for a in [*argv, "--samples-per-step", "10", "--steps-per-file", "2", "--quiet"]]) == 0
    reader = ShardReader(tmp_path / "shards", 1, 0)
    text = repr(reader)
    assert len(text) < 120 + len(str(tmp_path)), text
    assert text.startswith(f"ShardReader({str(tmp_path / 'shards')!r}, dp_rank=1 of 2, cp_rank=0 of 2, ")
    for part in (f"steps={reader.num_steps}", f"microbatches={len(reader)}", f"files={len(reader.files)}"):
        assert part in text, (part, text)
    assert reader.num_steps == 3 and len(reader.files) == 2 and f"plan={reader.plan_hash[:12]}" in text
