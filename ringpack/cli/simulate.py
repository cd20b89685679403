"""``ringpack simulate``: a whole epoch planned for a cluster shape, its speed predicted (docs/analysis.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.analysis.advice import OWN_PLAN, advise
from ringpack.analysis.report import format_table, write_report
from ringpack.analysis.simulate import format_modes, sample_line, simulate, synthetic_lengths, window_chunk_steps
from ringpack.cli.analysis_flags import add_advice_flag, add_host_time_flag, add_partner_memory_flag
from ringpack.cli.compare import add_compare_flags, check_outputs, comm_models, peer_names, variants
from ringpack.cli.config_file import add_config_file_flag
from ringpack.cli.flags import (
    EXPLORE_MESH,
    NON_NEGATIVE_REAL,
    POSITIVE,
    POSITIVE_REAL,
    flag,
    hidden_alias,
    integer,
    integer_list,
    new_command,
)
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import (
    cost_model,
    plan_config_from_args,
    progress,
    samples_per_step,
)
from ringpack.cli.layout import (
    AUTO,
    add_cp_auto,
    choice_to_dict,
    choose_for,
    layout_table,
    node_size,
)
from ringpack.cli.lengths_input import add_lengths_flags, lengths_from_args
from ringpack.cli.lengths_input import lengths_kind as input_lengths_kind
from ringpack.shard_plan import STRATEGIES

#: ``simulate``'s drawn lengths when their flags are not given (each flag applies to drawn lengths only;
#: ``median`` and ``sigma`` to ``--dist lognormal`` only).
DRAWN = {"samples": 1_000_000, "dist": "stdlib", "median": 2048.0, "sigma": 1.3}
#: ``simulate``'s defaults: the exploring mesh (``dp`` comes from ``--world``) and a batch of one full
#: micro-batch per DP rank, since an epoch in one step is no epoch to simulate.
DEFAULTS = {"cp": EXPLORE_MESH["cp"], "tokens_per_rank": EXPLORE_MESH["tokens_per_rank"], "global_batch_tokens": "auto"}
#: Global batches ``--cp auto`` plans of the chosen layout's epoch unless ``--sample-steps`` is given: one
#: chunk of the default ``--chunk-steps`` (docs/analysis.md gives how far such an estimate strays).
AUTO_SAMPLE_STEPS = 8
#: Nodes a CP group may span before the zigzag and contiguous baselines are left out unless asked
#: for: split node by node over many nodes they cut every sample into pieces on every node it
#: touches, and a pool of hundreds of nodes holds tens of gigabytes of them.
MAX_BASELINE_NODES = 8


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "simulate",
        help="simulate an epoch at cluster scale",
        description="Plan a whole epoch for a cluster shape with every strategy and predict tokens/s and idle "
        "time from the cost model and a ring / all-gather communication model.",
        examples=[
            "ringpack simulate --world 1024,8192 --cp 8 --samples 1000000 --overflow split --out sim/",
            "ringpack simulate --world 1024 --cp auto --gpus-per-node 8 --tokens-per-rank 16384 --overflow split "
            "--out sim/",
        ],
    )
    world = flag(
        p,
        "--world",
        type=integer_list(1),
        default=[1024],
        help="GPUs of the cluster, comma-separated for several shapes; DP = world / cp (--cp auto: the layout "
        "chosen for each)",
    )
    hidden_alias(p, "--gpus", world, deprecated=True)
    add_partner_memory_flag(p)
    add_host_time_flag(p)
    g = p.add_argument_group("lengths")
    flag(g, "--samples", type=integer(1, 10**9), help=f"drawn samples in the epoch (default {DRAWN['samples']:,})")
    add_lengths_flags(g, required=False, what="; simulated instead of drawn lengths")
    flag(
        g,
        "--dist",
        choices=["stdlib", "lognormal"],
        help="drawn lengths: resampled stdlib corpus (default) or log-normal",
    )
    flag(g, "--median", type=POSITIVE_REAL, help=f"log-normal median length in tokens (default {DRAWN['median']:g})")
    flag(g, "--sigma", type=NON_NEGATIVE_REAL, help=f"log-normal sigma (default {DRAWN['sigma']:g})")
    add_compare_flags(p, defaults=DEFAULTS, skip=("dp",), modes="ring,allgather", out="ringpack-simulation")
    add_cp_auto(
        p,
        "; auto: the fastest layout for each --world, simulated (every fixed CP size and the pool timed under "
        "each exchange on the first global batches, nodes of --gpus-per-node GPUs, 8 unless given; the "
        "comparison printed and in --json)",
    )
    flag(p, "--jobs", type=integer(0, 1024), default=0, help="worker processes (0: all cores)")
    flag(
        p,
        "--chunk-steps",
        type=POSITIVE,
        default=8,
        help="global batches planned per worker task; with --batch-window W a multiple of W+1 (the default is "
        "rounded up to one)",
    )
    flag(
        p,
        "--sample-steps",
        type=integer(0, 10**9),
        help="plan about N global batches of the epoch, whole chunks drawn at random, and estimate the epoch "
        f"from them (0: every global batch; default {AUTO_SAMPLE_STEPS} with --cp auto, else 0)",
    )
    add_advice_flag(p)
    add_config_file_flag(p)
    p.set_defaults(handler=run_simulate, command_parser=p)


def drawn_lengths(args: argparse.Namespace) -> dict[str, Any]:
    """``synthetic_lengths``' arguments from ``--samples``, ``--dist``, ``--median``, ``--sigma``, their defaults
    where not given (which of them apply to which lengths is :mod:`ringpack.cli.input_kinds`' to check)."""
    return {**DRAWN, **{name: getattr(args, name) for name in DRAWN if getattr(args, name) is not None}}


def lengths_kind(args: argparse.Namespace) -> str:
    """``simulate``'s kind of input (:data:`~ringpack.cli.input_kinds.TABLE`): lengths, text, stdlib or lognormal."""
    return input_lengths_kind(args) if args.lengths else args.dist or DRAWN["dist"]


def run_simulate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    check_flags_apply(args, "simulate", lengths_kind(args))
    drawn = drawn_lengths(args)
    check_outputs(args, inputs=[args.lengths, args.config])
    model = cost_model(args, tflops=True)
    comms = comm_models(args, model)
    auto = args.cp == AUTO
    for gpus in args.world:
        node = node_size(args, gpus, say=False)
        if auto and gpus % node:
            raise ValueError(f"--world {gpus} is not a whole number of nodes of {node} GPUs (--gpus-per-node)")
        if not auto and gpus % args.cp:
            raise ValueError(f"--world {gpus} is not a multiple of --cp {args.cp}")
    variants(args)  # validate options before any slow work
    peer_names(args)
    if args.lengths:
        lengths = lengths_from_args(args)
    else:
        lengths = synthetic_lengths(
            drawn["samples"], drawn["dist"], seed=args.seed, median=drawn["median"], sigma=drawn["sigma"]
        )
    docs = []
    for gpus in args.world:
        shape = _layout(args, lengths, gpus, comms) if auto else (gpus // args.cp, args.cp, args.gpus_per_node, None)
        dp, cp = shape[:2]
        out = Path(args.out) / f"dp{dp}xcp{cp}" if len(args.world) > 1 else Path(args.out)
        docs.append(_simulate_shape(args, lengths, *shape, model, comms, out))
    if args.json == "-":
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1) + "\n")
    if args.json != "-":
        print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _layout(
    args: argparse.Namespace, lengths: np.ndarray, gpus: int, comms: list
) -> tuple[int, int, int | None, dict[str, Any]]:
    """``--cp auto`` for ``gpus`` GPUs: the chosen ``(dp, cp, gpus_per_node)``, the comparison printed,
    and what the shape's simulation needs of it (its JSON, the links between nodes).

    Raises:
        PlanError: no layout plans the lengths.
    """
    if args.json != "-":
        print(f"== layouts for {gpus:,} GPUs ==", flush=True)
    with progress(args, f"comparing layouts for {gpus:,} GPUs", "layouts") as bar:
        choice = choose_for(args, lengths, gpus, progress=bar.advance_to)
    best = choice.best
    if args.json != "-":
        print(layout_table(choice, every=True, host_time=args.host_time), flush=True)
    node = next(c.gpus_per_node for c in choice.candidates if c.name == "pool")
    chosen = {"layout": choice_to_dict(choice), "gpus_per_node": node, "mode": best.mode}
    return best.dp, best.cp, best.gpus_per_node, chosen


