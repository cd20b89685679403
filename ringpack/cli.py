"""The ``ringpack`` command line: ``plan | report | shard | simulate | calibrate | demo``.

Every command's flags and handler live here; handlers call the library and return the exit code.
Heavy dependencies (torch, pyarrow, datasets, matplotlib) load inside the handlers, so
``ringpack --help`` stays quick. Results go to stdout; notes, warnings and progress to stderr
(the library's ``ringpack.*`` loggers, shown as ``ringpack COMMAND: ...``; progress is a bar on a
terminal and a line every few seconds elsewhere, off with ``--quiet``). Bad input ends in one line
on stderr and exit 1; hints in it name flags (``--overflow split``), not Python keywords.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ringpack import __version__
from ringpack._hints import command_line_hints
from ringpack.analysis import demo
from ringpack.analysis.calibration import run as calibration
from ringpack.analysis.calibration.cases import GRIDS
from ringpack.analysis.calibration.step import run_step
from ringpack.analysis.calibration.timing import TIMERS
from ringpack.analysis.comm_model import LINKS, CommModel
from ringpack.analysis.metrics import plan_label
from ringpack.analysis.peer_runner import PEERS, parse_peers, peer_rows
from ringpack.analysis.plots import default_rank_step
from ringpack.analysis.report import (
    build_report,
    format_ranks,
    format_table,
    plan_strategies,
    result_of_plan,
    write_report,
)
from ringpack.analysis.robustness import PRICE_FACTORS, imbalance_across_prices
from ringpack.analysis.simulate import SIM_VARIANTS, format_modes, simulate, synthetic_lengths
from ringpack.cost import MAX_SAMPLE_TOKENS, PRESETS, CostModel
from ringpack.data.corpus import stdlib_corpus
from ringpack.data.shard_reader import ShardReader
from ringpack.data.shard_writer import check_out_dir, write_shards
from ringpack.data.sources import SOURCES, load_source, tokenize_dataset
from ringpack.errors import DataError
from ringpack.lengths import FORMATS as LENGTHS_FORMATS
from ringpack.lengths import lengths_from_file
from ringpack.planner.bounds import plan_costs
from ringpack.planner.epoch import make_plan
from ringpack.progress import Progress
from ringpack.shard_plan import MAX_CP, MAX_DP, OVERFLOW_POLICIES, PACKINGS, STRATEGIES, Plan, PlanConfig
from ringpack.tokenizer import NO_SPECIAL_TOKENS, TOKENIZERS
from ringpack.traffic import plan_kv_traffic

#: ``add_plan_arguments``: the flag has no default and must be given.
REQUIRED: Any = object()
#: Largest tokens per rank the flag accepts (DP and CP sizes: ``PlanConfig``'s limits); ``PlanConfig``
#: also refuses a CP group (cp x tokens per rank) above ``MAX_SAMPLE_TOKENS``, where causal pair
#: counts stop being exact.
MAX_TOKENS = MAX_SAMPLE_TOKENS
#: Largest count (samples per step, seeds, steps, ...) a flag accepts: every count stays an int64.
MAX_COUNT = 1 << 62
#: ``--lengths`` of every command that plans lengths.
LENGTHS_HELP = f"sample lengths: {LENGTHS_FORMATS}"
COLUMN_HELP = (
    "column of lengths or token-id lists (default: a file's only column, else the first there is of "
    "length, lengths, num_tokens, n_tokens, input_ids, tokens; a saved dataset's input_ids or tokens first)"
)
logger = logging.getLogger("ringpack.cli")


# ------------------------------------------------------------------------------------- flag types
def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An ``argparse`` type: an integer in ``[low, high]``; anything else is refused with one line."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def real(low: float, *, inclusive: bool = True, high: float = math.inf) -> Callable[[str], float]:
    """An ``argparse`` type: a finite number ``>= low`` (``> low`` unless ``inclusive``) and ``<= high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive) or value > high:
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def integer_list(low: int) -> Callable[[str], list[int]]:
    """An ``argparse`` type: comma-separated integers, each ``>= low``, at least one."""
    item = integer(low)

    def parse(text: str) -> list[int]:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return values

    return parse


POSITIVE = integer(1, MAX_COUNT)
COUNT = integer(0, MAX_COUNT)
PROCESSES = integer(1, 1024)
DP_SIZE = integer(1, MAX_DP)
CP_SIZE = integer(1, MAX_CP)
TOKENS = integer(1, MAX_TOKENS)
POSITIVE_REAL = real(0.0, inclusive=False)
NON_NEGATIVE_REAL = real(0.0)
#: Hardware rates and latencies (TFLOP/s, GB/s, microseconds): at most 1e9, beyond any hardware,
#: so their products in FLOP/s or bytes/s stay finite.
RATE = real(0.0, inclusive=False, high=1e9)
LATENCY = real(0.0, high=1e9)
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
    ("pair_price_range", "pair_price_range"),
)


def add_plan_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    dp: int | None = REQUIRED,
    cp: int = REQUIRED,
    tokens_per_rank: int = REQUIRED,
    strategy: bool = True,
    samples_per_step_zero: str = "all in one step",
) -> None:
    """Declare the planner's flags on ``parser`` (a parser or an argument group).

    ``dp``, ``cp``, ``tokens_per_rank``: the default, :data:`REQUIRED` for a flag that must be
    given, or (``dp`` only) ``None`` for a command that derives it and has no ``--dp``.
    ``strategy=False`` leaves out ``--strategy`` and ``--packing`` (commands that plan every
    variant declare their own). ``samples_per_step_zero`` says what ``--samples-per-step 0`` means.
    """
    if dp is not None:
        _add_size_flag(parser, "--dp", dp, DP_SIZE, "data-parallel size")
    _add_size_flag(parser, "--cp", cp, CP_SIZE, "context-parallel size")
    _add_size_flag(parser, "--tokens-per-rank", tokens_per_rank, TOKENS, "token budget of one CP rank per micro-batch")
    if strategy:
        parser.add_argument("--strategy", choices=STRATEGIES, default="balanced", help="CP split (default: balanced)")
        parser.add_argument(
            "--packing", choices=PACKINGS, default="balanced", help="packing + DP balance (default: balanced)"
        )
    _add_batch_flags(parser, samples_per_step_zero)
    _add_split_and_cost_flags(parser)


