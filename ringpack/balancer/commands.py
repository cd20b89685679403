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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan sample lengths into a DP x CP shard plan",
        description="Plan sample lengths into a DP x CP shard plan (balanced packing, DP balance and CP split).",
    )
    p.add_argument("--lengths", required=True, help="file of sample lengths: .parquet, .arrow/.feather, .json/.jsonl or .npy")
    p.add_argument("--column", default=None, help="column holding lengths or token lists (default: guessed)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--cp", type=int, required=True, help="context-parallel size")
    p.add_argument("--tokens-per-rank", type=int, required=True, help="token budget of one GPU per micro-batch")
    p.add_argument("--strategy", choices=("balanced", "zigzag", "contiguous"), default="balanced", help="CP split (default: balanced)")
    p.add_argument("--packing", choices=("balanced", "first_fit"), default="balanced", help="packing + DP balance (default: balanced)")
    p.add_argument("--samples-per-step", type=int, default=0, help="global batch in samples (0: all in one step)")
    p.add_argument("--microbatches-per-rank", type=int, default=0, help="micro-batches per DP rank and step (0: automatic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epoch", type=int, default=0)
    p.add_argument("--overflow", choices=("error", "split", "drop"), default="error", help="samples longer than cp*tokens_per_rank (default: error)")
    p.add_argument("--solver-time-limit", type=float, default=0.0, help="CP-SAT refinement per step, deterministic seconds (0: heuristics only)")
    p.add_argument(
        "--cp-token-slack", type=float, default=None,
        help="balanced CP split: hold every rank within 1+SLACK of the mean tokens, a guard against a mispriced "
        "(uncalibrated) cost model; 0.02 recommended with FLOP models (default: tokens free)",
    )
    p.add_argument("--model", default="llama3-8b", help="cost model preset (default: llama3-8b)")
    p.add_argument("--cost-profile", default=None, help="calibrated cost model JSON (overrides --model)")
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
    from ringpack.balancer.cost import CostModel
    from ringpack.balancer.lengths import read_lengths
    from ringpack.balancer.plan import PlanConfig
    from ringpack.balancer.planner import make_plan

    lengths = read_lengths(args.lengths, args.column)
    cost = CostModel.load(args.cost_profile) if args.cost_profile else CostModel.preset(args.model)
    config = PlanConfig(
        dp=args.dp,
        cp=args.cp,
        tokens_per_rank=args.tokens_per_rank,
        strategy=args.strategy,
        packing=args.packing,
        samples_per_step=args.samples_per_step,
        microbatches_per_rank=args.microbatches_per_rank,
        seed=args.seed,
        epoch=args.epoch,
        overflow=args.overflow,
        solver_time_limit_s=args.solver_time_limit,
        cp_token_slack=args.cp_token_slack,
        cost=cost,
    )
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
