"""``--cp auto`` and ``--world`` of ``plan``, ``report`` and ``simulate``: the layout chosen for the cluster.

With ``--world N``, ``--dp`` is ``N / cp``; with ``--cp auto`` the fixed CP sizes and the pool
(``dp=1, cp=N``, split node by node) are planned on the first global batches and timed under
ring, all-gather and targeted exchange (:func:`~ringpack.planner.layout.choose_layout`), and the
fastest one is planned (``simulate``: for each ``--world``). See docs/planner.md, "Choosing the layout".
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ringpack import analysis
from ringpack.cli.analysis_flags import add_host_time_flag, add_partner_memory_flag
from ringpack.cli.compare import comm_models
from ringpack.cli.flags import (
    CP_SIZE,
    POSITIVE,
    REQUIRED,
    config_fields,
    flag,
)
from ringpack.cli.inputs import cost_model, samples_per_step
from ringpack.comm_model import CommModel
from ringpack.planner.layout import AUTO, DEFAULT_GPUS_PER_NODE, LayoutChoice, choose_layout
from ringpack.shard_plan import PlanConfig

logger = logging.getLogger("ringpack.cli")

#: Layouts listed under the choice (the rest are in ``--json``).
SHOWN = 6
#: The :class:`PlanConfig` fields ``choose_layout`` sets per layout or takes as arguments of its own.
_SET_PER_LAYOUT = ("dp", "cp", "gpus_per_node", "tokens_per_rank", "cost", "samples_per_step")


def cp_or_auto(text: str) -> int | str:
    """``--cp``: a CP size, or ``auto``."""
    return AUTO if text.strip().lower() == AUTO else CP_SIZE(text)


def add_cp_auto(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``auto`` as a value of ``parser``'s ``--cp``, ``help_text`` added to its help."""
    cp = {a.dest: a for a in parser._actions}["cp"]
    cp.type = cp_or_auto
    cp.help = _insert(cp.help, help_text)


def add_layout_flags(parser: argparse.ArgumentParser) -> None:
    """``--world``, and ``auto`` as a value of ``parser``'s ``--cp``; ``--dp`` stops being required."""
    add_cp_auto(parser, "; auto: the fastest layout for --world GPUs (fixed CP sizes and the pool)")
    dp = {a.dest: a for a in parser._actions}["dp"]
    if dp.fallback is REQUIRED:
        dp.fallback = None
        dp.help = dp.help.replace(" (required)", " (required unless --world is given)")
    flag(
        parser,
        "--world",
        type=POSITIVE,
        help="GPUs of the cluster: --dp becomes world / cp; with --cp auto the layout is chosen for them",
    )
    add_partner_memory_flag(parser)
    add_host_time_flag(parser)


def _insert(help_text: str, more: str) -> str:
    """``more`` added to a flag's help before its ``(default: ...)`` / ``(required)``."""
    head, paren, tail = help_text.partition(" (")
    return head + more + paren + tail


def resolve_layout(args: argparse.Namespace, lengths: Any) -> LayoutChoice | None:
    """Set ``args.dp`` (and, for ``--cp auto``, ``args.cp`` and ``args.gpus_per_node``) from ``--world``.

    Returns the choice for ``--cp auto`` (print it with :func:`layout_table`), else ``None``. The
    layouts share every other planning flag and the global batch in samples, as ``--samples-per-step``
    or ``--global-batch-tokens`` give it for the whole cluster (``auto``: the pool's).

    Raises:
        ValueError: ``--cp auto`` without ``--world`` or with ``--dp``, ``--dp`` and ``--world`` that
            disagree, or a ``--world`` that ``--cp`` does not divide;
            :class:`~ringpack.errors.PlanError` when no layout plans the lengths.
        SystemExit: neither ``--dp`` nor ``--world`` (a usage error, exit 2).
    """
    world = args.world
    if args.cp == AUTO:
        if world is None:
            raise ValueError("--cp auto needs --world N (the cluster's GPUs) to choose the layout for")
        if "dp" in args.given:
            raise ValueError("--cp auto sets --dp itself (world / cp); leave --dp out")
        choice = choose_for(args, lengths, world)
        best = choice.best
        args.dp, args.cp, args.gpus_per_node = best.dp, best.cp, best.gpus_per_node
        return choice
    if world is None:
        if args.dp is None:
            args.command_parser.error("the following arguments are required: --dp (or --world)")
        return None
    if world % args.cp:
        raise ValueError(f"--world {world} is not a multiple of --cp {args.cp}")
    if "dp" in args.given and args.dp * args.cp != world:
        raise ValueError(f"--dp {args.dp} x --cp {args.cp} is not --world {world}; give --dp or --world")
    args.dp = world // args.cp
    return None


def node_size(args: argparse.Namespace, world: int, say: bool = True) -> int:
    """``--gpus-per-node``, or :data:`DEFAULT_GPUS_PER_NODE` (at most ``world``; with ``say``, said on stderr)."""
    if args.gpus_per_node is not None:
        return args.gpus_per_node
    node = min(DEFAULT_GPUS_PER_NODE, world)
    if say:
        logger.info("--cp auto: assuming %d GPUs per node (set --gpus-per-node)", node)
    return node


