"""``ringpack demo`` (= ``make demo``): the standard-library corpus through every strategy (docs/analysis.md).

This module builds the parser (no torch); :mod:`~ringpack.cli.demo_run` runs the demo, whose ring
check needs torch.
"""

from __future__ import annotations

from typing import Any

from ringpack.analysis.demo_config import DEMO_PLAN, DemoConfig
from ringpack.cli.flags import (
    add_config_flags,
    add_field_flag,
    add_global_batch_flag,
    add_link_flag,
    add_quiet_flag,
    add_tflops_flag,
    config_fields,
    field_default,
    new_command,
)
from ringpack.shard_plan import PlanConfig

#: ``DemoConfig.plan`` fields with flags: the planner's flags, with the defaults of ``DEMO_PLAN``.
PLAN_FIELDS = ("dp", "cp", "tokens_per_rank", "samples_per_step", "seed", "cost")
#: ``DemoConfig`` fields whose flags every command that has them shares.
SHARED = ("global_batch_tokens", "tflops", "link")


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "demo",
        help="the embedded standard-library corpus through every strategy: report, plots, ring check",
        description="Plan the standard-library corpus with every CP strategy and packing, write the imbalance "
        "report and its plots, and check the ring runtime on 2 CPU processes.",
        examples=["ringpack demo --out demo-out/", "ringpack demo --quick --no-ring-check --quiet"],
    )
    demo, plan = config_fields(DemoConfig), config_fields(PlanConfig)
    add_config_flags(p, DemoConfig, skip=("plan", *SHARED))
    g = p.add_argument_group("planning (PlanConfig fields)")
    for name in PLAN_FIELDS:
        add_field_flag(g, plan[name], getattr(DEMO_PLAN, name))
    add_global_batch_flag(g, field_default(demo["global_batch_tokens"]))
    add_tflops_flag(g)
    add_link_flag(g)
    add_quiet_flag(p)
    p.set_defaults(handler="ringpack.cli.demo_run:run_demo_command", command_parser=p)
