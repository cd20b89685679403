"""``ringpack plan``: sample lengths into a DP x CP shard plan file (docs/planner.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from typing import Any

import numpy as np

from ringpack import analysis
from ringpack.analysis.advice import advise
from ringpack.analysis.partners import partner_line, plan_partners
from ringpack.analysis.report import window_line
from ringpack.analysis.robustness import PRICE_FACTORS, imbalance_across_prices
from ringpack.cli.analysis_flags import add_advice_flag
from ringpack.cli.config_file import SUFFIXES, add_config_file_flag, write_config, written_settings
from ringpack.cli.flags import REQUIRED, add_plan_flags, add_quiet_flag, flag, new_command
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import (
    check_output_file,
    plan_config_from_args,
    progress,
    samples_per_step,
)
from ringpack.cli.layout import add_layout_flags, choice_to_dict, layout_table, resolve_layout
from ringpack.cli.lengths_input import add_lengths_flags, lengths_from_args, lengths_kind
from ringpack.comm_model import CommModel
from ringpack.planner.bounds import plan_costs
from ringpack.planner.epoch import global_batches, make_plan
from ringpack.traffic import plan_kv_traffic

logger = logging.getLogger("ringpack.cli")
#: The plan file formats ``--out`` writes (``Plan.save``).
PLAN_SUFFIXES = (".parquet", ".json")
#: Settings of where and how a run reports, not of what it plans: ``--write-config`` leaves them out,
#: so a run from the written file writes no plan over the first one unless told where; whether the
#: length cache was read changes no length either.
NOT_WRITTEN = ("out", "json", "quiet", "no_length_cache", "no_advice")


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "plan",
        help="plan sample lengths into a DP x CP shard plan",
        description="Plan sample lengths into a DP x CP shard plan (balanced packing, DP balance and CP split).",
        examples=[
            "ringpack plan --lengths lengths.npy --dp 8 --cp 4 --tokens-per-rank 32768 --samples-per-step 512 "
            "--out plan.parquet",
            "ringpack plan --config run.toml --out plan.json --write-config used.toml",
            "ringpack plan --lengths lengths.npy --world 64 --gpus-per-node 8 --cp auto --tokens-per-rank 16384 "
            "--global-batch-tokens auto --out plan.parquet",
        ],
    )
    add_lengths_flags(p, required=True)
    add_plan_flags(p)
    add_layout_flags(p)
    flag(p, "--out", default=REQUIRED, help="output plan: a .parquet or .json file")
    flag(p, "--json", default=False, action="store_true", help="print the summary as JSON")
    add_advice_flag(p)
    add_quiet_flag(p)
    add_config_file_flag(p)
    flag(
        p,
        "--write-config",
        metavar="FILE",
        help="write the planning settings of this run (not --out, --json, --quiet) as a --config file "
        "(.toml, .json, .yaml)",
    )
    p.set_defaults(handler=run_plan, command_parser=p)


def summarize(plan) -> dict:
    """Summary numbers of a plan: what ``ringpack plan`` prints (``--json``: as they are)."""
    costs = plan_costs(plan)
    kv = plan_kv_traffic(plan)
    per_step_unique = np.bincount(kv["step"], weights=kv["unique"], minlength=plan.num_steps)
    prices = imbalance_across_prices(plan, PRICE_FACTORS)
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
        "robust_gap_median": float(np.nanmedian(costs["robust_gap"])),
        "robust_gap_max": float(np.nanmax(costs["robust_gap"])),
        "kv_tokens_per_step_median": float(np.median(per_step_unique)),
        "imbalance_by_pair_price": {str(f): round(v, 6) for f, v in prices.items()},
    }


def run_plan(args: argparse.Namespace) -> int:
    check_flags_apply(args, "plan", lengths_kind(args))
    inputs = [args.lengths, args.cost, args.config]
    check_output_file(args.out, "--out", inputs=inputs, suffixes=PLAN_SUFFIXES)
    if args.write_config:
        check_output_file(
            args.write_config, "--write-config", inputs=inputs, outputs={"--out": args.out}, suffixes=list(SUFFIXES)
        )
    lengths = lengths_from_args(args)
    choice = resolve_layout(args, lengths)
    if choice is not None and not args.json:
        print(layout_table(choice, host_time=args.host_time))
    config = plan_config_from_args(args, samples_per_step=samples_per_step(args, lengths))
    t0 = time.perf_counter()
    with progress(args, f"planning {len(lengths):,} samples", "steps") as bar:
        plan = make_plan(lengths, config, progress=bar.advance_to).validate()
    seconds = time.perf_counter() - t0
    plan.save(args.out)
    if args.write_config:  # the batch as the plan has it, so the file makes this plan again
        settings = written_settings(args, args.command_parser, leave_out=NOT_WRITTEN)
        write_config(
            args.write_config, {**settings, "samples_per_step": config.samples_per_step, "global_batch_tokens": 0}
        )
    summary = summarize(plan)
    if config.batch_window:
        tokens = int(np.sum(plan.lengths)) - sum(plan.lengths[k] for k in plan.dropped)
        moves = global_batches(lengths, config).moves()
        summary["batch_window"] = moves.summary(config, summary["samples"], tokens)
    if config.cp > 1:
        summary["partners"] = plan_partners(plan)
    if config.cp > 1 and args.host_time:
        largest = max(
            (mb for step in plan.steps for rank in step.microbatches for mb in rank),
            key=lambda mb: sum(len(shard.pieces) for shard in mb.shards),
        )
        summary["compile_ms"] = round(
            analysis.compile_milliseconds(largest, config.gpus_per_node, config.max_partners), 2
        )
    summary["plan_seconds"] = round(seconds, 4)
    summary["out"] = str(args.out)
    if choice is not None:
        summary["layout"] = choice_to_dict(choice)
    if not args.no_advice:
        with progress(args, "re-planning a sample with each remedy", "remedies"):
            summary["advice"] = advise(lengths, config, _comm_model(config, choice))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    _print_summary(summary, config, seconds)
    if args.write_config:
        print(f"wrote {args.write_config} (rerun with --config {args.write_config})")
    return 0


def _comm_model(config: Any, choice: Any) -> CommModel:
    """The communication model the advice times remedies with: the chosen layout's mode under
    ``--cp auto``, else the ring, with the model's K/V bytes, the plan's nodes and partner budget."""
    mode = choice.best.mode if choice is not None else "ring"
    comm = CommModel.for_model(config.cost, mode=mode, gpus_per_node=config.gpus_per_node)
    return dataclasses.replace(comm, max_partners=config.max_partners)


def _print_summary(summary: dict[str, Any], config: Any, seconds: float) -> None:
    print(
        f"planned {summary['samples']} samples into {summary['steps']} steps, {summary['microbatches']} micro-batches "
        f"(dp={config.dp} x cp={config.cp}, {config.tokens_per_rank} tokens/rank, strategy={config.strategy}) "
        f"in {seconds:.3f} s"
    )
    print(
        f"step cost / mean rank cost: median {summary['imbalance_median']:.4f}, worst {summary['imbalance_max']:.4f}; "
        f"gap to lower bound: median {summary['gap_median']:.2%}, worst {summary['gap_max']:.2%}"
    )
    print(
        f"over the pair-price range {config.price_range[0]:g}-{config.price_range[1]:g}x, against the robust bound "
        f"(the best any plan can stay at every price of the range at once): gap median "
        f"{summary['robust_gap_median']:.2%}, worst {summary['robust_gap_max']:.2%}"
    )
    if "batch_window" in summary:
        print(window_line(summary["batch_window"]))
    print(f"K/V tokens sent across CP ranks per step (median): {summary['kv_tokens_per_step_median']:.0f}")
    if "partners" in summary:
        print(partner_line(summary["partners"]))
    if "compile_ms" in summary:
        print(f"host time to compile one rank's schedule of the largest micro-batch: {summary['compile_ms']:.1f} ms")
    prices = summary["imbalance_by_pair_price"]
    print(
        "plan time / balanced time if a pair really costs x the model's price: "
        + ", ".join(f"x{f}: {v:.4f}" for f, v in prices.items())
        + f" (planned for x{config.price_range[0]:g}..x{config.price_range[1]:g})"
    )
    if summary["dropped"]:
        logger.warning(
            "dropped %d samples longer than %d tokens (--overflow drop)", summary["dropped"], config.group_capacity
        )
    print(f"wrote {summary['out']} (hash {summary['hash'][:16]})")
    if "advice" in summary:
        print(summary["advice"]["headline"] + " (ringpack report lists every remedy)")
