"""``ringpack shard``: preprocess a dataset into balanced Parquet shards."""

from __future__ import annotations

import argparse
import json
import sys

from ringpack._commands import add_plan_arguments, plan_config_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shard",
        help="write a dataset as balanced Parquet shards plus a manifest",
        description=(
            "Plan DATASET for a DP x CP mesh and write one Parquet file per DP rank (or per DP rank and step range), "
            "one row group per micro-batch, plus manifest.json (plan hash, config, row counts, sha256s) and plan.parquet. "
            "Re-running with the same inputs resumes an interrupted run and gives byte-identical files. "
            "Read back with ringpack.dataloaders.ShardReader."
        ),
    )
    p.add_argument("dataset", metavar="DATASET", help="local Parquet / JSON lines / Arrow / CSV file or folder, a saved `datasets` directory, or a Hub name")
    p.add_argument("--out", required=True, help="output directory")
    add_plan_arguments(p)
    p.add_argument("--split", default="train", help="split of a saved DatasetDict or a Hub dataset (default: train)")
    p.add_argument("--column", default="input_ids", help="token-id column (default: input_ids)")
    p.add_argument("--text-column", default=None, help="tokenize this text column when the dataset has no token-id column")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer.json (or its folder); default: the regex tokenizer with hashed ids")
    p.add_argument("--vocab-size", type=int, default=65536, help="id range of the regex tokenizer's hashed ids (default: 65536)")
    p.add_argument("--num-proc", type=int, default=None, help="processes for tokenizing")
    p.add_argument("--steps-per-file", type=int, default=0, help="split each DP rank's file every N steps (0: one file per DP rank)")
    p.add_argument("--cache-dir", default=None, help="datasets cache directory")
    p.add_argument("--overwrite", action="store_true", help="replace shards of another plan or dataset in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ringpack.dataloaders.shards import load_source, tokenize_dataset, write_shards

    if args.steps_per_file < 0:
        raise ValueError("--steps-per-file must be >= 0")
    config = plan_config_from_args(args)
    ds = load_source(args.dataset, split=args.split, cache_dir=args.cache_dir)
    tokenized = None
    if args.column not in ds.column_names:
        text = args.text_column or ("text" if "text" in ds.column_names else None)
        if text is None:
            raise ValueError(f"{args.dataset} has no column {args.column!r} and no text column to tokenize (columns: {list(ds.column_names)}); pass --text-column")
        ds = tokenize_dataset(ds, text, args.tokenizer, column=args.column, vocab_size=args.vocab_size, num_proc=args.num_proc)
        tokenized = {"text_column": text, "tokenizer": Path(args.tokenizer).name if args.tokenizer else f"regex-blake2b-mod-{args.vocab_size}"}
    elif args.text_column or args.tokenizer:
        print(f"ringpack shard: note: using the existing {args.column!r} column; --text-column/--tokenizer ignored", file=sys.stderr)
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
        progress=False if args.no_progress else None,
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
    print(json.dumps(summary))
    return 0