def _variants(args: argparse.Namespace, config: Any) -> list[tuple[str, str]]:
    """The ``(strategy, packing)`` pairs to plan: ``--strategies`` x ``--packings``; for a CP group
    over more than :data:`MAX_BASELINE_NODES` nodes, unless ``--strategies`` was given, ringpack's
    own strategy alone (said in one line), the peers being the comparison there."""
    pairs = variants(args)
    if config.nodes_per_group <= MAX_BASELINE_NODES or args.strategies != ",".join(STRATEGIES):
        return pairs
    kept = [pair for pair in pairs if pair[0] == "balanced"]
    if len(kept) < len(pairs) and not args.quiet:
        print(
            f"a CP group over {config.nodes_per_group} nodes: the zigzag and contiguous baselines are left out "
            f"(split node by node over more than {MAX_BASELINE_NODES} nodes they do not fit in memory at scale); "
            "give --strategies to plan them",
            file=sys.stderr,
        )
    return kept


def _chunk_steps(args: argparse.Namespace, config: Any) -> int:
    """``--chunk-steps``; when not given and a batch window is set, its default rounded up to whole window
    blocks (``batch_window + 1`` steps), which every chunk must hold (a given one that does not is refused)."""
    if "chunk_steps" in args.given or not config.batch_window:
        return args.chunk_steps
    return window_chunk_steps(args.chunk_steps, config.batch_window + 1)


