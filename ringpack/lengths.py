"""Sample lengths (token counts per sample), the planner's only input, from wherever samples live (docs/data.md).

Every reader returns a 1-D ``int64`` array with one entry per sample, in source order, and every
error is a :class:`~ringpack.errors.DataError` naming the file, column or sample:
:func:`read_lengths` reads ``.npy``, JSON / JSON lines, Parquet, Arrow IPC (``datasets`` caches)
files and saved ``datasets`` folders; :func:`lengths_from_dataset` a ``datasets.Dataset`` or
``IterableDataset`` (a token-id list column from its Arrow offsets without touching the values, an
integer length column, or a text column counted by a tokenizer of :mod:`ringpack.tokenizer` in a
batched ``map``); :func:`text_lengths` the token counts of a text column of a file, counted once
and then read from the length cache (:mod:`ringpack.length_cache`); :func:`lengths_from_array`
anything array-like. A column is picked the same way everywhere (:data:`DEFAULT_COLUMNS`,
:data:`DATASET_COLUMNS`, :data:`TOKEN_COLUMNS`), and :func:`check_lengths` holds every length to
``[1, MAX_SAMPLE_TOKENS]``; an error never quotes a text. ``datasets`` objects are
recognised by duck typing, so this module loads without ``datasets``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ringpack import length_cache
from ringpack._hints import on_command_line, option
from ringpack.cost import MAX_SAMPLE_TOKENS
from ringpack.errors import DataError
from ringpack.tokenizer import make_counter

__all__ = [
    "DATASET_COLUMNS",
    "DEFAULT_COLUMNS",
    "FORMATS",
    "TEXT_FORMATS",
    "TOKEN_COLUMNS",
    "DataError",
    "check_lengths",
    "is_dataset",
    "lengths_from_array",
    "lengths_from_arrow",
    "lengths_from_dataset",
    "lengths_from_file",
    "read_arrow_table",
    "read_lengths",
    "sample_lengths",
    "text_lengths",
]

DEFAULT_COLUMNS = ("length", "lengths", "num_tokens", "n_tokens", "input_ids", "tokens")
#: Columns of token ids: they must hold lists (an integer column of that name is refused).
TOKEN_COLUMNS = ("input_ids", "tokens")
#: A dataset's columns to take lengths from, in order: its token ids, else a length column.
DATASET_COLUMNS = TOKEN_COLUMNS + tuple(c for c in DEFAULT_COLUMNS if c not in TOKEN_COLUMNS)
#: The lengths sources a path may name (help texts and errors quote it).
FORMATS = "a saved `datasets` folder, .parquet, .arrow/.feather, .json/.jsonl or .npy"
#: The sources a text column's tokens are counted from (help texts and errors quote it).
TEXT_FORMATS = "a saved `datasets` folder, .parquet, .arrow/.feather, .json/.jsonl or .csv"
#: The text column counted when none is named (``ringpack shard``'s too).
DEFAULT_TEXT_COLUMN = "text"
#: Files in a folder written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``.
SAVED_DATASET_MARKERS = ("state.json", "dataset_info.json")
SAVED_DATASET_DICT_MARKER = "dataset_dict.json"


def _pick_column(names: list[str], column: str | None, path: Any) -> str:
    if column is not None:
        if column not in names:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
        return column
    if len(names) == 1:
        return names[0]
    for name in DEFAULT_COLUMNS:
        if name in names:
            return name
    raise DataError(
        f"{path}: cannot tell which column holds lengths (columns: {', '.join(names)}); name it with {option('column')}"
    )


def _column_lengths(array: Any, name: str, where: str) -> np.ndarray:
    """Lengths of column ``name``: integers as they are, lists from their offsets; a token-id column must hold lists."""
    return lengths_from_arrow(array, where, lists_only=name in TOKEN_COLUMNS)


def lengths_from_arrow(array: Any, where: str = "column", lists_only: bool = False) -> np.ndarray:
    """Lengths from an Arrow (chunked) array: integers as they are, lists from their offsets (nulls: 0).

    ``lists_only``: refuse an integer column (a token-id column must hold lists). Raises
    :class:`DataError` naming ``where`` for any other type.
    """
    import pyarrow as pa

    chunks = array.chunks if isinstance(array, pa.ChunkedArray) else [array]
    typ = array.type
    if pa.types.is_integer(typ) and not lists_only:
        if array.null_count:
            raise DataError(f"{where}: {array.null_count} null lengths")
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
    if lists_only:
        raise DataError(f"{where} holds {typ}, not a list of token ids")
    if _is_text_type(typ):
        raise DataError(f"{where} holds text, not lengths: count its tokens with {option('text_column')}")
    raise DataError(f"{where} has type {typ}: need integer lengths or a list column of token ids (tokenize text first)")


def _read_json(path: Path, column: str | None) -> np.ndarray:
    keys = (column,) if column else ("lengths", "length")
    data = _parse_json(path)
    if isinstance(data, list):
        if data and isinstance(data[0], dict):
            return _values_from_records(data, keys, path)
        _no_columns(path, column, "a JSON list of lengths")
        return _ints(data, f"{path}")
    if isinstance(data, dict):
        for key in keys:
            if key in data:
                return _ints(data[key], f"{path}, column {key!r}")
        raise DataError(f"{path}: no key {' or '.join(repr(k) for k in keys)} (keys: {', '.join(map(str, data))})")
    raise DataError(f"{path}: expected a list of lengths or an object with a {keys[0]!r} list")


def _parse_json(path: Path) -> Any:
    """A JSON document, or the list of records of a JSON-lines file; a :class:`DataError` names the file and line."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not UTF-8 text: {exc}") from exc
    if not text.strip():
        raise DataError(f"{path} is empty")
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise DataError(f"{path}: JSON nested too deeply") from exc
    except json.JSONDecodeError:
        pass
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError) as exc:
                raise DataError(f"{path} is neither JSON nor JSON lines: line {number}: {exc}") from exc
    return records


