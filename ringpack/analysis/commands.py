"""``ringpack report | simulate | calibrate | demo``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._commands import PACKINGS, STRATEGIES, add_plan_arguments, cost_model_from_args, plan_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    from ringpack.analysis import demo

    p = subparsers.add_parser(
        "report",
        help="imbalance report of a plan, shard manifest or lengths",
        description="Imbalance report (terminal table, report.json, PNG plots, report.html/.md) of plan files, "
        "a shard manifest's plan, or sample lengths planned with every strategy.",
    )
    p.add_argument("plans", nargs="*", metavar="PLAN", help="plan files (.parquet or .json) to compare")
    p.add_argument("--manifest", help="a `ringpack shard` output (manifest.json or its folder): reports its plan")
    p.add_argument("--lengths", help="sample lengths file (.npy, .parquet, .json, .txt); planned with every strategy")
    p.add_argument("--corpus", choices=["stdlib"], help="use the embedded standard-library corpus as the lengths")
    add_variant_plan_arguments(p, dp=4, cp=4)
    add_comm_arguments(p)
    add_output_arguments(p, default_out="ringpack-report")
    p.add_argument("--step", type=int, help="step whose per-GPU costs are plotted and tabled (default: the baseline's median-idle step)")
    p.add_argument("--steps-shown", type=int, default=5, help="steps per plan in the terminal table (default 5)")
    p.set_defaults(handler=run_report)

    p = subparsers.add_parser(
        "simulate",
        help="simulate an epoch at cluster scale",
        description="Plan a whole epoch for a cluster shape with every strategy and predict tokens/s and idle "
        "time from the cost model and a ring / all-gather communication model.",
    )
    p.add_argument("--gpus", default="1024", help="GPUs, comma-separated for several shapes (default 1024); DP = gpus / cp")
    p.add_argument("--samples", type=int, default=1_000_000, help="samples in the epoch (default 1,000,000)")
    p.add_argument("--lengths", help="lengths file to simulate instead of drawn lengths")
    p.add_argument("--dist", default="stdlib", choices=["stdlib", "lognormal"],
                   help="drawn lengths: resampled stdlib corpus (default) or log-normal")
    p.add_argument("--median", type=float, default=2048, help="log-normal median length (tokens)")
    p.add_argument("--sigma", type=float, default=1.3, help="log-normal sigma")
    p.add_argument("--global-batch-tokens", type=int, default=0,
                   help="tokens per optimizer step (default: dp * cp * tokens-per-rank, one full micro-batch per DP rank)")
    add_variant_plan_arguments(p, dp=None, cp=8, tokens_per_rank=16384, strategies=None)
    add_comm_arguments(p, modes="ring,allgather")
    add_output_arguments(p, default_out="ringpack-simulation")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: all cores)")
    p.add_argument("--chunk-steps", type=int, default=8, help="global batches planned per worker task (default 8)")
    p.set_defaults(handler=run_simulate)

    from ringpack.analysis import calibrate

    p = subparsers.add_parser(
        "calibrate",
        help="fit the cost model to measured GPU kernel times",
        description="Time ringpack's attention kernels (and the model's linear layers) on one GPU, "
        "fit the cost model's coefficients and write a profile the planner loads.",
    )
    calibrate.add_arguments(p)
    p.set_defaults(handler=calibrate.run)
    p = subparsers.add_parser("demo", help="the embedded standard-library corpus through every strategy: report, plots, ring check")
    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)


# ------------------------------------------------------------------------------------------ options
def add_variant_plan_arguments(p: argparse.ArgumentParser, dp: int | None, cp: int, tokens_per_rank: int = 32768,
                               strategies: str | None = ",".join(STRATEGIES)) -> None:
    """The planner's flags (:func:`ringpack._commands.add_plan_arguments`) and the variants to plan and compare."""
    g = p.add_argument_group("planning (for lengths)")
    add_plan_arguments(g, dp=dp, cp=cp, tokens_per_rank=tokens_per_rank, overflow="split", strategy=False,
                       samples_per_step_zero="derived")
    g.add_argument("--tflops", type=float, default=400.0, help="achieved fwd+bwd TFLOP/s per GPU for predicted times (default 400)")
    if strategies is None:  # simulate: a curated default set of (strategy, packing) pairs
        g.add_argument("--strategies", help="CP strategies to plan (default: balanced/balanced, zigzag/balanced, "
                       "zigzag/first_fit, contiguous/first_fit)")
        g.add_argument("--packings", help="packings to plan, crossed with --strategies (default balanced,first_fit)")
    else:
        g.add_argument("--strategies", default=strategies, help=f"CP strategies to plan (default {strategies})")
        g.add_argument("--packings", default=",".join(PACKINGS), help="packings to plan (default balanced,first_fit)")
    g.add_argument("--baseline", help="plan the others are compared with (default zigzag/first_fit when present)")


