"""A packing measured under a split without the plan: the plan's figures and piece table exactly, in bounded memory.

``evaluate_packed`` skips the plan objects; every figure, the piece table and the content hash
must still be those of ``make_plan``'s plan (floor-cut zigzag, its token-even fallback, samples
shorter than ``2*cp``, one CP rank, the balanced split a block at a time), blocks must not change
a figure, and memory must not grow with the pieces a CP size cuts samples into.
"""

from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

import ringpack.analysis.metrics as metrics
from ringpack.analysis.metrics import evaluate_plan
from ringpack.analysis.packed import (
    PackedSteps,
    chunk_shares,
    evaluate_packed,
    zigzag_chunk_sizes,
    zigzag_even_chunk_sizes,
)
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import global_batches, pack_step, split_microbatches
from ringpack.planner.split import split_zigzag_even
from ringpack.shard_plan import PlanConfig, plan_content_hash

FIELDS = ("mb_exists", "tokens", "pairs", "segments", "cost", "kv_cross_tokens", "zigzag_padding", "samples")
FLOPS = CostModel.preset("llama3-8b")


def packed_of(lengths, cfg: PlanConfig) -> PackedSteps:
    batches = global_batches(lengths, cfg)
    steps = [(ids, *pack_step(s, ids, batches.lengths, cfg)[:2]) for s, ids in enumerate(batches.windows)]
    return PackedSteps.of(steps, batches.lengths, cfg.dp)


def measure(packed: PackedSteps, lengths, cfg: PlanConfig, with_table: bool = False):
    docs = global_batches(lengths, cfg).lengths
    split = lambda groups: split_microbatches(groups, docs, cfg, docs.tolist())
    metrics, table = evaluate_packed(
        packed,
        cfg.strategy,
        cp=cfg.cp,
        tokens_per_rank=cfg.tokens_per_rank,
        model=cfg.cost,
        name="x",
        split=split,
        with_table=with_table,
    )
    return (metrics, table) if with_table else metrics


def assert_same(got, want) -> None:
    for field in FIELDS:
        a, b = getattr(got, field), getattr(want, field)
        assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), field
    assert got.loss_tokens.tolist() == want.loss_tokens.tolist()


def cases():
    rng = np.random.default_rng(0)
    out = []
    for trial in range(36):
        cp, dp = int(rng.choice([1, 2, 3, 4, 8])), int(rng.integers(1, 5))
        n = int(rng.integers(20, 200))
        kind = trial % 3
        if kind == 0:
            lengths = rng.integers(1, 3 * cp + 2, n)  # many samples shorter than 2*cp: empty zigzag chunks
        elif kind == 1:
            lengths = rng.integers(1, 4000, n)
        else:
            lengths = np.clip(np.round(300 * np.exp(1.5 * rng.standard_normal(n))), 1, 10**5).astype(np.int64)
        cfg = PlanConfig(
            dp=dp,
            cp=cp,
            tokens_per_rank=int(rng.choice([64, 256, 1024])),
            samples_per_step=int(rng.integers(dp, 3 * dp + 40)),
            overflow="split",
            packing=("balanced", "first_fit")[trial % 2],
            microbatches_per_rank=int(rng.choice([0, 1, 2])),
            cost=FLOPS,
        )
        out.append((lengths, cfg))
    return out


def test_packed_metrics_are_the_plans():
    checked = fallback = 0
    for lengths, cfg in cases():
        try:
            packed = packed_of(lengths, cfg)
        except ValueError:  # a fixed micro-batch count the samples cannot fill: nothing to compare
            continue
        batches = global_batches(lengths, cfg)
        for strategy in ("zigzag", "contiguous", "balanced"):
            c = dataclasses.replace(cfg, strategy=strategy)
            plan = make_plan(lengths, c)
            got, table = measure(packed, lengths, c, with_table=True)
            assert_same(got, evaluate_plan(plan))
            assert all(np.array_equal(table[k], plan.piece_arrays[k]) for k in plan.piece_arrays), "piece table"
            hashed = plan_content_hash(c, batches.lengths, batches.dropped, batches.origins, table)
            assert hashed == plan.content_hash
            checked += 1
        floor = np.zeros((packed.num_cells, cfg.cp), dtype=np.int64)
        np.add.at(floor, packed.cell, chunk_shares(zigzag_chunk_sizes(packed.length, cfg.cp))[0])
        fallback += int((floor.max(axis=1) > cfg.tokens_per_rank).sum())
    assert checked >= 36 and fallback > 0, "the token-even zigzag fallback was not exercised"


