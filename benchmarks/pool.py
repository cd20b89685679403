"""Pool-plan benchmark: planning one global batch for the whole pool (``world=N, gpus_per_node=G``).

    python benchmarks/pool.py [--worlds 1024,8192] [--lengths PATH] [--out pool.json]

Lengths: 1M log-normal samples (median 1,536 tokens, clipped at 131,072) unless ``--lengths``
names a file ``ringpack plan`` reads. For every pool size it cuts the global batches a pool plan
of ``--fill`` of the pool's tokens per step makes (``tokens_per_rank`` 16,384, one micro-batch per
rank) and plans the first ``--steps`` of them, each alone (``plan_step``, the sampler's way), in a
fresh process per pool size so that its peak resident memory is the planner's own. Reported per
pool size: planning seconds per global batch (median, and every run), peak RSS, the step's gap to
its lower bound (at the model's prices and over the price range), split samples, those whose
pieces cross nodes, and pieces. The targets: 1,024 ranks in under 1 s, 8,192 in under 10 s, on
one core of the 2-core CPU machine, with memory linear in the pool.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringpack.analysis.simulate import synthetic_lengths
from ringpack.lengths import sample_lengths
from ringpack.planner.bounds import plan_costs
from ringpack.planner.epoch import global_batches, plan_step
from ringpack.shard_plan import Plan, PlanConfig


def lengths_of(path: str | None) -> np.ndarray:
    if path:
        return np.asarray(sample_lengths(path), dtype=np.int64)
    return synthetic_lengths(1_000_000, "lognormal", seed=0, median=1536, max_len=131072)


def one_pool(world: int, node: int, tokens_per_rank: int, fill: float, steps: int, path: str | None) -> dict:
    """Plan ``steps`` global batches of a pool of ``world`` ranks; runs in its own process."""
    L = lengths_of(path)
    samples = int(fill * world * tokens_per_rank / float(L.mean()))
    config = PlanConfig(
        dp=1, cp=world, gpus_per_node=node, tokens_per_rank=tokens_per_rank, samples_per_step=samples,
        microbatches_per_rank=1, overflow="split",
    )  # fmt: skip
    batches = global_batches(L, config)
    seconds, planned = [], []
    for s in range(steps):
        if int(batches.lengths[batches.windows[s]].sum()) > config.group_capacity:
            raise SystemExit(f"global batch {s} holds more tokens than the pool: lower --fill")
        start = time.process_time()
        planned.append(plan_step(batches, s, config))
        seconds.append(time.process_time() - start)
    plan = Plan(config=config, lengths=tuple(batches.lengths.tolist()), steps=tuple(planned))
    costs = plan_costs(plan)
    split = crossing = 0
    for _, _, _, mb in plan.iter_microbatches():
        ranks: dict[int, set[int]] = {}
        for r, shard in enumerate(mb.shards):
            for p in shard.pieces:
                ranks.setdefault(p.sample, set()).add(r)
        split += sum(len(r) > 1 for r in ranks.values())
        crossing += sum(len({x // node for x in r}) > 1 for r in ranks.values())
    tokens = [int(batches.lengths[w].sum()) for w in batches.windows[:steps]]
    return {
        "world": world,
        "gpus_per_node": node,
        "tokens_per_rank": tokens_per_rank,
        "samples_per_step": samples,
        "fill": [t / config.group_capacity for t in tokens],
        "plan_seconds": float(np.median(seconds)),
        "plan_seconds_all": seconds,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "gap": costs["gap"].tolist(),
        "robust_gap": costs["robust_gap"].tolist(),
        "split_samples": split / steps,
        "crossing_nodes": crossing / steps,
        "pieces": len(plan.piece_arrays["start"]) / steps,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1024,8192", help="pool sizes, comma-separated")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tokens-per-rank", type=int, default=16384)
    parser.add_argument("--fill", type=float, default=0.93, help="a global batch's share of the pool's tokens")
    parser.add_argument("--steps", type=int, default=3, help="global batches planned per pool size")
    parser.add_argument("--lengths", default=None, help="a lengths file (default: 1M log-normal lengths)")
    parser.add_argument("--out", default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for world in (int(x) for x in args.worlds.split(",")):
        with ctx.Pool(1) as pool:
            row = pool.apply(
                one_pool, (world, args.gpus_per_node, args.tokens_per_rank, args.fill, args.steps, args.lengths)
            )
        rows.append(row)
        print(
            f"world {world:>5} ({world // args.gpus_per_node} nodes of {args.gpus_per_node}): "
            f"{row['plan_seconds']:.2f} s a global batch of {row['samples_per_step']:,} samples, "
            f"peak RSS {row['peak_rss_mb']:.0f} MB, gap median {np.median(row['gap']):.2%} "
            f"(price range {np.median(row['robust_gap']):.2%}), {row['split_samples']:.0f} split samples, "
            f"{row['crossing_nodes']:.0f} across nodes, {row['pieces']:.0f} pieces"
        )
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"machine": platform.platform(), "processor": platform.processor(), "commit": commit, "args": vars(args)}
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
