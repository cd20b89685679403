"""Balanced Parquet shards: preprocess a dataset once (``ringpack shard``), stream it back (:class:`ShardReader`).

Layout of an output directory::

    manifest.json                       written last: plan hash, config, files, row counts, sha256s
    plan.parquet                        the plan (Plan.write_parquet), for the attention schedule
    dp00000-of-00002.parquet            one file per DP rank ...
    dp00000-of-00002-steps-000000-000009.parquet   ... or per DP rank and step range (steps_per_file)

Each shard file has one row per *piece* (``step, microbatch, cp, slot, sample, row, start, stop,
next_token, input_ids``) and one row group per micro-batch, in plan order; ``input_ids`` holds the
piece's tokens and ``next_token`` the token after the piece in its sample (``-100`` at a sample's
end), which is all a CP rank needs to rebuild exactly the tensors :class:`PackedCollator` makes.
``row`` is the dataset row the piece came from (``sample`` is the plan's sample; they differ only
when ``overflow="split"`` cut long rows into documents).

Crash safety and determinism: every file is written under a fresh temporary name (created
exclusively, never through a link) and renamed into place; ``_progress.json``, written before any
shard, names every file the run may write and records each finished file's sha256;
``manifest.json`` is written last, so a directory without a manifest is never taken for a finished
one. Re-running with the same inputs resumes (files whose checksum matches are kept) and produces
byte-identical files (fixed writer options, no statistics, no timestamps).

Ownership: a run deletes or replaces only files that a ringpack manifest or progress record in the
directory names, and only under the names ringpack writes (shard files, ``plan.parquet``, the two
records, their temporaries); a record naming anything else is not ringpack's and is refused. A file
is deleted only when it proves to be ringpack's (a regular file whose Parquet footer carries
ringpack's metadata, or a record); a link is never followed, read or deleted (at a name this run
writes it is replaced, its target untouched). Any other file in the way is an error, as is an
output directory that holds the input. A directory holding shards of another plan or dataset is
refused unless ``overwrite=True``.

Reading: nothing in a shard directory is read through a symbolic link (the reader and the resume
refuse one). :class:`ShardReader` accepts only plain file names inside its directory and checks the
manifest against itself (one entry per file, every DP rank's steps covered once, counts that add
up), against the plan and against each file (size, sha256, schema, row groups in plan order)
before it yields a batch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._checks import is_bool, is_int
from ringpack._files import atomic_write, open_regular, refuse_link, temp_target
from ringpack._hints import on_command_line, option
from ringpack.data.collator import IGNORE_INDEX, check_schedule_flag, check_schedule_options, rank_arrays, to_batch
from ringpack.lengths import DataError, lengths_from_dataset, read_arrow_table
from ringpack.mesh import mesh_coordinates
from ringpack.progress import Progress
from ringpack.shard_plan import MicroBatch, Plan, PlanConfig
from ringpack.tokenizer import load_tokenizer, regex_token_ids

__all__ = [
    "write_shards",
    "ShardReader",
    "load_source",
    "tokenize_dataset",
    "regex_token_ids",
    "file_sha256",
    "check_out_dir",
    "MANIFEST",
    "SHARD_FORMAT_VERSION",
]

MANIFEST = "manifest.json"
PROGRESS = "_progress.json"
PLAN_FILE = "plan.parquet"
SHARD_FORMAT_VERSION = 1
_COLUMNS = ("step", "microbatch", "cp", "slot", "sample", "row", "start", "stop", "next_token")
#: Names of the shard files :func:`_layout` makes (DP rank, DP size, optional step range).
_SHARD_NAME = re.compile(r"^dp\d{5,}-of-\d{5,}(-steps-\d{6,}-\d{6,})?\.parquet$")
#: Token ids are stored as int32: every id must be an integer in ``[0, TOKEN_ID_LIMIT)``.
TOKEN_ID_LIMIT = 1 << 31
logger = logging.getLogger("ringpack.data.shards")
_WRITE_OPTIONS = dict(
    compression="zstd", compression_level=3, write_statistics=False, use_dictionary=False, version="2.6"
)


# ------------------------------------------------------------------------------------- helpers
def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 (hex) of the regular file ``path``; a symbolic link is refused (:class:`DataError`)."""
    h = hashlib.sha256()
    with open_regular(path, "file") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def _write_json(path: Path, obj: Any) -> None:
    with atomic_write(path) as f:
        f.write((json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _plain_name(name: Any, where: str) -> str:
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


def check_out_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse an output directory that is a file, is or holds one of ``inputs``, or lies inside an input folder.

    Args:
        out: the shard directory (it need not exist yet).
        inputs: the dataset's local files or folders (a folder is read whole, so shards written
            inside it would become input of the next run); ``None`` and paths that do not exist
            (Hub names) are skipped.

    Raises:
        DataError: naming the output directory and the input.
    """
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise DataError(f"output directory {out} is a file")
    root = root.resolve()
    for item in inputs:
        if not item or not Path(item).exists():
            continue
        source = Path(item).resolve()
        if source == root or root in source.parents:
            raise DataError(f"output directory {out} holds {item}, an input of this run; write the shards elsewhere")
        if source.is_dir() and source in root.parents:
            raise DataError(f"output directory {out} lies inside the input folder {item}; write the shards elsewhere")


class _TokenizeMap:
    """Picklable batched ``map`` function: texts -> ``input_ids`` (regex-hash ids or a tokenizer.json)."""

    def __init__(self, tokenizer: Any, vocab_size: int, column: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.column = column
        self._tok = None

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "column": self.column, "_tok": None}

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        if self.tokenizer in (None, "regex"):
            return {self.column: [regex_token_ids(t, self.vocab_size) for t in texts]}
        if self._tok is None:
            self._tok = load_tokenizer(self.tokenizer)
        return {
            self.column: [e.ids for e in self._tok.encode_batch([t or "" for t in texts], add_special_tokens=False)]
        }


def tokenize_dataset(
    ds: Any,
    text_column: str,
    tokenizer: Any = None,
    *,
    column: str = "input_ids",
    vocab_size: int = 65536,
    num_proc: int | None = None,
    batch_size: int = 256,
) -> Any:
    """Add a token-id column to a ``datasets.Dataset`` from ``text_column`` (batched ``map``, ``num_proc``).

    ``tokenizer``: ``None`` / ``"regex"`` (hashed regex ids below ``vocab_size``) or a Hugging Face
    ``tokenizer.json`` path or folder, read here first so a bad file is refused before any work
    (:func:`ringpack.tokenizer.load_tokenizer`: ``FileNotFoundError`` or a :class:`DataError`
    naming it).
    """
    if text_column not in ds.column_names:
        raise DataError(f"dataset has no column {text_column!r}; its columns are {list(ds.column_names)}")
    if tokenizer not in (None, "regex"):
        load_tokenizer(tokenizer)
    return ds.map(
        _TokenizeMap(tokenizer, vocab_size, column),
        input_columns=[text_column],
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        desc="tokenizing",
    )


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

    path = Path(source)
    if path.is_file() and path.suffix.lower() == ".npy":
        where = "`ringpack plan --lengths`" if on_command_line() else "ringpack.plan(path, ...)"
        raise DataError(f"{path} is a .npy file of lengths, not token ids or text: plan it with {where}")
    if path.is_dir():
        if any((path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
            with _loading(path):
                ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                split = "train" if split is None else split
                if split not in ds:
                    raise DataError(
                        f"{path} holds splits {sorted(ds)}, not {split!r} (choose one with {option('split')})"
                    )
                ds = ds[split]
            else:
                _does_not_apply("split", split, path, "a saved Dataset, which has no splits")
            return ds
        files = sorted(p for p in path.rglob("*") if p.suffix.lower() in _EXTENSIONS and not p.name.startswith("."))
        kinds = {_EXTENSIONS[p.suffix.lower()] for p in files}
        if len(kinds) != 1:
            raise DataError(
                f"{path}: want a saved datasets directory or files of one kind ({', '.join(_EXTENSIONS)}), "
                f"found {sorted(kinds) or 'none'}"
            )
        kind = kinds.pop()
        _does_not_apply("split", split, path, f"a folder of {kind} files, which has no splits")
        return _load_files(kind, [str(p) for p in files], cache_dir)
    if path.is_file():
        if path.suffix.lower() not in _EXTENSIONS:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; want {SOURCES}")
        kind = _EXTENSIONS[path.suffix.lower()]
        _does_not_apply("split", split, path, f"a {kind} file, which has no splits")
        return _load_files(kind, [str(path)], cache_dir)
    looks_local = str(source).startswith((".", "/", "~")) or path.suffix.lower() in _EXTENSIONS
    if looks_local or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise FileNotFoundError(f"no dataset at {source} (and Hub names are not tried offline)")
    with _loading(source):
        return datasets.load_dataset(str(source), split="train" if split is None else split, cache_dir=cache_dir)


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


def _content_fingerprint(ds: Any, column: str, lengths: np.ndarray, progress: Progress) -> str:
    """SHA-256 of the token ids in dataset order (identity of the input for resume checks).

    Every id is checked on the way (:func:`_token_ids`): a :class:`DataError` names the first
    sample whose ids are not integers in ``[0, TOKEN_ID_LIMIT)``. ``progress`` counts samples.
    """
    import pyarrow as pa

    h = hashlib.sha256(b"ringpack-tokens-v1|")
    h.update(np.asarray(lengths, dtype="<i8").tobytes())
    arrow = ds.with_format("arrow")
    for start in range(0, len(ds), 65536):
        col = arrow[start : start + 65536].column(column)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise DataError(f"column {column!r} holds {col.type}, not lists of token ids")
        values = _token_ids(col.flatten(), lengths[start : start + len(col)], start, column)
        h.update(values.astype("<i8").tobytes())
        progress.update(len(col))
    return h.hexdigest()


def _token_ids(values: Any, row_lengths: np.ndarray, first_row: int, column: str) -> np.ndarray:
    """The flat token ids of rows ``first_row...`` as int64, each checked to be an integer in ``[0, TOKEN_ID_LIMIT)``.

    ``values`` is the Arrow array of the rows' ids, ``row_lengths`` each row's count. Whole floats
    are accepted; a :class:`DataError` names the first sample holding a null, a fraction, a
    negative id or one beyond int32.
    """
    import pyarrow as pa

    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise DataError(f"column {column!r} holds {values.type} values, not integer token ids")
    ids = values.to_numpy(zero_copy_only=False)  # nulls become NaN
    with np.errstate(invalid="ignore"):
        bad = (ids < 0) | (ids >= TOKEN_ID_LIMIT)
        if ids.dtype.kind == "f":
            bad |= ~np.isfinite(ids) | (ids != np.round(ids))
    if not bad.any():
        return ids.astype(np.int64)
    k = int(np.flatnonzero(bad)[0])
    sample = first_row + int(np.searchsorted(np.cumsum(row_lengths), k, side="right"))
    value = ids[k].item()
    raise DataError(
        f"column {column!r}, sample {sample}: token id {'null' if value != value else value!r} is not an integer "
        f"in [0, {TOKEN_ID_LIMIT}) (ids are stored as int32)"
    )


# --------------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class _ShardFile:
    """One output file: DP rank ``dp_rank``'s micro-batches of steps ``[lo, hi)``."""

    name: str
    dp_rank: int
    lo: int
    hi: int


def _layout(plan: Plan, steps_per_file: int) -> list[_ShardFile]:
    """The output files in write order: per DP rank, one file or one per ``steps_per_file`` steps."""
    dp, n = plan.config.dp, plan.num_steps
    if steps_per_file <= 0:
        return [_ShardFile(f"dp{d:05d}-of-{dp:05d}.parquet", d, 0, n) for d in range(dp)]
    return [
        _ShardFile(f"dp{d:05d}-of-{dp:05d}-steps-{lo:06d}-{hi - 1:06d}.parquet", d, lo, hi)
        for d in range(dp)
        for lo, hi in ((lo, min(lo + steps_per_file, n)) for lo in range(0, n, steps_per_file))
    ]


def _schema(meta: dict[str, Any]) -> Any:
    import pyarrow as pa

    fields = [pa.field(name, pa.int64()) for name in _COLUMNS] + [pa.field("input_ids", pa.list_(pa.int32()))]
    return pa.schema(fields, metadata={b"ringpack.shard": json.dumps(meta, sort_keys=True).encode()})


def _microbatch_table(
    mb: MicroBatch, tokens: dict[int, np.ndarray], rows: dict[int, int], schema: Any, *, step: int, index: int
) -> Any:
    """One row group: a row per piece of micro-batch ``index`` of ``step`` (``tokens``/``rows`` by plan sample)."""
    import pyarrow as pa

    cols: dict[str, list[int]] = {name: [] for name in _COLUMNS}
    pieces: list[np.ndarray] = []
    slot_of = {sample: k for k, sample in enumerate(mb.samples)}
    for c, shard in enumerate(mb.shards):
        for p in shard.pieces:
            ids = tokens[p.sample]
            values = (step, index, c, slot_of[p.sample], p.sample, rows[p.sample], p.start, p.stop)
            for name, value in zip(_COLUMNS, values):
                cols[name].append(value)
            cols["next_token"].append(int(ids[p.stop]) if p.stop < len(ids) else IGNORE_INDEX)
            pieces.append(ids[p.start : p.stop])
    lens = np.fromiter((len(x) for x in pieces), dtype=np.int32, count=len(pieces))
    offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = np.concatenate(pieces).astype(np.int32)
    arrays = [pa.array(np.asarray(cols[name], dtype=np.int64)) for name in _COLUMNS]
    arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_shards(
    dataset: Any,
    out_dir: str | os.PathLike,
    config: PlanConfig,
    *,
    column: str = "input_ids",
    steps_per_file: int = 0,
    progress: bool | None = None,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan ``dataset`` and write its balanced shards (layout in the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` whose ``column`` holds each row's token ids (a list of
            integers per row, each in ``[0, 2**31)``: they are stored as int32).
        out_dir: the output directory (created if missing).
        config: the plan config (mesh, token budget, strategy, ...); the plan is made here.
        column: the token-id column.
        steps_per_file: split each DP rank's file every this many steps (``0``: one file per DP rank).
        progress: count steps planned, samples checked and micro-batches written
            (:class:`~ringpack.progress.Progress`: a bar on a terminal, else ``ringpack.progress``
            log lines); ``None`` is ``True``, ``False`` shows nothing.
        overwrite: replace the shards of another plan or dataset found in ``out_dir``.
        source: where the data came from, recorded in the manifest as given.

    Returns:
        The manifest, also written to ``out_dir/manifest.json`` (plan hash, dataset fingerprint,
        config, per-file row groups, rows, tokens, bytes and sha256).

    Raises:
        DataError: ``out_dir`` holds shards of another plan or dataset and ``overwrite`` is false;
            a file in the way that no ringpack record names, or bookkeeping that is not ringpack's
            (even with ``overwrite``); ``out_dir`` is or holds the dataset's files; a missing
            column, a bad length or a token id outside ``[0, 2**31)`` (the sample named).
        PlanError: the lengths cannot be planned under ``config``.

    An interrupted run of the same inputs resumes: files whose checksum matches are kept.
    """
    from ringpack.planner import make_plan

    show = progress is not False
    out = Path(out_dir)
    check_out_dir(out, _dataset_files(dataset))
    lengths = lengths_from_dataset(dataset, column)
    with Progress("planning", "steps", enabled=show) as bar:
        plan = make_plan(lengths, config, progress=bar.advance_to)
    with Progress("checking token ids", "samples", len(lengths), enabled=show) as bar:
        fingerprint = _content_fingerprint(dataset, column, lengths, bar)
    layout = _layout(plan, steps_per_file)
    identity = {
        "format": "ringpack-shards",
        "version": SHARD_FORMAT_VERSION,
        "plan_hash": plan.content_hash,
        "dataset_fingerprint": fingerprint,
        "column": column,
        "files": [f.name for f in layout],
    }
    out.mkdir(parents=True, exist_ok=True)
    done, owned = _claim(out, identity, overwrite)
    verified = {
        f.name: done[f.name]
        for f in layout
        if f.name in done and _regular(out / f.name) and file_sha256(out / f.name) == done[f.name]
    }
    progress_state = {**identity, "files_written": dict(verified), "owned": owned}
    _write_json(out / PROGRESS, progress_state)  # before anything is removed or written: it names what is ours
    _remove_stale(out, owned, keep={*identity["files"], PLAN_FILE, PROGRESS})

    total_mb = sum(len(step.microbatches[d]) for d in range(config.dp) for step in plan.steps)
    if verified:
        logger.info("%s: %d of %d shard files already written, kept", out, len(verified), len(layout))
    with Progress(f"writing shards to {out}", "micro-batches", total_mb, enabled=show) as bar:
        records = _write_files(_ShardWriter(out, plan, dataset, column), layout, progress_state, bar)
    manifest = _manifest(identity, plan, lengths, _write_plan_file(out, plan), records, source)
    _write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _write_files(
    writer: _ShardWriter, layout: list[_ShardFile], progress_state: dict[str, Any], bar: Any
) -> list[dict[str, Any]]:
    """Write the files of ``layout`` not yet finished, each recorded in the progress record; their manifest entries."""
    finished = progress_state["files_written"]
    records = []
    for file in layout:
        if file.name not in finished:
            finished[file.name] = writer.write(file, bar)
            _write_json(writer.out / PROGRESS, progress_state)
        else:
            bar.update(writer.microbatches(file))
        records.append(writer.record(file, finished[file.name]))
    return records


def _dataset_files(dataset: Any) -> list[str]:
    """The files behind a ``datasets.Dataset`` (its Arrow cache files), for :func:`check_out_dir`."""
    return [f["filename"] for f in getattr(dataset, "cache_files", None) or [] if isinstance(f, dict)]


def _claim(out: Path, identity: dict[str, Any], overwrite: bool) -> tuple[dict[str, str], list[str]]:
    """Claim ``out`` for this run: the files an earlier run of the same inputs finished there, and every name we own.

    Returns:
        ``(done, owned)``: sha256 of finished files by name (empty with ``overwrite``), and the
        sorted names this and earlier runs may have written (their records' files, the plan file,
        this run's files, the bookkeeping), the only files a run may remove or replace.

    Raises:
        DataError: a ``manifest.json`` or ``_progress.json`` that is not a ringpack record (never
            removed, even with ``overwrite``); shards of another plan or dataset without
            ``overwrite``; a file in the way that no record names.
    """
    records = _records(out)
    done: dict[str, str] = {}
    claimed = {PLAN_FILE} if records else set()
    for marker, old in records.items():
        same, recorded, names = _same_run(old, identity, marker)
        names = [_own_name(name, out / marker) for name in names]
        if not same and not overwrite:
            raise DataError(
                f"{out} holds shards of another plan or dataset (plan {str(old.get('plan_hash'))[:12]}..., "
                f"this run plans {identity['plan_hash'][:12]}...); pass {option('overwrite', True)} "
                "to replace them, or write elsewhere"
            )
        if same:
            done.update(recorded)
        claimed.update(names)
    foreign = [n for n in (*identity["files"], PLAN_FILE) if _present(out / n) and n not in claimed]
    if foreign:
        raise DataError(
            f"{out / foreign[0]} is in the way and no ringpack record in {out} names it; "
            "remove it or write the shards elsewhere"
        )
    owned = claimed | {*identity["files"], PLAN_FILE, MANIFEST, PROGRESS}
    return ({} if overwrite else done), sorted(owned)


def _records(out: Path) -> dict[str, dict[str, Any]]:
    """The ringpack bookkeeping in ``out`` (manifest and progress record), by file name."""
    records = {}
    for marker in (MANIFEST, PROGRESS):
        path = out / marker
        if not _present(path):
            continue
        try:
            with open_regular(path, "shard record") as f:
                old = json.loads(f.read().decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # DataError (a link) is a ValueError
            old = exc
        if not isinstance(old, dict) or old.get("format") != "ringpack-shards":
            raise DataError(
                f"{path} is not a ringpack shard record ({old if isinstance(old, Exception) else 'another format'}); "
                "ringpack never removes files it did not write: remove it or write the shards elsewhere"
            )
        records[marker] = old
    return records


def _same_run(old: dict[str, Any], identity: dict[str, Any], marker: str) -> tuple[bool, dict[str, str], list[Any]]:
    """Whether a record ``old`` is of this run's inputs, the sha256 of the files it finished, and every name it owns."""
    if marker == PROGRESS:
        same = all(old.get(k) == v for k, v in identity.items())
        finished = old.get("files_written")
        names = [*_as_list(old.get("owned")), *_as_list(old.get("files"))]
        return same, dict(finished) if isinstance(finished, dict) else {}, names
    files = [f for f in _as_list(old.get("files")) if isinstance(f, dict)]
    same = (
        all(old.get(k) == identity[k] for k in ("plan_hash", "dataset_fingerprint", "column"))
        and [f.get("name") for f in files] == identity["files"]
    )
    plan_file = old.get("plan_file")
    names = [f.get("name") for f in files] + ([plan_file.get("name")] if isinstance(plan_file, dict) else [])
    return same, {f.get("name"): f.get("sha256") for f in files}, names


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _own_name(name: Any, record: Path) -> str:
    """``name``, from the shard record ``record``, if it is a plain name ringpack writes; else :class:`DataError`.

    A record naming any other file (a path, a user's file) is not one ringpack wrote: nothing it
    names is removed or replaced.
    """
    name = _plain_name(name, str(record))
    if not (_SHARD_NAME.match(name) or name in (PLAN_FILE, MANIFEST, PROGRESS)):
        raise DataError(
            f"{record} names {name!r:.80}, a file ringpack never writes, so it is not a ringpack shard record; "
            "ringpack never removes files it did not write: remove the record or write the shards elsewhere"
        )
    return name


def _present(path: Path) -> bool:
    """Something is at ``path``: a file, a folder or a link (dangling or not)."""
    return path.exists() or path.is_symlink()


def _regular(path: Path) -> bool:
    """A regular file, not a symbolic link (which is never followed)."""
    return not path.is_symlink() and path.is_file()


def _wrote(path: Path) -> bool:
    """Whether ``path`` is a regular file ringpack wrote: a record, or Parquet whose footer carries its metadata."""
    import pyarrow.parquet as pq

    if not _regular(path):
        return False
    if path.name in (MANIFEST, PROGRESS):
        return True  # read and checked to be a ringpack record by _records
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception:  # pyarrow raises several types for files that are not Parquet
        return False
    return (b"ringpack.shard" if _SHARD_NAME.match(path.name) else b"ringpack.shard_plan") in metadata


def _remove_stale(out: Path, owned: list[str], keep: set[str]) -> None:
    """Remove the owned files this run does not write (the manifest too: it is rewritten last) and their temporaries.

    Only files that prove to be ringpack's (:func:`_wrote`) are removed; a link, or a file under an
    owned name that is not ringpack's, stays where it is (with a warning).
    """
    for name in owned:
        path = out / name
        if name in keep or not _present(path):
            continue
        if _wrote(path):
            path.unlink()
        else:
            logger.warning("%s left in place: a shard record names it, but it is not a file ringpack wrote", path)
    for entry in out.iterdir():
        if temp_target(entry.name) in owned and _regular(entry):
            entry.unlink()


class _ShardWriter:
    """Writes the shard files of one plan of one dataset into ``out``."""

    def __init__(self, out: Path, plan: Plan, dataset: Any, column: str) -> None:
        self.out = out
        self.plan = plan
        self.arrow = dataset.with_format("arrow")
        self.column = column
        self.doc_row, self.doc_offset = plan.origin_arrays()

    def microbatches(self, file: _ShardFile) -> int:
        return sum(len(self.plan.steps[s].microbatches[file.dp_rank]) for s in range(file.lo, file.hi))

    def write(self, file: _ShardFile, bar: Any) -> str:
        """Write ``file`` under a fresh temporary name, fsync and rename it into place; its sha256."""
        import pyarrow.parquet as pq

        meta = {
            "plan_hash": self.plan.content_hash,
            "dp_rank": file.dp_rank,
            "steps": [file.lo, file.hi],
            "version": SHARD_FORMAT_VERSION,
        }
        schema = _schema(meta)
        with atomic_write(self.out / file.name) as f, pq.ParquetWriter(f, schema, **_WRITE_OPTIONS) as writer:
            for s in range(file.lo, file.hi):
                for i, mb in enumerate(self.plan.steps[s].microbatches[file.dp_rank]):
                    tokens, rows = self._sample_tokens(mb)
                    writer.write_table(_microbatch_table(mb, tokens, rows, schema, step=s, index=i))
                    bar.update(1)
        return file_sha256(self.out / file.name)

    def _sample_tokens(self, mb: MicroBatch) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """Token ids and dataset row of each plan sample of ``mb`` (documents cut from rows by ``origins``)."""
        samples = np.asarray(mb.samples, dtype=np.int64)
        rows = self.doc_row[samples]
        col = self.arrow[rows.tolist()].column(self.column).combine_chunks()
        offs = col.offsets.to_numpy().astype(np.int64)
        vals = col.values.to_numpy(zero_copy_only=False)
        tokens = {}
        for k, sample in enumerate(mb.samples):
            a = offs[k] + self.doc_offset[sample]
            tokens[sample] = vals[a : a + self.plan.lengths[sample]]
        return tokens, dict(zip(mb.samples, rows.tolist()))

    def record(self, file: _ShardFile, sha256: str) -> dict[str, Any]:
        """The manifest entry of a written ``file``."""
        import pyarrow.parquet as pq

        path = self.out / file.name
        md = pq.ParquetFile(str(path)).metadata
        mbs = [mb for s in range(file.lo, file.hi) for mb in self.plan.steps[s].microbatches[file.dp_rank]]
        return {
            "name": file.name,
            "dp_rank": file.dp_rank,
            "steps": [file.lo, file.hi],
            "microbatches": len(mbs),
            "row_groups": md.num_row_groups,
            "rows": md.num_rows,
            "tokens": int(sum(mb.num_tokens for mb in mbs)),
            "bytes": path.stat().st_size,
            "sha256": sha256,
        }


def _write_plan_file(out: Path, plan: Plan) -> dict[str, Any]:
    """Write ``plan.parquet`` atomically; its manifest entry."""
    import pyarrow.parquet as pq

    path = out / PLAN_FILE
    with atomic_write(path) as f:
        pq.write_table(plan.to_table(), f, **_WRITE_OPTIONS)
    return {"name": PLAN_FILE, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def _manifest(
    identity: dict[str, Any],
    plan: Plan,
    lengths: np.ndarray,
    plan_file: dict[str, Any],
    records: list[dict[str, Any]],
    source: dict[str, Any] | None,
) -> dict[str, Any]:
    config = plan.config
    doc_row, _ = plan.origin_arrays()
    return {
        "format": "ringpack-shards",
        "version": SHARD_FORMAT_VERSION,
        "plan_hash": plan.content_hash,
        "dataset_fingerprint": identity["dataset_fingerprint"],
        "column": identity["column"],
        "config": config.to_dict(),
        "dp": config.dp,
        "cp": config.cp,
        "tokens_per_rank": config.tokens_per_rank,
        "num_steps": plan.num_steps,
        "num_samples": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "dropped": [int(doc_row[x]) for x in plan.dropped],
        "microbatches_per_step": [len(step.microbatches[0]) for step in plan.steps],
        "step_loss_tokens": [step.loss_tokens for step in plan.steps],
        "source": source or {},
        "plan_file": plan_file,
        "files": records,
    }


# --------------------------------------------------------------------------------------- reading
class ShardReader:
    """Stream one (DP rank, CP rank)'s micro-batches back from a shard directory.

    Args:
        path: a directory :func:`write_shards` finished (it holds ``manifest.json``).
        dp_rank, cp_rank: this process's coordinates in the mesh the shards were written for.
        dp_size, cp_size: this job's mesh; when given, they must match the manifest's.
        verify: check each file's sha256 against the manifest before reading it.
        schedule, schedule_options: as for :class:`~ringpack.data.collator.PackedCollator`.

    Iterating yields exactly the dicts ``PackedCollator`` makes for the same plan (same keys,
    same tensors: int64 ``input_ids``/``labels``/``position_ids`` ``[T]``, int32 ``cu_seqlens``
    ``[P+1]``, ...), one per micro-batch of this DP rank, in plan order. ``state_dict`` /
    ``load_state_dict`` resume mid-epoch by seeking.

    Raises:
        DataError: a ``path`` that is not a str or path, ranks or sizes that are not
            non-negative integers, a ``verify`` that is not a bool, a bad ``schedule`` or
            ``schedule_options``; no finished shard directory (an interrupted run says so), a manifest of
            another format or mesh or one that disagrees with itself (a file name that is not a
            plain name in the directory, a file listed twice, a DP rank's steps not covered
            exactly once, counts that do not add up), ranks out of range; while reading: a
            missing, corrupt or truncated file (named), a manifest that disagrees with the plan,
            or row groups that disagree with the plan.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dp_rank: int,
        cp_rank: int,
        *,
        dp_size: int | None = None,
        cp_size: int | None = None,
        verify: bool = True,
        schedule: Any = "auto",
        schedule_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise DataError(f"path must be a shard directory (a str or os.PathLike), got {type(path).__name__}")
        for name, value in (("dp_rank", dp_rank), ("cp_rank", cp_rank), ("dp_size", dp_size), ("cp_size", cp_size)):
            if (value is not None or name.endswith("rank")) and not (is_int(value) and value >= 0):
                raise DataError(f"{name} must be a non-negative integer, got {value!r}")
        if not is_bool(verify):
            raise DataError(f"verify must be True or False, got {verify!r}")
        check_schedule_flag(schedule)
        self.path = Path(path)
        self.schedule_options = check_schedule_options(schedule_options)
        manifest_path = refuse_link(self.path / MANIFEST, "manifest")
        if not manifest_path.is_file():
            hint = (
                " (an interrupted `ringpack shard` run: re-run it to resume)" if (self.path / PROGRESS).exists() else ""
            )
            raise DataError(f"no {MANIFEST} in {self.path}: not a finished ringpack shard directory{hint}")
        try:
            with open_regular(manifest_path, "manifest") as f:
                self.manifest = json.loads(f.read().decode("utf-8"))
        except DataError:
            raise
        except (ValueError, RecursionError) as exc:
            raise DataError(f"{manifest_path} is corrupt: {exc}") from exc
        m = self.manifest
        _check_manifest(m, manifest_path)
        if dp_size is not None and dp_size != m["dp"] or cp_size is not None and cp_size != m["cp"]:
            raise DataError(
                f"{self.path} was sharded for dp={m['dp']}, cp={m['cp']}; this job runs dp={dp_size}, cp={cp_size} "
                "(re-run `ringpack shard` with this job's sizes)"
            )
        if not 0 <= dp_rank < m["dp"]:
            raise DataError(f"dp_rank {dp_rank} outside [0, {m['dp']}) of {self.path}")
        if not 0 <= cp_rank < m["cp"]:
            raise DataError(f"cp_rank {cp_rank} outside [0, {m['cp']}) of {self.path}")
        self.dp_rank, self.cp_rank = int(dp_rank), int(cp_rank)
        self.verify = verify
        self.schedule = schedule
        self.files = sorted((f for f in m["files"] if f["dp_rank"] == self.dp_rank), key=lambda f: f["steps"][0])
        self._verified: set[str] = set()
        self._plan: Plan | None = None
        self._cursor = 0
        self._pending: int | None = None

    @classmethod
    def from_mesh(
        cls, path: str | os.PathLike, mesh: Any, *, dp_dim: str = "dp", cp_dim: str = "cp", **options: Any
    ) -> ShardReader:
        """The reader of this rank of a DeviceMesh with dimensions ``dp_dim`` and ``cp_dim``; the
        manifest's DP and CP sizes are checked against the mesh's. ``options``: as for the constructor."""
        c = mesh_coordinates(mesh, dp_dim, cp_dim)
        return cls(path, c.dp_rank, c.cp_rank, dp_size=c.dp_size, cp_size=c.cp_size, **options)

    # -------------------------------------------------------------- views
    @property
    def plan_hash(self) -> str:
        return self.manifest["plan_hash"]

    @property
    def num_steps(self) -> int:
        return self.manifest["num_steps"]

    def __len__(self) -> int:
        return sum(f["microbatches"] for f in self.files)

    def _check(self, entry: dict[str, Any]) -> Path:
        """The path of a manifest entry's file, checked: present, its sha256 (with ``verify``) and size."""
        path = refuse_link(self.path / entry["name"], "shard file")
        if not path.is_file():
            raise DataError(f"shard file {path} listed in the manifest is missing")
        if self.verify and entry["name"] not in self._verified:
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                raise DataError(
                    f"checksum mismatch for {path}: sha256 {digest[:16]}..., manifest says {entry['sha256'][:16]}... "
                    "(corrupt or truncated)"
                )
            self._verified.add(entry["name"])
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DataError(f"shard file {path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        return path

    @property
    def plan(self) -> Plan:
        """The plan of the shards (loaded from ``plan.parquet``, checked against the manifest)."""
        if self._plan is None:
            path = self._check(self.manifest["plan_file"])
            try:
                plan = Plan.read_parquet(path)
            except ValueError as exc:
                raise DataError(f"cannot read {path}: {exc}") from exc
            if plan.content_hash != self.plan_hash:
                raise DataError(
                    f"{path} holds plan {plan.content_hash[:12]}..., manifest says {self.plan_hash[:12]}..."
                )
            _check_manifest_against_plan(self.manifest, plan, self.path / MANIFEST)
            self._plan = plan
        return self._plan

    # ----------------------------------------------------------- iterate
    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._pending if self._pending is not None else 0
        self._pending = None
        self._cursor = start
        plan = self.plan
        position = 0
        for entry in self.files:
            n = entry["microbatches"]
            if position + n <= start:
                position += n
                continue
            path = self._check(entry)
            pf = self._open(path, entry)
            order = [
                (s, i) for s in range(*entry["steps"]) for i in range(len(plan.steps[s].microbatches[self.dp_rank]))
            ]
            for g in range(max(0, start - position), n):
                try:
                    table = pf.read_row_group(g)
                except Exception as exc:
                    raise DataError(f"cannot read row group {g} of shard file {path}: {exc}") from exc
                batch = self._batch(plan, table, path, g, position + g, order[g])
                self._cursor = position + g + 1
                yield batch
            position += n

    def _open(self, path: Path, entry: dict[str, Any]) -> Any:
        """The ``ParquetFile`` of a shard, its schema, metadata and row-group count checked against the manifest."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(str(path))
            schema = pf.schema_arrow
            meta = json.loads((schema.metadata or {}).get(b"ringpack.shard", b"{}"))
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DataError(f"cannot read shard file {path}: {exc}") from exc
        types = {name: schema.field(name).type for name in schema.names}
        ids = types.get("input_ids")
        if any(types.get(name) != pa.int64() for name in _COLUMNS) or not (
            ids is not None and pa.types.is_list(ids) and ids.value_type == pa.int32()
        ):
            raise DataError(f"shard file {path} does not have the shard schema (columns {schema.names})")
        want = {"plan_hash": self.plan_hash, "dp_rank": entry["dp_rank"], "steps": entry["steps"]}
        if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in want.items()):
            raise DataError(
                f"shard file {path} holds another plan's, rank's or steps' shard (its metadata: {meta!r:.120})"
            )
        if pf.metadata.num_rows != entry["rows"]:
            raise DataError(f"shard file {path} has {pf.metadata.num_rows} rows, manifest says {entry['rows']}")
        if pf.metadata.num_row_groups != entry["microbatches"]:
            raise DataError(
                f"shard file {path} has {pf.metadata.num_row_groups} row groups, "
                f"manifest says {entry['microbatches']} micro-batches"
            )
        return pf

    def _batch(
        self, plan: Plan, table: Any, path: Path, group: int, position: int, expected: tuple[int, int]
    ) -> dict[str, Any]:
        where = f"{path} row group {group}"
        steps = table.column("step").to_numpy()
        indices = table.column("microbatch").to_numpy()
        if not len(steps) or (steps != expected[0]).any() or (indices != expected[1]).any():
            raise DataError(
                f"{where}: not all rows are of step {expected[0]} micro-batch {expected[1]}, as the plan says"
            )
        step, index = expected
        mb = plan.steps[step].microbatches[self.dp_rank][index]
        cp = table.column("cp").to_numpy()
        keep = np.flatnonzero(cp == self.cp_rank)
        starts = table.column("start").to_numpy()[keep]
        stops = table.column("stop").to_numpy()[keep]
        samples = table.column("sample").to_numpy()[keep]
        want = [(p.sample, p.start, p.stop) for p in mb.shards[self.cp_rank].pieces]
        if list(zip(samples.tolist(), starts.tolist(), stops.tolist())) != want:
            raise DataError(f"{path} row group {group}: pieces of cp rank {self.cp_rank} differ from the plan")
        ids = table.column("input_ids").combine_chunks()
        offs = ids.offsets.to_numpy().astype(np.int64)
        vals = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
        pieces = [vals[offs[k] : offs[k + 1]] for k in keep]
        if any(len(p) != b - a for p, a, b in zip(pieces, starts, stops)):
            raise DataError(
                f"{path} row group {group}: a piece's token count differs from its [start, stop) (corrupt file)"
            )
        nexts = table.column("next_token").to_numpy()[keep]
        arrays = rank_arrays(starts, pieces, nexts)
        meta = {
            "step_loss_tokens": int(plan.steps[step].loss_tokens),
            "epoch": int(plan.config.epoch),
            "step": step,
            "microbatch_index": index,
            "microbatches_in_step": len(plan.steps[step].microbatches[self.dp_rank]),
            "cursor": position + 1,
            "plan_hash": self.plan_hash,
        }
        return to_batch(arrays, mb, self.cp_rank, meta, self.schedule, options=self.schedule_options)

    # -------------------------------------------------------------- state
    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        if cursor is None:
            cursor = self._pending if self._pending is not None else self._cursor
        if not is_int(cursor) or cursor < 0:
            raise DataError(f"cursor must be a non-negative integer (a batch's 'cursor'), got {cursor!r}")
        return {"version": SHARD_FORMAT_VERSION, "plan_hash": self.plan_hash, "cursor": int(cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to ``state`` (:meth:`state_dict`): the next ``iter()`` yields from its cursor on.

        Raises:
            DataError: not a reader state, another plan's, or a cursor that is not an integer in
                ``[0, len(self)]``.
        """
        if not isinstance(state, dict) or state.get("version") != SHARD_FORMAT_VERSION:
            raise DataError(f"not a ShardReader state (version {SHARD_FORMAT_VERSION}): {state!r:.200}")
        if state.get("plan_hash") != self.plan_hash:
            raise DataError(
                f"reader state is for plan {str(state.get('plan_hash'))[:12]}..., "
                f"these shards hold {self.plan_hash[:12]}..."
            )
        cursor = state.get("cursor")
        if not is_int(cursor):
            raise DataError(f"reader state cursor must be an integer, got {cursor!r}")
        if not 0 <= cursor <= len(self):
            raise DataError(f"reader state cursor {cursor} outside [0, {len(self)}]")
        self._cursor = self._pending = cursor


# ------------------------------------------------------------------------------ manifest checks


def _field(data: Any, key: str, where: str, low: int | None = 0) -> Any:
    """``data[key]``, which must exist; an integer ``>= low`` unless ``low`` is ``None`` (any value)."""
    if not isinstance(data, dict) or key not in data:
        raise DataError(f"{where} lacks {key!r}")
    value = data[key]
    if low is not None and (not is_int(value) or value < low):
        raise DataError(f"{where}: {key} must be an integer >= {low}, got {value!r:.60}")
    return value


def _check_manifest(m: Any, where: Path) -> None:
    """Check a manifest against itself before any shard is read.

    Types and plain file names, one entry per file, ``dp``/``cp`` equal to its config's, every DP
    rank's steps covered by its files exactly once, and each file's micro-batches and row groups
    equal to the steps it covers. Raises :class:`DataError` naming the manifest and the entry.
    """
    if not isinstance(m, dict) or m.get("format") != "ringpack-shards" or m.get("version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{where}: not a ringpack shard manifest of version {SHARD_FORMAT_VERSION}")
    num_steps = _field(m, "num_steps", str(where))
    dp, cp = _field(m, "dp", str(where), low=1), _field(m, "cp", str(where), low=1)
    config = _field(m, "config", str(where), low=None)
    if not isinstance(config, dict) or (config.get("dp"), config.get("cp")) != (dp, cp):
        raise DataError(f"{where}: dp={dp}, cp={cp} disagree with its config")
    if not isinstance(_field(m, "plan_hash", str(where), low=None), str):
        raise DataError(f"{where}: plan_hash must be a string")
    per_step = _field(m, "microbatches_per_step", str(where), low=None)
    if not isinstance(per_step, list) or len(per_step) != num_steps or not all(is_int(x) and x > 0 for x in per_step):
        raise DataError(f"{where}: microbatches_per_step must list a positive count for each of {num_steps} steps")
    files = _field(m, "files", str(where), low=None)
    if not isinstance(files, list):
        raise DataError(f"{where}: files must be a list")
    names = [_check_entry(_field(m, "plan_file", str(where), low=None), f"{where}, plan_file")]
    for k, entry in enumerate(files):
        names.append(_check_entry(entry, f"{where}, files[{k}]"))
        _check_file_steps(entry, f"{where}, files[{k}] ({entry['name']})", dp, per_step)
    twice = sorted({n for n in names if names.count(n) > 1} | ({MANIFEST} & set(names)))
    if twice:
        raise DataError(f"{where}: {twice[0]!r} is listed twice (or is the manifest itself)")
    _check_coverage(files, dp, num_steps, where)


def _check_entry(entry: Any, where: str) -> str:
    """A file entry's common fields (plain name, byte count, sha256); its name."""
    name = _plain_name(_field(entry, "name", where, low=None), where)
    _field(entry, "bytes", where)
    digest = _field(entry, "sha256", where, low=None)
    if not isinstance(digest, str) or len(digest) != 64:
        raise DataError(f"{where}: sha256 must be 64 hex digits, got {digest!r:.80}")
    return name


def _check_file_steps(entry: dict[str, Any], where: str, dp: int, per_step: list[int]) -> None:
    """A shard entry's DP rank and step range, and its micro-batch and row-group counts against them."""
    rank = _field(entry, "dp_rank", where)
    if rank >= dp:
        raise DataError(f"{where}: dp_rank {rank} outside [0, {dp})")
    steps = _field(entry, "steps", where, low=None)
    if not (isinstance(steps, list) and len(steps) == 2 and all(is_int(x) for x in steps)):
        raise DataError(f"{where}: steps must be [first, end), got {steps!r:.60}")
    lo, hi = steps
    if not 0 <= lo <= hi <= len(per_step):
        raise DataError(f"{where}: steps [{lo}, {hi}) outside the plan's [0, {len(per_step)})")
    want = sum(per_step[lo:hi])
    for key in ("microbatches", "row_groups"):
        if _field(entry, key, where) != want:
            raise DataError(f"{where}: {key} is {entry[key]}, steps [{lo}, {hi}) hold {want} micro-batches")
    _field(entry, "rows", where)
    _field(entry, "tokens", where)


def _check_coverage(files: list[dict[str, Any]], dp: int, num_steps: int, where: Path) -> None:
    """Every DP rank's files cover steps ``[0, num_steps)`` exactly once."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for entry in files:
        spans.setdefault(entry["dp_rank"], []).append(tuple(entry["steps"]))
    if num_steps and len(spans) != dp:
        missing = next(d for d in range(dp) if d not in spans)  # dp <= len(files) here
        raise DataError(f"{where}: no file holds dp rank {missing}'s steps")
    for rank, ranges in spans.items():
        end = 0
        for lo, hi in sorted(ranges):
            if lo != end:
                what = "are in two files" if lo < end else "are in no file"
                raise DataError(f"{where}: dp rank {rank}'s steps [{min(lo, end)}, {max(lo, end)}) {what}")
            end = hi
        if end != num_steps:
            raise DataError(f"{where}: dp rank {rank}'s steps [{end}, {num_steps}) are in no file")


def _check_manifest_against_plan(m: dict[str, Any], plan: Plan, where: Path) -> None:
    """The manifest's mesh, steps, micro-batch and token counts equal the plan's."""
    config = plan.config
    per_step = [len(step.microbatches[0]) for step in plan.steps]
    mine = {
        "dp": config.dp,
        "cp": config.cp,
        "num_steps": plan.num_steps,
        "microbatches_per_step": per_step,
        "step_loss_tokens": [step.loss_tokens for step in plan.steps],
    }
    for key, value in mine.items():
        if m.get(key) != value:
            raise DataError(f"{where}: {key} disagrees with the plan in {PLAN_FILE}")
    for entry in m["files"]:
        lo, hi = entry["steps"]
        tokens = sum(mb.num_tokens for s in range(lo, hi) for mb in plan.steps[s].microbatches[entry["dp_rank"]])
        if entry["tokens"] != tokens:
            raise DataError(f"{where}: {entry['name']} has {entry['tokens']} tokens, the plan gives it {tokens}")
