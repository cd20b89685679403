"""``ringpack plan``: lengths in, shard plan out.

    ringpack plan --lengths lengths.parquet --dp 8 --cp 4 --tokens-per-rank 32768 --out plan.parquet

Reads lengths with :func:`ringpack.balancer.lengths.read_lengths`, plans with
:func:`ringpack.balancer.planner.make_plan`, validates, writes the plan (``.json`` as JSON, anything
else as Parquet) and prints a summary: steps, micro-batches, balance and gap to the lower bound,
K/V traffic, dropped samples and the plan hash.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ringpack._commands import add_plan_arguments, plan_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan sample lengths into a DP x CP shard plan",
        description="Plan sample lengths into a DP x CP shard plan (balanced packing, DP balance and CP split).",
    )
    p.add_argument("--lengths", required=True, help="file of sample lengths: .parquet, .arrow/.feather, .json/.jsonl or .npy")
    p.add_argument("--column", default=None, help="column holding lengths or token lists (default: guessed)")
    add_plan_arguments(p)
    p.add_argument("--out", required=True, help="output plan: .parquet (default) or .json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(handler=run)


def summarize(plan) -> dict:
    """Summary numbers of a plan (also used by the benchmark)."""
    import numpy as np

    from ringpack.balancer.comm import plan_kv_traffic
    from ringpack.balancer.metrics import plan_costs

    costs = plan_costs(plan)
    kv = plan_kv_traffic(plan)
    per_step_unique = np.bincount(kv["step"], weights=kv["unique"], minlength=plan.num_steps)
    return {
        "hash": plan.content_hash,
        "steps": plan.num_steps,
        "microbatches": int(sum(len(step.microbatches) * len(step.microbatches[0]) for step in plan.steps)),
        "samples": len(plan.lengths) - len(plan.dropped),
        "dropped": len(plan.dropped),
        "imbalance_median": float(np.median(costs["imbalance"])),
        "imbalance_max": float(np.max(costs["imbalance"])),
        "gap_median": float(np.nanmedian(costs["gap"])),
        "gap_max": float(np.nanmax(costs["gap"])),
        "kv_tokens_per_step_median": float(np.median(per_step_unique)),
    }


def run(args: argparse.Namespace) -> int:
    from ringpack.balancer.lengths import read_lengths
    from ringpack.balancer.planner import make_plan

    lengths = read_lengths(args.lengths, args.column)
    config = plan_config_from_args(args)
    t0 = time.perf_counter()
    plan = make_plan(lengths, config).validate()
    seconds = time.perf_counter() - t0
    plan.save(args.out)
    summary = summarize(plan)
    summary["plan_seconds"] = round(seconds, 4)
    summary["out"] = str(args.out)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"planned {summary['samples']} samples into {summary['steps']} steps, {summary['microbatches']} micro-batches "
        f"(dp={config.dp} x cp={config.cp}, {config.tokens_per_rank} tokens/rank, strategy={config.strategy}) in {seconds:.3f} s"
    )
    print(
        f"step cost / mean rank cost: median {summary['imbalance_median']:.4f}, worst {summary['imbalance_max']:.4f}; "
        f"gap to lower bound: median {summary['gap_median']:.2%}, worst {summary['gap_max']:.2%}"
    )
    print(f"K/V tokens sent across CP ranks per step (median): {summary['kv_tokens_per_step_median']:.0f}")
    if summary["dropped"]:
        print(f"dropped {summary['dropped']} samples longer than {config.group_capacity} tokens (overflow=drop)", file=sys.stderr)
    print(f"wrote {args.out} (hash {summary['hash'][:16]})")
    return 0
