"""Balanced shards written on a Ray cluster (``ringpack shard --engine ray``): the local engine's files, byte for byte.

Three stages (docs/data.md, "Sharding on a cluster"): :func:`measure` (Ray tasks read, tokenize and
check the source's blocks, :mod:`~ringpack.data.input_blocks`, and send back each row's length and
the digest of its ids, never the ids); :func:`write_measured` (plans on the driver from the lengths
alone and claims the output directory as the local engine does, :class:`~ringpack.data.shard_writer.ShardRun`);
then a task per block reads it again and hands each row to the task writing the files that need it,
each writing task using the local engine's :func:`~ringpack.data.shard_writer.write_shard_file`; the
driver writes ``plan.parquet`` and ``manifest.json`` last.

Rows are numbered in the order the local engine reads them, so the plan, the files and the manifest
are the local engine's whatever the block size and the number of workers. Ray is imported inside
functions only: it is the optional extra ``ringpack[ray]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.cost import MAX_SAMPLE_TOKENS
from ringpack.data.input_blocks import DEFAULT_BLOCK_BYTES, InputBlock, TokenSpec, block_token_ids, list_blocks
from ringpack.data.shard_writer import (
    DatasetFingerprint,
    ShardFile,
    ShardRun,
    bad_token_id,
    check_out_dir,
    plan_for_shards,
    sample_digests,
    write_shard_file,
)
from ringpack.data.sources import SourceFiles, source_files
from ringpack.errors import DataError
from ringpack.lengths import check_lengths
from ringpack.progress import Progress
from ringpack.shard_plan import Plan, PlanConfig

__all__ = ["INSTALL_HINT", "Measured", "RayOptions", "measure", "ray_cluster", "write_measured", "write_shards_ray"]

logger = logging.getLogger("ringpack.data.shards")
#: How to get Ray (messages quote it).
INSTALL_HINT = "pip install 'ringpack[ray]'"


@dataclass(frozen=True, kw_only=True)
class RayOptions:
    """How the Ray engine runs."""

    address: str | None = None
    """The cluster to connect to (``"auto"``, ``"ray://head:10001"``, ...); ``None``: the one this process is
    connected to, else ``RAY_ADDRESS``, else a local cluster started for the run and stopped after it."""
    block_bytes: int = DEFAULT_BLOCK_BYTES
    """About how many input bytes one read task takes (a Parquet row group is one block whatever its size)."""
    write_tasks: int | None = None
    """How many tasks write the shard files (``None``: two per CPU of the cluster, at most one per file)."""
    max_retries: int = 3
    """How often Ray runs a task again whose worker died, before the run ends naming the block or files."""
    window: int | None = None
    """Read tasks in flight at once (``None``: four per CPU): bounds what waits in the object store."""


def import_ray() -> Any:
    """The ``ray`` module; a ``ValueError`` saying how to install it when it is missing."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"the Ray engine needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


@contextmanager
def ray_cluster(address: str | None = None) -> Iterator[Any]:
    """Connected to a Ray cluster while the block runs; yields the ``ray`` module.

    A process already connected stays so; otherwise this connects to ``address`` (``None``:
    ``RAY_ADDRESS`` or a new local cluster, without dashboard) and disconnects after the block
    (a local cluster started here stops).

    Raises:
        ValueError: Ray is not installed (the message says how to install it).
    """
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    local = address is None and not os.environ.get("RAY_ADDRESS")
    extra = {"include_dashboard": False} if local else {}
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, **extra)
    try:
        yield ray
    finally:
        ray.shutdown()


@dataclass(frozen=True, eq=False)
class Measured:
    """Stage 1 of a source: its blocks, each row's length, the dataset fingerprint (:func:`measure`)."""

    source: SourceFiles
    spec: TokenSpec
    blocks: list[InputBlock]
    first_rows: np.ndarray
    """int64 ``[len(blocks) + 1]``: the dataset row each block starts at (the last: the number of rows)."""
    lengths: np.ndarray
    """int64 ``[N]``: each row's number of token ids, in dataset order."""
    fingerprint: str
    bad_id: tuple[int, Any] | None = field(default=None)
    """``(row, value)``: the first token id that is not an integer in ``[0, 2**31)`` (refused after planning)."""

    def where(self, row: int) -> str:
        """Row ``row`` of the dataset as its file and row there: ``row 3 of data/b.jsonl``."""
        k = int(np.searchsorted(self.first_rows, row, side="right")) - 1
        path = self.blocks[k].path
        first_of_file = next(i for i in range(k + 1) if self.blocks[i].path == path)
        return f"row {row - int(self.first_rows[first_of_file])} of {path}"


