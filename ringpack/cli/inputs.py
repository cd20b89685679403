"""What commands read from their flags: lengths, the cost model, the plan config, the global batch; output checks.

See docs/planner.md, "`ringpack plan`".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.cli.flags import config_fields
from ringpack.cost import PRESETS, CostModel
from ringpack.errors import DataError
from ringpack.lengths import lengths_from_file
from ringpack.progress import Progress
from ringpack.shard_plan import PlanConfig, global_batch_samples


def cost_model_from_arg(value: str, flag: str = "--model"):
    """The ``CostModel`` a flag names: a preset name, or the path of a calibrated profile JSON."""
    if value in PRESETS:
        return CostModel.preset(value)
    if Path(value).is_file():
        return CostModel.load(value)
    if value.endswith(".json") or "/" in value:
        raise FileNotFoundError(f"{flag}: no profile file at {value}")
    raise ValueError(f"{flag} {value!r} is neither a preset ({', '.join(PRESETS)}) nor a profile file")


def cost_flag(args: argparse.Namespace) -> str:
    """The spelling the cost model was given with (``--model`` or ``--cost-profile``)."""
    return getattr(args, "_spellings", {}).get("cost") or "--model"


def cost_model(args: argparse.Namespace, tflops: bool = False):
    """The cost model of the ``--model`` / ``--cost-profile`` flag; with ``tflops``, a FLOP one runs at ``--tflops``."""
    model = cost_model_from_arg(args.cost, cost_flag(args))
    if tflops and model.unit == "flop":
        model = dataclasses.replace(model, flops_per_second=args.tflops * 1e12)
    return model


def plan_config_from_args(args: argparse.Namespace, **overrides: Any):
    """``PlanConfig`` from the flags built from its fields; ``overrides`` (any field) win.

    Fields whose flag the command did not declare keep ``PlanConfig``'s default; ``cost`` comes
    from :func:`cost_model` unless overridden.
    """
    given = vars(args)
    names = [name for name in config_fields(PlanConfig) if name != "cost"]
    fields = {name: given[name] for name in names if name in given and name not in overrides}
    if "cost" not in overrides:
        fields["cost"] = cost_model(args)
    return PlanConfig(**fields, **overrides)


def samples_per_step(
    args: argparse.Namespace, lengths: np.ndarray, dp: int | None = None, cp: int | None = None
) -> int:
    """The global batch in samples: ``--samples-per-step``, or ``--global-batch-tokens`` of ``lengths``.

    A batch given in one of the two (on the command line or in ``--config``) wins over the other's
    default; both given is refused.

    Raises:
        ValueError: both flags given.
    """
    dp = args.dp if dp is None else dp
    cp = args.cp if cp is None else cp
    if check_one_global_batch(args) == "samples_per_step" or not args.global_batch_tokens:
        return args.samples_per_step
    return global_batch_samples(lengths, args.global_batch_tokens, dp=dp, cp=cp, tokens_per_rank=args.tokens_per_rank)


def check_one_global_batch(args: argparse.Namespace) -> str | None:
    """Which of ``--samples-per-step`` and ``--global-batch-tokens`` states the batch (``None``: neither was given).

    ``--global-batch-tokens 0`` (not used) states nothing; one on the command line wins over the
    other in ``--config``.

    Raises:
        ValueError: both were given on the command line, or both in ``--config``.
    """
    pair = ("samples_per_step", "global_batch_tokens")
    given = set(getattr(args, "given", ())) - ({"global_batch_tokens"} if args.global_batch_tokens == 0 else set())
    if set(pair) <= given:
        typed = [name for name in pair if name not in getattr(args, "from_file", ())]
        if len(typed) != 1:
            raise ValueError("--samples-per-step and --global-batch-tokens both state the global batch; give one")
        return typed[0]
    return next((name for name in pair if name in given), None)


def progress(args: argparse.Namespace, desc: str, unit: str, total: int | None = None):
    """A :class:`~ringpack.progress.Progress` on stderr, off with ``--quiet`` or ``--json -``."""
    quiet = getattr(args, "quiet", False) or getattr(args, "json", None) == "-"
    return Progress(desc, unit, total, enabled=not quiet)


def lengths_from_flag(path: str, column: str | None = None, flag: str = "--lengths") -> np.ndarray:
    """Validated sample lengths (int64 ``[N]``, each >= 1) from the file or saved dataset ``flag`` names.

    Raises:
        DataError: an unreadable file, a bad length (the sample named) or no samples at all.
        FileNotFoundError: no file at ``path``.
    """
    lengths = lengths_from_file(path, column)
    if not lengths.size:
        raise DataError(f"{flag} {path} holds no samples")
    return lengths


def check_output_file(
    path: str,
    flag: str,
    inputs: Sequence[str | None] = (),
    outputs: Mapping[str, str | None] = {},
    suffixes: Sequence[str] = (),
) -> None:
    """Refuse, before any slow work, an output file that cannot be written or would replace an input.

    ``outputs``: the command's other output files, by flag; ``path`` must be none of them.
    ``suffixes``: the formats the command writes (``.parquet``, ``.json``); empty: any name.

    Raises:
        ValueError: ``path`` ends in none of ``suffixes``, is a directory, its folder does not
            exist, or it is one of ``inputs`` or ``outputs`` (naming both flags).
    """
    for other_flag, other in outputs.items():
        if other and os.path.realpath(path) == os.path.realpath(other):
            raise ValueError(f"{flag} {path} is also {other_flag}; write the two to different files")
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {target.parent} does not exist")
    for other in inputs:
        if other and target.exists() and Path(other).exists() and os.path.samefile(target, other):
            raise ValueError(f"{flag} {path} is an input of this command; write the output elsewhere")
    if suffixes and Path(path).suffix not in suffixes:
        kinds = ", ".join(suffixes[:-1]) + " or " * (len(suffixes) > 1) + suffixes[-1]
        raise ValueError(f"{flag} {path}: give a {kinds} file (the formats it writes)")


def check_output_folder(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that exists as a file (``ValueError``), before any slow work."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")
