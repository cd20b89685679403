"""``ringpack demo``, run: the demo of :mod:`~ringpack.analysis.demo` with the settings of its flags.

The parser is :mod:`ringpack.cli.demo`; this module imports the demo (torch, for its ring check),
and only when the command runs.

See docs/analysis.md, "`ringpack demo`".
"""

from __future__ import annotations

import argparse
import dataclasses

from ringpack.analysis.demo import run_demo
from ringpack.analysis.demo_config import DEMO_PLAN, DemoConfig
from ringpack.cli.demo import PLAN_FIELDS
from ringpack.cli.flags import config_fields
from ringpack.cli.inputs import check_one_global_batch, check_output_folder, cost_model
from ringpack.shard_plan import PlanConfig


def run_demo_command(args: argparse.Namespace) -> int:
    """Run the demo with the parsed flags; the exit code of :func:`~ringpack.analysis.demo.run_demo`."""
    check_output_folder(args.out)
    batch = check_one_global_batch(args)
    fields = {name: getattr(args, name) for name in config_fields(DemoConfig) if name != "plan"}
    if batch == "samples_per_step":  # stated in samples, 0 included (all samples in one step)
        fields["global_batch_tokens"] = 0
    return run_demo(DemoConfig(**fields, plan=demo_plan(args)), progress=not args.quiet)


def demo_plan(args: argparse.Namespace) -> PlanConfig:
    """``DEMO_PLAN`` with the values of the planning flags."""
    flagged = {name: getattr(args, name) for name in PLAN_FIELDS if name != "cost"}
    return dataclasses.replace(DEMO_PLAN, **flagged, cost=cost_model(args))
