"""Write a dataset's balanced shards once (``ringpack shard``), crash-safe and byte-reproducible (docs/data.md).

:func:`write_shards` plans the dataset, checks every token id, and writes the layout of
:mod:`~ringpack.data.shard_format`. Every file is written under a fresh temporary name and renamed
into place; ``_progress.json``, written before any shard, names every file the run may write, and
``manifest.json`` is written last, so a directory without a manifest is never taken for a finished
one. Re-running the same inputs resumes and gives byte-identical files. A run deletes or replaces
only files a ringpack record in the directory names, under the names ringpack writes, and only
when they prove to be ringpack's; a link is never followed. Notes go to the ``ringpack.data.shards``
logger.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._checks import is_int
from ringpack._files import atomic_write, file_sha256, open_regular, temp_target
from ringpack._hints import option
from ringpack.data.shard_format import (
    IGNORE_INDEX,
    MANIFEST,
    PIECE_COLUMNS,
    PLAN_FILE,
    PROGRESS,
    SHARD_FORMAT_VERSION,
    SHARD_NAME,
    TOKEN_ID_LIMIT,
    plain_name,
)
from ringpack.errors import DataError
from ringpack.lengths import lengths_from_dataset
from ringpack.planner import make_plan
from ringpack.progress import Progress
from ringpack.ranges import cumsum0
from ringpack.shard_plan import MicroBatch, Plan, PlanConfig

__all__ = [
    "DEFAULT_WRITE_THREADS",
    "TOKEN_ID_LIMIT",
    "ShardFile",
    "ShardRun",
    "bad_token_id",
    "check_out_dir",
    "check_records",
    "checked_token_ids",
    "DatasetFingerprint",
    "plan_for_shards",
    "sample_digests",
    "shard_layout",
    "write_shard_file",
    "write_shards",
]

logger = logging.getLogger("ringpack.data.shards")  # the documented name of the shard notes
_WRITE_OPTIONS = dict(
    compression="zstd", compression_level=3, write_statistics=False, use_dictionary=False, version="2.6"
)


def _write_json(path: Path, obj: Any) -> None:
    with atomic_write(path) as f:
        f.write((json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


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


def check_records(out: str | os.PathLike) -> None:
    """Refuse an output directory holding a ``manifest.json`` or ``_progress.json`` that is not a ringpack record.

    What :meth:`ShardRun.start` refuses first, for an engine that writes into ``out`` before it
    plans (a directory that does not exist yet passes).

    Raises:
        DataError: naming the record (ringpack never removes or replaces it).
    """
    if Path(out).is_dir():
        _records(Path(out))


def _content_fingerprint(ds: Any, column: str, lengths: np.ndarray, progress: Progress) -> str:
    """The fingerprint of ``ds`` (:class:`DatasetFingerprint`: identity of the input for resume checks).

    Every id is checked on the way (:func:`_token_ids`): a :class:`DataError` names the first
    sample whose ids are not integers in ``[0, TOKEN_ID_LIMIT)``. ``progress`` counts samples.
    """
    fingerprint = DatasetFingerprint()
    for _, ids, row_lengths in _id_chunks(ds, column, lengths):
        fingerprint.add(sample_digests(ids, row_lengths))
        progress.update(len(row_lengths))
    return fingerprint.hexdigest(lengths)


#: Token ids :func:`_id_chunks` reads at a time (64 MiB as int64), however long the rows.
CHUNK_TOKENS = 1 << 23


def _id_chunks(ds: Any, column: str, lengths: np.ndarray, rows: int = 65536) -> Iterable[tuple[int, Any, Any]]:
    """``(first_row, ids, row_lengths)`` of runs of at most ``rows`` rows and about :data:`CHUNK_TOKENS` ids
    (a row longer than that alone), the ids checked (:func:`_token_ids`)."""
    import pyarrow as pa

    arrow = ds.with_format("arrow")
    ends = np.cumsum(lengths, dtype=np.int64)
    start = 0
    while start < len(ds):
        before = int(ends[start - 1]) if start else 0
        stop = int(np.searchsorted(ends, before + CHUNK_TOKENS, side="right"))
        stop = min(max(stop, start + 1), start + rows, len(ds))
        col = arrow[start:stop].column(column)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise DataError(f"column {column!r} holds {col.type}, not lists of token ids")
        row_lengths = lengths[start:stop]
        yield start, _token_ids(col.flatten(), row_lengths, start, column), row_lengths
        start = stop


def sample_digests(ids: np.ndarray, row_lengths: np.ndarray) -> bytes:
    """The 16-byte BLAKE2b digest of each row's token ids (as little-endian int32), concatenated.

    Args:
        ids: the rows' token ids, flat (checked to be in ``[0, TOKEN_ID_LIMIT)``).
        row_lengths: each row's number of ids (they sum to ``len(ids)``).

    Returns:
        ``16 * len(row_lengths)`` bytes. A digest depends on its row alone, so the digests of a
        dataset are the same however its rows are split into blocks (the engines of docs/data.md).
    """
    data = memoryview(np.ascontiguousarray(ids, dtype="<i4")).cast("B")
    out = bytearray()
    start = 0
    for end in (np.cumsum(row_lengths, dtype=np.int64) * 4).tolist():
        out += hashlib.blake2b(data[start:end], digest_size=16).digest()
        start = end
    return bytes(out)


class DatasetFingerprint:
    """The dataset fingerprint: SHA-256 of every sample's row digest (:func:`sample_digests`) in dataset order,
    then of every length (int64). Digests are added as they come (:meth:`add`), so none need be kept."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"ringpack-tokens-v2|")

    def add(self, digests: bytes) -> None:
        """The digests of the next samples, in dataset order."""
        self._hash.update(digests)

    def hexdigest(self, lengths: np.ndarray) -> str:
        """The fingerprint, once every sample's digest was added; ``lengths`` are every sample's."""
        h = self._hash.copy()
        h.update(np.asarray(lengths, dtype="<i8").tobytes())
        return h.hexdigest()


