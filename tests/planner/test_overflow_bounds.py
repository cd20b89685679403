"""``overflow="split"`` is refused, in bounded time and memory, when it would create too many documents."""

from __future__ import annotations

import json
import time
import tracemalloc

import numpy as np
import pytest

import ringpack
from ringpack.analysis.simulate import simulate
from ringpack.planner.epoch import (
    MAX_SPLIT_DOCUMENTS,
    MIN_SPLIT_DOCUMENTS,
    SPLIT_DOCUMENTS_PER_SAMPLE,
    expand_overflow,
    make_plan,
    split_document_limit,
)
from ringpack.shard_plan import PlanConfig, PlanError
from tests.helpers.cli import assert_clean, run_cli


def config(**options) -> PlanConfig:
    return PlanConfig(dp=1, cp=2, tokens_per_rank=512, overflow="split", **options)


def test_a_huge_sample_is_refused_fast_and_small():
    tracemalloc.start()
    t0 = time.perf_counter()
    with pytest.raises(PlanError) as info:
        make_plan([100, 2**31, 50], config())
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    message = str(info.value)
    assert "sample 1 (2147483648 tokens)" in message
    assert f"{2**31 // 1024:,} documents" in message  # ceil(2**31 / 1024)
    assert "overflow='drop'" in message and "tokens_per_rank" in message
    assert seconds < 1.0 and peak < 1 << 20, (seconds, peak)  # nothing of the documents' size was built


def test_many_cut_samples_are_refused_by_their_sum():
    lengths = [5] * 10 + [4_000_000] * 4  # 4 samples of 7,813 documents each: 31,262 in all, under the floor
    limit = split_document_limit(len(lengths))
    assert limit == MIN_SPLIT_DOCUMENTS
    many = [5] * 10 + [40_000_000] * 4  # 78,125 documents each: no sample alone is over 100,000, the sum is
    with pytest.raises(PlanError, match=r"cut 4 samples into 312,510 documents in all \(sample 10"):
        expand_overflow(np.array(many), 512)
    doc_lengths, doc_sample, _ = expand_overflow(np.array(lengths), 512)
    assert len(doc_lengths) == 10 + 4 * 7813 and doc_lengths.sum() == sum(lengths)
    assert doc_sample[-1] == len(lengths) - 1


def test_the_limit_grows_with_the_samples_and_is_capped():
    assert split_document_limit(1) == MIN_SPLIT_DOCUMENTS
    assert split_document_limit(10**5) == SPLIT_DOCUMENTS_PER_SAMPLE * 10**5
    assert split_document_limit(10**9) == MAX_SPLIT_DOCUMENTS


def test_splits_within_the_limit_still_plan():
    plan = make_plan([100, 5000, 50], config()).validate()
    assert sum(plan.lengths) == 5150 and len(plan.lengths) == 2 + 5  # 5000 tokens into 5 documents of 1000


def test_the_library_and_the_simulator_share_the_bound():
    with pytest.raises(PlanError, match="sample 0"):
        ringpack.plan([2**31], dp=1, cp=1, tokens_per_rank=64, overflow="split")
    with pytest.raises(PlanError, match="sample 2"):
        simulate(np.array([10, 20, 2**31, 30]), config(samples_per_step=2), [("balanced", "balanced")], jobs=1)


def test_the_command_line_names_its_flags(tmp_path):
    path = tmp_path / "lengths.json"
    path.write_text(json.dumps([100, 2**31, 50]))
    argv = ["plan", "--lengths", path, "--dp", "1", "--cp", "2", "--tokens-per-rank", "512"]
    run = run_cli([*argv, "--out", tmp_path / "plan.json", "--overflow", "split"])
    assert_clean(run)
    assert run.code == 1 and "sample 1" in run.err and "2,097,152 documents" in run.err
    assert "--overflow drop" in run.err and "--tokens-per-rank" in run.err and "overflow=" not in run.err
    assert not (tmp_path / "plan.json").exists()