def measure(
    source: str | os.PathLike,
    spec: TokenSpec,
    *,
    split: str | None = None,
    options: RayOptions = RayOptions(),
    progress: bool = True,
) -> Measured:
    """Stage 1 on the connected Ray cluster: read, tokenize and measure every row of ``source`` in parallel.

    Args:
        source: a local file, folder of files or saved ``datasets`` folder
            (:func:`~ringpack.data.sources.source_files`), on a file system every node sees.
        spec: the token-id column, or the text column and tokenizer.
        split: the split of a saved ``DatasetDict``.
        options: block size, retries and tasks in flight.
        progress: count the blocks read.

    Returns:
        The blocks, lengths (the driver holds these, never token ids) and fingerprint.

    Raises:
        DataError: a Hub name (not read by this engine), an unreadable file or block, a missing
            column, a sample without tokens (the sample and its file and row named, as the local
            engine names it), a task that failed after its retries (its block named).
    """
    ray = import_ray()
    files = source_files(source, split)
    if files is None:
        raise DataError(f"{source}: the Ray engine reads local files and saved datasets only, not Hub names")
    blocks = list_blocks(files, options.block_bytes)
    task = ray.remote(_measure_block).options(max_retries=options.max_retries)
    fingerprint = DatasetFingerprint()
    lengths: list[np.ndarray] = []
    counts = [0]
    bad: tuple[int, Any] | None = None
    window = options.window or 4 * _cpus(ray)
    with Progress("reading and measuring on Ray", "blocks", len(blocks), enabled=progress) as bar:
        for result in _in_order(ray, task, blocks, spec, window):
            if isinstance(result, str):
                raise DataError(result)
            part, digests, bad_local = result
            if bad is None and bad_local is not None:
                bad = (counts[-1] + bad_local[0], bad_local[1])
            fingerprint.add(digests)
            lengths.append(part)
            counts.append(counts[-1] + len(part))
            bar.update(1)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    measured = Measured(files, spec, blocks, np.asarray(counts, np.int64), all_lengths, "", bad)
    if not len(all_lengths):
        raise DataError(f"dataset {source} holds no rows")
    _check_lengths(measured)
    return dataclasses.replace(measured, fingerprint=fingerprint.hexdigest(all_lengths))


def _check_lengths(measured: Measured) -> None:
    """The local engine's check of every length, the offending sample's file and row added."""
    try:
        check_lengths(measured.lengths, what=f"lengths of column {measured.spec.column!r}")
    except DataError as exc:
        row = int(np.flatnonzero((measured.lengths < 1) | (measured.lengths > MAX_SAMPLE_TOKENS))[0])
        raise DataError(f"{exc} [{measured.where(row)}]") from None


def _cpus(ray: Any) -> int:
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _in_order(ray: Any, task: Any, blocks: list[InputBlock], spec: TokenSpec, window: int) -> Iterator[Any]:
    """Each block's result of ``task``, in block order, with at most ``window`` tasks in flight."""
    pending: list[tuple[InputBlock, Any]] = []
    todo = iter(blocks)
    for block in todo:
        pending.append((block, task.remote(block, spec)))
        if len(pending) >= window:
            break
    try:
        while pending:
            block, ref = pending[0]
            result = _get(ray, ref, f"reading {block.describe()}")
            pending.pop(0)
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, task.remote(nxt, spec)))
            yield result
    finally:
        _cancel(ray, [ref for _, ref in pending])


def _cancel(ray: Any, refs: list[Any], force: bool = False) -> None:
    """Stop the tasks of ``refs`` (a run that ends early leaves none behind); those already done are untouched."""
    for ref in refs:
        with contextlib.suppress(Exception):  # a task that finished or whose worker is gone
            ray.cancel(ref, force=force)


