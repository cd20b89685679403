"""Datasets to shard: a local file, folder or saved dataset, or a Hub name, and their tokenizing (docs/data.md).

:func:`load_source` opens what ``ringpack shard DATASET`` names as a ``datasets.Dataset`` (a saved
``datasets`` folder, Parquet, Arrow/Feather, JSON/JSON lines or CSV files, a folder of one kind of
them, or a Hub dataset name); :func:`tokenize_dataset` adds a token-id column from a text column with
the tokenizers of :mod:`ringpack.tokenizer`. What ``datasets`` raises for a source it cannot load
becomes one :class:`DataError` naming the source, and an option that does not apply to a source is
refused, never ignored.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ringpack._hints import on_command_line, option
from ringpack.data.shard_format import plain_name
from ringpack.errors import DataError
from ringpack.lengths import read_arrow_table
from ringpack.tokenizer import load_tokenizer, regex_token_ids, token_encoder

__all__ = [
    "SOURCES",
    "SampleTooLong",
    "refuse_too_long",
    "SourceFiles",
    "encode_texts",
    "load_source",
    "source_files",
    "tokenize_dataset",
]


class SampleTooLong(DataError):
    """Row ``row`` of the dataset encoded to ``length`` token ids, more than ``tokenize_dataset``'s
    ``max_tokens``: raised as soon as it is encoded, in whichever process encodes it. ``where``: the
    row's file and row there, when a reader knows them (``"row 1 of data/b.jsonl"``), else ``""``."""

    def __init__(self, row: int, length: int, where: str = "") -> None:
        super().__init__(row, length, where)
        self.row, self.length, self.where = int(row), int(length), where

    def __str__(self) -> str:
        return f"row {self.row} has {self.length} tokens" + (f" [{self.where}]" if self.where else "")


def refuse_too_long(
    lengths: Iterable[int] | np.ndarray, max_tokens: int | None, rows: Sequence[int] | None = None, first: int = 0
) -> None:
    """Raise :class:`SampleTooLong` for the first of ``lengths`` over ``max_tokens`` (``None``: no limit),
    named as its row ``rows[k]``, or ``first + k`` without ``rows``."""
    if max_tokens is None:
        return
    lengths = lengths if isinstance(lengths, np.ndarray) else np.fromiter(lengths, dtype=np.int64)
    over = np.flatnonzero(lengths > max_tokens)
    if over.size:
        k = int(over[0])
        raise SampleTooLong(rows[k] if rows is not None else first + k, int(lengths[k]))


