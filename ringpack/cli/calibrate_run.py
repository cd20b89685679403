"""``ringpack calibrate``, run: time on the GPU (or a CPU dry run), fit, write the profile and report.

The parser is :mod:`ringpack.cli.calibrate`; this module imports the timing code (torch), and only
when the command runs.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path
from typing import Any

from ringpack.calibration.config import KernelCalibrationConfig, StepCalibrationConfig
from ringpack.calibration.run import (
    calibrate_kernels,
    check_outputs,
    format_summary,
    quality_line,
    refit_file,
    save_calibration,
    with_fit_quality,
)
from ringpack.calibration.step import calibrate_step, format_step_summary
from ringpack.cli.calibrate import KERNELS, STEP
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import progress

logger = logging.getLogger("ringpack.calibrate")


def run_calibrate(args: argparse.Namespace) -> int:
    """Calibrate (or ``--refit``) with the parsed flags and write the profile and report; 0 done, 2 no usable device."""
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