def _add_size_flag(parser: Any, flag: str, value: Any, kind: Callable[[str], int], what: str) -> None:
    if value is REQUIRED:
        parser.add_argument(flag, type=kind, required=True, help=what)
    else:
        parser.add_argument(flag, type=kind, default=value, help=f"{what} (default {value})")


def _add_batch_flags(parser: Any, samples_per_step_zero: str) -> None:
    """Global batch, micro-batches, shuffle and overflow flags of :func:`add_plan_arguments`."""
    parser.add_argument(
        "--samples-per-step", type=COUNT, default=0, help=f"global batch in samples (0: {samples_per_step_zero})"
    )
    parser.add_argument(
        "--microbatches-per-rank", type=COUNT, default=0, help="micro-batches per DP rank and step (0: fewest that fit)"
    )
    parser.add_argument("--seed", type=COUNT, default=0, help="shuffle seed (default 0)")
    parser.add_argument("--epoch", type=COUNT, default=0, help="epoch whose plan is made (default 0)")
    parser.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="error",
        help="samples longer than cp * tokens-per-rank: error (default: name the first), split (into documents "
        "of at most that many tokens) or drop",
    )


def _add_split_and_cost_flags(parser: Any) -> None:
    """Solver, CP-split guard and cost-model flags of :func:`add_plan_arguments`."""
    parser.add_argument(
        "--solver-time-limit",
        type=NON_NEGATIVE_REAL,
        default=0.0,
        help="CP-SAT refinement per step, deterministic seconds (0: heuristics only)",
    )
    parser.add_argument(
        "--pair-price-range",
        type=_price_range,
        default=None,
        metavar="LOW,HIGH",
        help="stay balanced while the true price of an attention pair is LOW..HIGH times the cost model's "
        "(default: 0.25,2 for FLOP models, 1,1 for measured profiles; 1,1 balances the model's prices alone)",
    )
    parser.add_argument(
        "--cp-token-slack",
        type=NON_NEGATIVE_REAL,
        default=None,
        help="balanced CP split: hold every rank within 1+SLACK of the mean tokens (default 0.01; "
        "a large value turns the guard off)",
    )
    parser.add_argument(
        "--model",
        default="llama3-8b",
        help="cost-model preset (llama3-8b, llama-1b, tiny) or a calibrated profile JSON (default llama3-8b)",
    )
    parser.add_argument("--cost-profile", default=None, help="calibrated cost-model JSON (overrides --model)")