class _TokenizeMap:
    """Picklable batched ``map`` function: texts -> ``input_ids`` (regex-hash ids, or a tokenizer's, no special tokens).

    ``loaded``: the tokenizer already read from ``tokenizer`` (not pickled: each worker reads its own).
    ``on_encoded``: called with the ids of every :data:`_REPORT_ROWS` texts as soon as they are
    encoded, in this process only. Neither is pickled, so neither changes the ``map`` fingerprint
    (the cache key): the ids do not depend on them.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        column: str,
        loaded: Any = None,
        on_encoded: Callable[[list[list[int]]], None] | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.column = column
        self._encode = None if loaded is None else token_encoder(loaded)
        self.on_encoded = on_encoded
        self.max_tokens = max_tokens

    def __getstate__(self) -> dict:
        state = {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "column": self.column, "_encode": None}
        return state if self.max_tokens is None else {**state, "max_tokens": self.max_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({"max_tokens": None, **state}, on_encoded=None)

    def __call__(self, texts: list[str], rows: list[int] | None = None) -> dict[str, list[list[int]]]:
        if self.on_encoded is None and self.max_tokens is None:
            return {self.column: self._ids(texts)}
        ids: list[list[int]] = []
        for start in range(0, len(texts), _REPORT_ROWS):  # small runs: a long text is measured soon after it is read
            part = self._ids(texts[start : start + _REPORT_ROWS])
            self._check(part, rows[start:] if rows is not None else None)
            if self.on_encoded is not None:
                self.on_encoded(part)
            ids.extend(part)
        return {self.column: ids}

    def _check(self, part: list[list[int]], rows: list[int] | None) -> None:
        """Raise :class:`SampleTooLong` for the first of ``part`` (rows ``rows``) over ``max_tokens``."""
        refuse_too_long(map(len, part), self.max_tokens, rows)

    def _ids(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer in (None, "regex"):
            return [regex_token_ids(t, self.vocab_size) for t in texts]
        if self._encode is None:
            self._encode = token_encoder(load_tokenizer(self.tokenizer))
        return self._encode([t or "" for t in texts])


#: Texts encoded between two ``on_encoded`` calls of :func:`tokenize_dataset`.
_REPORT_ROWS = 16


def encode_texts(texts: list[str | None], tokenizer: Any = None, vocab_size: int = 65536) -> list[list[int]]:
    """The token ids :func:`tokenize_dataset` gives ``texts`` (no special tokens; a missing text has none).

    ``tokenizer`` is ``None`` / ``"regex"`` or a path or name :func:`ringpack.tokenizer.load_tokenizer`
    reads; it is read once per process and kept.
    """
    return _encoder(None if tokenizer is None else str(tokenizer), vocab_size)._ids(texts)


@functools.lru_cache(maxsize=4)
def _encoder(tokenizer: str | None, vocab_size: int) -> _TokenizeMap:
    return _TokenizeMap(tokenizer, vocab_size, "ids")


def tokenize_dataset(
    ds: Any,
    text_column: str,
    tokenizer: Any = None,
    *,
    column: str = "input_ids",
    vocab_size: int = 65536,
    num_proc: int | None = None,
    batch_size: int = 256,
    on_encoded: Callable[[list[list[int]]], None] | None = None,
    max_tokens: int | None = None,
) -> Any:
    """Add a token-id column to a ``datasets.Dataset`` from ``text_column`` (batched ``map``, ``num_proc``).

    Args:
        ds: the dataset.
        text_column: the column of texts.
        tokenizer: ``None`` / ``"regex"`` (hashed regex ids below ``vocab_size``), or what
            :func:`ringpack.tokenizer.load_tokenizer` reads (a ``tokenizer.json`` file or folder, a
            ``save_pretrained`` folder, a Hub name), read here first so a bad one is refused before
            any work. No BOS, EOS or other special token is added: the ids are each text's alone.
        column: the token-id column to add.
        vocab_size, num_proc, batch_size: the regex ids' range, the ``map``'s processes and batch size.
        on_encoded: called with the token ids of each run of up to 16 rows, in row order, as soon
            as they are encoded (to count progress, or to refuse a sample by its length: what it
            raises ends the tokenizing). Only in this process: with ``num_proc`` above 1 the
            workers encode without it. Not called for rows ``datasets`` takes from its cache.
        max_tokens: refuse a text that encodes to more ids than this, as soon as it is encoded (in
            runs of 16 rows), in every process; ``None``: no limit.

    Returns:
        The dataset with ``column``.

    Raises:
        SampleTooLong: (a ``DataError``) a row over ``max_tokens``, with its row index and length.
        DataError: no ``text_column``; a tokenizer file or folder that cannot be read (named).
        FileNotFoundError: a tokenizer that is nowhere (the message says what to pass).
    """
    if text_column not in ds.column_names:
        raise DataError(f"dataset has no column {text_column!r}; its columns are {list(ds.column_names)}")
    loaded = None if tokenizer in (None, "regex") else load_tokenizer(tokenizer)
    encode = _TokenizeMap(
        tokenizer, vocab_size, column, loaded, on_encoded if (num_proc or 1) <= 1 else None, max_tokens
    )
    return ds.map(
        encode,
        input_columns=[text_column],
        with_indices=max_tokens is not None,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        desc="tokenizing",
        cache_file_name=_temporary_cache_file(ds),
    )


def _temporary_cache_file(ds: Any) -> str | None:
    """Where the token ids of a dataset held in memory go (``None``: ``datasets``' cache beside its files).

    ``map`` keeps the result of a dataset without cache files (an Arrow IPC file, a dataset built
    in memory) in memory too: every token id at once. A file in ``datasets``' temporary folder
    (removed when the process ends) is memory-mapped instead, so only the pages read are held.
    """
    if ds.cache_files:
        return None
    from datasets.fingerprint import get_temporary_cache_files_directory

    return os.path.join(get_temporary_cache_files_directory(), f"ringpack-tokens-{secrets.token_hex(8)}.arrow")


#: Data file suffixes :func:`load_source` reads, and the ``datasets`` loader of each.
_EXTENSIONS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
    ".csv": "csv",
}
#: What :func:`load_source` reads (help texts and errors quote it).
SOURCES = (
    "a saved `datasets` folder, .parquet, .arrow/.feather, .json/.jsonl or .csv file, a folder of such files, "
    "or a Hub dataset name"
)


class SourceFiles(NamedTuple):
    """The files of a local dataset source, in the order their rows are the dataset's (:func:`source_files`)."""

    kind: str
    """``"parquet"``, ``"json"``, ``"arrow"``, ``"csv"``, or ``"saved"`` (a ``save_to_disk`` folder's Arrow files)."""
    files: list[Path]
    """The data files, in row order."""
    root: Path
    """The file, the folder of files, or the saved ``Dataset`` folder (a ``DatasetDict``'s split folder)."""


def source_files(source: str | os.PathLike, split: str | None = None) -> SourceFiles | None:
    """The kind and files of a local source (``None``: no such path, a Hub name), as :func:`load_source` reads it.

    Raises:
        DataError: as :func:`load_source` for a local path (a ``.npy`` file, an unknown file type,
            a folder of mixed or no data files, a missing split, a ``split`` that does not apply).
        FileNotFoundError: a local-looking path that does not exist (or any name while offline).
    """
    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".npy":
        where = "`ringpack plan --lengths`" if on_command_line() else "ringpack.plan(path, ...)"
        raise DataError(f"{path} is a .npy file of lengths, not token ids or text: plan it with {where}")
    if path.is_dir():
        if any((path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return _saved_files(path, split)
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _EXTENSIONS and not p.name.startswith("."))
        kinds = {_EXTENSIONS[p.suffix.lower()] for p in files}
        if len(kinds) != 1:
            raise DataError(
                f"{path}: want a saved datasets directory or files of one kind ({', '.join(_EXTENSIONS)}), "
                f"found {sorted(kinds) or 'none'}"
            )
        kind = kinds.pop()
        _does_not_apply("split", split, path, f"a folder of {kind} files, which has no splits")
        return SourceFiles(kind, files, path)
    if path.is_file():
        if path.suffix.lower() not in _EXTENSIONS:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; want {SOURCES}")
        kind = _EXTENSIONS[path.suffix.lower()]
        _does_not_apply("split", split, path, f"a {kind} file, which has no splits")
        return SourceFiles(kind, [path], path)
    looks_local = str(source).startswith((".", "/", "~")) or path.suffix.lower() in _EXTENSIONS
    if looks_local or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise FileNotFoundError(f"no dataset at {source} (and Hub names are not tried offline)")
    return None


def _saved_files(path: Path, split: str | None) -> SourceFiles:
    """The Arrow files of a folder ``save_to_disk`` wrote (a ``DatasetDict``'s: of ``split``), in row order."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        split = "train" if split is None else split
        try:
            splits = list(json.loads(dict_file.read_text())["splits"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DataError(f"cannot load dataset {path}: {dict_file} is not a DatasetDict record ({exc})") from None
        if split not in splits:
            raise DataError(f"{path} holds splits {sorted(splits)}, not {split!r} (choose one with {option('split')})")
        path = path / split
    else:
        _does_not_apply("split", split, path, "a saved Dataset, which has no splits")
    try:
        state = json.loads((path / "state.json").read_text())
        files = [path / plain_name(f["filename"], str(path / "state.json")) for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"cannot load dataset {path}: no readable state.json ({exc})") from None
    if state.get("_indices_data_files"):
        raise DataError(f"{path} holds an indices mapping; save it again with save_to_disk (which flattens it)")
    return SourceFiles("saved", files, path)


def load_source(source: str | os.PathLike, split: str | None = None, cache_dir: str | None = None) -> Any:
    """A ``datasets.Dataset`` from a local path or, when no such path exists, a Hub dataset name.

    Args:
        source: a folder written by ``save_to_disk`` (a ``DatasetDict``'s: ``split`` is taken), a
            ``.parquet``/``.pq``, ``.arrow``/``.feather``/``.ipc`` (Arrow IPC stream or file),
            ``.json``/``.jsonl`` or ``.csv`` file, a folder of files of one of these kinds, or a
            Hub dataset name.
        split: the split of a saved ``DatasetDict`` or a Hub dataset (``None``: ``"train"``); a
            source without splits refuses one.
        cache_dir: the ``datasets`` cache folder (``None``: its default).

    Raises:
        DataError: an unknown file type (a ``.npy`` file holds lengths, not tokens), a folder of
            mixed or no data files, a missing split, a ``split`` for a source without splits, or
            files ``datasets`` cannot load (empty, malformed); the message names the source.
        FileNotFoundError: a local-looking path that does not exist (or any name while offline).
    """
    import datasets

    local = source_files(source, split)
    if local is None:
        with _loading(source):
            return datasets.load_dataset(str(source), split="train" if split is None else split, cache_dir=cache_dir)
    if local.kind == "saved":
        with _loading(local.root):
            return datasets.load_from_disk(str(local.root))
    return _load_files(local.kind, [str(p) for p in local.files], cache_dir)


def _does_not_apply(name: str, value: Any, source: Path, what: str) -> None:
    """Refuse an option given for a source it does not apply to (it would be ignored)."""
    if value is not None:
        raise DataError(f"{source} is {what}: {option(name, value)} does not apply to it (leave it out)")


def _load_files(kind: str, files: list[str], cache_dir: str | None) -> Any:
    import datasets

    empty = next((f for f in files if os.path.getsize(f) == 0), None)
    if empty is not None:
        raise DataError(f"dataset file {empty} is empty")
    with _loading(files[0] if len(files) == 1 else f"{len(files)} {kind} files under {Path(files[0]).parent}"):
        if kind == "arrow":
            parts = [_arrow_dataset(f) for f in files]
            return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)


def _arrow_dataset(path: str) -> Any:
    """A ``datasets.Dataset`` of an Arrow IPC stream (as ``datasets`` caches it) or file (Feather v2), memory-mapped."""
    import datasets
    import pyarrow as pa

    try:
        return datasets.Dataset.from_file(path)
    except pa.ArrowInvalid:  # the IPC file format, which Dataset.from_file does not read
        return datasets.Dataset(read_arrow_table(Path(path)))


@contextmanager
def _loading(what: Any) -> Iterator[None]:
    """Turn what ``datasets`` raises for an unloadable source into a :class:`DataError` naming it.

    ``datasets`` wraps parser errors in its own types (a generation error whose cause holds the
    parser's message, a bare ``StopIteration`` for an empty file), so the whole chain is reported.
    """
    try:
        yield
    except DataError:
        raise
    except Exception as exc:
        causes, cause = [], exc
        while cause is not None and len(causes) < 4:
            causes.append(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)
            cause = cause.__cause__ or cause.__context__
        raise DataError(f"cannot load dataset {what}: " + " <- ".join(causes)) from exc
