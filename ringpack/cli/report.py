"""``ringpack report``: the imbalance report of plan files, a shard manifest's plan, or lengths (docs/analysis.md)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from ringpack import data
from ringpack.analysis.advice import OWN_PLAN, advise
from ringpack.analysis.metrics import plan_label
from ringpack.analysis.plots import default_rank_step
from ringpack.analysis.report import build_report, format_ranks, format_table, result_of_plan
from ringpack.analysis.simulate import measure_variants
from ringpack.cli.analysis_flags import add_advice_flag
from ringpack.cli.compare import add_compare_flags, check_outputs, comm_models, emit, peer_names, variants
from ringpack.cli.config_file import add_config_file_flag
from ringpack.cli.flags import COUNT, EXPLORE_MESH, flag, integer, new_command
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import (
    cost_model,
    plan_config_from_args,
    progress,
    samples_per_step,
)
from ringpack.cli.layout import add_layout_flags, layout_table, resolve_layout
from ringpack.cli.lengths_input import add_lengths_flags, lengths_from_args, lengths_kind
from ringpack.data.corpus import stdlib_corpus
from ringpack.planner.epoch import global_batches
from ringpack.shard_plan import Plan


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "report",
        help="imbalance report of a plan, shard manifest or lengths",
        description="Imbalance report (terminal table, report.json, PNG plots, report.html/.md) of plan files, "
        "a shard manifest's plan, or sample lengths planned with every strategy.",
        examples=[
            "ringpack report plan.parquet --out report/",
            "ringpack report --lengths lengths.npy --dp 8 --cp 4 --tokens-per-rank 32768 --samples-per-step 512 "
            "--out report/",
        ],
    )
    flag(p, "plans", nargs="*", default=[], metavar="PLAN", help="plan files (.parquet or .json) to compare")
    flag(p, "--manifest", help="a `ringpack shard` output (manifest.json or its folder): reports its plan")
    add_lengths_flags(p, required=False, what="; planned with every strategy")
    flag(p, "--corpus", choices=["stdlib"], help="use the embedded standard-library corpus as the lengths")
    add_compare_flags(p, defaults=EXPLORE_MESH, skip=(), modes="ring", out="ringpack-report")
    add_layout_flags(p)
    flag(
        p,
        "--step",
        type=COUNT,
        help="step whose per-GPU costs are plotted and tabled (default: the baseline's median-idle step)",
    )
    flag(p, "--steps-shown", type=COUNT, default=5, help="steps per plan in the terminal table")
    flag(p, "--jobs", type=integer(0, 1024), default=0, help="worker processes (0: all cores)")
    add_advice_flag(p)
    add_config_file_flag(p)
    p.set_defaults(handler=run_report, command_parser=p)


def run_report(args: argparse.Namespace) -> int:
    sources = sum(bool(x) for x in (args.plans, args.manifest, args.lengths, args.corpus))
    if sources != 1:
        raise ValueError("give exactly one input: plan files, --manifest, --lengths or --corpus stdlib")
    kind = "plans" if args.plans else "manifest" if args.manifest else lengths_kind(args) if args.lengths else "corpus"
    check_flags_apply(args, "report", kind)
    check_outputs(args, inputs=[*args.plans, args.manifest, args.lengths, args.config])
    wanted = variants(args)  # validate options before any slow work
    peers = peer_names(args)
    if args.plans or args.manifest:
        plans = [Plan.load(p) for p in args.plans] if args.plans else [_plan_from_manifest(args.manifest)]
        shapes = {(p.config.dp, p.config.cp) for p in plans}
        if len(shapes) > 1:
            raise ValueError(f"plans are for different DP x CP shapes {sorted(shapes)}; report one shape at a time")
        lengths = np.asarray(plans[0].lengths)
        comms = comm_models(args, plans[0].config.cost)
        names = _file_names(args.plans) if args.plans else [plan_label(plans[0].config)]
        with progress(args, "costing every rank of every step", "plans", len(plans)) as bar:
            results = []
            for plan, name in zip(plans, names):
                results.append(result_of_plan(plan, comms[0], name=name))
                bar.update(1)
        rows = []
    else:
        lengths = lengths_from_args(args) if args.lengths else _corpus_lengths()
        model = cost_model(args, tflops=True)
        choice = resolve_layout(args, lengths)
        if choice is not None:
            if "modes" not in args.given:  # the chosen exchange is the headline
                args.modes = choice.best.mode
            if args.json != "-":
                print(layout_table(choice, host_time=args.host_time) + "\n")
        comms = comm_models(args, model)
        config = plan_config_from_args(args, samples_per_step=samples_per_step(args, lengths), cost=model)
        desc = f"planning {len(lengths):,} samples x {len(wanted)} variants" + (
            f" and {len(peers)} peers" * bool(peers)
        )
        labels = [f"{s}/{p}" for s, p in wanted]
        if config.batch_window:  # the first variant again without the window: what the window bought
            labels.append(f"{labels[0]} no window")
        names = _unique_names(labels)
        with progress(args, desc, "samples") as bar:
            results, rows = measure_variants(
                lengths,
                config,
                wanted,
                comms[0],
                names=names[: len(wanted)],
                peers=peers,
                jobs=args.jobs or None,
                progress=bar,
            )
            if config.batch_window:
                unwindowed, _ = measure_variants(
                    lengths,
                    dataclasses.replace(config, batch_window=0),
                    wanted[:1],
                    comms[0],
                    names=names[len(wanted) :],
                    jobs=args.jobs or None,
                    progress=bar,
                )
                results += unwindowed
    extra = _window_entry(lengths, config, names) if not (args.plans or args.manifest) else {}
    if not args.no_advice:
        with progress(args, "re-planning a sample with each remedy", "remedies"):
            base = plans[0].config if args.plans or args.manifest else dataclasses.replace(config, **OWN_PLAN)
            extra["advice"] = advise(lengths, base, comms[0], jobs=args.jobs or None)
    doc = build_report(results, lengths=lengths, baseline=args.baseline, peers=rows, extra=extra)
    step = args.step
    if step is not None and not all(0 <= step < r.metrics.num_steps for r in results):
        raise ValueError(f"--step {step} is outside some plan's steps")
    shown = default_rank_step(doc) if step is None else step
    table = format_table(doc, steps_shown=args.steps_shown)
    table += "\n\n" + format_ranks(doc, doc["baseline"], shown)
    best = min(doc["plans"], key=lambda p: p["summary"]["predicted_seconds_comm"])["name"]
    if best != doc["baseline"]:
        table += "\n\n" + format_ranks(doc, best, shown)
    emit(doc, args, table, rank_step=shown)
    return 0


def _plan_from_manifest(path: str) -> Plan:
    """The plan a ``ringpack shard`` directory was written from (``manifest.json`` or its folder).

    Read through :class:`~ringpack.data.shard_reader.ShardReader`, which checks the plan file's
    checksum and hash against the manifest.
    """
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    return data.ShardReader(folder, 0, 0).plan  # the reader (torch) loads with the first manifest


def _window_entry(lengths: np.ndarray, config: Any, names: list[str]) -> dict[str, Any]:
    """``{"batch_window": ...}`` for a report of ``lengths`` planned with a batch window: what it
    moved (:meth:`~ringpack.planner.batch_window.WindowMoves.summary`), the first variant's name and
    the name of the same plan made without the window (the last row); ``{}`` without a window."""
    if not config.batch_window:
        return {}
    batches = global_batches(lengths, config)
    docs = batches.lengths
    planned = len(docs) - len(batches.dropped)
    tokens = int(docs.sum()) - int(sum(int(docs[k]) for k in batches.dropped))
    summary = batches.moves().summary(config, planned, tokens)
    return {"batch_window": {**summary, "plan": names[0], "without": names[-1]}}


def _file_names(paths: list[str]) -> list[str]:
    """Each plan file's row name: its file name, with as many of its folders as tell it from the other files
    (``a/plan.parquet``, ``b/plan.parquet``); a file given twice is numbered (``plan.parquet#2``)."""
    full = [Path(os.path.abspath(p)).parts for p in paths]

    def name(parts: tuple[str, ...]) -> str:
        others = [other for other in full if other != parts]
        depth = next(d for d in range(1, len(parts) + 1) if all(o[-d:] != parts[-d:] for o in others))
        return "/".join(parts[-depth:])

    return _unique_names([name(parts) for parts in full])


def _unique_names(labels: list[str]) -> list[str]:
    """The plans' labels, numbered (``#1``, ``#2``) where several plans share one."""
    seen: dict[str, int] = {}
    out = []
    for n in labels:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if labels.count(n) == 1 else f"{n}#{seen[n]}")
    return out


def _corpus_lengths() -> np.ndarray:
    return stdlib_corpus().lengths
