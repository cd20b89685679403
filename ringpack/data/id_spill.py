"""Token ids kept on disk between reading a dataset and writing its shards (docs/data.md, "Sharding on a cluster").

A distributed engine tokenizes each block of a source once: the task that reads a block writes its
ids with :func:`write_block_ids` into a :class:`SpillFolder` (``.ringpack-spill/`` inside the shard
directory, on a file system every node sees), one uncompressed Arrow IPC file per block (a single
``large_list<int32>`` column: flat int32 ids and int64 offsets), under a temporary name renamed into
place, so a retried task replaces its file whole. A writing task reads only the rows it is asked
for (:class:`SpilledRows`, positioned reads), so it holds one micro-batch's ids, not its files'.
Each file carries the run's token: a file an earlier run left is never read as this run's. The
folder holds nothing else of ringpack's; only files under the names written here are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
from bisect import bisect_right
from pathlib import Path

import numpy as np

from ringpack._files import atomic_write, temp_target
from ringpack.errors import DataError
from ringpack.ranges import cumsum0

__all__ = ["SPILL_FOLDER", "SpillFolder", "SpilledRows", "write_block_ids"]

logger = logging.getLogger("ringpack.data.shards")
#: The folder, inside the shard directory, that holds the spilled ids while a run writes.
SPILL_FOLDER = ".ringpack-spill"
_BLOCK_FILE = re.compile(r"^block-\d{6,}\.arrow$")
_METADATA_KEY = b"ringpack.spill"


class SpillFolder:
    """The spill folder of one run: ``out/.ringpack-spill``, with a token naming the run's files.

    Args:
        out: the shard directory (created here when missing, with its parents).

    Raises:
        DataError: something other than a folder is at the spill folder's path (a file, a link).
    """

    def __init__(self, out: Path) -> None:
        self.created_out = not out.exists()
        self.out = out
        self.path = out / SPILL_FOLDER
        self.token = secrets.token_hex(8)
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_dir()):
            raise DataError(f"{self.path} is in the way (not a folder ringpack made); remove it or write elsewhere")
        self.path.mkdir(parents=True, exist_ok=True)
        self._clear()  # what a run that ended without cleaning up left: rewritten by this one, never read

    def block_path(self, index: int) -> str:
        """The absolute path of block ``index``'s file (the same on every node)."""
        return str(self.path.absolute() / f"block-{index:06d}.arrow")

    def remove(self) -> None:
        """Remove this folder's block files and the folder (kept, with a warning, when it holds anything else);
        also the shard directory when this run created it and it stayed empty."""
        if self.path.is_dir() and not self.path.is_symlink():
            self._clear()
            try:
                self.path.rmdir()
            except OSError:
                logger.warning("%s left in place: it holds files ringpack did not write", self.path)
        if self.created_out:
            with contextlib.suppress(OSError):  # not empty: the shards, or the user's files
                self.out.rmdir()

    def _clear(self) -> None:
        for entry in self.path.iterdir():
            if _BLOCK_FILE.match(temp_target(entry.name) or entry.name) and entry.is_file() and not entry.is_symlink():
                entry.unlink(missing_ok=True)


def write_block_ids(path: str, token: str, lengths: np.ndarray, ids: np.ndarray) -> None:
    """Write one block's ids to ``path`` atomically: row ``i``'s ids at ``ids[offsets[i]:offsets[i + 1]]``.

    Args:
        path: the block's file (:meth:`SpillFolder.block_path`).
        token: the run's token (:attr:`SpillFolder.token`), checked when the file is read.
        lengths: int64 ``[n]``, each row's number of ids.
        ids: int32, the rows' ids, flat.
    """
    import pyarrow as pa

    offsets = cumsum0(np.asarray(lengths, dtype=np.int64))
    column = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(ids, dtype=np.int32)))
    schema = pa.schema([pa.field("ids", column.type)], metadata={_METADATA_KEY: token.encode()})
    batch = pa.record_batch([column], schema=schema)
    # scratch: a later run never reads it (the per-run token), so no fsync is spent on it
    with atomic_write(path, durable=False) as f, pa.ipc.new_file(f, schema) as writer:
        writer.write_batch(batch)