def _token_ids(values: Any, row_lengths: np.ndarray, first_row: int, column: str) -> np.ndarray:
    """The flat token ids of rows ``first_row...`` as int64, each checked to be an integer in ``[0, TOKEN_ID_LIMIT)``.

    ``values`` is the Arrow array of the rows' ids, ``row_lengths`` each row's count. Whole floats
    are accepted; a :class:`DataError` (:func:`bad_token_id`) names the first sample holding a
    null, a fraction, a negative id or one beyond int32.
    """
    ids, bad = checked_token_ids(values, row_lengths, column)
    if bad is not None:
        raise bad_token_id(column, first_row + bad[0], bad[1])
    return ids


def checked_token_ids(values: Any, row_lengths: np.ndarray, column: str) -> tuple[np.ndarray, tuple[int, Any] | None]:
    """The flat token ids of some rows as int64, and ``(row, value)`` of the first bad id (``None``: all good).

    ``row`` counts from the first of these rows; a bad id is a null, a fraction, a negative id or
    one beyond int32. Raises :class:`DataError` when ``values`` are neither integers nor floats.
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
        return ids.astype(np.int64), None
    k = int(np.flatnonzero(bad)[0])
    row = int(np.searchsorted(np.cumsum(row_lengths), k, side="right"))
    return ids, (row, ids[k].item())


def bad_token_id(column: str, sample: int, value: Any) -> DataError:
    """The error for token id ``value`` of sample ``sample`` (not an integer in ``[0, TOKEN_ID_LIMIT)``)."""
    return DataError(
        f"column {column!r}, sample {sample}: token id {'null' if value != value else value!r} is not an integer "
        f"in [0, {TOKEN_ID_LIMIT}) (ids are stored as int32)"
    )


@dataclass(frozen=True)
class ShardFile:
    """One shard file: DP rank ``dp_rank``'s micro-batches of steps ``[lo, hi)``."""

    name: str
    dp_rank: int
    lo: int
    hi: int


def shard_layout(plan: Plan, steps_per_file: int) -> list[ShardFile]:
    """The output files in write order: per DP rank, one file or one per ``steps_per_file`` steps."""
    dp, n = plan.config.dp, plan.num_steps
    if steps_per_file <= 0:
        return [ShardFile(f"dp{d:05d}-of-{dp:05d}.parquet", d, 0, n) for d in range(dp)]
    return [
        ShardFile(f"dp{d:05d}-of-{dp:05d}-steps-{lo:06d}-{hi - 1:06d}.parquet", d, lo, hi)
        for d in range(dp)
        for lo, hi in ((lo, min(lo + steps_per_file, n)) for lo in range(0, n, steps_per_file))
    ]


def _schema(meta: dict[str, Any]) -> Any:
    import pyarrow as pa

    fields = [pa.field(name, pa.int64()) for name in PIECE_COLUMNS] + [pa.field("input_ids", pa.list_(pa.int32()))]
    return pa.schema(fields, metadata={b"ringpack.shard": json.dumps(meta, sort_keys=True).encode()})


