"""``ringpack calibrate``: fit the cost model to measured GPU times (docs/analysis.md, docs/cost-model.md).

Its flags are the fields of :class:`~ringpack.calibration.run.KernelCalibrationConfig`
(``--scope kernels``) and :class:`~ringpack.calibration.step.StepCalibrationConfig`
(``--scope step``); a field both have is one flag, and a flag of one scope is refused in the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from ringpack.calibration.run import (
    KernelCalibrationConfig,
    calibrate_kernels,
    check_outputs,
    format_summary,
    quality_line,
    refit_file,
    save_calibration,
    with_fit_quality,
)
from ringpack.calibration.step import StepCalibrationConfig, calibrate_step, format_step_summary
from ringpack.cli.flags import add_field_flag, add_quiet_flag, config_fields, field_default, flag, new_command, shown
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import progress

logger = logging.getLogger("ringpack.calibrate")
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
    p.set_defaults(handler=run_calibrate, command_parser=p)


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


def run_calibrate(args: argparse.Namespace) -> int:
    if args.refit and not Path(args.refit).is_file():
        raise FileNotFoundError(f"--refit: no calibration report at {args.refit}")
    check_flags_apply(args, "calibrate", "refit" if args.refit and args.scope == "kernels" else args.scope)
    if args.scope == "step" and "model" not in args.given:
        raise ValueError("--scope step needs --model: a preset or a transformers config file or folder")
    check_outputs(args.out, args.report, args.refit)  # before minutes of timing, not after
    if args.refit:
        result, scope = refit_file(args.refit), "kernels"
    elif not _device_usable(args):
        return 2
    elif args.scope == "step":
        result, scope = _calibrate_step(args), "step"
    else:
        config = KernelCalibrationConfig(**_given(args, KERNELS))
        result, scope = calibrate_kernels(config, log=(lambda _: None) if args.quiet else logger.info), "kernels"
    profile = with_fit_quality(result, scope)
    if args.quiet:  # one line on the fit, one on the files
        summary = quality_line(profile)
    else:
        summary = format_step_summary(result) if scope == "step" else format_summary(result)
    out, report = save_calibration(result, args.out, args.report, profile)
    print(summary)
    print(f"wrote {out} (load with CostModel.load / `ringpack plan --cost-profile {out}`) and {report}")
    return 0


def _given(args: argparse.Namespace, fields: dict[str, dataclasses.Field]) -> dict[str, Any]:
    """The config fields given on the command line (the others keep the config's defaults)."""
    return {name: getattr(args, name) for name in fields if name in args.given}


def _device_usable(args: argparse.Namespace) -> bool:
    """Whether the run can time on ``--device`` with ``--backend``; if not, one error line is logged."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        if args.scope == "step":
            logger.error(
                "step calibration times the model on a GPU, and none is visible. Run it on the training GPU "
                "(or `--device cpu --backend reference --model tiny` for a dry run)."
            )
        else:
            logger.error(
                "calibration times GPU kernels and needs a CUDA device, and none is visible. "
                "Run it on the training GPU (or `--device cpu --backend reference` for a tiny dry run)."
            )
        return False
    if (
        args.scope == "kernels"
        and args.device == "cpu"
        and args.backend not in ("reference", "reference_hybrid", "auto")
    ):
        logger.error(f"--device cpu runs only --backend reference (a dry run), not {args.backend!r}")
        return False
    return True


def _calibrate_step(args: argparse.Namespace) -> Any:
    """``--scope step``: time and fit the training step; ``--quiet`` keeps only warnings of its progress."""
    config = StepCalibrationConfig(**_given(args, STEP))
    saved = logger.level
    if args.quiet:
        logger.setLevel(logging.WARNING)
    try:
        with progress(args, f"timing {config.model} rank shards", "shards") as bar:
            return calibrate_step(config, progress=bar)
    finally:
        logger.setLevel(saved)
