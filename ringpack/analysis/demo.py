"""``ringpack demo``: the embedded default corpus through packing and CP splitting, with exact costs.

Runs anywhere Python runs (the corpus is the interpreter's own standard library) and prints what
the planner sees: the corpus's length statistics, then for a few packed micro-batches the exact
cost of every CP rank under a contiguous and a zigzag split.
"""

from __future__ import annotations

import argparse

import numpy as np

from ringpack.balancer.cost import CostModel, rank_costs
from ringpack.balancer.split import split_contiguous, split_zigzag
from ringpack.dataloaders.corpus import stdlib_corpus


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """Summary statistics of sample lengths (tokens)."""
    q = np.percentile(lengths, [50, 90, 99])
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum()),
        "min": int(lengths.min()),
        "median": float(q[0]),
        "mean": float(lengths.mean()),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()),
    }


def pack_in_order(order: np.ndarray, lengths: np.ndarray, capacity: int, count: int) -> list[list[int]]:
    """Fill micro-batches in the given order up to ``capacity`` tokens (no balancing: the baseline)."""
    batches: list[list[int]] = [[]]
    used = 0
    for sample in order:
        length = int(lengths[sample])
        if length > capacity:
            continue
        if used + length > capacity:
            if len(batches) == count:
                break
            batches.append([])
            used = 0
        batches[-1].append(int(sample))
        used += length
    return batches


def run(args: argparse.Namespace) -> int:
    corpus = stdlib_corpus(tokenizer=args.tokenizer)
    lengths = corpus.lengths
    stats = length_stats(lengths)
    print(f"corpus: {stats['samples']} standard-library files under {corpus.root} ({corpus.counter})")
    print(
        "lengths (tokens): total {tokens:,}  min {min}  median {median:.0f}  mean {mean:.0f}  "
        "p90 {p90:.0f}  p99 {p99:.0f}  max {max:,}".format(**stats)
    )
    model = CostModel.preset(args.model)
    capacity = args.cp * args.tokens_per_rank
    too_long = int((lengths > capacity).sum())
    if too_long:
        print(f"note: {too_long} files exceed one micro-batch ({capacity:,} tokens) and are left out of this demo")
    order = np.random.default_rng(args.seed).permutation(lengths.size)
    batches = pack_in_order(order, lengths, capacity, args.microbatches)
    print(
        f"\n{len(batches)} micro-batches packed in shuffled order, CP={args.cp}, {args.tokens_per_rank:,} tokens/rank, "
        f"cost model {model.name} (fwd+bwd TFLOPs per rank)"
    )
    for split_name, split in (("contiguous", split_contiguous), ("zigzag", split_zigzag)):
        print(f"\n  {split_name}")
        for i, samples in enumerate(batches):
            mb = split(samples, lengths, args.cp)
            costs = rank_costs(mb.shards, model) / 1e12
            ranks = "  ".join(f"r{r}={c:8.1f}" for r, c in enumerate(costs))
            print(f"    mb{i} ({len(samples):3d} samples): {ranks}   max/mean {costs.max() / costs.mean():.3f}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="Hugging Face tokenizer.json (or its folder) for exact token counts")
    p.add_argument("--cp", type=int, default=4, help="context-parallel ranks per micro-batch (default 4)")
    p.add_argument("--tokens-per-rank", type=int, default=16384, help="token budget per CP rank (default 16384)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches to show (default 4)")
    p.add_argument("--model", default="llama3-8b", help="cost-model preset (default llama3-8b)")
    p.add_argument("--seed", type=int, default=0)