def _values_from_records(records: list, keys: tuple, path: Path) -> np.ndarray:
    for k, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {k} is {type(record).__name__}, not an object like record 0")
    for key in keys:
        if key in records[0]:
            missing = next((k for k, r in enumerate(records) if key not in r), None)
            if missing is not None:
                raise DataError(f"{path}: record {missing} lacks column {key!r}")
            return _ints([r[key] for r in records], f"{path}, column {key!r}")
    names = list(records[0]) if records else []
    texts = [name for name in names if isinstance(records[0][name], str)]
    hint = f"; count the tokens of a text column with {option('text_column', texts[0])}" if texts else ""
    raise DataError(
        f"{path}: records have no column {' or '.join(repr(k) for k in keys)} (columns: {', '.join(names)}){hint}"
    )


def _ints(values: Any, where: str) -> np.ndarray:
    """``values`` as a 1-D int64 array (integers, or whole finite floats); a :class:`DataError` names the sample."""
    return _as_int64(values, where, DataError)


def _as_int64(values: Any, what: str, error: type[ValueError]) -> np.ndarray:
    """``values`` as a 1-D int64 array; ``error`` names the first sample that is not an integer of int64's range.

    ``True``/``False`` in a list are refused even among integers (numpy would read them as 1 and 0).
    """
    if isinstance(values, (list, tuple)):
        flag = next((i for i, x in enumerate(values) if isinstance(x, (bool, np.bool_))), None)
        if flag is not None:
            raise error(f"{what}: sample {flag} has length {values[flag]!r}; lengths must be integers")
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged lists, mixed objects
        raise error(f"{what}: expected a flat list of integer lengths ({exc})") from exc
    if arr.ndim != 1:
        raise error(f"{what} must be 1-D, got shape {arr.shape}")
    if not arr.size:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(arr) | (arr != np.round(arr)) | (np.abs(arr) >= 2.0**63)
    elif arr.dtype.kind == "u":
        bad = arr > np.iinfo(np.int64).max
    elif arr.dtype.kind == "i":
        bad = np.zeros(arr.shape, dtype=bool)
    else:  # bools, strings, None, Python ints beyond int64 (object arrays)
        bad = np.array([isinstance(x, bool) or not _fits_int64(x) for x in arr.tolist()])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        value = arr[i].item() if isinstance(arr[i], np.generic) else arr[i]
        if isinstance(value, str):  # the text itself stays out of the message
            raise error(f"{what}: sample {i} holds text, not a length; count its tokens with {option('text_column')}")
        if not isinstance(value, (int, float, bool, type(None))):
            raise error(f"{what}: sample {i} holds a {type(value).__name__} value, not a length")
        raise error(f"{what}: sample {i} has length {value!r:.60}; lengths must be integers of int64's range")
    return arr.astype(np.int64)


