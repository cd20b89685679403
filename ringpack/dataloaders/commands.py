"""``ringpack shard``: preprocess a dataset into balanced Parquet shards."""

from __future__ import annotations

import argparse

from ringpack._commands import not_done


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("shard", help="write a dataset as balanced Parquet shards plus a manifest")
    p.set_defaults(handler=not_done("issue 5, the dataloaders"))