def add_comm_arguments(p: argparse.ArgumentParser, modes: str = "ring") -> None:
    from ringpack.analysis.comm_model import LINKS

    g = p.add_argument_group("communication model")
    g.add_argument("--link", default="nvlink", choices=sorted(LINKS), help="link preset for CP traffic (default nvlink)")
    g.add_argument("--bandwidth", type=float, help="link bandwidth in GB/s (overrides --link)")
    g.add_argument("--latency-us", type=float, help="per-message latency in microseconds (overrides --link)")
    g.add_argument("--modes", default=modes, help=f"attention modes, first is the headline (default {modes})")


def add_output_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--out", default=default_out, help=f"folder for report.json, plots and report.html (default {default_out}/)")
    g.add_argument("--json", help="also write the JSON document here ('-' prints it to stdout instead of the table)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {bad or text!r} not in {allowed}")
    return items


def cost_model(args: argparse.Namespace):
    """The planner's cost model (:func:`ringpack._commands.cost_model_from_args`), a FLOP one at ``--tflops``."""
    import dataclasses

    model = cost_model_from_args(args)
    if model.unit == "flop":
        model = dataclasses.replace(model, flops_per_second=args.tflops * 1e12)
    return model


def comm_models(args: argparse.Namespace, model) -> list:
    from ringpack.analysis.comm_model import CommModel

    modes = _list(args.modes, ("ring", "allgather"), "modes")
    bw = None if args.bandwidth is None else args.bandwidth * 1e9
    lat = None if args.latency_us is None else args.latency_us * 1e-6
    return [CommModel.for_model(model, link=args.link, mode=m, bandwidth=bw, latency=lat) for m in modes]


def variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.strategies is None and args.packings is None:
        from ringpack.analysis.simulate import SIM_VARIANTS

        return list(SIM_VARIANTS)
    strategies = _list(args.strategies or ",".join(STRATEGIES), STRATEGIES, "strategies")
    packings = _list(args.packings or ",".join(PACKINGS), PACKINGS, "packings")
    return [(s, p) for p in packings for s in strategies]


def read_lengths_file(path: str) -> np.ndarray:
    """Lengths from a file, with the balancer's reader (one implementation)."""
    from ringpack.balancer.lengths import read_lengths

    return np.asarray(read_lengths(path), dtype=np.int64)


def plan_from_manifest(path: str):
    """The plan a ``ringpack shard`` directory was written from (``manifest.json`` or its folder).

    Read through :class:`~ringpack.dataloaders.shards.ShardReader`, which checks the plan file's
    checksum and hash against the manifest.
    """
    from ringpack.dataloaders.shards import ShardReader

    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    return ShardReader(folder, 0, 0).plan


def _emit(doc: dict[str, Any], args: argparse.Namespace, table: str, progress: Any = None, rank_step: int | None = None) -> None:
    from ringpack.analysis.report import write_report

    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    paths = write_report(doc, args.out, plots=not args.no_plots, rank_step=rank_step, progress=progress)
    if progress is not None:
        progress.close()
    if to_stdout:
        json.dump(doc, sys.stdout, indent=1)
        print()
        return
    print(table)
    print(f"\nwrote {Path(args.out)}/: " + ", ".join(p.name for p in paths.values()))


