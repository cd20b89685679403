"""``ringpack calibrate``: fit the cost model to measured GPU times (docs/analysis.md, docs/cost-model.md).

Its flags are the fields of :class:`~ringpack.calibration.config.KernelCalibrationConfig`
(``--scope kernels``) and :class:`~ringpack.calibration.config.StepCalibrationConfig`
(``--scope step``); a field both have is one flag, and a flag of one scope is refused in the other.
This module builds the parser (no torch); :mod:`~ringpack.cli.calibrate_run` times and fits.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ringpack.calibration.config import KernelCalibrationConfig, StepCalibrationConfig
from ringpack.cli.flags import add_field_flag, add_quiet_flag, config_fields, field_default, flag, new_command, shown

KERNELS = config_fields(KernelCalibrationConfig)
STEP = config_fields(StepCalibrationConfig)
#: Destinations of the flags of one scope only (given in the other, :mod:`ringpack.cli.input_kinds` refuses them).
KERNEL_ONLY = (*(name for name in KERNELS if name not in STEP), "refit")
STEP_ONLY = tuple(name for name in STEP if name not in KERNELS)


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "calibrate",
        help="fit the cost model to measured GPU times",
        description="Time ringpack's attention kernels and the model's linear layers (--scope kernels), or the "
        "whole model's training step per rank shard (--scope step), on one GPU, fit the cost model's "
        "coefficients and write a profile the planner loads.",
        examples=[
            "ringpack calibrate --out profile.json",
            "ringpack calibrate --scope step --model llama-1b --grad-ckpt --tokens-per-rank 65536 --out step.json",
            "ringpack calibrate --device cpu --backend reference --out dry.json",
        ],
    )
    flag(p, "--out", default="ringpack-profile.json", help="profile JSON to write")
    flag(p, "--report", help="calibration report JSON (default: the profile's name with .report.json)")
    flag(
        p,
        "--scope",
        choices=["kernels", "step"],
        default="kernels",
        help="kernels: attention kernels and GEMMs; step: the whole model's forward+loss+backward per rank shard",
    )
    for name, f in KERNELS.items():
        if name in STEP:
            _add_shared_flag(p, f, STEP[name])
    kernels = p.add_argument_group("the kernels (--scope kernels)")
    for name in KERNEL_ONLY[:-1]:
        add_field_flag(kernels, KERNELS[name])
    flag(
        kernels,
        "--refit",
        metavar="REPORT",
        help="no GPU: refit the models on the measurements of a stored calibration report "
        "and write a new profile and report",
    )
    step = p.add_argument_group("the training step (--scope step)")
    for name in STEP_ONLY:
        add_field_flag(step, STEP[name])
    add_quiet_flag(p)
    p.set_defaults(handler="ringpack.cli.calibrate_run:run_calibrate", command_parser=p)


def _add_shared_flag(parser: Any, kernels: dataclasses.Field, step: dataclasses.Field) -> None:
    """One flag for a field of both configs; its help and default say where the step scope's differ."""
    help_text = kernels.metadata["help"]
    if step.metadata["help"] != help_text:
        help_text += "; with --scope step: " + step.metadata["help"]
    default, other = field_default(kernels), field_default(step)
    meta = dict(kernels.metadata, help=help_text)
    if kernels.name == "model":  # the step scope has no default model: the run names what it trains
        meta["default_text"] = f"{kernels.metadata['default_text']}; required with --scope step"
    elif other != default:
        other_text = step.metadata.get("default_text") or shown(other)
        meta["default_text"] = f"{shown(default)}; with --scope step {other_text}"
    action = add_field_flag(parser, kernels, None if "default_text" in meta else default, meta)
    action.fallback = default