def _price_range(text: str) -> tuple[float, float]:
    """``--pair-price-range LOW,HIGH``: two finite numbers with ``0 < LOW <= 1 <= HIGH``."""
    parts = text.split(",")
    try:
        low, high = (float(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two numbers), got {text!r}") from None
    if not (math.isfinite(high) and 0 < low <= 1.0 <= high):
        raise argparse.ArgumentTypeError(f"must satisfy 0 < LOW <= 1 <= HIGH (finite), got {text!r}")
    return low, high


def cost_model_from_arg(value: str, flag: str = "--model"):
    """The ``CostModel`` a flag names: a preset name, or the path of a calibrated profile JSON."""
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
    given = vars(args)
    fields = {name: given[dest] for name, dest in _CONFIG_FLAGS if dest in given and name not in overrides}
    if "cost" not in overrides:
        fields["cost"] = cost_model_from_args(args)
    return PlanConfig(**fields, **overrides)


# ------------------------------------------------------------------------------- inputs and outputs
def add_lengths_arguments(parser: argparse.ArgumentParser, *, required: bool, what: str = "") -> None:
    """``--lengths`` and ``--column``: the same sources and help on every command that plans lengths."""
    parser.add_argument("--lengths", required=required, metavar="PATH", help=LENGTHS_HELP + what)
    parser.add_argument("--column", default=None, help=COLUMN_HELP)


def add_quiet_argument(parser: Any, *aliases: str) -> None:
    """``--quiet``: no progress (bars on a terminal, log lines elsewhere); results and errors still print."""
    parser.add_argument("--quiet", *aliases, dest="quiet", action="store_true", help="no progress on stderr")


def progress(args: argparse.Namespace, desc: str, unit: str, total: int | None = None):
    """A :class:`~ringpack.progress.Progress` on stderr, off with ``--quiet`` or ``--json -``."""
    quiet = getattr(args, "quiet", False) or getattr(args, "json", None) == "-"
    return Progress(desc, unit, total, enabled=not quiet)


def check_column_has_lengths(args: argparse.Namespace, instead: str) -> None:
    """Refuse ``--column`` without ``--lengths`` (``instead``: the input used then), where it would be ignored."""
    if args.column is not None and not args.lengths:
        raise ValueError(f"--column {args.column} names a column of --lengths; it does not apply to {instead}")


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


def check_output_file(path: str, flag: str, inputs: Sequence[str | None] = ()) -> None:
    """Refuse, before any slow work, an output file that cannot be written or would replace an input.

    Raises:
        ValueError: ``path`` is a directory, its folder does not exist, or it is one of ``inputs``.
    """
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    if not target.parent.is_dir():
        raise ValueError(f"{flag} {path}: folder {target.parent} does not exist")
    for other in inputs:
        if other and target.exists() and Path(other).exists() and os.path.samefile(target, other):
            raise ValueError(f"{flag} {path} is an input of this command; write the output elsewhere")


def check_output_folder(path: str, flag: str = "--out") -> None:
    """Refuse an output folder that exists as a file (``ValueError``), before any slow work."""
    if Path(path).exists() and not Path(path).is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")


# ------------------------------------------------------------------------------------------- plan


def _add_plan_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="plan sample lengths into a DP x CP shard plan",
        description="Plan sample lengths into a DP x CP shard plan (balanced packing, DP balance and CP split).",
    )
    add_lengths_arguments(p, required=True)
    add_plan_arguments(p)
    p.add_argument("--out", required=True, help="output plan: .parquet (default) or .json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_quiet_argument(p)
    p.set_defaults(handler=run_plan)


def summarize(plan) -> dict:
    """Summary numbers of a plan: what ``ringpack plan`` prints (``--json``: as they are)."""
    costs = plan_costs(plan)
    kv = plan_kv_traffic(plan)
    per_step_unique = np.bincount(kv["step"], weights=kv["unique"], minlength=plan.num_steps)
    prices = imbalance_across_prices(plan, PRICE_FACTORS)
    return {
        "hash": plan.content_hash,
        "steps": plan.num_steps,
        "microbatches": int(sum(len(step.microbatches) * len(step.microbatches[0]) for step in plan.steps)),
        "samples": len(plan.lengths) - len(plan.dropped),
        "dropped": len(plan.dropped),
        "imbalance_median": float(np.median(costs["imbalance"])),
        "imbalance_max": float(np.max(costs["imbalance"])),
        "gap_median": float(np.nanmedian(costs["gap"])),
        "gap_max": float(np.nanmax(costs["gap"])),
        "kv_tokens_per_step_median": float(np.median(per_step_unique)),
        "imbalance_by_pair_price": {str(f): round(v, 6) for f, v in prices.items()},
    }


def run_plan(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out", inputs=[args.lengths, args.cost_profile, args.model])
    lengths = lengths_from_flag(args.lengths, args.column)
    config = plan_config_from_args(args)
    t0 = time.perf_counter()
    with progress(args, f"planning {len(lengths):,} samples", "steps") as bar:
        plan = make_plan(lengths, config, progress=bar.advance_to).validate()
    seconds = time.perf_counter() - t0
    plan.save(args.out)
    summary = summarize(plan)
    summary["plan_seconds"] = round(seconds, 4)
    summary["out"] = str(args.out)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(
        f"planned {summary['samples']} samples into {summary['steps']} steps, {summary['microbatches']} micro-batches "
        f"(dp={config.dp} x cp={config.cp}, {config.tokens_per_rank} tokens/rank, strategy={config.strategy}) "
        f"in {seconds:.3f} s"
    )
    print(
        f"step cost / mean rank cost: median {summary['imbalance_median']:.4f}, worst {summary['imbalance_max']:.4f}; "
        f"gap to lower bound: median {summary['gap_median']:.2%}, worst {summary['gap_max']:.2%}"
    )
    print(f"K/V tokens sent across CP ranks per step (median): {summary['kv_tokens_per_step_median']:.0f}")
    prices = summary["imbalance_by_pair_price"]
    print(
        "plan time / balanced time if a pair really costs x the model's price: "
        + ", ".join(f"x{f}: {v:.4f}" for f, v in prices.items())
        + f" (planned for x{config.price_range[0]:g}..x{config.price_range[1]:g})"
    )
    if summary["dropped"]:
        logger.warning(
            "dropped %d samples longer than %d tokens (--overflow drop)", summary["dropped"], config.group_capacity
        )
    print(f"wrote {args.out} (hash {summary['hash'][:16]})")
    return 0


# ------------------------------------------------------------------------------------------ shard


#: The regex tokenizer's id range when ``--vocab-size`` is not given.
DEFAULT_VOCAB = 65536
#: ``shard`` flags that only apply when the dataset is tokenized (it has no ``--column``), by destination.
_TOKENIZING_FLAGS = (
    ("--text-column", "text_column"),
    ("--tokenizer", "tokenizer"),
    ("--vocab-size", "vocab_size"),
    ("--num-proc", "num_proc"),
)


def _add_shard_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shard",
        help="write a dataset as balanced Parquet shards plus a manifest",
        description=(
            "Plan DATASET for a DP x CP mesh and write one Parquet file per DP rank (or per DP rank and step range), "
            "one row group per micro-batch, plus manifest.json (plan hash, config, row counts, sha256s) "
            "and plan.parquet. "
            "Re-running with the same inputs resumes an interrupted run and gives byte-identical files. "
            "Read back with ringpack.data.ShardReader."
        ),
    )
    p.add_argument("dataset", metavar="DATASET", help=_shard_sources())
    p.add_argument("--out", required=True, help="output directory")
    add_plan_arguments(p)
    p.add_argument(
        "--split", default=None, help="split of a saved DatasetDict or a Hub dataset (default: train; files have none)"
    )
    p.add_argument("--column", default="input_ids", help="token-id column (default: input_ids)")
    tokenizing = "; only when the dataset has no token-id column"
    p.add_argument("--text-column", default=None, help="tokenize this text column (default: text)" + tokenizing)
    p.add_argument(
        "--tokenizer",
        default=None,
        help=f"{TOKENIZERS}; {NO_SPECIAL_TOKENS}; default: the regex tokenizer with hashed ids" + tokenizing,
    )
    p.add_argument(
        "--vocab-size",
        type=integer(1, 1 << 31),
        default=None,
        help=f"id range of the regex tokenizer's hashed ids (default: {DEFAULT_VOCAB}; not with --tokenizer)"
        + tokenizing,
    )
    p.add_argument("--num-proc", type=PROCESSES, default=None, help="processes for tokenizing" + tokenizing)
    p.add_argument(
        "--steps-per-file",
        type=COUNT,
        default=0,
        help="split each DP rank's file every N steps (0: one file per DP rank)",
    )
    p.add_argument("--cache-dir", default=None, help="datasets cache directory")
    p.add_argument("--overwrite", action="store_true", help="replace shards of another plan or dataset in --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    add_quiet_argument(p, "--no-progress")
    p.set_defaults(handler=run_shard)


def _shard_sources() -> str:
    return SOURCES + " (a .npy file holds lengths, not tokens: plan it with `ringpack plan --lengths`)"


def run_shard(args: argparse.Namespace) -> int:
    check_out_dir(args.out, [args.dataset])
    config = plan_config_from_args(args)
    with _datasets_progress(not args.quiet):
        loaded = load_source(args.dataset, split=args.split, cache_dir=args.cache_dir)
        if len(loaded) == 0:
            raise ValueError(f"dataset {args.dataset} holds no rows")
        ds, tokenized = _token_dataset(args, loaded)
    source = {
        "dataset": str(args.dataset),
        "split": args.split,
        "column": args.column,
        "tokenized_from": tokenized,
    }
    manifest = write_shards(
        ds,
        args.out,
        config,
        column=args.column,
        steps_per_file=args.steps_per_file,
        progress=not args.quiet,
        overwrite=args.overwrite,
        source=source,
    )
    summary = {
        "out": str(args.out),
        "plan_hash": manifest["plan_hash"],
        "steps": manifest["num_steps"],
        "samples": manifest["num_samples"],
        "tokens": manifest["num_tokens"],
        "dropped": len(manifest["dropped"]),
        "files": len(manifest["files"]),
        "bytes": sum(f["bytes"] for f in manifest["files"]),
    }
    print(json.dumps(summary) if args.json else _shard_summary(summary, manifest))
    return 0


def _shard_summary(summary: dict[str, Any], manifest: dict[str, Any]) -> str:
    """What ``ringpack shard`` prints when done: what was written, how big, where, and how to read it back."""
    dp, cp = manifest["dp"], manifest["cp"]
    dropped = f", {summary['dropped']:,} dropped (--overflow drop)" if summary["dropped"] else ""
    out = summary["out"]
    return "\n".join(
        [
            f"sharded {summary['samples']:,} samples ({summary['tokens']:,} tokens{dropped}) into "
            f"{summary['steps']:,} steps for dp={dp} x cp={cp}, {manifest['tokens_per_rank']:,} tokens per rank",
            f"wrote {summary['files']:,} shard files ({_size(summary['bytes'])}), plan.parquet and manifest.json "
            f"to {out}",
            f"plan hash {summary['plan_hash'][:16]}; read with ringpack.ShardReader({out!r}, dp_rank, cp_rank)",
        ]
    )


def _size(num_bytes: int) -> str:
    """``1234567`` -> ``"1.2 MB"`` (decimal units)."""
    value = float(num_bytes)
    for unit in ("bytes", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{int(value)} {unit}" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _datasets_progress(show: bool):
    """``datasets``' own bars (loading, tokenizing) while this block runs: on a terminal unless ``--quiet``.

    Off a terminal they would fill a log with carriage returns, so there they are off.
    """
    import datasets

    if show and sys.stderr.isatty():
        yield
        return
    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _token_dataset(args: argparse.Namespace, ds: Any) -> tuple[Any, dict[str, str] | None]:
    """``ds`` with its token-id column (tokenized from a text column when it has none) and how it was made.

    A dataset that has the column is used as it is, with a warning naming every tokenizing flag
    given (they do not apply to it).

    Raises:
        ValueError: ``--vocab-size`` with ``--tokenizer``, or no column to take ids from.
    """
    if args.column in ds.column_names:
        given = [flag for flag, dest in _TOKENIZING_FLAGS if getattr(args, dest) is not None]
        if given:
            logger.warning(
                "using the existing %r column of %s; %s ignored (only for tokenizing a dataset without it)",
                args.column,
                args.dataset,
                "/".join(given),
            )
        return ds, None
    if args.tokenizer and args.vocab_size is not None:
        raise ValueError(
            "--vocab-size sets the id range of the regex tokenizer's hashed ids; "
            f"--tokenizer {args.tokenizer} has its own vocabulary (leave --vocab-size out)"
        )
    text = args.text_column or ("text" if "text" in ds.column_names else None)
    if text is None:
        raise ValueError(
            f"{args.dataset} has no column {args.column!r} and no text column to tokenize "
            f"(columns: {list(ds.column_names)}); pass --text-column"
        )
    if not args.quiet:
        logger.info("tokenizing column %r of %s rows", text, f"{len(ds):,}")
    vocab_size = DEFAULT_VOCAB if args.vocab_size is None else args.vocab_size
    ds = tokenize_dataset(ds, text, args.tokenizer, column=args.column, vocab_size=vocab_size, num_proc=args.num_proc)
    tokenizer = Path(args.tokenizer).name if args.tokenizer else f"regex-blake2b-mod-{vocab_size}"
    return ds, {"text_column": text, "tokenizer": tokenizer}


# ----------------------------------------------------------------------------- report, simulate, ...


def _add_report_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="imbalance report of a plan, shard manifest or lengths",
        description="Imbalance report (terminal table, report.json, PNG plots, report.html/.md) of plan files, "
        "a shard manifest's plan, or sample lengths planned with every strategy.",
    )
    p.add_argument("plans", nargs="*", metavar="PLAN", help="plan files (.parquet or .json) to compare")
    p.add_argument("--manifest", help="a `ringpack shard` output (manifest.json or its folder): reports its plan")
    add_lengths_arguments(p, required=False, what="; planned with every strategy")
    p.add_argument("--corpus", choices=["stdlib"], help="use the embedded standard-library corpus as the lengths")
    _add_comparison_arguments(p, dp=4, cp=4, modes="ring", default_out="ringpack-report")
    p.add_argument(
        "--step",
        type=COUNT,
        help="step whose per-GPU costs are plotted and tabled (default: the baseline's median-idle step)",
    )
    p.add_argument("--steps-shown", type=COUNT, default=5, help="steps per plan in the terminal table (default 5)")
    p.set_defaults(handler=run_report)


def _add_simulate_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="simulate an epoch at cluster scale",
        description="Plan a whole epoch for a cluster shape with every strategy and predict tokens/s and idle "
        "time from the cost model and a ring / all-gather communication model.",
    )
    p.add_argument(
        "--gpus",
        type=integer_list(1),
        default=[1024],
        help="GPUs, comma-separated for several shapes (default 1024); DP = gpus / cp",
    )
    p.add_argument(
        "--samples", type=integer(1, 10**9), help=f"drawn samples in the epoch (default {DRAWN['samples']:,})"
    )
    add_lengths_arguments(p, required=False, what="; simulated instead of drawn lengths")
    p.add_argument(
        "--dist",
        choices=["stdlib", "lognormal"],
        help="drawn lengths: resampled stdlib corpus (default) or log-normal",
    )
    p.add_argument(
        "--median", type=POSITIVE_REAL, help=f"log-normal median length in tokens (default {DRAWN['median']:g})"
    )
    p.add_argument("--sigma", type=NON_NEGATIVE_REAL, help=f"log-normal sigma (default {DRAWN['sigma']:g})")
    p.add_argument(
        "--global-batch-tokens",
        type=COUNT,
        default=0,
        help="tokens per optimizer step (default: dp * cp * tokens-per-rank, one full micro-batch per DP rank)",
    )
    _add_comparison_arguments(
        p,
        dp=None,
        cp=8,
        tokens_per_rank=16384,
        strategies=None,
        modes="ring,allgather",
        default_out="ringpack-simulation",
    )
    p.add_argument("--jobs", type=integer(0, 1024), default=0, help="worker processes (default: all cores)")
    p.add_argument("--chunk-steps", type=POSITIVE, default=8, help="global batches planned per worker task (default 8)")
    p.set_defaults(handler=run_simulate)


#: ``simulate``'s drawn lengths when their flags are not given (each flag applies to drawn lengths only;
#: ``median`` and ``sigma`` to ``--dist lognormal`` only).
DRAWN = {"samples": 1_000_000, "dist": "stdlib", "median": 2048.0, "sigma": 1.3}


def drawn_lengths(args: argparse.Namespace) -> dict[str, Any]:
    """``synthetic_lengths``' arguments from ``--samples``, ``--dist``, ``--median``, ``--sigma``.

    Raises:
        ValueError: one of them with ``--lengths``, or ``--median``/``--sigma`` without ``--dist lognormal``.
    """
    given = {name: getattr(args, name) for name in DRAWN if getattr(args, name) is not None}
    if args.lengths and given:
        flags = ", ".join(f"--{name}" for name in given)
        raise ValueError(f"{flags} shape drawn lengths; they do not apply to --lengths {args.lengths}")
    drawn = {**DRAWN, **given}
    shape = [f"--{name}" for name in ("median", "sigma") if name in given]
    if shape and drawn["dist"] != "lognormal":
        raise ValueError(f"{', '.join(shape)} shape log-normal draws; they do not apply to --dist {drawn['dist']}")
    return drawn


def _add_calibrate_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit the cost model to measured GPU times",
        description="Time ringpack's attention kernels and the model's linear layers (--scope kernels), or the "
        "whole model's training step per rank shard (--scope step), on one GPU, fit the cost model's "
        "coefficients and write a profile the planner loads.",
    )
    _add_calibrate_arguments(p)
    p.set_defaults(handler=run_calibrate)


