"""Token counts of a text file, kept on disk so a dataset is tokenized once (docs/data.md, "The length cache").

Counting the tokens of a text column is the slow part of planning a text dataset; the counts depend
only on the file, the column and the tokenizer. :func:`entry_key` describes those three: the file
by its real path, size and modification time (and, for a file of at most :data:`HASHED_BYTES`, a
hash of its bytes; a saved ``datasets`` folder by every file in it), the tokenizer by a hash of its
``tokenizer.json`` (or of its folder's files, or of a ``tokenizers.Tokenizer``'s serialization), or
``"regex"`` for the regex tokenizer, whose counts do not depend on its id range. :func:`load` gives
the counts stored under a key, :func:`store` writes them.

An entry lives in :func:`cache_dir` (``$RINGPACK_CACHE/lengths``, else
``~/.cache/ringpack/lengths``), one file per file, column and tokenizer, named by a hash of these:
a changed file replaces its entry instead of adding one. The entry holds the whole key and a
checksum of the counts; one whose key differs, that is cut short or altered, is ignored (and
rewritten by the next count), never trusted. Entries are written to a temporary file and renamed,
so a reader sees a whole entry or none; a folder that cannot be written only means counting again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._files import atomic_write

__all__ = ["HASHED_BYTES", "cache_dir", "entry_key", "load", "store", "tokenizer_identity"]

logger = logging.getLogger("ringpack.lengths")
#: Files up to this size are also known by a hash of their bytes (an edit within the same
#: modification-time tick changes the key too).
HASHED_BYTES = 1 << 20
#: Bumped when counting changes, so entries of an older rule are never read.
VERSION = 1
_MAGIC = b"ringpack-lengths\n"


def cache_dir(root: str | os.PathLike | None = None) -> Path:
    """The folder of the length cache: ``root`` when given, else ``$RINGPACK_CACHE/lengths``, else
    ``$XDG_CACHE_HOME/ringpack/lengths`` (``~/.cache/ringpack/lengths``)."""
    if root is not None:
        return Path(root)
    if os.environ.get("RINGPACK_CACHE"):
        return Path(os.environ["RINGPACK_CACHE"]) / "lengths"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ringpack" / "lengths"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    identity: dict[str, Any] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if stat.st_size <= HASHED_BYTES:
        identity["sha256"] = _sha256_file(path)
    return identity


def source_identity(path: str | os.PathLike) -> dict[str, Any]:
    """What the key knows of a data file or folder: its real path and, for each file, size and modification time.

    Raises:
        OSError: ``path`` cannot be read.
    """
    real = Path(os.path.realpath(path))
    if real.is_dir():
        files = sorted(p for p in real.rglob("*") if p.is_file())
        return {"path": str(real), "files": {str(p.relative_to(real)): _file_identity(p) for p in files}}
    return {"path": str(real), **_file_identity(real)}


def tokenizer_identity(tokenizer: Any) -> str | None:
    """A string that changes whenever ``tokenizer``'s counts could, or ``None`` where it cannot be told.

    ``None`` / ``"regex"``: ``"regex"``. A ``tokenizer.json`` file, or a folder (its ``tokenizer.json``,
    else every file in it): a hash of the bytes read. A ``tokenizers.Tokenizer``: a hash of its
    serialization. A Hub name, a ``transformers`` tokenizer object or a counting function: ``None``
    (what they count can change without a file here changing, so they are not cached).
    """
    if tokenizer is None or (isinstance(tokenizer, str) and tokenizer == "regex"):
        return "regex"
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if path.is_dir() and (path / "tokenizer.json").is_file():
            path = path / "tokenizer.json"
        if path.is_file():
            return "file:" + _sha256_file(path)
        if path.is_dir():
            digest = hashlib.sha256()
            for p in sorted(q for q in path.iterdir() if q.is_file()):
                digest.update(p.name.encode() + b"\0" + _sha256_file(p).encode())
            return "folder:" + digest.hexdigest()
        return None
    if hasattr(tokenizer, "to_str") and hasattr(tokenizer, "encode_batch"):  # a tokenizers.Tokenizer
        return "tokenizers:" + hashlib.sha256(tokenizer.to_str().encode()).hexdigest()
    return None


def entry_key(path: str | os.PathLike, column: str, tokenizer: Any) -> dict[str, Any] | None:
    """The key of the token counts of ``column`` of the file or folder ``path`` by ``tokenizer``.

    Returns:
        A JSON-able dict, or ``None`` when the tokenizer cannot be told (:func:`tokenizer_identity`)
        or the source cannot be read (nothing is cached then).
    """
    identity = tokenizer_identity(tokenizer)
    if identity is None:
        return None
    try:
        source = source_identity(path)
    except OSError:
        return None
    return {"version": VERSION, "source": source, "column": column, "tokenizer": identity}


def _entry_path(key: dict[str, Any], root: str | os.PathLike | None) -> Path:
    """One entry per file, column and tokenizer: a changed file's counts replace the old ones."""
    name = json.dumps([key["source"]["path"], key["column"], key["tokenizer"]])
    return cache_dir(root) / (hashlib.sha256(name.encode()).hexdigest()[:32] + ".lengths")


def load(key: dict[str, Any] | None, root: str | os.PathLike | None = None) -> np.ndarray | None:
    """The counts stored under ``key`` (int64 ``[N]``), or ``None``: no entry, another key's, or a damaged one."""
    if key is None:
        return None
    path = _entry_path(key, root)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not a length cache entry")
        header, _, payload = data[len(_MAGIC) :].partition(b"\n")
        meta = json.loads(header)
        if meta["key"] != key:
            return None  # the file changed (or another tokenizer): counted again and replaced
        if len(payload) != 8 * meta["count"] or hashlib.sha256(payload).hexdigest() != meta["sha256"]:
            raise ValueError("its counts do not match their checksum")
    except (ValueError, KeyError, TypeError) as exc:
        logger.debug("ignoring the length cache entry %s: %s", path, exc)
        return None
    return np.frombuffer(payload, dtype="<i8").astype(np.int64)


def store(key: dict[str, Any] | None, lengths: np.ndarray, root: str | os.PathLike | None = None) -> Path | None:
    """Write ``lengths`` under ``key`` (atomically); the entry's path, or ``None`` when nothing was written.

    A cache that cannot be written (a read-only home, a full disk) is skipped, never an error.
    """
    if key is None:
        return None
    path = _entry_path(key, root)
    payload = np.ascontiguousarray(lengths, dtype="<i8").tobytes()
    header = json.dumps({"key": key, "count": len(lengths), "sha256": hashlib.sha256(payload).hexdigest()})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as f:
            f.write(_MAGIC + header.encode() + b"\n" + payload)
    except OSError as exc:
        logger.debug("cannot write the length cache entry %s: %s", path, exc)
        return None
    return path
