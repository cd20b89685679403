"""Read sample lengths (tokens per sample) from a file: Parquet, Arrow IPC/Feather, JSON or NumPy.

``read_lengths(path, column=None)`` returns a 1-D int64 array, one entry per row/sample:

* ``.npy`` -- a 1-D integer array (memory-mapped).
* ``.json`` / ``.jsonl`` -- a list of integers, an object with the column (default ``"lengths"``
  or ``"length"``) holding one, or JSON lines with that key per line.
* ``.parquet`` / ``.pq`` -- one column, read alone.
* ``.arrow`` / ``.feather`` / ``.ipc`` -- Arrow IPC file or stream (Hugging Face ``datasets`` cache
  files are streams), memory-mapped: no copy of the data.

The column: an integer column (e.g. ``length``) is read directly; a list column (e.g.
``input_ids``) gives the length of each list from the list *offsets*, without touching the values.
With ``column=None`` the only column is taken, else the first of ``length, lengths, num_tokens,
n_tokens, input_ids, tokens`` that exists. Every error names the file and the column.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["read_lengths", "lengths_from_arrow", "DEFAULT_COLUMNS"]

DEFAULT_COLUMNS = ("length", "lengths", "num_tokens", "n_tokens", "input_ids", "tokens")


def _pick_column(names: list[str], column: str | None, path: Any) -> str:
    if column is not None:
        if column not in names:
            raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
        return column
    if len(names) == 1:
        return names[0]
    for name in DEFAULT_COLUMNS:
        if name in names:
            return name
    raise ValueError(f"{path}: cannot tell which column holds lengths (columns: {', '.join(names)}); pass column=")


def lengths_from_arrow(array: Any, where: str = "column") -> np.ndarray:
    """Lengths from an Arrow (chunked) array: integers as they are, lists from their offsets."""
    import pyarrow as pa

    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    typ = array.type
    if pa.types.is_integer(typ):
        if array.null_count:
            raise ValueError(f"{where}: {array.null_count} null lengths")
        if not chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([c.to_numpy(zero_copy_only=False).astype(np.int64, copy=False) for c in chunks])
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        out = []
        for c in chunks:
            if pa.types.is_fixed_size_list(typ):
                lens = np.full(len(c), typ.list_size, dtype=np.int64)
            else:
                # offsets of a sliced array start at c.offset; only len(c) + 1 of them are ours
                offsets = np.frombuffer(c.buffers()[1], dtype=np.int64 if pa.types.is_large_list(typ) else np.int32)
                offsets = offsets[c.offset : c.offset + len(c) + 1].astype(np.int64)
                lens = np.diff(offsets)
            if c.null_count:
                valid = np.asarray(c.is_valid())
                lens = np.where(valid, lens, 0)
            out.append(lens)
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    raise ValueError(f"{where} has type {typ}: need integer lengths or a list column of token ids (tokenize text first)")


def _read_json(path: Path, column: str | None) -> np.ndarray:
    text = path.read_text()
    keys = (column,) if column else ("lengths", "length")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:  # JSON lines: one record per line
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is neither JSON nor JSON lines: {exc}") from exc
    if isinstance(data, list):
        if data and isinstance(data[0], dict):
            return _values_from_records(data, keys, path)
        return _ints(data, f"{path}")
    if isinstance(data, dict):
        for key in keys:
            if key in data:
                return _ints(data[key], f"{path}, column {key!r}")
        raise ValueError(f"{path}: no key {' or '.join(repr(k) for k in keys)} (keys: {', '.join(map(str, data))})")
    raise ValueError(f"{path}: expected a list of lengths or an object with a {keys[0]!r} list")


def _values_from_records(records: list, keys: tuple, path: Path) -> np.ndarray:
    for key in keys:
        if records and key in records[0]:
            try:
                return _ints([r[key] for r in records], f"{path}, column {key!r}")
            except KeyError as exc:
                raise ValueError(f"{path}: a record lacks column {key!r}") from exc
    raise ValueError(f"{path}: records have no column {' or '.join(repr(k) for k in keys)}")


def _ints(values: Any, where: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{where}: expected a flat list of lengths, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            return arr.astype(np.int64)
        raise ValueError(f"{where}: lengths must be integers, got {arr.dtype}")
    return arr.astype(np.int64)


def read_lengths(path: str | Path, column: str | None = None) -> np.ndarray:
    """Sample lengths from ``path`` (see the module docstring); int64, one per sample."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"lengths file {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return _ints(np.asarray(arr), f"{path}")
    if suffix in (".json", ".jsonl"):
        return _read_json(path, column)
    import pyarrow as pa

    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as exc:
            raise ValueError(f"cannot read Parquet file {path}: {exc}") from exc
        name = _pick_column(names, column, path)
        table = pq.read_table(path, columns=[name])
        return lengths_from_arrow(table.column(name), f"{path}, column {name!r}")
    if suffix in (".arrow", ".feather", ".ipc"):
        source = pa.memory_map(str(path), "r")
        try:
            try:
                table = pa.ipc.open_file(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid as exc:
            raise ValueError(f"cannot read Arrow file {path}: {exc}") from exc
        name = _pick_column(table.column_names, column, path)
        return lengths_from_arrow(table.column(name), f"{path}, column {name!r}")
    raise ValueError(f"{path}: unknown lengths format {suffix!r} (use .parquet, .arrow/.feather, .json or .npy)")