def _add_demo_command(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo", help="the embedded standard-library corpus through every strategy: report, plots, ring check"
    )
    _add_demo_arguments(p)
    p.set_defaults(handler=run_demo)


# ------------------------------------------------------------------------------------------ options
def _add_comparison_arguments(
    p: argparse.ArgumentParser,
    *,
    dp: int | None,
    cp: int,
    modes: str,
    default_out: str,
    tokens_per_rank: int = 32768,
    strategies: str | None = ",".join(STRATEGIES),
) -> None:
    """The option groups of the commands that plan and compare variants: planning, communication, output."""
    add_variant_plan_arguments(p, dp=dp, cp=cp, tokens_per_rank=tokens_per_rank, strategies=strategies)
    add_comm_arguments(p, modes=modes)
    add_output_arguments(p, default_out=default_out)


def add_variant_plan_arguments(
    p: argparse.ArgumentParser,
    dp: int | None,
    cp: int,
    tokens_per_rank: int = 32768,
    strategies: str | None = ",".join(STRATEGIES),
) -> None:
    """The planner's flags (:func:`add_plan_arguments`) and the variants to plan and compare."""
    g = p.add_argument_group("planning (for lengths)")
    add_plan_arguments(
        g,
        dp=dp,
        cp=cp,
        tokens_per_rank=tokens_per_rank,
        strategy=False,
        samples_per_step_zero="derived",
    )
    g.add_argument(
        "--tflops",
        type=RATE,
        default=400.0,
        help="achieved fwd+bwd TFLOP/s per GPU for predicted times (default 400)",
    )
    if strategies is None:  # simulate: a curated default set of (strategy, packing) pairs
        g.add_argument(
            "--strategies",
            help="CP strategies to plan (default: balanced/balanced, zigzag/balanced, "
            "zigzag/first_fit, contiguous/first_fit)",
        )
        g.add_argument("--packings", help="packings to plan, crossed with --strategies (default balanced,first_fit)")
    else:
        g.add_argument("--strategies", default=strategies, help=f"CP strategies to plan (default {strategies})")
        g.add_argument("--packings", default=",".join(PACKINGS), help="packings to plan (default balanced,first_fit)")
    g.add_argument("--baseline", help="plan the others are compared with (default zigzag/first_fit when present)")
    g.add_argument(
        "--peers",
        help="other systems run on the same data, as extra rows: megatron-dcp (Megatron-Core dynamic CP), "
        "wlb (WLB-LLM packing), comma-separated, or none (default: both, when planning lengths)",
    )


