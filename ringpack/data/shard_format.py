"""The on-disk format of a balanced shard directory: file names, record names, the piece columns (docs/data.md).

Layout::

    manifest.json                       written last: plan hash, config, files, row counts, sha256s
    plan.parquet                        the plan (Plan.write_parquet), for the attention schedule
    dp00000-of-00002.parquet            one file per DP rank ...
    dp00000-of-00002-steps-000000-000009.parquet   ... or per DP rank and step range (steps_per_file)

Each shard file has one row per *piece* (:data:`PIECE_COLUMNS` and ``input_ids``, the piece's
tokens) and one row group per micro-batch, in plan order; ``next_token`` is the token after the
piece in its sample (``-100`` at a sample's end); ``row`` is the dataset row the piece came from.
:mod:`~ringpack.data.shard_writer` writes this format and :mod:`~ringpack.data.shard_reader` checks it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ringpack.errors import DataError

__all__ = [
    "IGNORE_INDEX",
    "MANIFEST",
    "PIECE_COLUMNS",
    "PLAN_FILE",
    "PROGRESS",
    "SHARD_FORMAT_VERSION",
    "SHARD_NAME",
    "TOKEN_ID_LIMIT",
    "plain_name",
]

MANIFEST = "manifest.json"
PROGRESS = "_progress.json"
PLAN_FILE = "plan.parquet"
SHARD_FORMAT_VERSION = 1
#: Token ids are stored as int32: every id must be an integer in ``[0, TOKEN_ID_LIMIT)``.
TOKEN_ID_LIMIT = 1 << 31
#: The label of a position with no next token (a piece that ends its sample): the loss skips it.
IGNORE_INDEX = -100
#: The integer columns of a shard file's rows, one row per piece (``input_ids`` follows them).
PIECE_COLUMNS = ("step", "microbatch", "cp", "slot", "sample", "row", "start", "stop", "next_token")
#: Names of the shard files the writer makes (DP rank, DP size, optional step range).
SHARD_NAME = re.compile(r"^dp\d{5,}-of-\d{5,}(-steps-\d{6,}-\d{6,})?\.parquet$")


def plain_name(name: Any, where: str) -> str:
    """``name`` if it is a plain file name (no folder, not ``.``/``..``, no NUL); else :class:`DataError`."""
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or any(c in name for c in "/\\\0")
        or Path(name).name != name
        or Path(name).is_absolute()
    ):
        raise DataError(f"{where}: {name!r:.80} is not a plain file name inside the shard directory")
    return name
