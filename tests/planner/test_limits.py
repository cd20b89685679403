"""ringpack.planner.limits: a balanced split too large to finish is refused before any work, naming the CP size."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ringpack.analysis.simulate import simulate
from ringpack.errors import PlanError
from ringpack.planner import make_plan
from ringpack.planner.limits import MAX_BALANCED_CP, balanced_split_seconds, check_split_size
from ringpack.shard_plan import MAX_CP, PlanConfig
from tests.helpers.cli import assert_clean, run_cli

LENGTHS = np.full(8, 100, dtype=np.int64)


def test_a_balanced_split_past_the_limit_is_refused_at_once():
    t0 = time.monotonic()
    with pytest.raises(PlanError, match=r"^cp 65,536 with the balanced split: .* about 14\.3 hours per micro-batch"):
        make_plan(LENGTHS, PlanConfig(dp=1, cp=MAX_CP, tokens_per_rank=64))
    assert time.monotonic() - t0 < 1


def test_the_limit_grows_with_the_square_of_the_cp_size():
    assert balanced_split_seconds(2 * MAX_BALANCED_CP) == pytest.approx(4 * balanced_split_seconds(MAX_BALANCED_CP))
    assert balanced_split_seconds(MAX_BALANCED_CP) < 300  # the largest group taken on plans a micro-batch in minutes


@pytest.mark.parametrize(
    "options",
    [
        {"cp": MAX_BALANCED_CP},
        {"cp": MAX_CP, "strategy": "zigzag"},
        {"cp": MAX_CP, "strategy": "contiguous"},
        {"cp": MAX_CP, "gpus_per_node": 8},  # split node by node
    ],
)
def test_linear_splits_and_groups_within_the_limit_are_taken_on(options):
    check_split_size(PlanConfig(dp=1, tokens_per_rank=64, **options))


def test_simulate_refuses_before_planning():
    config = PlanConfig(dp=1, cp=2 * MAX_BALANCED_CP, tokens_per_rank=64, samples_per_step=4)
    with pytest.raises(PlanError, match="cp 8,192 with the balanced split"):
        simulate(LENGTHS, config, jobs=1, progress=False)


def test_plan_command_names_the_flag(tmp_path):
    np.save(tmp_path / "l.npy", LENGTHS)
    t0 = time.monotonic()
    run = run_cli(
        ["plan", "--lengths", tmp_path / "l.npy", "--world", MAX_CP, "--cp", MAX_CP, "--tokens-per-rank", 64,
         "--out", tmp_path / "p.json"]
    )  # fmt: skip
    assert_clean(run)
    assert run.code == 1 and "error: --cp 65,536 with the balanced split" in run.err and "--strategy zigzag" in run.err
    assert time.monotonic() - t0 < 2


def test_a_slow_split_within_the_limit_says_how_slow(caplog):
    with caplog.at_level("INFO", logger="ringpack.progress"):
        check_split_size(PlanConfig(dp=1, cp=2048, tokens_per_rank=64))
        check_split_size(PlanConfig(dp=1, cp=512, tokens_per_rank=64))
    assert [r.getMessage() for r in caplog.records] == [
        "the balanced split over 2048 CP ranks takes about 50 s per micro-batch"
    ]
