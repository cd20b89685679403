"""``ringpack shard``: a dataset as balanced Parquet shards plus a manifest (docs/data.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from ringpack import length_cache
from ringpack._hints import option
from ringpack.cli.config_file import add_config_file_flag
from ringpack.cli.flags import (
    COUNT,
    PROCESSES,
    REQUIRED,
    add_plan_flags,
    add_quiet_flag,
    flag,
    new_command,
)
from ringpack.cli.input_kinds import check_flags_apply
from ringpack.cli.inputs import plan_config_from_args, samples_per_step
from ringpack.cli.lengths_input import DEFAULT_VOCAB, add_text_flags, check_text_flags
from ringpack.data import ray_shards
from ringpack.data.input_blocks import TokenSpec, block_columns, list_blocks
from ringpack.data.shard_writer import DEFAULT_WRITE_THREADS, check_out_dir, write_shards
from ringpack.data.sources import SOURCES, SampleTooLong, load_source, source_files, tokenize_dataset
from ringpack.errors import DataError, PlanError
from ringpack.lengths import DEFAULT_TEXT_COLUMN, lengths_from_dataset
from ringpack.plan_config import PlanConfig
from ringpack.progress import Progress
from ringpack.tokenizer import load_tokenizer

logger = logging.getLogger("ringpack.cli")
#: ``--num-proc`` by default: a process per core (at most :data:`MAX_AUTO_PROCESSES`) for a text
#: dataset of this many rows or more, where forking pays (1,096 documents of 1.7M tokens with a BPE
#: ``tokenizer.json``: 9.4 s in one process, 5.9 s in two, on 2 cores); fewer rows tokenize in this one.
AUTO_PROCESS_ROWS = 1000
MAX_AUTO_PROCESSES = 8


def add_command(subparsers: Any) -> None:
    p = new_command(
        subparsers,
        "shard",
        help="write a dataset as balanced Parquet shards plus a manifest",
        description=(
            "Plan DATASET for a DP x CP mesh and write one Parquet file per DP rank (or per DP rank and step range), "
            "one row group per micro-batch, plus manifest.json (plan hash, config, row counts, sha256s) "
            "and plan.parquet. "
            "Re-running with the same inputs resumes an interrupted run and gives byte-identical files. "
            "Read back with ringpack.data.ShardReader."
        ),
        examples=[
            "ringpack shard data.jsonl --out shards/ --dp 2 --cp 2 --tokens-per-rank 4096 --samples-per-step 64",
        ],
    )
    sources = SOURCES + " (a .npy file holds lengths, not tokens: plan it with `ringpack plan --lengths`)"
    flag(p, "dataset", nargs="?", default=REQUIRED, metavar="DATASET", help=sources)
    flag(p, "--out", default=REQUIRED, help="output directory")
    add_plan_flags(p)
    flag(p, "--split", help="split of a saved DatasetDict or a Hub dataset (default: train; files have none)")
    flag(p, "--column", default="input_ids", help="token-id column")
    tokenizing = "; only when the dataset has no token-id column"
    add_text_flags(p)
    flag(
        p,
        "--num-proc",
        type=PROCESSES,
        help=f"processes for tokenizing (--engine local; default: one per core, up to {MAX_AUTO_PROCESSES}, from "
        f"{AUTO_PROCESS_ROWS:,} rows on, else 1; 1 shows this command's own progress)" + tokenizing,
    )
    flag(
        p,
        "--steps-per-file",
        type=COUNT,
        default=0,
        help="split each DP rank's file every N steps (0: one file per DP rank)",
    )
    flag(
        p,
        "--write-threads",
        type=COUNT,
        default=0,
        help="shard files written at once (--engine local; 0: one per core, up to "
        f"{DEFAULT_WRITE_THREADS}; the files are the same whatever the number)",
    )
    flag(p, "--cache-dir", help="datasets cache directory (--engine local)")
    flag(
        p,
        "--engine",
        default="local",
        choices=ENGINES,
        help="local: this process (and --num-proc); ray: a Ray cluster, the same files (pip install 'ringpack[ray]')",
    )
    flag(p, "--ray-address", help="the Ray cluster of --engine ray (default: RAY_ADDRESS, else a local one)")
    flag(
        p, "--overwrite", default=False, action="store_true", help="replace shards of another plan or dataset in --out"
    )
    flag(p, "--json", default=False, action="store_true", help="print the summary as one JSON object")
    add_quiet_flag(p)
    add_config_file_flag(p)
    p.set_defaults(handler=run_shard, command_parser=p)


#: The engines of ``--engine`` (docs/data.md, "Sharding on a cluster").
ENGINES = ("local", "ray")
#: The flags only one engine uses.
_ENGINE_FLAGS = {"num_proc": "local", "cache_dir": "local", "write_threads": "local", "ray_address": "ray"}


def run_shard(args: argparse.Namespace) -> int:
    check_out_dir(args.out, [args.dataset])
    config = plan_config_from_args(args)  # the flags checked before the dataset is loaded
    _check_engine_flags(args)
    if args.engine == "ray":
        return _run_on_ray(args, config)
    with _datasets_progress(not args.quiet):
        loaded = load_source(args.dataset, split=args.split, cache_dir=args.cache_dir)
        if len(loaded) == 0:
            raise ValueError(f"dataset {args.dataset} holds no rows")
        ds, tokenized = _token_dataset(args, loaded, config)
    lengths = _measured_lengths(args, config, lengths_from_dataset(ds, args.column), tokenized)
    config = _config_for(args, config, lengths)
    manifest = write_shards(
        ds,
        args.out,
        config,
        column=args.column,
        steps_per_file=args.steps_per_file,
        progress=not args.quiet,
        overwrite=args.overwrite,
        source=_source_record(args, tokenized),
        write_threads=args.write_threads,
    )
    return _summarize(args, manifest)


def _run_on_ray(args: argparse.Namespace, config: PlanConfig) -> int:
    """``--engine ray``: the same steps on a Ray cluster (:mod:`ringpack.data.ray_shards`)."""
    options = ray_shards.RayOptions(address=args.ray_address)
    ray_shards.import_ray()  # before any work: says how to install it
    files = source_files(args.dataset, args.split)
    if files is None:
        raise DataError(f"{args.dataset}: --engine ray reads local files and saved datasets only, not Hub names")
    first = list_blocks(files._replace(files=files.files[:1]), options.block_bytes)[:1]  # its columns
    text = _text_column(args, block_columns(first[0]) if first else [])
    tokenized = None if text is None else _tokenized_from(args, text)
    spec = TokenSpec(column=args.column, text_column=text, tokenizer=args.tokenizer, vocab_size=_vocab_size(args))
    if text is not None and args.tokenizer:
        load_tokenizer(args.tokenizer)  # a bad one is refused before the cluster starts
    with ray_shards.ray_cluster(args.ray_address):
        try:
            measured = ray_shards.measure(
                args.dataset,
                spec,
                out_dir=args.out,
                split=args.split,
                max_tokens=config.sample_token_limit,
                options=options,
                progress=not args.quiet,
            )
        except SampleTooLong as exc:  # refused as soon as its block was measured
            raise _too_long(args, config, exc.row, exc.length, exc.where) from None
        with measured:  # the spilled ids are removed however this ends
            lengths = _measured_lengths(args, config, measured.lengths, tokenized)
            manifest = ray_shards.write_measured(
                measured,
                args.out,
                _config_for(args, config, lengths),
                steps_per_file=args.steps_per_file,
                overwrite=args.overwrite,
                source=_source_record(args, tokenized),
                options=options,
                progress=not args.quiet,
            )
    return _summarize(args, manifest)


def _check_engine_flags(args: argparse.Namespace) -> None:
    """Refuse a flag the chosen ``--engine`` does not use (``ValueError`` naming it)."""
    given = set(getattr(args, "given", ()))
    for name, engine in _ENGINE_FLAGS.items():
        if name in given and args.engine != engine:
            flag_name = "--" + name.replace("_", "-")
            raise ValueError(f"{flag_name} applies to --engine {engine} only, not --engine {args.engine}; leave it out")


def _measured_lengths(
    args: argparse.Namespace, config: PlanConfig, lengths: Any, tokenized: dict[str, str] | None
) -> Any:
    """``lengths``, kept in the length cache when they are a text's counts, after the over-long check."""
    if tokenized is not None and not args.no_length_cache:
        _store_counts(args, lengths, tokenized["text_column"])
    too_long = (lengths > config.group_capacity).nonzero()[0]
    if config.overflow == "error" and too_long.size:  # a token-id column, or ids from the cache: before planning
        raise _too_long(args, config, int(too_long[0]), int(lengths[too_long[0]]))
    return lengths