def _microbatch_table(
    mb: MicroBatch, tokens: dict[int, np.ndarray], rows: dict[int, int], schema: Any, *, step: int, index: int
) -> Any:
    """One row group: a row per piece of micro-batch ``index`` of ``step`` (``tokens``/``rows`` by plan sample)."""
    import pyarrow as pa

    cols: dict[str, list[int]] = {name: [] for name in PIECE_COLUMNS}
    pieces: list[np.ndarray] = []
    slot_of = {sample: k for k, sample in enumerate(mb.samples)}
    for c, shard in enumerate(mb.shards):
        for p in shard.pieces:
            ids = tokens[p.sample]
            values = (step, index, c, slot_of[p.sample], p.sample, rows[p.sample], p.start, p.stop)
            for name, value in zip(PIECE_COLUMNS, values):
                cols[name].append(value)
            cols["next_token"].append(int(ids[p.stop]) if p.stop < len(ids) else IGNORE_INDEX)
            pieces.append(ids[p.start : p.stop])
    lens = np.fromiter((len(x) for x in pieces), dtype=np.int32, count=len(pieces))
    offsets = cumsum0(lens).astype(np.int32)
    values = np.concatenate(pieces).astype(np.int32)
    arrays = [pa.array(np.asarray(cols[name], dtype=np.int64)) for name in PIECE_COLUMNS]
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
    write_threads: int = 0,
) -> dict[str, Any]:
    """Plan ``dataset`` and write its balanced shards (the layout of :mod:`~ringpack.data.shard_format`).

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
        write_threads: shard files written at once, each by a thread (Parquet's encoding and
            compression run outside the interpreter lock); ``0``: :data:`DEFAULT_WRITE_THREADS`
            capped by the CPU count. The files' bytes do not depend on it.

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
    show = progress is not False
    if not is_int(write_threads) or write_threads < 0:
        raise ValueError(f"write_threads must be an integer >= 0 (0: automatic), got {write_threads!r}")
    out = Path(out_dir)
    check_out_dir(out, _dataset_files(dataset))
    lengths = lengths_from_dataset(dataset, column)
    plan = plan_for_shards(lengths, config, show)
    with Progress("checking token ids", "samples", len(lengths), enabled=show) as bar:
        fingerprint = _content_fingerprint(dataset, column, lengths, bar)
    run = ShardRun.start(out, plan, fingerprint, column, steps_per_file, overwrite)
    rows = _DatasetRows(dataset, column)
    with Progress(f"writing shards to {out}", "micro-batches", run.total_microbatches, enabled=show) as bar:
        todo = [file for file in run.layout if file.name not in run.finished]
        bar.update(run.total_microbatches - sum(run.microbatches(file) for file in todo))
        threads = write_threads or min(DEFAULT_WRITE_THREADS, os.cpu_count() or 1)
        _write_files(todo, lambda file: write_shard_file(out, plan, file, rows, bar), run.record_finished, threads)
    return run.finish(lengths, source)


#: Shard files :func:`write_shards` writes at once by default (fewer on a machine with fewer CPUs).
DEFAULT_WRITE_THREADS = 4


def _write_files(
    files: list[ShardFile], write: Callable[[ShardFile], str], record: Callable[[str, str], None], threads: int
) -> None:
    """``write(file)`` of every file on ``threads`` threads, ``record(name, sha256)`` in this thread as
    each one ends. On an error (or an interrupt) files not started are left, those being written
    are finished (each renamed into place whole, so a re-run keeps them), and the error is raised."""
    with ThreadPoolExecutor(threads, thread_name_prefix="ringpack-shard") as pool:
        names = {pool.submit(write, file): file.name for file in files}
        try:
            for done in as_completed(names):
                record(names[done], done.result())
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def plan_for_shards(lengths: np.ndarray, config: PlanConfig, show: bool) -> Plan:
    """The plan of ``lengths`` under ``config``, the steps counted (``show``)."""
    with Progress("planning", "steps", enabled=show) as bar:
        return make_plan(lengths, config, progress=bar.advance_to)


class ShardRun:
    """The bookkeeping of one run writing a plan's shard files into ``out``, whichever engine writes them.

    :meth:`start` claims the directory (resume, stale files, the progress record), the engine
    writes every file of :attr:`layout` not in :attr:`finished` with :func:`write_shard_file` and
    reports it with :meth:`record_finished`, and :meth:`finish` writes ``plan.parquet`` and
    ``manifest.json`` last.
    """

    def __init__(self, out: Path, plan: Plan, identity: dict[str, Any], layout: list[ShardFile], state: dict) -> None:
        self.out, self.plan, self.identity, self.layout, self._state = out, plan, identity, layout, state

    @classmethod
    def start(
        cls, out: Path, plan: Plan, fingerprint: str, column: str, steps_per_file: int, overwrite: bool
    ) -> ShardRun:
        """Claim ``out`` for ``plan``'s files (rules: :func:`write_shards`); files already written are kept.

        Raises:
            DataError: as :func:`write_shards` (another plan or dataset, a file in the way, a record not ringpack's).
        """
        layout = shard_layout(plan, steps_per_file)
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
        state = {**identity, "files_written": dict(verified), "owned": owned}
        _write_json(out / PROGRESS, state)  # before anything is removed or written: it names what is ours
        _remove_stale(out, owned, keep={*identity["files"], PLAN_FILE, PROGRESS})
        if verified:
            logger.info("%s: %d of %d shard files already written, kept", out, len(verified), len(layout))
        return cls(out, plan, identity, layout, state)

    @property
    def finished(self) -> dict[str, str]:
        """sha256 of each file written so far (kept from an earlier run or written by this one), by name."""
        return self._state["files_written"]

    @property
    def total_microbatches(self) -> int:
        return sum(self.microbatches(f) for f in self.layout)

    def microbatches(self, file: ShardFile) -> int:
        return sum(len(self.plan.steps[s].microbatches[file.dp_rank]) for s in range(file.lo, file.hi))

    def record_finished(self, name: str, sha256: str) -> None:
        """Note file ``name`` (written and renamed into place) in the progress record."""
        self.finished[name] = sha256
        _write_json(self.out / PROGRESS, self._state)

    def finish(self, lengths: np.ndarray, source: dict[str, Any] | None) -> dict[str, Any]:
        """Write ``plan.parquet`` and ``manifest.json`` once every file is written; the manifest."""
        missing = [f.name for f in self.layout if f.name not in self.finished]
        if missing:
            raise RuntimeError(f"{self.out}: {len(missing)} shard files not written, e.g. {missing[0]}")
        records = [_file_record(self.out, self.plan, f, self.finished[f.name]) for f in self.layout]
        manifest = _manifest(self.identity, self.plan, lengths, _write_plan_file(self.out, self.plan), records, source)
        _write_json(self.out / MANIFEST, manifest)
        (self.out / PROGRESS).unlink(missing_ok=True)
        return manifest


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
    name = plain_name(name, str(record))
    if not (SHARD_NAME.match(name) or name in (PLAN_FILE, MANIFEST, PROGRESS)):
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
    return (b"ringpack.shard" if SHARD_NAME.match(path.name) else b"ringpack.shard_plan") in metadata


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


class _DatasetRows:
    """The token ids of rows of a ``datasets.Dataset`` (:func:`write_shard_file`'s ``rows``)."""

    def __init__(self, dataset: Any, column: str) -> None:
        self.arrow = dataset.with_format("arrow")
        self.column = column

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        col = self.arrow[rows.tolist()].column(self.column).combine_chunks()
        return col.offsets.to_numpy().astype(np.int64), col.values.to_numpy(zero_copy_only=False)


def write_shard_file(out: Path, plan: Plan, file: ShardFile, rows: Any, bar: Any = None) -> str:
    """Write shard ``file`` of ``plan`` into ``out``: a fresh temporary name, fsync, rename into place; its sha256.

    Args:
        out: the shard directory.
        plan: the plan the file is of.
        file: which DP rank and steps (:func:`shard_layout`).
        rows: ``rows(dataset_rows) -> (offsets, ids)``: the token ids of the given dataset rows
            (int64 array ``[k]``), flat, row ``i``'s at ``ids[offsets[i]:offsets[i + 1]]``. Only
            the rows of the micro-batch being written are asked for at a time.
        bar: counts micro-batches written (``bar.update(1)``); ``None``: nothing is counted.

    The bytes depend only on ``plan``, ``file`` and the rows' ids: every engine writes the same file.
    """
    import pyarrow.parquet as pq

    meta = {"plan_hash": plan.content_hash, "dp_rank": file.dp_rank, "steps": [file.lo, file.hi]}
    schema = _schema({**meta, "version": SHARD_FORMAT_VERSION})
    doc_row, doc_offset = plan.origin_arrays()
    with atomic_write(out / file.name) as f, pq.ParquetWriter(f, schema, **_WRITE_OPTIONS) as writer:
        for s in range(file.lo, file.hi):
            for i, mb in enumerate(plan.steps[s].microbatches[file.dp_rank]):
                samples = np.asarray(mb.samples, dtype=np.int64)
                offsets, ids = rows(doc_row[samples])
                starts = offsets[:-1] + doc_offset[samples]
                tokens = {x: ids[a : a + plan.lengths[x]] for x, a in zip(mb.samples, starts.tolist())}
                row_of = dict(zip(mb.samples, doc_row[samples].tolist()))
                writer.write_table(_microbatch_table(mb, tokens, row_of, schema, step=s, index=i))
                if bar is not None:
                    bar.update(1)
    return file_sha256(out / file.name)


def _file_record(out: Path, plan: Plan, file: ShardFile, sha256: str) -> dict[str, Any]:
    """The manifest entry of a written ``file``."""
    import pyarrow.parquet as pq

    path = out / file.name
    md = pq.ParquetFile(str(path)).metadata
    mbs = [mb for s in range(file.lo, file.hi) for mb in plan.steps[s].microbatches[file.dp_rank]]
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
