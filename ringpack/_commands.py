"""Helpers shared by the subpackages' ``commands`` modules (kept out of ``cli`` so that nothing imports ``cli``).

The planner's flags (``--dp``, ``--cp``, ``--tokens-per-rank``, ``--strategy``, ..., ``--model`` /
``--cost-profile``) are declared once, by :func:`add_plan_arguments`, and turned into a
``PlanConfig`` once, by :func:`plan_config_from_args`; every command that plans uses both and adds
its own flags. Only the standard library is imported here: the heavy parts load inside functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

#: CP strategies, packings and overflow policies the planner accepts (as in ``ringpack.balancer.plan``).
STRATEGIES = ("balanced", "zigzag", "contiguous")
PACKINGS = ("balanced", "first_fit")
OVERFLOWS = ("error", "split", "drop")
#: ``add_plan_arguments``: the flag has no default and must be given.
REQUIRED: Any = object()
#: ``PlanConfig`` field <- ``argparse`` destination of its flag.
_CONFIG_FLAGS = (
    ("dp", "dp"),
    ("cp", "cp"),
    ("tokens_per_rank", "tokens_per_rank"),
    ("strategy", "strategy"),
    ("packing", "packing"),
    ("samples_per_step", "samples_per_step"),
    ("microbatches_per_rank", "microbatches_per_rank"),
    ("seed", "seed"),
    ("epoch", "epoch"),
    ("overflow", "overflow"),
    ("solver_time_limit_s", "solver_time_limit"),
    ("cp_token_slack", "cp_token_slack"),
)


def add_plan_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    dp: int | None = REQUIRED,
    cp: int = REQUIRED,
    tokens_per_rank: int = REQUIRED,
    overflow: str = "error",
    strategy: bool = True,
    samples_per_step_zero: str = "all in one step",
) -> None:
    """Declare the planner's flags on ``parser`` (a parser or an argument group).

    ``dp``, ``cp``, ``tokens_per_rank``: the default, :data:`REQUIRED` for a flag that must be
    given, or (``dp`` only) ``None`` for a command that derives it and has no ``--dp``.
    ``strategy=False`` leaves out ``--strategy`` and ``--packing`` (commands that plan every
    variant declare their own). ``samples_per_step_zero`` says what ``--samples-per-step 0`` means.
    """

    def sized(flag: str, value: Any, what: str) -> None:
        if value is REQUIRED:
            parser.add_argument(flag, type=int, required=True, help=what)
        else:
            parser.add_argument(flag, type=int, default=value, help=f"{what} (default {value})")

    if dp is not None:
        sized("--dp", dp, "data-parallel size")
    sized("--cp", cp, "context-parallel size")
    sized("--tokens-per-rank", tokens_per_rank, "token budget of one CP rank per micro-batch")
    if strategy:
        parser.add_argument("--strategy", choices=STRATEGIES, default="balanced", help="CP split (default: balanced)")
        parser.add_argument("--packing", choices=PACKINGS, default="balanced", help="packing + DP balance (default: balanced)")
    parser.add_argument("--samples-per-step", type=int, default=0, help=f"global batch in samples (0: {samples_per_step_zero})")
    parser.add_argument("--microbatches-per-rank", type=int, default=0, help="micro-batches per DP rank and step (0: fewest that fit)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--epoch", type=int, default=0, help="epoch whose plan is made (default 0)")
    parser.add_argument("--overflow", choices=OVERFLOWS, default=overflow,
                        help=f"samples longer than cp * tokens-per-rank (default: {overflow})")
    parser.add_argument("--solver-time-limit", type=float, default=0.0,
                        help="CP-SAT refinement per step, deterministic seconds (0: heuristics only)")
    parser.add_argument(
        "--cp-token-slack", type=float, default=None,
        help="balanced CP split: hold every rank within 1+SLACK of the mean tokens, a guard against a mispriced "
        "(uncalibrated) cost model; 0.02 recommended with FLOP models (default: tokens free)",
    )
    parser.add_argument("--model", default="llama3-8b",
                        help="cost-model preset (llama3-8b, llama-1b, tiny) or a calibrated profile JSON (default llama3-8b)")
    parser.add_argument("--cost-profile", default=None, help="calibrated cost-model JSON (overrides --model)")


def cost_model_from_arg(value: str, flag: str = "--model"):
    """The ``CostModel`` a flag names: a preset name, or the path of a calibrated profile JSON."""
    from ringpack.balancer.cost import PRESETS, CostModel

    if value in PRESETS:
        return CostModel.preset(value)
    if Path(value).is_file():
        return CostModel.load(value)
    if value.endswith(".json") or "/" in value:
        raise FileNotFoundError(f"{flag}: no profile file at {value}")
    raise ValueError(f"{flag} {value!r} is neither a preset ({', '.join(PRESETS)}) nor a profile file")


def cost_model_from_args(args: argparse.Namespace):
    """The cost model of :func:`add_plan_arguments`' flags: ``--cost-profile`` if given, else ``--model``."""
    if getattr(args, "cost_profile", None):
        return cost_model_from_arg(args.cost_profile, "--cost-profile")
    return cost_model_from_arg(args.model)


def plan_config_from_args(args: argparse.Namespace, **overrides: Any):
    """``PlanConfig`` from :func:`add_plan_arguments`' flags; ``overrides`` (any field) win.

    Fields whose flag the command did not declare keep ``PlanConfig``'s default; ``cost`` comes
    from :func:`cost_model_from_args` unless overridden.
    """
    from ringpack.balancer.plan import PlanConfig

    given = vars(args)
    fields = {name: given[dest] for name, dest in _CONFIG_FLAGS if dest in given and name not in overrides}
    if "cost" not in overrides:
        fields["cost"] = cost_model_from_args(args)
    return PlanConfig(**fields, **overrides)