def choose_for(args: argparse.Namespace, lengths: Any, world: int, progress: Any = None) -> LayoutChoice:
    """:func:`choose_layout` of ``world`` GPUs for the flags: the planning flags shared by every
    layout, the cost model (at ``--tflops``, where the command has it) and the links (``--link``,
    ``--bandwidth``, ``--latency-us``, ``--inter-link``, where it has them).

    Raises:
        PlanError: no layout plans the lengths, or ``world`` is not whole nodes.

    ``progress``: :func:`choose_layout`'s ``(done, total)`` callback, per layout.
    """
    node = node_size(args, world)
    given = vars(args)
    shared = {n: given[n] for n in config_fields(PlanConfig) if n in given and n not in _SET_PER_LAYOUT}
    cost = cost_model(args, tflops="tflops" in given)
    links = comm_models(args, cost)[0] if "link" in given else CommModel.for_model(cost)
    batch = samples_per_step(args, lengths, dp=1, cp=world)
    memory = getattr(args, "partner_memory_gib", None)
    return choose_layout(
        lengths,
        world,
        node,
        args.tokens_per_rank,
        cost,
        links,
        samples_per_step=batch or None,
        progress=progress,
        partner_memory_budget=None if memory is None else memory * 2**30,
        **shared,
    )


def layout_table(choice: LayoutChoice, every: bool = False, host_time: bool = False) -> str:
    """The choice as text: the chosen layout, its reason, and the fastest :data:`SHOWN` layouts.

    Every timed row also has a GPU's point-to-point partners in one micro-batch (median/max: what
    the partner budget bounds; ``rF`` where ``F`` sampled micro-batches run the ring, over the
    budget), the partners a GPU gathers over the sampled steps and the NCCL buffers those keep
    (GiB); with ``host_time``, the host time of compiling one rank's schedule of the layout's largest
    sampled micro-batch (ms, measured here: :func:`~ringpack.analysis.host_time.compile_milliseconds`,
    which imports torch).
    ``every``: every layout and exchange, with each one's exposed communication per step and, for
    ``p2p``, the K/V (GB, forward) its node-relayed exchange sends between nodes per step
    (``simulate``'s comparison).
    """
    lines = [f"layout for these lengths ({choice.steps} global batches planned per layout): {choice.reason}"]
    head = f"  {'layout':<10} {'exchange':<10} {'tokens/s':>12} {'step s':>10} {'compute s':>10}"
    head += f" {'exposed s':>10} {'IB GB/step':>10}" if every else ""
    lines.append(head + f" {'partners':>10} {'kept':>5} {'NCCL GiB':>8}" + (f" {'host ms':>8}" if host_time else ""))
    listed = set()
    host: dict[str, float] = {}
    for c in choice.candidates if every else choice.candidates[:SHOWN]:
        if (not c.feasible or c.stopped) and every and c.name in listed:
            continue  # a layout that cannot plan the lengths, once for all its exchanges
        if not c.feasible:
            lines.append(f"  {c.name:<10} {'any' if every else c.mode:<10} cannot plan: {c.note}")
            listed.add(c.name)
            continue
        if c.stopped:
            if c.name not in listed:
                lines.append(f"  {c.name:<10} {'any':<10} {c.note}")
                listed.add(c.name)
            continue
        row = (
            f"  {c.name:<10} {c.mode:<10} {c.tokens_per_second:>12,.0f} {c.step_seconds:>10.4g} "
            f"{c.compute_seconds:>10.4g}"
        )
        if every:
            sent = f"{c.inter_node_bytes / 1e9:.4g}" if c.mode == "p2p" else "-"
            row += f" {c.exposed_seconds:>10.4g} {sent:>10}"
        partners = f"{c.microbatch_partners_median:.0f}/{c.microbatch_partners_max}"
        partners += f" r{c.ring_fallback}" if c.ring_fallback else ""
        row += f" {partners:>10} {c.partners_max:>5} {c.partner_memory_bytes / 2**30:>8.2f}"
        if host_time:
            if c.name not in host and c.microbatch is not None:
                host[c.name] = analysis.compile_milliseconds(c.microbatch, c.gpus_per_node, c.max_partners)
            row += f" {host.get(c.name, float('nan')):>8.1f}"
        lines.append(row)
    best = choice.best
    lines.append(
        f"planning with dp={best.dp} x cp={best.cp}"
        + (f", gpus_per_node={best.gpus_per_node}" if best.gpus_per_node else "")
        + f"; run attention with mode={best.mode!r}"
    )
    return "\n".join(lines)


def choice_to_dict(choice: LayoutChoice) -> dict[str, Any]:
    """The choice as JSON-ready data (``--json``): the reason and every candidate's figures."""
    return {
        "reason": choice.reason,
        "steps": choice.steps,
        "candidates": [
            {
                "layout": c.name,
                "mode": c.mode,
                "dp": c.dp,
                "cp": c.cp,
                "gpus_per_node": c.gpus_per_node,
                "feasible": c.feasible,
                "stopped": c.stopped,
                "tokens_per_second": c.tokens_per_second if c.timed else None,
                "bound_tokens_per_second": c.bound_tokens_per_second if c.feasible else None,
                "step_seconds": c.step_seconds if c.timed else None,
                "compute_seconds": c.compute_seconds if c.timed else None,
                "exposed_comm_seconds": c.exposed_seconds if c.timed else None,
                "inter_node_bytes": c.inter_node_bytes if c.timed else None,
                "partners_median": c.partners_median if c.timed else None,
                "partners_max": c.partners_max if c.timed else None,
                "partner_memory_bytes": c.partner_memory_bytes if c.timed else None,
                "microbatch_partners_median": c.microbatch_partners_median if c.timed else None,
                "microbatch_partners_max": c.microbatch_partners_max if c.timed else None,
                "ring_fallback_microbatches": c.ring_fallback if c.timed else None,
                "note": c.note,
            }
            for c in choice.candidates
        ],
    }
