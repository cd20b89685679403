"""A local dataset source as blocks that can be read, tokenized and measured apart, in the dataset's row order.

A distributed engine (``ringpack shard --engine ray``, docs/data.md "Sharding on a cluster") reads a
source in parallel: :func:`list_blocks` cuts the files :func:`~ringpack.data.sources.source_files`
lists (the order ``load_source`` reads them in) into :class:`InputBlock` s, a run of Parquet row groups, a
byte range of whole JSON lines, a row range of an Arrow file, or a whole CSV or JSON-array file;
:func:`block_token_ids` gives the token ids of a block's rows, tokenized with the tokenizers of
:func:`~ringpack.data.sources.tokenize_dataset`. Row ``k`` of the dataset is row ``k - first`` of
the block holding it, where ``first`` counts the rows of the blocks before it, so the rows and their
ids are the ones ``load_source`` and ``tokenize_dataset`` give, whatever the block size.
"""

from __future__ import annotations

import io
import itertools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.data.shard_writer import checked_token_ids
from ringpack.data.sources import SourceFiles, encode_texts, refuse_too_long
from ringpack.errors import DataError
from ringpack.lengths import lengths_from_arrow, read_arrow_table
from ringpack.ranges import cumsum0

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "InputBlock",
    "TokenSpec",
    "BlockIds",
    "block_columns",
    "block_token_ids",
    "list_blocks",
    "read_block",
]

#: About how many bytes of input one block holds (Parquet: a run of whole row groups, one at least).
DEFAULT_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True)
class TokenSpec:
    """Where a block's token ids come from."""

    column: str = "input_ids"
    """The token-id column: read as it is when ``text_column`` is ``None``, else the name the ids get."""
    text_column: str | None = None
    """The text column to tokenize (``None``: the source has ``column``)."""
    tokenizer: Any = None
    """``None`` / ``"regex"`` or a tokenizer path or name (:func:`~ringpack.data.sources.tokenize_dataset`)."""
    vocab_size: int = 65536
    """The regex ids' range."""


@dataclass(frozen=True)
class InputBlock:
    """One block of a source: ``kind`` ``"parquet"`` (``part``: a range of row groups), ``"jsonl"`` (byte range),
    ``"arrow"`` (row range), ``"json-array"`` or ``"csv"`` (the whole file, ``part`` = ``(0, 0)``)."""

    index: int
    path: str
    kind: str
    part: tuple[int, int]

    def describe(self) -> str:
        """How messages name the block: ``data.jsonl (block 3: bytes 0-1048576)``."""
        unit = {"parquet": "row groups", "jsonl": "bytes", "arrow": "rows"}.get(self.kind)
        where = "" if unit is None else f": {unit} {self.part[0]}-{self.part[1]}"
        return f"{self.path} (block {self.index}{where})"


@dataclass(frozen=True)
class BlockIds:
    """The token ids of a block's rows: ``lengths`` (int64 ``[n]``), ``ids`` (int32, flat, row order), and
    ``bad`` = ``(row, value)`` of the first id that is not an integer in ``[0, 2**31)`` (``None``: all good)."""

    lengths: np.ndarray
    ids: np.ndarray
    bad: tuple[int, Any] | None


def list_blocks(source: SourceFiles, block_bytes: int = DEFAULT_BLOCK_BYTES) -> list[InputBlock]:
    """The blocks of ``source``'s files, in row order (each named by its file's absolute path).

    Raises:
        DataError: an empty or unreadable file (named), a saved dataset with an indices mapping.
    """
    blocks: list[InputBlock] = []
    for path in source.files:
        if os.path.getsize(path) == 0:
            raise DataError(f"dataset file {path} is empty")
        for kind, part in _file_parts(source, path, max(1, int(block_bytes))):
            blocks.append(InputBlock(len(blocks), os.path.abspath(path), kind, part))  # the same on every node
    return blocks