def _fits_int64(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and -(2**63) <= int(value) < 2**63


def read_lengths(path: str | Path, column: str | None = None) -> np.ndarray:
    """Sample lengths from a file, not validated (:func:`lengths_from_file` checks each is >= 1).

    Args:
        path: a ``.npy``, ``.json``/``.jsonl``, ``.parquet``/``.pq`` or ``.arrow``/``.feather``/``.ipc``
            file (formats in the module docstring).
        column: the column (or JSON key) holding lengths or token-id lists; ``None`` picks a
            file's only column, else the first of :data:`DEFAULT_COLUMNS` there is. A file
            without columns (``.npy``, a JSON list of integers) refuses one.

    Returns:
        int64 array ``[N]``, one entry per sample in file order.

    Raises:
        FileNotFoundError: no file at ``path``.
        DataError: an unknown suffix, an unreadable file, a missing or ambiguous column, a
            column for a file without columns, or values that are not integer lengths (naming the
            file and column).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"lengths file {path} does not exist")
    if path.is_dir():
        return _read_saved_dataset(path, column)
    if not path.is_file():
        raise DataError(f"lengths file {path} is not a regular file")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        return _read_npy(path, column)
    if suffix in (".json", ".jsonl"):
        return _read_json(path, column)
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path, column)
    if suffix in (".arrow", ".feather", ".ipc"):
        table = read_arrow_table(path)
        name = _pick_column(table.column_names, column, path)
        return _column_lengths(table.column(name), name, f"{path}, column {name!r}")
    raise DataError(f"{path}: unknown lengths format {suffix!r} (use {FORMATS})")


def _read_saved_dataset(path: Path, column: str | None) -> np.ndarray:
    """Lengths of a folder written by ``Dataset.save_to_disk`` (:func:`lengths_from_dataset`)."""
    if (path / SAVED_DATASET_DICT_MARKER).is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise DataError(
            f"{path} holds the splits {splits} of a DatasetDict; give one split's folder, e.g. {path}/train"
        )
    return lengths_from_dataset(_load_saved_dataset(path, f"; give {FORMATS}"), column)


def _load_saved_dataset(path: Path, hint: str = "") -> Any:
    """The ``datasets.Dataset`` saved in folder ``path`` (``Dataset.save_to_disk``).

    Raises:
        DataError: a folder without a saved dataset (``hint`` ends the message), ``datasets`` not
            installed, a damaged folder, or a DatasetDict (one line each, naming the folder).
    """
    if not any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        raise DataError(f"{path} is a folder but not a saved `datasets` folder (no state.json){hint}")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path} is a saved `datasets` folder; reading it needs `pip install datasets`") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises many types for a damaged folder
        raise DataError(f"cannot load the saved dataset {path}: {type(exc).__name__}: {exc}") from exc
    if isinstance(ds, datasets.DatasetDict):  # a folder whose dataset_dict.json is missing
        raise DataError(f"{path} holds the splits {sorted(ds)} of a DatasetDict; give one split's folder")
    return ds


def _no_columns(path: Path, column: str | None, what: str) -> None:
    """Refuse a ``column`` for a file that has none (it would be ignored)."""
    if column is not None:
        raise DataError(
            f"{path} is {what}, which has no columns: {option('column', column)} does not apply (leave it out)"
        )


def _read_npy(path: Path, column: str | None) -> np.ndarray:
    _no_columns(path, column, "a .npy array of lengths")
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, EOFError, OSError) as exc:  # empty, truncated, not .npy, or pickled objects
        raise DataError(f"cannot read .npy file {path}: {exc or type(exc).__name__}") from exc
    return _ints(np.asarray(arr), f"{path}")


def _read_parquet(path: Path, column: str | None) -> np.ndarray:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        name = _pick_column(names, column, path)
        table = pq.read_table(path, columns=[name])
    except DataError:
        raise
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"cannot read Parquet file {path}: {exc}") from exc
    return _column_lengths(table.column(name), name, f"{path}, column {name!r}")


def read_arrow_table(path: Path) -> Any:
    """The ``pyarrow.Table`` of an Arrow IPC file (Feather v2) or stream (a ``datasets`` cache), memory-mapped.

    Raises:
        DataError: not an Arrow IPC file or stream (naming ``path``).
    """
    import pyarrow as pa

    try:
        source = pa.memory_map(str(path), "r")
        try:
            return pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_stream(source).read_all()
    except Exception as exc:  # pyarrow raises several types for unreadable files
        raise DataError(f"cannot read Arrow file {path}: {exc}") from exc


# ------------------------------------------------------------------------- validated sources


def check_lengths(values: Any, what: str = "lengths", error: type[ValueError] = DataError) -> np.ndarray:
    """``values`` as a 1-D int64 array of lengths, each an integer in ``[1, MAX_SAMPLE_TOKENS]``.

    Every sample length ringpack plans, reads or loads passes here, so one rule holds everywhere:
    at most :data:`~ringpack.cost.MAX_SAMPLE_TOKENS` tokens, where causal pair counts stay exact.

    Raises ``error`` (:class:`DataError` unless given; the planner passes ``PlanError``) naming the
    first bad sample: not 1-D, not integer (floats must be whole and finite), below 1 or above
    :data:`~ringpack.cost.MAX_SAMPLE_TOKENS`.
    """
    out = _as_int64(values, what, error)
    bad = np.flatnonzero(out < 1)
    if bad.size:
        i = int(bad[0])
        raise error(
            f"{what}: sample {i} has length {int(out[i])} ({bad.size} sample(s) below 1); "
            "every sample needs >= 1 token "
            "(filter empty rows first, e.g. dataset.filter(lambda r: len(r['input_ids']) > 0))"
        )
    long = np.flatnonzero(out > MAX_SAMPLE_TOKENS)
    if long.size:
        i = int(long[0])
        raise error(
            f"{what}: sample {i} has {int(out[i]):,} tokens ({long.size} sample(s) that long); a sample may have at "
            f"most {MAX_SAMPLE_TOKENS:,} (2**31), the longest whose causal pair count stays exact: cut such "
            "documents before planning"
        )
    return out


def lengths_from_array(values: Any) -> np.ndarray:
    """Lengths given directly (list, numpy or torch), validated."""
    if hasattr(values, "detach"):  # torch tensor, without importing torch
        values = values.detach().cpu().numpy()
    return check_lengths(values)


def lengths_from_file(path: str | os.PathLike, column: str | None = None) -> np.ndarray:
    """Lengths from a lengths file or a saved dataset folder (:func:`read_lengths`), validated."""
    return check_lengths(read_lengths(path, column=column), what=f"lengths of {path}")


def is_dataset(obj: Any) -> bool:
    """Whether ``obj`` is a ``datasets.Dataset`` or ``IterableDataset`` (told without importing ``datasets``)."""
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")


def _is_iterable_dataset(obj: Any) -> bool:
    return is_dataset(obj) and type(obj).__name__ == "IterableDataset"


def _arrow_table(ds: Any) -> Any:
    """The Arrow table behind a ``datasets.Dataset`` (without applying its indices mapping)."""
    data = ds.data
    return getattr(data, "table", data)


def _indices(ds: Any) -> np.ndarray | None:
    idx = getattr(ds, "_indices", None)
    if idx is None:
        return None
    table = getattr(idx, "table", idx)
    return table.column(0).to_numpy().astype(np.int64, copy=False)


class _CountMap:
    """Picklable ``map`` function for ``num_proc > 1`` (closures over tokenizers pickle poorly)."""

    def __init__(self, tokenizer: Any, out: str) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self._counter: Callable | None = None

    def __call__(self, texts: list[str]) -> dict[str, list[int]]:
        if self._counter is None:
            self._counter = make_counter(self.tokenizer)
        return {self.out: list(self._counter(texts))}

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer, "out": self.out, "_counter": None}


def lengths_from_dataset(
    ds: Any,
    column: str | None = None,
    *,
    length_column: str | None = None,
    text_column: str | None = None,
    tokenizer: Any = None,
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> np.ndarray:
    """Lengths of every row of a ``datasets.Dataset`` or ``IterableDataset``.

    Exactly one way is used, in this order: ``length_column`` (integers), ``text_column`` with
    ``tokenizer`` (batched ``map``, ``num_proc`` processes), else ``column``: a list column (token
    ids, read from its Arrow offsets) or an integer column (lengths). ``column=None`` takes the
    first of :data:`DATASET_COLUMNS` the dataset has (``input_ids``, ``tokens``, ``length``, ...).

    Returns:
        int64 array ``[N]``, every entry ``>= 1``, in row order (``select``/``shuffle`` honoured).

    Raises:
        DataError: a missing column (listing the columns there are), a token-id column
            (:data:`TOKEN_COLUMNS`) that does not hold lists, or a bad length.
    """
    names = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None
    if length_column is None and text_column is None:
        column = _dataset_column(names, column)

    if _is_iterable_dataset(ds):
        return _lengths_from_iterable(ds, column, length_column, text_column, tokenizer, batch_size)
    if length_column is not None:
        _need_column(names, length_column)
        values = _arrow_table(ds).column(length_column).to_numpy()
        return check_lengths(_in_row_order(ds, values), what=f"column {length_column!r}")
    if text_column is not None:
        _need_column(names, text_column)
        return _count_text_tokens(ds, text_column, tokenizer, num_proc, batch_size)
    lens = _column_lengths(_arrow_table(ds).column(column), column, f"column {column!r}")
    return check_lengths(_in_row_order(ds, lens), what=f"lengths of column {column!r}")


def _dataset_column(names: list[str] | None, column: str | None) -> str:
    """The column a dataset's lengths come from: ``column``, else the first of :data:`DATASET_COLUMNS` it has."""
    if names is None:  # a stream whose columns are unknown until read
        return column or "input_ids"
    if column is not None:
        _need_column(names, column)
        return column
    found = next((name for name in DATASET_COLUMNS if name in names), None)
    if found is not None:
        return found
    hint = ""
    if "text" in names:
        hint = (
            " (count the tokens of its text with --text-column text)"
            if on_command_line()
            else " (pass text_column= and a tokenizer to count tokens of a text column)"
        )
    raise DataError(
        f"dataset has no column 'input_ids' nor another of {', '.join(DATASET_COLUMNS[1:])}; "
        f"its columns are {names}{hint}"
    )


def _need_column(names: list[str] | None, column: str) -> None:
    if names is not None and column not in names:
        raise DataError(f"dataset has no column {column!r}; its columns are {names}")


def _in_row_order(ds: Any, values: np.ndarray) -> np.ndarray:
    """Per-row ``values`` of the Arrow table behind ``ds`` in the dataset's row order (its indices mapping)."""
    idx = _indices(ds)
    return values if idx is None else values[idx]


def _count_text_tokens(ds: Any, text_column: str, tokenizer: Any, num_proc: int | None, batch_size: int) -> np.ndarray:
    counted = ds.map(
        _CountMap(tokenizer, "__ringpack_len__"),
        input_columns=[text_column],
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        remove_columns=list(ds.column_names),
        desc="counting tokens",
        load_from_cache_file=False,
    )
    return check_lengths(
        _arrow_table(counted).column("__ringpack_len__").to_numpy(), what=f"token counts of {text_column!r}"
    )


def _lengths_from_iterable(
    ds: Any, column: str | None, length_column: str | None, text_column: str | None, tokenizer: Any, batch_size: int
) -> np.ndarray:
    import pyarrow as pa

    counter = make_counter(tokenizer) if text_column is not None else None
    col = length_column or text_column or column
    parts: list[np.ndarray] = []
    try:
        batches = ds.with_format("arrow").iter(batch_size=batch_size)
    except Exception:  # older datasets: python batches
        batches = ds.iter(batch_size=batch_size)
    for batch in batches:
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_pydict(batch)
        if col not in table.column_names:
            raise DataError(f"dataset has no column {col!r}; its columns are {table.column_names}")
        values = table.column(col)
        if length_column is not None:
            parts.append(lengths_from_arrow(values, f"column {col!r}"))
        elif counter is not None:
            parts.append(np.asarray(counter(values.to_pylist()), dtype=np.int64))
        else:
            parts.append(_column_lengths(values, col, f"column {col!r}"))
    return check_lengths(
        np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), what=f"lengths of column {col!r}"
    )