def _get(ray: Any, ref: Any, what: str) -> Any:
    """``ray.get(ref)``; a task that failed (after Ray's retries) is one :class:`DataError` naming ``what``."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, DataError):
            raise DataError(str(cause)) from None
        reason = " ".join(str(cause or exc).split())[:300]
        raise DataError(f"{what} failed on Ray ({type(exc).__name__}): {reason}") from None


def _measure_block(block: InputBlock, spec: TokenSpec) -> Any:
    """Stage 1 of one block (a Ray task): ``(lengths, digests, bad id)``, or the message of what is wrong with it."""
    try:
        ids = block_token_ids(block, spec)
    except DataError as exc:
        return str(exc)
    digests = sample_digests(ids.ids, ids.lengths) if ids.bad is None else b""
    return ids.lengths, digests, ids.bad


def write_measured(
    measured: Measured,
    out_dir: str | os.PathLike,
    config: PlanConfig,
    *,
    steps_per_file: int = 0,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
    options: RayOptions = RayOptions(),
    progress: bool = True,
) -> dict[str, Any]:
    """Stages 2 and 3 on the connected Ray cluster: plan ``measured`` and write its shards into ``out_dir``.

    Args, returns and raises as :func:`~ringpack.data.shard_writer.write_shards` (``source`` is
    recorded in the manifest as given); ``out_dir`` must be on a file system every node sees. The
    result is byte-identical to the local engine's, and an interrupted run resumes as it does.
    A bad token id is refused after planning, naming the sample and its file and row.
    """
    ray = import_ray()
    out = Path(out_dir)
    check_out_dir(out, [measured.source.root])
    plan = plan_for_shards(measured.lengths, config, progress)
    if measured.bad_id is not None:
        row, value = measured.bad_id
        raise DataError(f"{bad_token_id(measured.spec.column, row, value)} [{measured.where(row)}]")
    run = ShardRun.start(out, plan, measured.fingerprint, measured.spec.column, steps_per_file, overwrite)
    todo = [f for f in run.layout if f.name not in run.finished]
    with Progress(f"writing shards to {out} on Ray", "micro-batches", run.total_microbatches, enabled=progress) as bar:
        bar.update(run.total_microbatches - sum(run.microbatches(f) for f in todo))
        if todo:
            tasks = options.write_tasks or 2 * _cpus(ray)
            n = min(len(todo), tasks)
            groups = [todo[len(todo) * g // n : len(todo) * (g + 1) // n] for g in range(n)]
            for file, sha256 in _write_groups(ray, measured, plan, out, groups, options):
                run.record_finished(file.name, sha256)
                bar.update(run.microbatches(file))
    return run.finish(measured.lengths, source)


def _write_groups(
    ray: Any, measured: Measured, plan: Plan, out: Path, groups: list[list[ShardFile]], options: RayOptions
) -> Iterator[tuple[ShardFile, str]]:
    """Stage 3: split every block's rows among the ``groups`` of files, write each group in a task; as they finish."""
    rows, group_of = _destinations(plan, groups)
    split = ray.remote(_split_block).options(num_returns=len(groups), max_retries=options.max_retries)
    pieces: list[list[Any]] = []
    for k, block in enumerate(measured.blocks):
        lo, hi = int(measured.first_rows[k]), int(measured.first_rows[k + 1])
        a, b = np.searchsorted(rows, [lo, hi])
        if a == b:
            continue
        refs = split.remote(block, measured.spec, rows[a:b] - lo, group_of[a:b], lo, hi - lo, len(groups))
        pieces.append(refs if len(groups) > 1 else [refs])
    write = ray.remote(_write_group).options(max_retries=options.max_retries)
    plan_ref = ray.put(plan)
    running = {
        write.remote(str(out.absolute()), plan_ref, group, [refs[g] for refs in pieces]): group
        for g, group in enumerate(groups)
    }
    try:
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            group = running.pop(ref)
            names = ", ".join(f.name for f in group[:3]) + (", ..." if len(group) > 3 else "")
            sha256 = _get(ray, ref, f"writing {names}")
            for file in group:
                yield file, sha256[file.name]
    finally:  # the driver stops (an error, an interrupt): no task writes on behind its back
        _cancel(ray, list(running), force=True)
        _cancel(ray, [ref for refs in pieces for ref in refs])


