"""The shard-plan contract: validation names each broken invariant; JSON/Parquet round trips; hashing."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given

from ringpack.shard_plan import (
    ColumnShards,
    MicroBatch,
    Piece,
    Plan,
    PlanConfig,
    PlanError,
    RankShard,
    Step,
    microbatch_from_shards,
    new_rank_shard,
)
from tests.helpers.plans import random_plan

LENGTHS = (5, 3, 7, 1)


def small_plan(**config) -> Plan:
    """dp=1, cp=2, one step with two micro-batches; sample 3 (length 1) is dropped."""
    mb0 = microbatch_from_shards([0, 2], [[Piece(0, 0, 3), Piece(2, 0, 4)], [Piece(0, 3, 5), Piece(2, 4, 7)]], LENGTHS)
    mb1 = microbatch_from_shards([1], [[Piece(1, 0, 1)], [Piece(1, 1, 3)]], LENGTHS)
    cfg = PlanConfig(dp=1, cp=2, tokens_per_rank=8, **config)
    return Plan(config=cfg, lengths=LENGTHS, steps=(Step(((mb0, mb1),)),), dropped=(3,))


def replace_mb(plan: Plan, mb: MicroBatch, index: int = 0) -> Plan:
    ranks = list(plan.steps[0].microbatches[0])
    ranks[index] = mb
    return dataclasses.replace(plan, steps=(Step((tuple(ranks),)),))


def test_small_plan_is_valid():
    plan = small_plan()
    assert plan.validate() is plan
    assert plan.steps[0].loss_tokens == (5 - 1) + (7 - 1) + (3 - 1)


def test_fast_shard_constructor_builds_ordinary_shards():
    shard = new_rank_shard([(1, 0, 3), (0, 2, 5)], (7, 4))
    fast, slow = shard.pieces[0], Piece(4, 0, 3)
    assert type(fast) is Piece and fast == slow and hash(fast) == hash(slow) and repr(fast) == repr(slow)
    assert vars(fast) == vars(slow) and dataclasses.asdict(fast) == dataclasses.asdict(slow)
    assert fast.length == 3 and fast != Piece(4, 0, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.start = 0
    assert type(shard) is RankShard and shard == RankShard((Piece(4, 0, 3), Piece(7, 2, 5)))
    assert hash(shard) == hash(RankShard((Piece(4, 0, 3), Piece(7, 2, 5)))) and shard.num_tokens == 6
    assert new_rank_shard([], (1,)) == RankShard()
    with pytest.raises(dataclasses.FrozenInstanceError):
        shard.pieces = ()


def test_piece_columns_are_read_once_and_leave_equality_hash_and_pickles_alone():
    shards = (RankShard((Piece(4, 0, 3),)), RankShard((Piece(7, 0, 2), Piece(4, 3, 5))))
    mb = MicroBatch(samples=(4, 7), shards=shards, loss_tokens=5)
    before = pickle.dumps(mb)
    rank, sample, start, stop = mb.piece_columns
    assert rank.tolist() == [0, 1, 1] and sample.tolist() == [4, 7, 4]
    assert start.tolist() == [0, 0, 3] and stop.tolist() == [3, 2, 5]
    assert mb.piece_columns is mb.piece_columns
    twin = MicroBatch(samples=mb.samples, shards=mb.shards, loss_tokens=5)
    assert mb == twin and hash(mb) == hash(twin) and repr(mb) == repr(twin)
    assert pickle.dumps(mb) == before and "piece_columns" not in vars(pickle.loads(before))


def column_shards_of(shards: tuple[RankShard, ...]) -> ColumnShards:
    rows = [(p.sample, p.start, p.stop) for shard in shards for p in shard.pieces]
    bounds = np.cumsum([0, *(len(shard.pieces) for shard in shards)])
    return ColumnShards(np.asarray(rows, dtype=np.int64).reshape(-1, 3), bounds)


def test_column_shards_build_each_rank_on_first_read_and_equal_the_tuple():
    shards = (RankShard((Piece(4, 0, 3),)), RankShard(), RankShard((Piece(7, 0, 2), Piece(4, 3, 5))))
    lazy = column_shards_of(shards)
    assert len(lazy) == 3 and not lazy._built, "nothing built before a read"
    assert lazy[2] == shards[2] and lazy[2] is lazy[2] and set(lazy._built) == {2}, "one rank built, then kept"
    assert lazy[-1] is lazy[2] and lazy[1] == RankShard() and lazy[0:2] == shards[0:2]
    with pytest.raises(IndexError):
        _ = lazy[3]
    with pytest.raises(TypeError):
        _ = lazy["0"]
    assert lazy == shards and shards == lazy and hash(lazy) == hash(shards) and lazy != shards[:2]
    assert lazy != column_shards_of((RankShard((Piece(4, 0, 3),)), RankShard(), RankShard((Piece(7, 0, 2),))))
    tuple_mb = MicroBatch(samples=(4, 7), shards=shards, loss_tokens=5)
    mb = MicroBatch(samples=(4, 7), shards=column_shards_of(shards), loss_tokens=5)
    assert mb == tuple_mb and hash(mb) == hash(tuple_mb) and repr(mb) == repr(tuple_mb)
    assert mb.num_tokens == tuple_mb.num_tokens == 7 and mb.fingerprint == tuple_mb.fingerprint
    for got, want in zip(mb.piece_columns, tuple_mb.piece_columns):
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert pickle.loads(pickle.dumps(mb)) == tuple_mb
    assert MicroBatch(samples=(4, 7), shards=column_shards_of(shards[:2] + (RankShard(),)), loss_tokens=5) != mb


@pytest.mark.parametrize(
    "shards",
    [
        (RankShard((Piece(0, 0, 2.0),)),),
        (RankShard((Piece(0, True, 2),)),),
        (RankShard(((0, 0, 2),)),),
        ((Piece(0, 0, 2),),),
    ],
    ids=["float", "bool", "tuple piece", "tuple shard"],
)
def test_piece_columns_refuse_what_is_not_integer_pieces(shards):
    mb = MicroBatch(samples=(0,), shards=shards, loss_tokens=1)
    with pytest.raises(TypeError):
        _ = mb.piece_columns


@given(random_plan())
def test_random_plans_validate(plan):
    plan.validate()


@given(random_plan())
def test_json_round_trip(plan):
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.content_hash == plan.content_hash


@given(random_plan())
def test_parquet_table_round_trip(plan):
    again = Plan.from_table(plan.to_table())
    assert again == plan
    assert again.content_hash == plan.content_hash


def test_parquet_and_json_files(tmp_path):
    plan = small_plan()
    for name in ("plan.parquet", "plan.json"):
        plan.save(tmp_path / name)
        assert Plan.load(tmp_path / name) == plan


@pytest.mark.slow
def test_hash_is_identical_across_processes(tmp_path):
    plan = small_plan(seed=7)
    path = tmp_path / "plan.json"
    plan.save(path)
    code = (
        "import sys; from ringpack.shard_plan import Plan, PlanConfig, Step, MicroBatch;"
        f"print(Plan.from_json({str(path)!r}).content_hash)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == plan.content_hash


def test_hash_changes_with_content():
    plan = small_plan()
    assert small_plan(seed=1).content_hash != plan.content_hash
    cut = dataclasses.replace(plan, origins=((0, 0), (0, 5), (1, 0), (2, 0)))
    assert cut.validate().content_hash != plan.content_hash
    assert Plan.from_table(cut.to_table()).origins == cut.origins
    moved = microbatch_from_shards([1], [[Piece(1, 0, 2)], [Piece(1, 2, 3)]], LENGTHS)
    assert replace_mb(plan, moved, 1).content_hash != plan.content_hash


def test_tampered_json_is_rejected():
    data = json.loads(small_plan().to_json())
    data["steps"][0]["microbatches"][0][1]["shards"][0][0][2] = 2  # move a cut
    data["steps"][0]["microbatches"][0][1]["shards"][1][0][1] = 2
    with pytest.raises(PlanError, match="hash mismatch"):
        Plan.from_dict(data)


def test_not_a_plan_file(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(PlanError, match="bad.parquet"):
        Plan.read_parquet(bad)


# ---------------------------------------------------------------- every invariant, broken once
def broken_plans():
    plan = small_plan()
    mb0, mb1 = plan.steps[0].microbatches[0]
    L = LENGTHS
    yield "length 0", dataclasses.replace(plan, lengths=(5, 3, 7, 0)), r"sample 3 has length 0"
    yield "negative length", dataclasses.replace(plan, lengths=(5, -3, 7, 1)), r"sample 1 has length -3"
    yield (
        "overlap",
        replace_mb(
            plan,
            microbatch_from_shards([0, 2], [[Piece(0, 0, 4), Piece(2, 0, 4)], [Piece(0, 3, 5), Piece(2, 4, 7)]], L),
        ),
        r"sample 0 tokens \[3, 4\) are in two pieces",
    )
    yield (
        "gap",
        replace_mb(
            plan,
            microbatch_from_shards([0, 2], [[Piece(0, 0, 2), Piece(2, 0, 4)], [Piece(0, 3, 5), Piece(2, 4, 7)]], L),
        ),
        r"sample 0 tokens \[2, 3\) are in no piece",
    )
    yield (
        "missing tail",
        replace_mb(
            plan,
            microbatch_from_shards([0, 2], [[Piece(0, 0, 3), Piece(2, 0, 4)], [Piece(0, 3, 5), Piece(2, 4, 6)]], L),
        ),
        r"sample 2 tokens \[6, 7\) are in no piece",
    )
    yield (
        "piece out of range",
        replace_mb(plan, microbatch_from_shards([1], [[Piece(1, 0, 1)], [Piece(1, 1, 4)]], L), 1),
        r"piece \[1, 4\) of sample 1 is empty or outside",
    )
    yield (
        "empty piece",
        replace_mb(plan, MicroBatch((1,), (RankShard((Piece(1, 0, 3),)), RankShard((Piece(1, 3, 3),))), 2), 1),
        r"piece \[3, 3\) of sample 1 is empty",
    )
    yield (
        "wrong dp",
        dataclasses.replace(plan, config=dataclasses.replace(plan.config, dp=2)),
        r"step 0 has 1 DP ranks, plan is for dp=2",
    )
    yield (
        "wrong cp",
        dataclasses.replace(plan, config=dataclasses.replace(plan.config, cp=3)),
        r"micro-batch 0 has 2 rank shards, plan is for cp=3",
    )
    yield (
        "over budget",
        dataclasses.replace(plan, config=dataclasses.replace(plan.config, tokens_per_rank=6)),
        r"cp rank 0 holds 7 tokens, over tokens_per_rank=6",
    )
    yield (
        "order",
        replace_mb(
            plan, MicroBatch((0, 2), (RankShard((Piece(2, 0, 4), Piece(0, 0, 3))), mb0.shards[1]), mb0.loss_tokens)
        ),
        r"cp rank 0: piece \[0, 3\) of sample 0 breaks canonical order",
    )
    yield (
        "planned twice",
        dataclasses.replace(
            plan,
            steps=(
                Step(
                    ((mb0, mb1),),
                ),
                Step(
                    ((mb1, mb0),),
                ),
            ),
        ),
        r"sample \d is planned twice",
    )
    yield "not planned", dataclasses.replace(plan, dropped=()), r"sample 3 is in no micro-batch and not dropped"
    yield (
        "dropped but planned",
        dataclasses.replace(plan, dropped=(3, 1)),
        r"sample 1 is listed as dropped but is planned",
    )
    yield (
        "loss tokens",
        replace_mb(plan, dataclasses.replace(mb1, loss_tokens=3), 1),
        r"loss_tokens is 3, its samples give 2",
    )
    yield (
        "foreign piece",
        replace_mb(plan, MicroBatch((1,), (RankShard((Piece(1, 0, 1), Piece(3, 0, 1))), mb1.shards[1]), 2), 1),
        r"piece of sample 3, which the micro-batch does not list",
    )
    yield (
        "empty micro-batch",
        replace_mb(plan, MicroBatch((), (RankShard(), RankShard()), 0), 1),
        r"micro-batch 1 has no samples",
    )
    yield "sample listed twice", replace_mb(plan, dataclasses.replace(mb1, samples=(1, 1)), 1), r"lists a sample twice"
    yield (
        "unknown sample",
        replace_mb(plan, dataclasses.replace(mb1, samples=(1, 9)), 1),
        r"names sample 9, outside \[0, 4\)",
    )
    uneven = PlanConfig(dp=2, cp=2, tokens_per_rank=8)
    yield "uneven dp", Plan(uneven, LENGTHS, (Step(((mb0, mb1), ())),), (3,)), r"DP ranks run \[2, 0\] micro-batches"
    yield "dropped out of range", dataclasses.replace(plan, dropped=(3, 4)), r"dropped sample 4 is out of range"
    yield (
        "origins length",
        dataclasses.replace(plan, origins=((0, 0), (0, 5))),
        r"origins has 2 entries for 4 planned samples",
    )
    yield (
        "origin negative",
        dataclasses.replace(plan, origins=((0, 0), (1, 0), (2, -1), (3, 0))),
        r"sample 2 has origin \(2, -1\)",
    )


@pytest.mark.parametrize("name, plan, message", list(broken_plans()), ids=[b[0] for b in broken_plans()])
def test_each_broken_invariant_is_named(name, plan, message):
    with pytest.raises(PlanError, match=message):
        plan.validate()


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dp", 0, "dp must be a positive"),
        ("cp", -1, "cp must be a positive"),
        ("tokens_per_rank", 0, "tokens_per_rank"),
        ("strategy", "fancy", "strategy must be one of"),
        ("overflow", "truncate", "overflow must be one of"),
        ("packing", "random", "packing must be"),
    ],
)
def test_bad_config_is_rejected(field, value, message):
    kwargs = dict(dp=1, cp=1, tokens_per_rank=4)
    kwargs[field] = value
    with pytest.raises(PlanError, match=message):
        PlanConfig(**kwargs)