def _file_parts(source: SourceFiles, path: Path, block_bytes: int) -> list[tuple[str, tuple[int, int]]]:
    if source.kind == "parquet":
        return [("parquet", part) for part in _row_group_runs(_parquet(path).metadata, block_bytes)]
    if source.kind in ("arrow", "saved"):
        if source.kind == "saved" and json.loads((source.root / "state.json").read_text()).get("_indices_data_files"):
            raise DataError(f"{source.root} holds an indices mapping: save it again with save_to_disk (it flattens)")
        rows = read_arrow_table(path).num_rows
        step = max(1, block_bytes * rows // max(1, os.path.getsize(path)))
        return [("arrow", (lo, min(lo + step, rows))) for lo in range(0, rows, step)] or [("arrow", (0, 0))]
    if source.kind == "csv":
        return [("csv", (0, 0))]
    with open(path, "rb") as f:
        head = f.read(4096).lstrip()
        if head.startswith(b"["):
            return [("json-array", (0, 0))]
        return [("jsonl", part) for part in _line_ranges(f, os.path.getsize(path), block_bytes)]


def _row_group_runs(metadata: Any, block_bytes: int) -> list[tuple[int, int]]:
    """Runs ``[lo, hi)`` of consecutive row groups of about ``block_bytes`` (uncompressed) each, at
    least one group per run: small row groups are read together, so a task's work outweighs its cost."""
    runs, lo, size = [], 0, 0
    for g in range(metadata.num_row_groups):
        group_bytes = metadata.row_group(g).total_byte_size
        if g > lo and size + group_bytes > block_bytes:
            runs.append((lo, g))
            lo, size = g, 0
        size += group_bytes
    if metadata.num_row_groups:
        runs.append((lo, metadata.num_row_groups))
    return runs or [(0, 0)]


def _line_ranges(f: Any, size: int, block_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about ``block_bytes`` each, every one ending after a newline (or at the end of the file)."""
    cuts = [0]
    while cuts[-1] + block_bytes < size:
        f.seek(cuts[-1] + block_bytes)
        rest = f.readline()
        end = f.tell() if rest.endswith(b"\n") else size
        if end >= size:
            break
        cuts.append(end)
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


def _parquet(path: str | Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(str(path))
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"cannot read Parquet file {path}: {exc}") from None


def read_block(block: InputBlock, columns: list[str] | None = None) -> Any:
    """The rows of ``block`` as a ``pyarrow.Table`` (``columns`` only, when given and present).

    Raises:
        DataError: the file cannot be read or parsed (naming the block).
    """
    try:
        table = _read(block, columns)
    except DataError:
        raise
    except Exception as exc:  # pyarrow, pandas and json raise many types for malformed input
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise DataError(f"cannot read {block.describe()}: {type(exc).__name__}: {reason}") from None
    if columns:
        table = table.select([c for c in columns if c in table.column_names])
    return table


def _read(block: InputBlock, columns: list[str] | None) -> Any:
    import pyarrow as pa

    if block.kind == "parquet":
        present = _parquet(block.path).schema_arrow.names
        wanted = [c for c in columns if c in present] if columns else None
        return _parquet(block.path).read_row_groups(list(range(*block.part)), columns=wanted)
    if block.kind == "arrow":
        lo, hi = block.part
        return read_arrow_table(Path(block.path)).slice(lo, hi - lo)
    if block.kind == "csv":
        import pandas as pd

        return pa.Table.from_pandas(pd.read_csv(block.path), preserve_index=False)
    if block.kind == "json-array":
        with open(block.path, "rb") as f:
            return pa.Table.from_pylist(json.load(f))
    import pyarrow.json as paj

    lo, hi = block.part
    with open(block.path, "rb") as f:
        f.seek(lo)
        data = f.read(hi - lo)
    if not data.strip():
        return pa.table({})
    options = paj.ReadOptions(block_size=max(len(data), 1 << 20), use_threads=False)
    return paj.read_json(io.BytesIO(data), read_options=options)


def block_columns(block: InputBlock) -> list[str]:
    """The columns of ``block``'s rows (the source's, read from its first block)."""
    if block.kind == "parquet":
        return list(_parquet(block.path).schema_arrow.names)
    return list(read_block(block).column_names)


#: Texts encoded at a time: their ids are Python lists until they are packed into arrays.
_TEXTS_AT_ONCE = 1024


def _tokenized(texts: Any, spec: TokenSpec, max_tokens: int | None) -> Any:
    """The token ids of a column of texts as an Arrow list array, encoded :data:`_TEXTS_AT_ONCE` at a time
    (:class:`SampleTooLong` for the first text over ``max_tokens``, as soon as its run is encoded)."""
    import pyarrow as pa

    lengths, values = [], []
    for start in range(0, len(texts), _TEXTS_AT_ONCE):
        ids = encode_texts(texts.slice(start, _TEXTS_AT_ONCE).to_pylist(), spec.tokenizer, spec.vocab_size)
        lengths.append(np.fromiter(map(len, ids), dtype=np.int64, count=len(ids)))
        refuse_too_long(lengths[-1], max_tokens, first=start)
        values.append(np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths[-1].sum())))
    offsets = cumsum0(np.concatenate(lengths) if lengths else np.zeros(0, np.int64))
    flat = np.concatenate(values) if values else np.zeros(0, np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))


def block_token_ids(block: InputBlock, spec: TokenSpec, max_tokens: int | None = None) -> BlockIds:
    """The token ids of every row of ``block``: its ``spec.column`` as it is, or ``spec.text_column`` tokenized.

    Args:
        block: the block.
        spec: the token-id column, or the text column and tokenizer.
        max_tokens: refuse a row of more ids than this as soon as it is measured (``None``: no limit).

    Raises:
        SampleTooLong: the first row over ``max_tokens`` (its row in the block, and its length).
        DataError: the block cannot be read, lacks the column, or its column holds no lists of ids
            (naming the block).
    """
    import pyarrow as pa

    name = spec.text_column or spec.column
    table = read_block(block, [name])
    if name not in table.column_names:
        if table.num_rows == 0:
            return BlockIds(np.zeros(0, np.int64), np.zeros(0, np.int32), None)
        raise DataError(f"{block.describe()} has no column {name!r} (columns: {table.column_names})")
    col = table.column(name)
    if spec.text_column is not None:
        col = _tokenized(col, spec, max_tokens)
    col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_null(col.type):
        col = pa.array([None] * len(col), type=pa.list_(pa.int64()))
    where = f"{block.describe()}, column {spec.column!r}"
    lengths = lengths_from_arrow(col, where, lists_only=True)
    refuse_too_long(lengths, max_tokens)
    values = col.flatten()
    if pa.types.is_null(values.type):
        values = values.cast(pa.int64())
    try:
        ids, bad = checked_token_ids(values, lengths, spec.column)
    except DataError as exc:
        raise DataError(f"{block.describe()}: {exc}") from None
    return BlockIds(lengths, ids.astype(np.int32) if bad is None else np.zeros(0, np.int32), bad)