def add_comm_arguments(p: argparse.ArgumentParser, modes: str = "ring") -> None:
    g = p.add_argument_group("communication model")
    g.add_argument(
        "--link", default="nvlink", choices=sorted(LINKS), help="link preset for CP traffic (default nvlink)"
    )
    g.add_argument("--bandwidth", type=RATE, help="link bandwidth in GB/s (overrides --link)")
    g.add_argument("--latency-us", type=LATENCY, help="per-message latency in microseconds (overrides --link)")
    g.add_argument("--modes", default=modes, help=f"attention modes, first is the headline (default {modes})")


def add_output_arguments(p: argparse.ArgumentParser, default_out: str) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "--out", default=default_out, help=f"folder for report.json, plots and report.html (default {default_out}/)"
    )
    g.add_argument("--json", help="also write the JSON document here ('-' prints it to stdout instead of the table)")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    add_quiet_argument(g)


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {bad or text!r} not in {allowed}")
    return items


def cost_model(args: argparse.Namespace):
    """The planner's cost model (:func:`cost_model_from_args`), a FLOP one at ``--tflops``."""
    model = cost_model_from_args(args)
    if model.unit == "flop":
        model = dataclasses.replace(model, flops_per_second=args.tflops * 1e12)
    return model


def comm_models(args: argparse.Namespace, model) -> list:
    modes = _list(args.modes, ("ring", "allgather"), "modes")
    bw = None if args.bandwidth is None else args.bandwidth * 1e9
    lat = None if args.latency_us is None else args.latency_us * 1e-6
    return [CommModel.for_model(model, link=args.link, mode=m, bandwidth=bw, latency=lat) for m in modes]


