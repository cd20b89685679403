"""The flags plan, report and simulate add beside the planner's: the advice, the layout choice's NCCL
memory budget and schedule compile times (docs/analysis.md)."""

from __future__ import annotations

import argparse
from typing import Any

from ringpack.cli.flags import POSITIVE_REAL, flag


def add_partner_memory_flag(parser: Any) -> argparse.Action:
    """``--partner-memory-gib``: the layout choice's per-GPU budget for NCCL's point-to-point buffers."""
    return flag(
        parser,
        "--partner-memory-gib",
        type=POSITIVE_REAL,
        help="with --cp auto: GiB of GPU memory NCCL's point-to-point buffers may take per GPU (a GPU's "
        "partners over the sampled steps x about 24 MiB each); a layout over it is listed as infeasible "
        "(default: no limit)",
    )


def add_host_time_flag(parser: Any) -> argparse.Action:
    """``--host-time``: also time compiling attention schedules (the only part of planning that needs torch)."""
    return flag(
        parser,
        "--host-time",
        action="store_true",
        default=False,
        help="also time compiling one rank's attention schedule of the largest micro-batch (of each layout, with "
        "--cp auto): host ms on this machine (imports torch)",
    )


def add_advice_flag(parser: Any) -> None:
    """``--no-advice`` on plan, report and simulate: skip the "what would help" re-planning."""
    flag(
        parser,
        "--no-advice",
        default=False,
        action="store_true",
        help="skip re-planning a sample of the steps with each remedy (--batch-window 2, a larger CP group, "
        "more samples per micro-batch) for the 'what would help' line",
    )