# ------------------------------------------------------------------------------------------ report
def run_report(args: argparse.Namespace) -> int:
    from ringpack.analysis.report import build_report, format_ranks, format_table, plan_strategies, result_of_plan
    from ringpack.balancer.plan import Plan

    sources = sum(bool(x) for x in (args.plans, args.manifest, args.lengths, args.corpus))
    if sources != 1:
        raise ValueError("give exactly one input: plan files, --manifest, --lengths or --corpus stdlib")
    wanted = variants(args)  # validate options before any slow work
    progress = _bar(args, total=2 + (0 if args.no_plots else 4), desc="report")
    if args.plans or args.manifest:
        plans = [Plan.load(p) for p in args.plans] if args.plans else [plan_from_manifest(args.manifest)]
        shapes = {(p.config.dp, p.config.cp) for p in plans}
        if len(shapes) > 1:
            raise ValueError(f"plans are for different DP x CP shapes {sorted(shapes)}; report one shape at a time")
        lengths = np.asarray(plans[0].lengths)
        model = plans[0].config.cost
    else:
        lengths = read_lengths_file(args.lengths) if args.lengths else _corpus_lengths()
        model = cost_model(args)
        mean = float(lengths.mean())
        per_step = args.samples_per_step or max(args.dp, int(args.dp * args.cp * args.tokens_per_rank / mean))
        config = plan_config_from_args(args, samples_per_step=per_step, cost=model)
        plans = plan_strategies(lengths, config, wanted)
    if progress:
        progress.update(1)
    comms = comm_models(args, model)
    names = _unique_names(plans)
    results = [result_of_plan(p, comms[0], name=n) for p, n in zip(plans, names)]
    doc = build_report(results, lengths=lengths, baseline=args.baseline)
    if progress:
        progress.update(1)
    step = args.step
    if step is not None and not all(0 <= step < p.num_steps for p in plans):
        raise ValueError(f"--step {step} is outside some plan's steps")
    from ringpack.analysis.plots import default_rank_step

    shown = default_rank_step(doc) if step is None else step
    table = format_table(doc, steps_shown=args.steps_shown)
    table += "\n\n" + format_ranks(doc, doc["baseline"], shown)
    best = min(doc["plans"], key=lambda p: p["summary"]["predicted_seconds_comm"])["name"]
    if best != doc["baseline"]:
        table += "\n\n" + format_ranks(doc, best, shown)
    _emit(doc, args, table, progress, rank_step=shown)
    return 0


def _unique_names(plans) -> list[str]:
    from ringpack.analysis.metrics import plan_label

    names = [plan_label(p.config) for p in plans]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if names.count(n) == 1 else f"{n}#{seen[n]}")
    return out


def _corpus_lengths() -> np.ndarray:
    from ringpack.dataloaders.corpus import stdlib_corpus

    return stdlib_corpus().lengths


def _bar(args: argparse.Namespace, total: int, desc: str):
    if getattr(args, "quiet", False) or args.json == "-":
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="stage", file=sys.stderr)


# ---------------------------------------------------------------------------------------- simulate
def run_simulate(args: argparse.Namespace) -> int:
    import time

    from ringpack.analysis.report import format_table, write_report
    from ringpack.analysis.simulate import format_modes, simulate, synthetic_lengths

    t0 = time.perf_counter()
    model = cost_model(args)
    comms = comm_models(args, model)
    gpus_list = [int(x) for x in str(args.gpus).split(",") if x.strip()]
    if args.lengths:
        lengths = read_lengths_file(args.lengths)
    else:
        lengths = synthetic_lengths(args.samples, args.dist, seed=args.seed, median=args.median, sigma=args.sigma)
    docs = []
    for gpus in gpus_list:
        if gpus % args.cp:
            raise ValueError(f"--gpus {gpus} is not a multiple of --cp {args.cp}")
        dp = gpus // args.cp
        batch_tokens = args.global_batch_tokens or dp * args.cp * args.tokens_per_rank
        per_step = args.samples_per_step or max(dp, int(batch_tokens / float(lengths.mean())))
        config = plan_config_from_args(args, dp=dp, samples_per_step=per_step, cost=model)
        doc = simulate(lengths, config, variants(args), comms, chunk_steps=args.chunk_steps, jobs=args.jobs or None,
                       progress=not args.quiet and args.json != "-", baseline=args.baseline)
        docs.append(doc)
        out = Path(args.out) / f"dp{dp}xcp{args.cp}" if len(gpus_list) > 1 else Path(args.out)
        paths = write_report(doc, out, plots=not args.no_plots)
        if args.json != "-":
            print(f"\n== {doc['title']} ==")
            print(format_table(doc))
            print()
            print(format_modes(doc))
            plan = doc["planning"]
            print(f"\nplanned {len(doc['plans'])} strategies in {plan['wall_seconds']:.1f} s wall "
                  f"({plan['worker_cpu_seconds']:.1f} CPU s in {plan['jobs']} workers); wrote {out}/: "
                  + ", ".join(p.name for p in paths.values()))
    if args.json == "-":
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1) + "\n")
    if args.json != "-":
        print(f"total {time.perf_counter() - t0:.1f} s")
    return 0