def variants(args: argparse.Namespace) -> list[tuple[str, str]]:
    if args.strategies is None and args.packings is None:
        return list(SIM_VARIANTS)
    strategies = _list(args.strategies or ",".join(STRATEGIES), STRATEGIES, "strategies")
    packings = _list(args.packings or ",".join(PACKINGS), PACKINGS, "packings")
    return [(s, p) for p in packings for s in strategies]


def peer_names(args: argparse.Namespace) -> list[str]:
    """``--peers`` resolved: every peer by default, ``none`` for none."""
    return list(PEERS) if args.peers is None else parse_peers(args.peers)


def plan_from_manifest(path: str):
    """The plan a ``ringpack shard`` directory was written from (``manifest.json`` or its folder).

    Read through :class:`~ringpack.data.shard_reader.ShardReader`, which checks the plan file's
    checksum and hash against the manifest.
    """
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    return ShardReader(folder, 0, 0).plan


def check_outputs(args: argparse.Namespace, inputs: Sequence[str | None]) -> None:
    """Check ``--out`` (a folder) and ``--json`` (a file, or ``-`` for stdout) of report and simulate."""
    check_output_folder(args.out)
    if args.json and args.json != "-":
        check_output_file(args.json, "--json", inputs=inputs)


def _emit(doc: dict[str, Any], args: argparse.Namespace, table: str, rank_step: int | None = None) -> None:
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


# ------------------------------------------------------------------------------------------ report
def run_report(args: argparse.Namespace) -> int:
    sources = sum(bool(x) for x in (args.plans, args.manifest, args.lengths, args.corpus))
    if sources != 1:
        raise ValueError("give exactly one input: plan files, --manifest, --lengths or --corpus stdlib")
    check_column_has_lengths(args, "plan files" if args.plans else "--manifest" if args.manifest else "--corpus")
    check_outputs(args, inputs=[*args.plans, args.manifest, args.lengths])
    wanted = variants(args)  # validate options before any slow work
    peers = peer_names(args)
    if args.plans or args.manifest:
        if args.peers is not None and peers:
            raise ValueError("--peers runs other systems on lengths: give --lengths or --corpus, not plan files")
        peers = []
        plans = [Plan.load(p) for p in args.plans] if args.plans else [plan_from_manifest(args.manifest)]
        shapes = {(p.config.dp, p.config.cp) for p in plans}
        if len(shapes) > 1:
            raise ValueError(f"plans are for different DP x CP shapes {sorted(shapes)}; report one shape at a time")
        lengths = np.asarray(plans[0].lengths)
        model = plans[0].config.cost
    else:
        lengths = lengths_from_flag(args.lengths, args.column) if args.lengths else _corpus_lengths()
        model = cost_model(args)
        mean = float(lengths.mean())
        per_step = args.samples_per_step or max(args.dp, int(args.dp * args.cp * args.tokens_per_rank / mean))
        config = plan_config_from_args(args, samples_per_step=per_step, cost=model)
        desc = f"planning {len(lengths):,} samples x {len(wanted)} variants"
        with progress(args, desc, "steps") as bar:
            plans = plan_strategies(lengths, config, wanted, progress=bar)
    comms = comm_models(args, model)
    names = _unique_names(plans)
    with progress(args, "costing every rank of every step", "plans", len(plans)) as bar:
        results = []
        for plan, name in zip(plans, names):
            results.append(result_of_plan(plan, comms[0], name=name))
            bar.update(1)
    rows = []
    if peers:
        rows = peer_rows(lengths, config, comms[0], peers)
    doc = build_report(results, lengths=lengths, baseline=args.baseline, peers=rows)
    step = args.step
    if step is not None and not all(0 <= step < p.num_steps for p in plans):
        raise ValueError(f"--step {step} is outside some plan's steps")
    shown = default_rank_step(doc) if step is None else step
    table = format_table(doc, steps_shown=args.steps_shown)
    table += "\n\n" + format_ranks(doc, doc["baseline"], shown)
    best = min(doc["plans"], key=lambda p: p["summary"]["predicted_seconds_comm"])["name"]
    if best != doc["baseline"]:
        table += "\n\n" + format_ranks(doc, best, shown)
    _emit(doc, args, table, rank_step=shown)
    return 0


