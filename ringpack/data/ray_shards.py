"""Balanced shards written on a Ray cluster (``ringpack shard --engine ray``): the local engine's files, byte for byte.

Three stages (docs/data.md, "Sharding on a cluster"): :func:`measure` (a Ray task per block of the
source, :mod:`~ringpack.data.input_blocks`, reads, tokenizes and checks it, writes its ids into the
shard directory's spill folder, :mod:`~ringpack.data.id_spill`, and sends back each row's length
and the digest of its ids, never the ids; a sample over ``max_tokens`` is refused there and then);
:func:`write_measured` (plans on the driver from the lengths alone and claims the output directory
as the local engine does, :class:`~ringpack.data.shard_writer.ShardRun`); then writing tasks each
write a run of the files with the local engine's :func:`~ringpack.data.shard_writer.write_shard_file`,
reading each micro-batch's rows from the spilled ids, so no text is tokenized twice and a task holds
one micro-batch's ids. The driver writes ``plan.parquet`` and ``manifest.json`` last, then removes
the spilled ids. Rows are numbered in the order the local engine reads them, so the plan, the files
and the manifest are the local engine's whatever the block size and the number of workers. Ray is
imported inside functions only: it is the optional extra ``ringpack[ray]``.
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
from ringpack.data.id_spill import SpilledRows, SpillFolder, write_block_ids
from ringpack.data.input_blocks import DEFAULT_BLOCK_BYTES, InputBlock, TokenSpec, block_token_ids, list_blocks
from ringpack.data.shard_writer import (
    DatasetFingerprint,
    ShardFile,
    ShardRun,
    bad_token_id,
    check_out_dir,
    check_records,
    plan_for_shards,
    sample_digests,
    write_shard_file,
)
from ringpack.data.sources import SampleTooLong, SourceFiles, source_files
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
    """About how many input bytes one read task takes (Parquet: a run of whole row groups, one at least)."""
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
    """Stage 1 of a source: its blocks, each row's length, the dataset fingerprint (:func:`measure`), and the
    folder its token ids were spilled to. As a context manager, the spilled ids are removed when the block
    ends (:meth:`discard`); :func:`write_measured` removes them too, once it is done."""

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
    spill: SpillFolder | None = field(default=None)
    """Where each block's ids were written (``None`` once discarded)."""

    def where(self, row: int) -> str:
        """Row ``row`` of the dataset as its file and row there: ``row 3 of data/b.jsonl``."""
        k = int(np.searchsorted(self.first_rows, row, side="right")) - 1
        return _where(self.blocks, self.first_rows.tolist(), k, row - int(self.first_rows[k]))

    def discard(self) -> None:
        """Remove the spilled ids (and the shard directory, when measuring created it and it stayed empty)."""
        if self.spill is not None:
            self.spill.remove()

    def __enter__(self) -> Measured:
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()


def _where(blocks: list[InputBlock], first_rows: list[int], k: int, row: int) -> str:
    """Row ``row`` of block ``k`` as its file and row there (``first_rows``: the rows before each block, to ``k``)."""
    path = blocks[k].path
    first_of_file = next(i for i in range(k + 1) if blocks[i].path == path)
    return f"row {first_rows[k] + row - first_rows[first_of_file]} of {path}"