def test_token_even_chunks_are_split_zigzag_evens():
    rng = np.random.default_rng(5)
    for _ in range(200):
        cp = int(rng.integers(1, 9))
        lengths = rng.integers(1, 40, int(rng.integers(1, 12)))
        mb = split_zigzag_even(list(range(lengths.size)), lengths.tolist(), cp)
        extra = lengths % cp
        turn = (np.cumsum(extra) - extra) % cp
        sizes = zigzag_even_chunk_sizes(lengths, turn, cp)
        stop = np.cumsum(sizes, axis=1)
        want = sorted((p.sample, c, p.start, p.stop) for c, shard in enumerate(mb.shards) for p in shard.pieces)
        got = sorted(
            (i, min(k, 2 * cp - 1 - k), int(stop[i, k] - sizes[i, k]), int(stop[i, k]))
            for i in range(lengths.size)
            for k in range(2 * cp)
            if sizes[i, k] > 0
        )
        assert got == want


def test_blocks_change_no_figure(monkeypatch):
    lengths = np.random.default_rng(2).integers(1, 3000, 300)
    cfg = PlanConfig(dp=3, cp=4, tokens_per_rank=1024, samples_per_step=60, packing="first_fit", cost=FLOPS)
    packed = packed_of(lengths, cfg)
    strategies = ("zigzag", "contiguous", "balanced")
    whole = [measure(packed, lengths, dataclasses.replace(cfg, strategy=s)) for s in strategies]
    monkeypatch.setattr(metrics, "BLOCK_ENTRIES", 7)  # one or two samples, one micro-batch per block
    for strategy, want in zip(strategies, whole):
        assert_same(measure(packed, lengths, dataclasses.replace(cfg, strategy=strategy)), want)


def test_the_planners_split_goes_in_blocks(monkeypatch):
    """The balanced split's objects exist one block of micro-batches at a time: each block holds at
    most BLOCK_ENTRIES pieces as a zigzag would cut its samples, or a single micro-batch."""
    monkeypatch.setattr(metrics, "BLOCK_ENTRIES", 600)
    lengths = np.random.default_rng(3).integers(1, 400, 600)
    cfg = PlanConfig(dp=4, cp=8, tokens_per_rank=512, samples_per_step=100, strategy="balanced", cost=FLOPS)
    packed = packed_of(lengths, cfg)
    docs = global_batches(lengths, cfg).lengths
    blocks = []

    def split(groups):
        blocks.append([min(int(docs[s]), 2 * cfg.cp) for g in groups for s in g])
        return split_microbatches(groups, docs, cfg, [])

    got, _ = evaluate_packed(packed, "balanced", cp=8, tokens_per_rank=512, model=FLOPS, name="x", split=split)
    assert_same(got, evaluate_plan(make_plan(lengths, cfg)))
    assert len(blocks) > 3 and sum(map(len, blocks)) == len(docs)
    assert all(sum(b) <= 600 for b in blocks if len(b) > 1)


@pytest.mark.parametrize("strategy", ["zigzag", "contiguous"])
def test_memory_does_not_grow_with_the_pieces(monkeypatch, strategy):
    """512 GPUs as DP=2 x CP=256: zigzag cuts each sample into 512 pieces, yet the peak stays far
    below one column of that piece table (``8 * samples * 2 * cp`` bytes), where a plan or a table
    needs eight such columns and more."""
    monkeypatch.setattr(metrics, "BLOCK_ENTRIES", 1 << 14)
    lengths = np.random.default_rng(1).integers(600, 3000, 3000)
    cfg = PlanConfig(
        dp=2, cp=256, tokens_per_rank=2048, samples_per_step=1500, packing="first_fit", strategy=strategy, cost=FLOPS
    )
    packed = packed_of(lengths, cfg)
    tracemalloc.start()
    try:
        measure(packed, lengths, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    column = 8 * lengths.size * 2 * cfg.cp
    assert peak < column / 3, (peak, column)