def _config_for(args: argparse.Namespace, config: PlanConfig, lengths: Any) -> PlanConfig:
    """``config``, its samples per step from ``--global-batch-tokens`` and the lengths when given."""
    if args.global_batch_tokens:
        return plan_config_from_args(args, samples_per_step=samples_per_step(args, lengths))
    return config


def _source_record(args: argparse.Namespace, tokenized: dict[str, str] | None) -> dict[str, Any]:
    """The manifest's ``source`` (the same whichever engine wrote the shards)."""
    return {"dataset": str(args.dataset), "split": args.split, "column": args.column, "tokenized_from": tokenized}


def _summarize(args: argparse.Namespace, manifest: dict[str, Any]) -> int:
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


def _too_long(args: argparse.Namespace, config: PlanConfig, row: int, length: int, where: str = "") -> PlanError:
    """The refusal of sample ``row`` of the dataset, ``length`` tokens, more than one CP group holds
    (``where``: its file and row there, when known)."""
    capacity = config.group_capacity
    return PlanError(
        f"sample {row} of {args.dataset} has {length} tokens, more than one CP group holds "
        f"(cp={config.cp} x tokens_per_rank={config.tokens_per_rank} = {capacity}). "
        f"Raise {option('tokens_per_rank')} or {option('cp')}, or use "
        f"{option('overflow', 'drop')} or {option('overflow', 'split')}" + (f" [{where}]" if where else "")
    )