def measure(
    source: str | os.PathLike,
    spec: TokenSpec,
    *,
    out_dir: str | os.PathLike,
    split: str | None = None,
    max_tokens: int | None = None,
    options: RayOptions = RayOptions(),
    progress: bool = True,
) -> Measured:
    """Stage 1 on the connected Ray cluster: read, tokenize and measure every row of ``source`` in parallel.

    Each task writes its block's token ids into the spill folder of ``out_dir``
    (:class:`~ringpack.data.id_spill.SpillFolder`), where :func:`write_measured` reads them.

    Args:
        source: a local file, folder of files or saved ``datasets`` folder
            (:func:`~ringpack.data.sources.source_files`), on a file system every node sees.
        spec: the token-id column, or the text column and tokenizer.
        out_dir: the shard directory the ids are spilled into (created when missing; checked as
            :func:`write_measured` checks it), on a file system every node can write.
        split: the split of a saved ``DatasetDict``.
        max_tokens: refuse a sample of more ids than this as soon as its block measures it
            (``None``: no limit).
        options: block size, retries and tasks in flight.
        progress: count the blocks read.

    Returns:
        The blocks, lengths (the driver holds these, never token ids), fingerprint and spill folder.
        On an error the spilled ids are removed.

    Raises:
        SampleTooLong: the first sample over ``max_tokens`` in dataset order (its dataset row,
            length, and file and row).
        DataError: a Hub name (not read by this engine), an output directory the local engine
            refuses, an unreadable file or block, a missing column, a sample without tokens (the
            sample and its file and row named, as the local engine names it), a task that failed
            after its retries (its block named).
    """
    ray = import_ray()
    files = source_files(source, split)
    if files is None:
        raise DataError(f"{source}: the Ray engine reads local files and saved datasets only, not Hub names")
    check_out_dir(out_dir, [files.root])
    check_records(out_dir)
    blocks = list_blocks(files, options.block_bytes)
    spill = SpillFolder(Path(out_dir))
    try:
        measured = _measure_blocks(ray, files, spec, blocks, spill, max_tokens, options, progress)
    except BaseException:
        spill.remove()
        raise
    return measured


def _measure_blocks(
    ray: Any,
    files: SourceFiles,
    spec: TokenSpec,
    blocks: list[InputBlock],
    spill: SpillFolder,
    max_tokens: int | None,
    options: RayOptions,
    progress: bool,
) -> Measured:
    """:func:`measure`'s tasks, their results taken in block order."""
    task = ray.remote(_measure_block).options(max_retries=options.max_retries)
    fingerprint = DatasetFingerprint()
    lengths: list[np.ndarray] = []
    counts = [0]
    bad: tuple[int, Any] | None = None
    window = options.window or 4 * _cpus(ray)
    args = [(spill.block_path(b.index), spill.token, max_tokens) for b in blocks]
    with Progress("reading and measuring on Ray", "blocks", len(blocks), enabled=progress) as bar:
        for k, result in enumerate(_in_order(ray, task, blocks, spec, args, window)):
            if isinstance(result, SampleTooLong):
                where = _where(blocks, counts, k, result.row)
                raise SampleTooLong(counts[-1] + result.row, result.length, where)
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
    measured = Measured(files, spec, blocks, np.asarray(counts, np.int64), all_lengths, "", bad, spill)
    if not len(all_lengths):
        raise DataError(f"dataset {files.root} holds no rows")
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


def _in_order(
    ray: Any, task: Any, blocks: list[InputBlock], spec: TokenSpec, args: list[tuple], window: int
) -> Iterator[Any]:
    """Each block's result of ``task(block, spec, *args[k])``, in block order, with at most ``window`` in flight.

    A run that stops early ends the tasks still running and waits (a few seconds at most) until they
    are gone, so none writes a spill file after the folder is removed.
    """
    pending: list[tuple[InputBlock, Any]] = []
    todo = iter(blocks)
    for block in todo:
        pending.append((block, task.remote(block, spec, *args[block.index])))
        if len(pending) >= window:
            break
    try:
        while pending:
            block, ref = pending[0]
            result = _get(ray, ref, f"reading {block.describe()}")
            pending.pop(0)
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, task.remote(nxt, spec, *args[nxt.index])))
            yield result
    finally:
        _stop(ray, [ref for _, ref in pending])


#: How long a run that stops early waits for its interrupted tasks to end before killing their workers.
_CANCEL_WAIT_S = 10.0


def _stop(ray: Any, refs: list[Any]) -> None:
    """End the tasks of ``refs`` (a run that stops early leaves none behind), those already done untouched:
    each is interrupted (a ``KeyboardInterrupt`` in the task) and waited for; only those still running
    after :data:`_CANCEL_WAIT_S` have their worker killed. Killing first races with tasks finishing at
    that moment, which can crash Ray's own bookkeeping of retried tasks in the driver."""
    _cancel(ray, refs)
    with contextlib.suppress(Exception):
        _, running = ray.wait(refs, num_returns=len(refs), timeout=_CANCEL_WAIT_S)
        _cancel(ray, running, force=True)