def _sample_steps(args: argparse.Namespace, auto: bool) -> int:
    """``--sample-steps``, or its default: :data:`AUTO_SAMPLE_STEPS` for ``--cp auto``, else the whole epoch."""
    if args.sample_steps is not None:
        return args.sample_steps
    return AUTO_SAMPLE_STEPS if auto else 0


def _with_chosen_mode(args: argparse.Namespace, comms: list, chosen: dict[str, Any]) -> list:
    """The communication models of a ``--cp auto`` shape: the chosen exchange first (the headline),
    then the other ``--modes``, all with the links between nodes of the comparison. ``--modes``
    given without the chosen exchange keeps its order, the chosen one timed after them."""
    comms = [dataclasses.replace(c, gpus_per_node=chosen["gpus_per_node"]) for c in comms]
    mode = chosen["mode"]
    if any(c.mode == mode for c in comms):
        if "modes" in args.given:
            return comms
        return sorted(comms, key=lambda c: c.mode != mode)  # stable: the chosen first, the rest in order
    chosen_comm = dataclasses.replace(comms[0], mode=mode)
    return [*comms, chosen_comm] if "modes" in args.given else [chosen_comm, *comms]


def _simulate_shape(
    args: argparse.Namespace,
    lengths: np.ndarray,
    dp: int,
    cp: int,
    gpus_per_node: int | None,
    chosen: dict[str, Any] | None,
    model: Any,
    comms: list,
    out: Path,
) -> dict[str, Any]:
    """Simulate one cluster shape (``dp`` x ``cp``), write its report to ``out`` and print its tables.

    ``chosen``: the ``--cp auto`` comparison that picked the shape (added to the document as
    ``"layout"``), and the GPUs per node it assumed, which the communication model then has too.
    """
    per_step = samples_per_step(args, lengths, dp=dp, cp=cp)
    if not per_step:
        raise ValueError(
            "--samples-per-step 0 puts every sample in one step, and simulate plans an epoch of many: give "
            "--samples-per-step N or --global-batch-tokens (auto: one full micro-batch per DP rank)"
        )
    config = plan_config_from_args(
        args, dp=dp, cp=cp, gpus_per_node=gpus_per_node, samples_per_step=per_step, cost=model
    )
    if chosen is not None:
        comms = _with_chosen_mode(args, comms, chosen)
    doc = simulate(
        lengths,
        config,
        _variants(args, config),
        comms,
        chunk_steps=_chunk_steps(args, config),
        jobs=args.jobs or None,
        progress=not args.quiet and args.json != "-",
        baseline=args.baseline,
        peers=peer_names(args),
        sample_steps=_sample_steps(args, chosen is not None),
    )
    if chosen is not None:
        doc["layout"] = chosen["layout"]
    if not args.no_advice:
        with progress(args, "re-planning a sample with each remedy", "remedies"):
            own = dataclasses.replace(config, **OWN_PLAN)
            doc["advice"] = advise(lengths, own, comms[0], jobs=args.jobs or None)
    with progress(args, "drawing plots", "plots") as bar:
        paths = write_report(doc, out, plots=not args.no_plots, progress=bar)
    if args.json != "-":
        print(f"\n== {doc['title']} ==")
        print(sample_line(doc))
        print(f"headline exchange: {doc['comm_model']['mode']}" + (" (the layout choice's)" if chosen else ""))
        print(format_table(doc))
        print()
        print(format_modes(doc))
        plan = doc["planning"]
        print(
            f"\nplanned {len(doc['plans'])} strategies in {plan['wall_seconds']:.1f} s wall "
            f"({plan['worker_cpu_seconds']:.1f} CPU s in {plan['jobs']} workers); wrote {out}/: "
            + ", ".join(p.name for p in paths.values())
        )
    return doc