def tokenizing_processes(num_proc: int | None, rows: int) -> int:
    """``--num-proc``, or its default for a text dataset of ``rows`` rows (:data:`AUTO_PROCESS_ROWS`)."""
    if num_proc is not None:
        return num_proc
    if rows < AUTO_PROCESS_ROWS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_AUTO_PROCESSES))


def _token_dataset(args: argparse.Namespace, ds: Any, config: PlanConfig) -> tuple[Any, dict[str, str] | None]:
    """``ds`` with its token-id column (tokenized from a text column when it has none) and how it was made.

    A dataset that has the column is used as it is. Tokenizing counts rows (a bar on a terminal,
    a ``ringpack.progress`` line every 10 s otherwise, nothing with ``--quiet``) and, under
    ``--overflow error``, stops at the first sample longer than ``config`` lets a CP group hold.

    Raises:
        ValueError: a tokenizing flag given for a dataset that has the column (every one named),
            ``--vocab-size`` with ``--tokenizer``, or no column to take ids from.
        PlanError: a sample too long for ``config`` under ``--overflow error`` (named, with its file).
    """
    text = _text_column(args, list(ds.column_names))
    if text is None:
        return ds, None
    if not args.quiet:
        logger.info("tokenizing column %r of %s rows", text, f"{len(ds):,}")
    processes = tokenizing_processes(args.num_proc, len(ds))
    in_process = processes <= 1
    # in this process the count is ours, so the datasets bar (which would be a second one) is off;
    # in worker processes datasets' own bar counts (with its estimate), and --quiet turns it off
    own_count = _datasets_progress(False) if in_process or args.quiet else contextlib.ExitStack()
    with own_count, Progress("tokenizing", "samples", len(ds), enabled=not args.quiet and in_process) as bar:
        try:
            ds = tokenize_dataset(
                ds,
                text,
                args.tokenizer,
                column=args.column,
                vocab_size=_vocab_size(args),
                num_proc=processes if processes > 1 else None,
                on_encoded=lambda ids: bar.update(len(ids)),
                max_tokens=config.sample_token_limit,
            )
        except SampleTooLong as exc:  # refused as soon as it was encoded, in whichever process
            raise _too_long(args, config, exc.row, exc.length) from None
    return ds, _tokenized_from(args, text)


def _text_column(args: argparse.Namespace, columns: list[str]) -> str | None:
    """The text column to tokenize (``None``: the dataset has its token-id column), the flags checked against it.

    Raises:
        ValueError: a tokenizing flag given for a dataset that has the column (every one named),
            ``--vocab-size`` with ``--tokenizer``, or no column to take ids from.
    """
    if args.column in columns:
        check_flags_apply(args, "shard", "ids")
        return None
    check_text_flags(args)
    text = args.text_column or (DEFAULT_TEXT_COLUMN if DEFAULT_TEXT_COLUMN in columns else None)
    if text is None:
        raise ValueError(
            f"{args.dataset} has no column {args.column!r} and no text column to tokenize "
            f"(columns: {list(columns)}); pass --text-column"
        )
    if text not in columns:
        raise DataError(f"{args.dataset} has no column {text!r} to tokenize (columns: {list(columns)})")
    return text


def _vocab_size(args: argparse.Namespace) -> int:
    return DEFAULT_VOCAB if args.vocab_size is None else args.vocab_size


def _tokenized_from(args: argparse.Namespace, text: str) -> dict[str, str]:
    """How the ids were made, as the manifest's ``source.tokenized_from`` records it."""
    tokenizer = Path(args.tokenizer).name if args.tokenizer else f"regex-blake2b-mod-{_vocab_size(args)}"
    return {"text_column": text, "tokenizer": tokenizer}


def _store_counts(args: argparse.Namespace, lengths: Any, text: str) -> None:
    """The token counts of a file or saved dataset just tokenized, into the length cache, where
    ``plan``, ``report`` and ``simulate --lengths DATASET --text-column`` find them.

    A folder of files or a split is no source those commands read, so nothing is stored for one.
    """
    source = Path(args.dataset)
    if args.split is not None or not (source.is_file() or (source / "state.json").is_file()):
        return
    length_cache.store(length_cache.entry_key(source, text, args.tokenizer), lengths)