def _unique_names(plans) -> list[str]:
    names = [plan_label(p.config) for p in plans]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if names.count(n) == 1 else f"{n}#{seen[n]}")
    return out


def _corpus_lengths() -> np.ndarray:
    return stdlib_corpus().lengths


# ---------------------------------------------------------------------------------------- simulate
def run_simulate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    check_column_has_lengths(args, "drawn lengths (--dist)")
    drawn = drawn_lengths(args)
    check_outputs(args, inputs=[args.lengths])
    model = cost_model(args)
    comms = comm_models(args, model)
    gpus_list = args.gpus
    for gpus in gpus_list:
        if gpus % args.cp:
            raise ValueError(f"--gpus {gpus} is not a multiple of --cp {args.cp}")
    variants(args)  # validate options before any slow work
    peer_names(args)
    if args.lengths:
        lengths = lengths_from_flag(args.lengths, args.column)
    else:
        lengths = synthetic_lengths(
            drawn["samples"], drawn["dist"], seed=args.seed, median=drawn["median"], sigma=drawn["sigma"]
        )
    docs = []
    for gpus in gpus_list:
        out = Path(args.out) / f"dp{gpus // args.cp}xcp{args.cp}" if len(gpus_list) > 1 else Path(args.out)
        docs.append(_simulate_shape(args, lengths, gpus // args.cp, model, comms, out))
    if args.json == "-":
        json.dump(docs[0] if len(docs) == 1 else docs, sys.stdout, indent=1)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(docs[0] if len(docs) == 1 else docs, indent=1) + "\n")
    if args.json != "-":
        print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


def _simulate_shape(
    args: argparse.Namespace, lengths: np.ndarray, dp: int, model: Any, comms: list, out: Path
) -> dict[str, Any]:
    """Simulate one cluster shape (``dp`` x ``--cp``), write its report to ``out`` and print its tables."""
    batch_tokens = args.global_batch_tokens or dp * args.cp * args.tokens_per_rank
    per_step = args.samples_per_step or max(dp, int(batch_tokens / float(lengths.mean())))
    config = plan_config_from_args(args, dp=dp, samples_per_step=per_step, cost=model)
    doc = simulate(
        lengths,
        config,
        variants(args),
        comms,
        chunk_steps=args.chunk_steps,
        jobs=args.jobs or None,
        progress=not args.quiet and args.json != "-",
        baseline=args.baseline,
        peers=peer_names(args),
    )
    with progress(args, "drawing plots", "plots") as bar:
        paths = write_report(doc, out, plots=not args.no_plots, progress=bar)
    if args.json != "-":
        print(f"\n== {doc['title']} ==")
        print(format_table(doc))
        print()
        print(format_modes(doc))
        plan = doc["planning"]
        print(
            f"\nplanned {len(doc['plans'])} strategies in {plan['wall_seconds']:.1f} s wall "
            f"({plan['worker_cpu_seconds']:.1f} CPU s in {plan['jobs']} workers); wrote {out}/: "
            + ", ".join(p.name for p in paths.values())
        )
    return doc


def _add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ringpack calibrate``."""
    p.add_argument(
        "--out", default="ringpack-profile.json", help="profile JSON to write (default ringpack-profile.json)"
    )
    p.add_argument("--report", help="calibration report JSON (default: the profile's name with .report.json)")
    p.add_argument(
        "--model",
        help=f"a model preset ({', '.join(PRESETS)}; default llama3-8b), or with --scope step (where it is "
        "required) also a transformers config file or folder",
    )
    p.add_argument("--heads", type=POSITIVE, help="query heads (default: the preset's)")
    p.add_argument("--kv-heads", type=POSITIVE, help="key/value heads (default: the preset's)")
    p.add_argument("--head-dim", type=POSITIVE, help="head dim (default: the preset's)")
    p.add_argument("--layers", type=POSITIVE, help="layers the profile covers (default: the preset's)")
    p.add_argument(
        "--mode",
        choices=["linear", "attention"],
        help="linear: also time the linear layers' GEMMs per token (default); attention: attention-only profile",
    )
    p.add_argument(
        "--backend",
        default="auto",
        help="attention kernel backend timed: auto (what training picks), or one of ringpack.attention.BACKENDS",
    )
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cuda (default); cpu only for a dry run with --backend reference",
    )
    p.add_argument("--grid", choices=GRIDS, help="shape grid (default full; quick with --quick; tiny on cpu)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a third of the time)")
    p.add_argument(
        "--reps", type=POSITIVE, help="timed repetitions per shard, median taken (default 5; 2 with --scope step)"
    )
    p.add_argument("--warmup", type=COUNT, default=1, help="untimed runs per shard first (default 1)")
    p.add_argument("--seed", type=COUNT, default=0)
    p.add_argument(
        "--timer",
        choices=TIMERS,
        help="gpu: each shard's GPU execution, host launch time hidden (default); "
        "wall: from the first launch, host overhead included",
    )
    p.add_argument(
        "--refit",
        metavar="REPORT",
        help="no GPU: refit the models on the measurements of a stored calibration report "
        "and write a new profile and report",
    )
    p.add_argument("--quiet", action="store_true", help="only the summary")
    _add_step_calibrate_arguments(p)


#: ``ringpack calibrate`` flags of one scope only (argparse dests; a given one is refused in the other scope)
KERNEL_SCOPE_FLAGS = ("heads", "kv_heads", "head_dim", "layers", "mode", "grid", "quick", "timer", "refit")
STEP_SCOPE_FLAGS = ("grad_ckpt", "tokens_per_rank", "cp", "max_len", "fit_mixes", "held_out_mixes", "microbatches")


def _add_step_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``ringpack calibrate --scope step`` (defaults resolved in :func:`run_calibrate`)."""
    step = p.add_argument_group("the training step (--scope step)")
    step.add_argument(
        "--scope",
        choices=["kernels", "step"],
        default="kernels",
        help="kernels: attention kernels and GEMMs (default); step: the whole model's forward+loss+backward "
        "per rank shard, --model a preset or a transformers config file or folder",
    )
    step.add_argument("--grad-ckpt", action="store_true", help="time with activation checkpointing (as training runs)")
    step.add_argument(
        "--tokens-per-rank", type=TOKENS, help="token budget per CP rank (default 65536; 1024 with --device cpu)"
    )
    step.add_argument("--cp", type=CP_SIZE, help="CP size of the split shards timed (default 2)")
    step.add_argument("--max-len", type=COUNT, help="longest sample of the mixes (default the budget)")
    step.add_argument("--fit-mixes", type=POSITIVE, help="length mixes timed for the fit (default 3)")
    step.add_argument("--held-out-mixes", type=POSITIVE, help="length mixes held out (default 2)")
    step.add_argument("--microbatches", type=POSITIVE, help="micro-batches timed per plan (default 2)")


def _add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="demo-out", help="folder for the report, JSON and plots (default demo-out/)")
    p.add_argument("--tokenizer", help=f"for exact token counts: {TOKENIZERS}; {NO_SPECIAL_TOKENS}")
    p.add_argument("--dp", type=DP_SIZE, default=4, help="data-parallel ranks (default 4)")
    p.add_argument("--cp", type=CP_SIZE, default=4, help="context-parallel ranks per micro-batch (default 4)")
    p.add_argument("--tokens-per-rank", type=TOKENS, default=32768, help="token budget per CP rank (default 32768)")
    p.add_argument(
        "--samples-per-step",
        type=COUNT,
        default=0,
        help="global batch in samples (default: about one full micro-batch per DP rank)",
    )
    p.add_argument("--model", default="llama3-8b", help="cost-model preset (default llama3-8b)")
    p.add_argument("--tflops", type=RATE, default=400.0, help="achieved fwd+bwd TFLOP/s per GPU (default 400)")
    p.add_argument("--link", default="nvlink", help="CP link preset for the communication model (default nvlink)")
    p.add_argument("--seed", type=COUNT, default=0)
    p.add_argument("--quick", action="store_true", help="a 300-file subset of the corpus (for tests)")
    p.add_argument("--no-ring-check", action="store_true", help="skip the 2-process ring runtime check")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_calibrate(args: argparse.Namespace) -> int:
    if args.refit and not Path(args.refit).is_file():
        raise FileNotFoundError(f"--refit: no calibration report at {args.refit}")
    other_scope = STEP_SCOPE_FLAGS if args.scope == "kernels" else KERNEL_SCOPE_FLAGS
    given = ["--" + name.replace("_", "-") for name in other_scope if getattr(args, name) not in (None, False)]
    if given:
        other = "step" if args.scope == "kernels" else "kernels"
        which = "this flag applies" if len(given) == 1 else "these flags apply"
        raise ValueError(f"{', '.join(given)}: {which} only to --scope {other}")
    if args.scope == "step":
        if not args.model:
            raise ValueError("--scope step needs --model: a preset or a transformers config file or folder")
        return run_step(args)
    return calibration.run(args)


