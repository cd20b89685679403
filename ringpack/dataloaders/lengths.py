"""Sample lengths (token counts) from wherever samples live: the planner's only input.

Sources, all returning a 1-D ``int64`` numpy array with one entry per sample, in dataset order:

* a ``datasets.Dataset`` with a token-id column (``input_ids``): read from the Arrow list offsets,
  no Python loop and no copy of the tokens (1M rows in a few milliseconds), ``select``/``shuffle``
  index mappings honoured;
* a ``datasets.Dataset`` with a length column (``length_column=``);
* a ``datasets.Dataset`` with a text column and a tokenizer (``text_column=``, ``tokenizer=``):
  counted with a batched ``map`` over ``num_proc`` processes;
* a ``datasets.IterableDataset`` (streamed once, in Arrow batches);
* Parquet / Arrow / JSON / ``.npy`` files: delegated to :func:`ringpack.balancer.lengths.read_lengths`
  (one implementation for files, shared with ``ringpack plan``);
* anything array-like (list, numpy, torch).

``datasets`` is never imported here at module level; a ``datasets`` object is recognised by duck
typing, so this module (and the collator that imports it) loads on machines without ``datasets``.

Tokenizers (``tokenizer=``): ``None`` / ``"regex"`` for the dependency-free regex pre-tokenizer of
:mod:`ringpack.dataloaders.corpus`, a path to a Hugging Face ``tokenizer.json`` (or its folder), or
any callable mapping a list of texts to a list of token counts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["sample_lengths", "lengths_from_dataset", "lengths_from_array", "lengths_from_file", "check_lengths", "DataError"]


class DataError(ValueError):
    """Bad input data (missing column, empty sample, corrupt shard, mismatched manifest...)."""


def check_lengths(lengths: Any, what: str = "lengths") -> np.ndarray:
    """Validate and return lengths as a 1-D int64 array; an empty sample is an error naming it."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise DataError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.all(np.mod(arr, 1) == 0):
            raise DataError(f"{what} must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        i = int(bad[0])
        raise DataError(
            f"sample {i} has {int(arr[i])} tokens ({bad.size} sample(s) have < 1); every sample needs >= 1 token "
            "(filter empty rows first, e.g. dataset.filter(lambda r: len(r['input_ids']) > 0))"
        )
    return arr


def lengths_from_array(values: Any) -> np.ndarray:
    """Lengths given directly (list, numpy or torch), validated."""
    if hasattr(values, "detach"):  # torch tensor, without importing torch
        values = values.detach().cpu().numpy()
    return check_lengths(values)


def lengths_from_file(path: str | os.PathLike, column: str | None = None) -> np.ndarray:
    """Lengths from a Parquet / Arrow / JSON / ``.npy`` file (delegates to the balancer's reader)."""
    try:
        from ringpack.balancer.lengths import read_lengths
    except ImportError as exc:  # pragma: no cover - lands with the planner
        raise DataError("reading lengths from files needs ringpack.balancer.lengths (not installed in this build)") from exc
    return check_lengths(read_lengths(path, column=column), what=f"lengths of {path}")


def _is_hf_dataset(obj: Any) -> bool:
    return type(obj).__module__.startswith("datasets.") and hasattr(obj, "column_names")


def _is_iterable_dataset(obj: Any) -> bool:
    return _is_hf_dataset(obj) and type(obj).__name__ == "IterableDataset"


def _list_lengths(column: Any, name: str) -> np.ndarray:
    """Per-row list lengths of an Arrow (chunked) list column from its offsets; nulls count as 0."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        chunks = column.chunks
        typ = column.type
    else:
        chunks = [column]
        typ = column.type
    if not (pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)):
        raise DataError(f"column {name!r} holds {typ}, not a list of token ids")
    if not chunks:
        return np.zeros(0, dtype=np.int64)
    out = []
    for chunk in chunks:
        if pa.types.is_fixed_size_list(typ):
            lens = np.full(len(chunk), typ.list_size, dtype=np.int64)
        else:
            offsets = chunk.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
            lens = np.diff(offsets)
        if chunk.null_count:
            lens = np.where(pc.is_null(chunk).to_numpy(zero_copy_only=False), 0, lens)
        out.append(lens)
    return np.concatenate(out)


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


def _regex_counter(texts: Sequence[str]) -> list[int]:
    from ringpack.dataloaders.corpus import regex_token_count

    return [regex_token_count(t or "") for t in texts]


def make_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]]:
    """A batch token counter: ``None``/"regex", a tokenizer.json path, a tokenizer object, or a callable."""
    if tokenizer is None or tokenizer == "regex":
        return _regex_counter
    if isinstance(tokenizer, (str, os.PathLike)):
        from ringpack.dataloaders.corpus import load_tokenizer_counter

        return load_tokenizer_counter(Path(tokenizer))
    if hasattr(tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
        return lambda texts: [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    if callable(tokenizer) and hasattr(tokenizer, "pad_token_id"):  # a transformers tokenizer
        return lambda texts: [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    if callable(tokenizer):
        return tokenizer
    raise DataError(f"tokenizer must be None, 'regex', a tokenizer.json path or a callable, got {type(tokenizer).__name__}")


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
    ``tokenizer`` (batched ``map``, ``num_proc`` processes), else the token-id list column
    ``column`` (default ``"input_ids"``) via Arrow offsets. A column that is missing is an error
    listing the columns there are.
    """
    names = list(ds.column_names or []) if getattr(ds, "column_names", None) is not None else None

    def need(col: str) -> None:
        if names is not None and col not in names:
            raise DataError(f"dataset has no column {col!r}; its columns are {names}")

    if length_column is None and text_column is None:
        column = column or "input_ids"
        if names is not None and column not in names:
            hint = " (pass text_column= and a tokenizer to count tokens of a text column)" if "text" in names else ""
            raise DataError(f"dataset has no column {column!r}; its columns are {names}{hint}")

    if _is_iterable_dataset(ds):
        return _lengths_from_iterable(ds, column, length_column, text_column, tokenizer, batch_size)

    if length_column is not None:
        need(length_column)
        table = _arrow_table(ds)
        values = table.column(length_column).to_numpy()
        idx = _indices(ds)
        return check_lengths(values if idx is None else values[idx], what=f"column {length_column!r}")
    if text_column is not None:
        need(text_column)
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
        return check_lengths(_arrow_table(counted).column("__ringpack_len__").to_numpy(), what=f"token counts of {text_column!r}")
    table = _arrow_table(ds)
    lens = _list_lengths(table.column(column), column)
    idx = _indices(ds)
    return check_lengths(lens if idx is None else lens[idx], what=f"lengths of column {column!r}")


def _lengths_from_iterable(ds: Any, column: str | None, length_column: str | None, text_column: str | None, tokenizer: Any, batch_size: int) -> np.ndarray:
    import pyarrow as pa

    counter = make_counter(tokenizer) if text_column is not None else None
    col = length_column or text_column or column
    parts: list[np.ndarray] = []
    try:
        batches = ds.with_format("arrow").iter(batch_size=batch_size)
    except Exception:  # older datasets: python batches
        batches = ds.iter(batch_size=batch_size)
    for batch in batches:
        if isinstance(batch, pa.Table):
            if col not in batch.column_names:
                raise DataError(f"dataset has no column {col!r}; its columns are {batch.column_names}")
            values = batch.column(col)
            if length_column is not None:
                parts.append(values.to_numpy().astype(np.int64))
            elif counter is not None:
                parts.append(np.asarray(counter(values.to_pylist()), dtype=np.int64))
            else:
                parts.append(_list_lengths(values, col))
        else:
            if col not in batch:
                raise DataError(f"dataset has no column {col!r}; its columns are {sorted(batch)}")
            values = batch[col]
            if length_column is not None:
                parts.append(np.asarray(values, dtype=np.int64))
            elif counter is not None:
                parts.append(np.asarray(counter(values), dtype=np.int64))
            else:
                parts.append(np.fromiter((len(v) if v is not None else 0 for v in values), dtype=np.int64))
    return check_lengths(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64), what=f"lengths of column {col!r}")


def sample_lengths(source: Any, column: str | None = None, **kwargs: Any) -> np.ndarray:
    """Lengths from any supported source (see the module docstring); dispatches on its type."""
    if _is_hf_dataset(source):
        return lengths_from_dataset(source, column, **kwargs)
    if isinstance(source, (str, os.PathLike)):
        if kwargs:
            raise DataError(f"options {sorted(kwargs)} apply to datasets, not files")
        return lengths_from_file(source, column=column)
    if kwargs:
        raise DataError(f"options {sorted(kwargs)} apply to datasets, not arrays")
    return lengths_from_array(source)