# ------------------------------------------------------------------------- text: token counts


def _is_text_type(typ: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(typ) or pa.types.is_large_string(typ) or str(typ) == "string_view"


#: Rows of a text column and its texts, a batch (list of strings and ``None``) at a time.
Texts = tuple[int, Iterable[list[Any]]]


def _arrow_texts(column: Any, where: str, batch_size: int) -> Texts:
    """The texts of an Arrow (chunked) text column; anything but text is refused by its type alone."""
    if not _is_text_type(column.type) and str(column.type) != "null":
        raise DataError(f"{where} holds {column.type}, not text")
    return len(column), (column.slice(start, batch_size).to_pylist() for start in range(0, len(column), batch_size))


def _dataset_texts(ds: Any, column: str, where: str, batch_size: int) -> Texts:
    """Batches of texts of a ``datasets.Dataset``'s column, in its row order."""
    if column not in ds.column_names:
        raise DataError(f"{where}: no column {column!r} (columns: {', '.join(ds.column_names)})")
    table = _arrow_table(ds).column(column)
    idx = _indices(ds)
    if idx is not None:
        table = table.take(idx)
    return _arrow_texts(table, f"{where}, column {column!r}", batch_size)


def _read_texts(path: Path, column: str, batch_size: int) -> Texts:
    """The texts of ``column`` of a file or saved dataset (:data:`TEXT_FORMATS`), in row order.

    The values read are never quoted in an error: only the file, the column and the row.
    """
    if path.is_dir():
        return _dataset_texts(_load_saved_dataset(path), column, str(path), batch_size)
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            parquet = pq.ParquetFile(path)
            schema = parquet.schema_arrow
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DataError(f"cannot read Parquet file {path}: {exc}") from exc
        _pick_column(schema.names, column, path)
        typ = schema.field(column).type
        if not _is_text_type(typ):
            raise DataError(f"{path}, column {column!r} holds {typ}, not text")
        batches = parquet.iter_batches(batch_size=batch_size, columns=[column])
        return parquet.metadata.num_rows, (b.column(0).to_pylist() for b in batches)
    if suffix in (".arrow", ".feather", ".ipc"):
        table = read_arrow_table(path)
        _pick_column(table.column_names, column, path)
        return _arrow_texts(table.column(column), f"{path}, column {column!r}", batch_size)
    if suffix in (".json", ".jsonl"):
        records = _parse_json(path)
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise DataError(f"{path}: want records (JSON objects, one per row) with a text column {column!r}")
        missing = next((k for k, r in enumerate(records) if column not in r), None)
        if missing is not None:
            names = ", ".join(map(str, records[missing]))
            raise DataError(f"{path}: record {missing} has no column {column!r} (its columns: {names})")
        texts = [r[column] for r in records]
        bad = next((k for k, t in enumerate(texts) if t is not None and not isinstance(t, str)), None)
        if bad is not None:
            kind = type(texts[bad]).__name__
            raise DataError(f"{path}, column {column!r}: record {bad} holds a {kind} value, not text")
        return len(texts), (texts[start : start + batch_size] for start in range(0, len(texts), batch_size))
    if suffix == ".csv":
        try:
            import datasets
        except ImportError:
            raise DataError(f"{path}: reading a CSV file needs `pip install datasets`") from None
        try:
            ds = datasets.load_dataset("csv", data_files=[str(path)], split="train")
        except Exception as exc:  # datasets wraps the parser's errors in its own types
            raise DataError(f"cannot read CSV file {path}: {type(exc).__name__}") from exc
        return _dataset_texts(ds, column, str(path), batch_size)
    raise DataError(f"{path}: cannot count tokens of a {suffix or 'suffix-less'} file (use {TEXT_FORMATS})")


def text_lengths(
    path: str | os.PathLike,
    text_column: str = DEFAULT_TEXT_COLUMN,
    tokenizer: Any = None,
    *,
    cache: bool | str | os.PathLike = True,
    batch_size: int = 1000,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[np.ndarray, bool]:
    """Token counts of every row of a text column of a file, from the length cache when it holds them.

    The counts are those ``ringpack shard`` writes for the same file, column and tokenizer: a
    missing text (null) counts as an empty one, and no special token is added.

    Args:
        path: a file or saved dataset folder (:data:`TEXT_FORMATS`).
        text_column: the column of texts.
        tokenizer: ``None`` / ``"regex"`` (the regex tokenizer), what
            :func:`ringpack.tokenizer.load_tokenizer` reads (a ``tokenizer.json`` file or folder, a
            ``save_pretrained`` folder, a Hub name), a tokenizer object, or a function from a list
            of texts to their counts.
        cache: ``True``: read and write the length cache (:mod:`ringpack.length_cache`) in its
            default folder; a path: in that folder; ``False``: count, and store nothing. A
            tokenizer that cannot be identified (a Hub name, a function) is never cached.
        batch_size: texts counted at a time.
        progress: called as ``progress(rows_done, rows)`` after each batch counted.

    Returns:
        ``(lengths, cached)``: int64 ``[N]``, every entry ``>= 1``, in row order; ``cached`` says
        they came from the cache (the tokenizer did not run).

    Raises:
        FileNotFoundError: no file at ``path``, or a tokenizer path that does not exist.
        DataError: an unreadable file, an unknown format, a missing column (naming the columns
            there are), a value that is not text (naming the row and its type, never its value),
            a row with no token, or a tokenizer that cannot be read.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"text file {path} does not exist")
    what = f"token counts of {path}, column {text_column!r}"
    key = length_cache.entry_key(path, text_column, tokenizer) if cache is not False else None
    root = None if isinstance(cache, bool) else cache
    stored = length_cache.load(key, root)
    if stored is not None:
        try:
            return check_lengths(stored, what=what), True
        except DataError:  # an entry that passed its checksum yet holds no lengths: counted again
            pass
    count = make_counter(tokenizer)  # a tokenizer that cannot be read is refused before the data is
    total, batches = _read_texts(path, text_column, batch_size)
    counts: list[np.ndarray] = []
    done = 0
    for texts in batches:
        counts.append(np.asarray(count([t or "" for t in texts]), dtype=np.int64))
        done += len(texts)
        if progress is not None:
            progress(done, total)
    lengths = check_lengths(np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64), what=what)
    length_cache.store(key, lengths, root)
    return lengths, False


def sample_lengths(
    source: Any,
    column: str | None = None,
    *,
    text_column: str | None = None,
    tokenizer: Any = None,
    cache: bool | str | os.PathLike = True,
    **kwargs: Any,
) -> np.ndarray:
    """Validated lengths from any supported source, dispatched on its type.

    Args:
        source: a ``datasets.Dataset``/``IterableDataset`` (:func:`lengths_from_dataset`), a file
            path (:func:`lengths_from_file`; with ``text_column`` or ``tokenizer``,
            :func:`text_lengths`), or an array-like of lengths (list, numpy, torch).
        column: the dataset or file column of lengths or token ids (``None``: the default for the
            source); not with a file's ``text_column``.
        text_column: count the tokens of this text column with ``tokenizer``. For a file,
            ``tokenizer`` alone counts the column ``"text"``.
        tokenizer: what :func:`text_lengths` takes (``None``: the regex tokenizer).
        cache: files only: the length cache of :func:`text_lengths` (``False``: off, a path: its
            folder); datasets and arrays are never cached.
        **kwargs: options of :func:`lengths_from_dataset` (``length_column``, ``num_proc``,
            ``batch_size``); datasets only, but ``batch_size`` for a file's texts too.

    Returns:
        int64 array ``[N]``, every entry ``>= 1``, one per sample in source order.

    Raises:
        DataError: a bad length (naming the sample), a missing column, ``column`` with a file's
            ``text_column``, or options given for a source they do not apply to.
        FileNotFoundError: a path that does not exist.
    """
    if is_dataset(source):
        return lengths_from_dataset(source, column, text_column=text_column, tokenizer=tokenizer, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        if text_column is None and tokenizer is None:
            if kwargs:
                raise DataError(f"options {sorted(kwargs)} apply to datasets, not files")
            return lengths_from_file(source, column=column)
        if set(kwargs) - {"batch_size"}:
            raise DataError(f"options {sorted(set(kwargs) - {'batch_size'})} apply to datasets, not files")
        text_column = DEFAULT_TEXT_COLUMN if text_column is None else text_column
        if column is not None:
            raise DataError(
                f"column={column!r} names a column of lengths or token ids; text_column={text_column!r} "
                "counts tokens of text instead: give one"
            )
        return text_lengths(source, text_column, tokenizer, cache=cache, **kwargs)[0]
    if kwargs or text_column is not None or tokenizer is not None:
        raise DataError("options of datasets and text files do not apply to arrays of lengths")
    return lengths_from_array(source)