def _destinations(plan: Plan, groups: list[list[ShardFile]]) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(dataset row, group)`` pair where the group's files hold a piece of the row, sorted by row."""
    doc_row, _ = plan.origin_arrays()
    keys = []
    for g, files in enumerate(groups):
        for f in files:
            for s in range(f.lo, f.hi):
                for mb in plan.steps[s].microbatches[f.dp_rank]:
                    keys.append(doc_row[np.asarray(mb.samples, dtype=np.int64)] * len(groups) + g)
    key = np.unique(np.concatenate(keys)) if keys else np.zeros(0, np.int64)
    return key // len(groups), key % len(groups)


def take_rows(offsets: np.ndarray, ids: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The ids of ``rows`` of flat ``ids`` (row ``i``'s at ``ids[offsets[i]:offsets[i + 1]]``): ``(offsets, ids)``."""
    starts, ends = offsets[rows], offsets[rows + 1]
    sizes = ends - starts
    new = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(sizes, out=new[1:])
    index = np.arange(new[-1], dtype=np.int64) + np.repeat(starts - new[:-1], sizes)
    return new, ids[index]


def _split_block(
    block: InputBlock, spec: TokenSpec, rows: np.ndarray, groups: np.ndarray, first_row: int, count: int, n: int
) -> Any:
    """Stage 3's read of one block (a Ray task): per group, ``(dataset rows, offsets, ids)`` of the rows it needs."""
    ids = block_token_ids(block, spec)
    if len(ids.lengths) != count or ids.bad is not None:
        raise DataError(f"{block.describe()} changed while it was sharded ({len(ids.lengths)} rows, were {count})")
    offsets = np.zeros(count + 1, dtype=np.int64)
    np.cumsum(ids.lengths, out=offsets[1:])
    parts = []
    for g in range(n):
        mine = rows[groups == g]
        parts.append((mine + first_row, *take_rows(offsets, ids.ids, mine)))
    return parts if n > 1 else parts[0]


class _GatheredRows:
    """The token ids of the dataset rows a writing task was sent (:func:`write_shard_file`'s ``rows``)."""

    def __init__(self, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        self.rows = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        sizes = np.concatenate([np.diff(p[1]) for p in parts]) if parts else np.zeros(0, np.int64)
        self.offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=self.offsets[1:])
        self.ids = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.int32)

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return take_rows(self.offsets, self.ids, np.searchsorted(self.rows, rows))


def _write_group(out: str, plan: Plan, files: list[ShardFile], piece_refs: list[Any]) -> dict[str, str]:
    """Stage 3's write of a group of files (a Ray task): each file's sha256, by name."""
    import ray

    rows = _GatheredRows(ray.get(piece_refs))
    return {f.name: write_shard_file(Path(out), plan, f, rows) for f in files}


def write_shards_ray(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    config: PlanConfig,
    *,
    spec: TokenSpec = TokenSpec(),
    split: str | None = None,
    steps_per_file: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    record: dict[str, Any] | None = None,
    options: RayOptions = RayOptions(),
) -> dict[str, Any]:
    """:func:`~ringpack.data.shard_writer.write_shards` of a local source on a Ray cluster: the same files.

    Args:
        source: a file, folder of files or saved ``datasets`` folder every node can read.
        out_dir: the shard directory, on a file system every node can write.
        config: the plan config.
        spec: the token-id column, or the text column and tokenizer (:class:`TokenSpec`).
        split: the split of a saved ``DatasetDict``.
        steps_per_file, overwrite, progress: as for ``write_shards``.
        record: the manifest's ``source`` entry, as given.
        options: the cluster and how the work is cut (:class:`RayOptions`).

    Returns:
        The manifest.

    Raises:
        ValueError: Ray is not installed (how to install it named).
        DataError, PlanError: as :func:`measure`, :func:`write_measured`.
    """
    with ray_cluster(options.address):
        measured = measure(source, spec, split=split, options=options, progress=progress)
        return write_measured(
            measured,
            out_dir,
            config,
            steps_per_file=steps_per_file,
            overwrite=overwrite,
            source=record,
            options=options,
            progress=progress,
        )