def _cancel(ray: Any, refs: list[Any], force: bool = False) -> None:
    """Cancel the tasks of ``refs`` (``force``: kill their workers); those already done are untouched."""
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


def _measure_block(block: InputBlock, spec: TokenSpec, spill_path: str, token: str, max_tokens: int | None) -> Any:
    """Stage 1 of one block (a Ray task): its ids written to ``spill_path``, and ``(lengths, digests, bad id)``;
    or the :class:`SampleTooLong` of its first row over ``max_tokens``, or the message of what is wrong with it."""
    try:
        ids = block_token_ids(block, spec, max_tokens)
    except SampleTooLong as exc:
        return exc
    except DataError as exc:
        return str(exc)
    if ids.bad is not None:  # the run is refused after planning: nothing of this block is written
        return ids.lengths, b"", ids.bad
    write_block_ids(spill_path, token, ids.lengths, ids.ids)
    return ids.lengths, sample_digests(ids.ids, ids.lengths), None


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
    recorded in the manifest as given); ``out_dir`` is the one ``measured`` spilled its ids into
    (:func:`measure`). The result is byte-identical to the local engine's, and an interrupted run
    resumes as it does. A bad token id is refused after planning, naming the sample and its file
    and row. The spilled ids are removed when this returns or raises.

    Raises:
        ValueError: ``measured`` was not measured into ``out_dir``, or was discarded.
    """
    if measured.spill is None or not measured.spill.path.is_dir() or measured.spill.out != Path(out_dir):
        raise ValueError(f"write_measured needs ids measured into {out_dir}: measure(..., out_dir={str(out_dir)!r})")
    try:
        return _plan_and_write(measured, Path(out_dir), config, steps_per_file, overwrite, source, options, progress)
    finally:
        measured.discard()


def _plan_and_write(
    measured: Measured,
    out: Path,
    config: PlanConfig,
    steps_per_file: int,
    overwrite: bool,
    source: dict[str, Any] | None,
    options: RayOptions,
    progress: bool,
) -> dict[str, Any]:
    """Stages 2 and 3 of :func:`write_measured`."""
    ray = import_ray()
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
    """Stage 3: write each of the ``groups`` of files in a task reading the spilled ids; as they finish."""
    assert measured.spill is not None
    paths = [measured.spill.block_path(block.index) for block in measured.blocks]
    spilled = ray.put((paths, measured.first_rows, measured.spill.token))
    write = ray.remote(_write_group).options(max_retries=options.max_retries)
    plan_ref = ray.put(plan)
    running = {write.remote(str(out.absolute()), plan_ref, group, spilled): group for group in groups}
    try:
        while running:
            (ref,), _ = ray.wait(list(running), num_returns=1)
            group = running.pop(ref)
            names = ", ".join(f.name for f in group[:3]) + (", ..." if len(group) > 3 else "")
            sha256 = _get(ray, ref, f"writing {names}")
            for file in group:
                yield file, sha256[file.name]
    finally:  # the driver stops (an error, an interrupt): no task writes on behind its back
        _stop(ray, list(running))


def _write_group(out: str, plan: Plan, files: list[ShardFile], spilled: tuple) -> dict[str, str]:
    """Stage 3's write of a group of files (a Ray task): each file's sha256, by name.

    ``spilled``: the block files, the row each block starts at and the run's token
    (:class:`~ringpack.data.id_spill.SpilledRows`); each micro-batch's rows are read as it is written.
    """
    rows = SpilledRows(*spilled)
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
        SampleTooLong: with ``config.overflow == "error"``, the first sample longer than one CP
            group holds, as soon as its block is measured (its file and row named).
        DataError, PlanError: as :func:`measure`, :func:`write_measured`.
    """
    with ray_cluster(options.address):
        measured = measure(
            source,
            spec,
            out_dir=out_dir,
            split=split,
            max_tokens=config.sample_token_limit,
            options=options,
            progress=progress,
        )
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