class SpilledRows:
    """The token ids of dataset rows, read from a run's block files (:func:`write_shard_file`'s ``rows``).

    Args:
        paths: every block's file, in block order.
        first_rows: int64 ``[len(paths) + 1]``, the dataset row each block starts at.
        token: the run's token.

    Only the rows asked for are read (positioned reads: no file stays mapped or open), so a call
    holds its rows' ids alone; each file's layout is read once, when it is first needed.

    Raises:
        DataError: (on a call) a block file that is missing, not this run's or not its block's rows.
    """

    def __init__(self, paths: list[str], first_rows: np.ndarray, token: str) -> None:
        self.paths, self.first_rows, self.token = paths, first_rows.tolist(), token
        self._layout: dict[int, tuple[int, int]] = {}

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        blocks = [bisect_right(self.first_rows, r) - 1 for r in rows.tolist()]
        pieces: list[np.ndarray] = [np.zeros(0, np.int32)] * len(blocks)
        for b in sorted(set(blocks)):
            mine = [i for i, k in enumerate(blocks) if k == b]
            for i, piece in zip(mine, self._read(b, [int(rows[i]) - self.first_rows[b] for i in mine])):
                pieces[i] = piece
        sizes = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
        return cumsum0(sizes), np.concatenate(pieces) if pieces else np.zeros(0, np.int32)

    def _read(self, block: int, local: list[int]) -> list[np.ndarray]:
        """The ids of rows ``local`` of block ``block``."""
        offsets_at, ids_at = self._positions(block)
        lo, hi = min(local), max(local) + 2
        fd = os.open(self.paths[block], os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            offsets = np.frombuffer(_pread(fd, 8 * (hi - lo), offsets_at + 8 * lo), dtype="<i8")
            return [
                np.frombuffer(_pread(fd, 4 * int(b - a), ids_at + 4 * int(a)), dtype="<i4")
                for a, b in (offsets[k - lo : k - lo + 2] for k in local)
            ]
        finally:
            os.close(fd)

    def _positions(self, block: int) -> tuple[int, int]:
        """Where block ``block``'s offsets and ids start in its file (read from its Arrow footer once)."""
        if block not in self._layout:
            self._layout[block] = _buffer_positions(
                self.paths[block], self.token, self.first_rows[block + 1] - self.first_rows[block]
            )
        return self._layout[block]


def _pread(fd: int, size: int, at: int) -> bytes:
    data = os.pread(fd, size, at)
    while len(data) < size:  # a short read (large reads on some file systems)
        more = os.pread(fd, size - len(data), at + len(data))
        if not more:
            raise DataError("a spilled token-id file ended early: it changed while the shards were written")
        data += more
    return data


def _buffer_positions(path: str, token: str, rows: int) -> tuple[int, int]:
    """The file positions of the offsets and ids of block file ``path``, checked to be this run's ``rows`` rows."""
    import pyarrow as pa

    try:
        with pa.memory_map(path) as mm:
            base = mm.read_buffer(1).address  # the map's start (a memory map reads without copying)
            mm.seek(0)
            reader = pa.ipc.open_file(mm)
            metadata = reader.schema.metadata or {}
            batch = reader.get_batch(0)
            column = batch.column(0)
            positions = (
                column.buffers()[1].address - base + 8 * column.offset,
                column.values.buffers()[1].address - base + 4 * column.values.offset,
            )
            found = batch.num_rows
    except (OSError, ValueError, pa.ArrowException) as exc:
        raise DataError(f"cannot read spilled token ids {path}: {exc}") from None
    if metadata.get(_METADATA_KEY) != token.encode() or found != rows:
        raise DataError(f"{path} is not this run's token ids ({found} rows, expected {rows}); run the command again")
    return positions
