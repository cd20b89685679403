"""What ``report`` and ``simulate`` share: the variants they plan, the peers, the communication model, the output.

See docs/analysis.md, "`ringpack report`".
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ringpack.analysis import peers as peer_systems
from ringpack.analysis.report import write_report
from ringpack.cli.flags import (
    add_comm_flags,
    add_plan_flags,
    add_report_output_flags,
    add_tflops_flag,
    add_variant_flags,
)
from ringpack.cli.inputs import check_output_file, check_output_folder, progress
from ringpack.comm_model import MODES, CommModel
from ringpack.shard_plan import PACKINGS, STRATEGIES


def add_compare_flags(
    parser: argparse.ArgumentParser, *, defaults: dict[str, Any], skip: Sequence[str], modes: str, out: str
) -> None:
    """The planner's flags (less ``skip``; the command's ``defaults``), the variants, the comm model, the output."""
    add_plan_flags(parser, defaults=defaults, skip=("strategy", "packing", *skip))
    g = parser.add_argument_group("variants")
    add_variant_flags(g)
    add_tflops_flag(g)
    add_comm_flags(parser, modes)
    add_report_output_flags(parser, out)


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {bad or text!r} not in {allowed}")
    return items


def variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(strategy, packing)`` of every plan: each of ``--strategies`` with each of ``--packings``."""
    strategies = _list(args.strategies, STRATEGIES, "strategies")
    packings = _list(args.packings, PACKINGS, "packings")
    return [(s, p) for p in packings for s in strategies]


def comm_models(args: argparse.Namespace, model) -> list[CommModel]:
    """One communication model per ``--modes`` entry, from ``--link``, ``--bandwidth`` and ``--latency-us``
    within a node and, with ``--gpus-per-node``, ``--inter-link`` between nodes."""
    modes = _list(args.modes, MODES, "modes")
    bw = None if args.bandwidth is None else args.bandwidth * 1e9
    lat = None if args.latency_us is None else args.latency_us * 1e-6
    node = getattr(args, "gpus_per_node", None)
    return [
        CommModel.for_model(
            model, link=args.link, mode=m, bandwidth=bw, latency=lat, gpus_per_node=node, inter_link=args.inter_link
        )
        for m in modes
    ]


def peer_names(args: argparse.Namespace) -> list[str]:
    """``--peers`` resolved: every peer by default, ``none`` for none."""
    return list(peer_systems.PEERS) if args.peers is None else peer_systems.parse_peers(args.peers)


def check_outputs(args: argparse.Namespace, inputs: Sequence[str | None]) -> None:
    """Check ``--out`` (a folder) and ``--json`` (a file, or ``-`` for stdout) of report and simulate."""
    check_output_folder(args.out)
    if args.json and args.json != "-":
        check_output_file(args.json, "--json", inputs=inputs)


def emit(doc: dict[str, Any], args: argparse.Namespace, table: str, rank_step: int | None = None) -> None:
    """Write the report (and ``--json``), then print ``table`` and what was written (or the JSON, for ``--json -``)."""
    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    with progress(args, "drawing plots", "plots") as bar:
        paths = write_report(doc, args.out, plots=not args.no_plots, rank_step=rank_step, progress=bar)
    if to_stdout:
        json.dump(doc, sys.stdout, indent=1)
        print()
        return
    print(table)
    print(f"\nwrote {Path(args.out)}/: " + ", ".join(p.name for p in paths.values()))
