"""One size rule everywhere: at most MAX_SAMPLE_TOKENS tokens per sample and per CP group.

Causal pair counts of such samples are exact in int64; longer ones are refused, naming the
sample (or the config fields), by the Python API, plan files and the command line alike, so no
report ever prints costs computed from wrapped integers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import ringpack
from ringpack.cost import MAX_SAMPLE_TOKENS, CostModel, piece_pairs
from ringpack.errors import DataError, PlanError
from ringpack.lengths import check_lengths, lengths_from_array
from ringpack.shard_plan import MAX_CP, MAX_DP, MicroBatch, Piece, Plan, PlanConfig, RankShard, Step
from tests.helpers.cli import assert_clean, run_cli


def test_the_limit_is_two_to_the_31():
    assert MAX_SAMPLE_TOKENS == 2**31


@given(st.integers(0, MAX_SAMPLE_TOKENS), st.integers(0, MAX_SAMPLE_TOKENS))
def test_piece_pairs_are_exact_up_to_the_limit(a, b):
    start, stop = min(a, b), max(a, b)
    exact = (stop * (stop + 1) - start * (start + 1)) // 2  # Python integers: no wrapping
    assert int(piece_pairs(start, stop)) == exact
    assert int(piece_pairs(np.array([start, 0]), np.array([stop, stop]))[1]) == stop * (stop + 1) // 2


@pytest.mark.parametrize("stop", [MAX_SAMPLE_TOKENS + 1, 3_100_000_000, 2**32, 2**40, 2**62])
def test_piece_pairs_refuse_a_piece_past_the_limit(stop):
    with pytest.raises(PlanError, match=f"{stop:,}"):
        piece_pairs(0, stop)
    with pytest.raises(PlanError):
        CostModel.preset("tiny").sample_cost([5, stop])


@pytest.mark.parametrize("length", [MAX_SAMPLE_TOKENS + 1, 2**32, 2**40, 2**62])
def test_lengths_past_the_limit_are_refused_naming_the_sample(length):
    for call in (lambda v: check_lengths(v), lengths_from_array):
        with pytest.raises(DataError, match=rf"sample 1 has {length:,} tokens.*at most 2,147,483,648"):
            call([3, length, 4])
    with pytest.raises(PlanError, match="sample 1 has"):
        ringpack.plan([3, length, 4], dp=1, cp=1, tokens_per_rank=64, overflow="drop")


def test_the_longest_sample_allowed_still_plans():
    lengths = [3, MAX_SAMPLE_TOKENS, 4]
    assert check_lengths(lengths).tolist() == lengths
    plan = ringpack.plan(lengths, dp=1, cp=1, tokens_per_rank=64, overflow="drop")
    assert plan.dropped == (1,)


@pytest.mark.parametrize("cp, tokens_per_rank", [(1, MAX_SAMPLE_TOKENS + 1), (2, 2**30 + 1), (4096, 2**31), (1, 2**40)])
def test_a_cp_group_past_the_limit_is_refused_by_the_config(cp, tokens_per_rank):
    with pytest.raises(PlanError, match=rf"cp x tokens_per_rank = {cp} x {tokens_per_rank}"):
        PlanConfig(dp=1, cp=cp, tokens_per_rank=tokens_per_rank)
    with pytest.raises(PlanError, match="tokens per CP group"):
        PlanConfig.from_dict({"dp": 1, "cp": cp, "tokens_per_rank": tokens_per_rank})
    with pytest.raises(PlanError, match="tokens per CP group"):
        ringpack.plan([5, 6], dp=1, cp=cp, tokens_per_rank=tokens_per_rank)


def test_the_largest_cp_group_allowed_is_a_valid_config():
    assert PlanConfig(dp=1, cp=2, tokens_per_rank=2**30).group_capacity == MAX_SAMPLE_TOKENS


def _plan_holding(lengths, dropped, tokens_per_rank=64) -> Plan:
    """A one-step plan of sample 0 whole on one rank, the rest listed as dropped (built by hand)."""
    config = PlanConfig(dp=1, cp=1, tokens_per_rank=tokens_per_rank, overflow="drop")
    mb = MicroBatch(samples=(0,), shards=(RankShard((Piece(0, 0, lengths[0]),)),), loss_tokens=lengths[0] - 1)
    return Plan(config=config, lengths=tuple(lengths), steps=(Step(microbatches=((mb,),)),), dropped=tuple(dropped))


def test_validate_refuses_a_sample_past_the_limit():
    _plan_holding([5, MAX_SAMPLE_TOKENS], [1]).validate()
    with pytest.raises(PlanError, match=r"plan lengths: sample 1 has 4,294,967,296 tokens"):
        _plan_holding([5, 2**32], [1]).validate()


@pytest.mark.parametrize("suffix", [".json", ".parquet"])
def test_plan_files_past_the_limit_are_refused_on_load(tmp_path, suffix):
    path = tmp_path / f"plan{suffix}"
    _plan_holding([5, 2**40], [1]).save(path)  # save writes what it is given; load checks
    with pytest.raises(PlanError, match=rf"plan file {path}: .*sample 1 has 1,099,511,627,776 tokens"):
        Plan.load(path)
    doc = _plan_holding([5, 6], [1]).to_dict()
    doc["config"]["tokens_per_rank"] = 2**40
    (tmp_path / "config.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="tokens per CP group"):
        Plan.load(tmp_path / "config.json")


def test_report_and_plan_refuse_them_in_one_line(tmp_path):
    plan_file = tmp_path / "huge.json"
    _plan_holding([5, 2**40], [1]).save(plan_file)
    run = run_cli(["report", plan_file, "--out", tmp_path / "report", "--no-plots"])
    assert_clean(run)
    assert run.code == 1 and "sample 1 has 1,099,511,627,776 tokens" in run.err
    assert not (tmp_path / "report").exists() or not any((tmp_path / "report").iterdir())
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([7, 8, 2**33]))
    for command in (["plan", "--out", tmp_path / "p.json"], ["report", "--out", tmp_path / "r", "--no-plots"]):
        run = run_cli([*command, "--lengths", lengths, "--dp", 1, "--cp", 1, "--tokens-per-rank", 64])
        assert_clean(run)
        assert run.code == 1 and "sample 2 has 8,589,934,592 tokens" in run.err, run.err
    lengths.write_text(json.dumps([7, 8, 9]))
    run = run_cli(
        ["plan", "--lengths", lengths, "--dp", 1, "--cp", 2, "--tokens-per-rank", 2**31, "--out", tmp_path / "p.json"]
    )
    assert_clean(run)
    assert run.code == 1 and "--cp x --tokens-per-rank = 2 x 2147483648" in run.err, run.err


@pytest.mark.parametrize("field, value", [("dp", MAX_DP + 1), ("cp", MAX_CP + 1), ("cp", 2**31)])
def test_dp_and_cp_beyond_the_command_lines_limits_are_refused_everywhere(tmp_path, field, value):
    """The flags' limits are PlanConfig's: a plan file or Python call cannot build millions of rank shards."""
    sizes = {"dp": 1, "cp": 1, "tokens_per_rank": 1, field: value}
    with pytest.raises(PlanError, match=f"{field} {value} is more than"):
        PlanConfig(**sizes)
    with pytest.raises(PlanError, match=f"{field} {value} is more than"):
        ringpack.plan([1, 1], **sizes)
    doc = _plan_holding([5, 6], [1]).to_dict()
    doc["config"].update(sizes)
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=f"{field} {value} is more than"):
        Plan.load(tmp_path / "plan.json")
    PlanConfig(**{**sizes, field: MAX_DP if field == "dp" else MAX_CP})