def run_demo(args: argparse.Namespace) -> int:
    check_output_folder(args.out)
    return demo.run(args)


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: the flag, what is wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # an argument holding a line break or separator stays on the line
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="ringpack",
        description="Cost-balanced packing and DP x CP sharding of variable-length samples, and its analysis.",
    )
    parser.add_argument("--version", action="version", version=f"ringpack {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_command(subparsers)
    _add_shard_command(subparsers)
    _add_report_command(subparsers)
    _add_simulate_command(subparsers)
    _add_calibrate_command(subparsers)
    _add_demo_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ringpack COMMAND ...``; the exit code (0 done, 1 bad input or a file error, 2 a usage error).

    Bad input (a ``ValueError``: :class:`~ringpack.errors.PlanError`, :class:`~ringpack.errors.DataError`,
    ...) and file-system errors (``OSError``: a missing file, a directory where a file is expected,
    no permission, a closed pipe) end in one line on stderr naming the file, flag, sample or key.
    Anything else is a bug and keeps its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        with command_line_hints(), _log_to_stderr(args.command):
            return int(args.handler(args) or 0)
    except BrokenPipeError:  # stdout closed early, e.g. piped to `head`
        _silence_stdout()
        return _fail(args.command, "output closed before it was all written (broken pipe)")
    except (ValueError, OSError) as exc:
        return _fail(args.command, exc)
    except KeyboardInterrupt:
        print(f"ringpack {args.command}: interrupted", file=sys.stderr)
        return 130


class _CommandFormatter(logging.Formatter):
    """``ringpack COMMAND: message``; warnings say so (``ringpack shard: warning: ...``)."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        kind = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"ringpack {self.command}: {kind}{record.getMessage()}"


@contextlib.contextmanager
def _log_to_stderr(command: str):
    """Show the ``ringpack`` loggers' notes, warnings and progress (INFO and up) on stderr while a command runs.

    The handler writes to the ``sys.stderr`` of this call and is removed afterwards, and the
    records stop at the ``ringpack`` logger, so a program that calls :func:`main` keeps its own
    logging as it was.
    """
    root = logging.getLogger("ringpack")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter(command))
    saved = root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


def _fail(command: str, problem: Any) -> int:
    """Print ``problem`` as one line on stderr; exit code 1."""
    text = " ".join(str(problem).split()) or type(problem).__name__
    print(f"ringpack {command}: error: {text}", file=sys.stderr)
    return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of a closed pipe raises nothing."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    # stdout may be an object without a descriptor (tests, notebooks): then there is nothing to redirect
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
