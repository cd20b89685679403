"""Crash-safe, link-safe files: outputs are written under a fresh temporary name and renamed; reads follow no link.

:func:`atomic_write` creates its temporary file with ``O_CREAT | O_EXCL | O_NOFOLLOW`` under an
unpredictable name (``.NAME.<16 hex>.tmp`` next to the target), so a planted file or symbolic link
is never written through, and a reader sees either the old file or the new one, never half of one;
:func:`temp_target` recognises these names, so cleanup removes only temporaries of files a caller
owns. A folder ringpack writes (a shard directory) never holds a link, so its files are checked with
:func:`refuse_link` and opened with :func:`open_regular` (``O_NOFOLLOW``), as :func:`file_sha256`
reads them: a link planted there is refused, so nothing outside the folder is read (docs/data.md,
"Balanced shards").
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from ringpack.errors import DataError

__all__ = ["atomic_write", "file_sha256", "temp_target", "refuse_link", "open_regular"]

_TEMP = re.compile(r"^\.(?P<target>.+)\.[0-9a-f]{16}\.tmp$")
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _create_temp(path: Path) -> tuple[int, Path]:
    """A new, exclusively created temporary file next to ``path``: its descriptor and path."""
    for _ in range(16):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, _FLAGS, 0o666), tmp  # permissions: 0o666 less the umask, as open() gives
        except FileExistsError:
            continue
    raise FileExistsError(f"cannot create a temporary file next to {path}")


@contextmanager
def atomic_write(path: str | os.PathLike, durable: bool = True) -> Iterator[BinaryIO]:
    """Write ``path`` atomically: yields a binary file; on a clean exit it is fsynced (``durable``) and
    renamed onto ``path``.

    Args:
        path: the target file; its directory must exist. An existing target (or a symbolic link
            there) is replaced, never written through.
        durable: fsync before the rename, so the file survives a crash of the machine. False for
            scratch files a run never reads after a crash (renamed whole all the same).

    Raises:
        OSError: the directory is missing or not writable, or the target is a directory. On any
            error the temporary file is removed and the target is left as it was.
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{target} is a directory, not a file to write")
    fd, tmp = _create_temp(target)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def temp_target(name: str) -> str | None:
    """The target name of a temporary file :func:`atomic_write` made (``None`` for any other name)."""
    match = _TEMP.match(name)
    return match.group("target") if match else None


def refuse_link(path: str | os.PathLike, what: str) -> Path:
    """``path`` itself, unless it is a symbolic link.

    Args:
        path: a file inside a folder ringpack wrote (which never holds links).
        what: how messages name the file (``"shard file"``).

    Raises:
        DataError: ``path`` is a symbolic link (named with its target), which is never followed.
    """
    path = Path(path)
    if path.is_symlink():
        raise DataError(
            f"{what} {path} is a symbolic link (to {os.readlink(path)}); ringpack reads only regular files "
            f"inside {path.parent} and never follows a link: replace it with the file"
        )
    return path


def open_regular(path: str | os.PathLike, what: str) -> BinaryIO:
    """``path`` opened for binary reading without following a symbolic link (:func:`refuse_link`).

    Raises:
        DataError: a symbolic link, or not a regular file.
        FileNotFoundError: no file at ``path``.
    """
    path = refuse_link(path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        refuse_link(path, what)  # a link planted since the check (O_NOFOLLOW refused it)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{what} {path} is not a regular file")
    return os.fdopen(fd, "rb")


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 (hex) of the regular file ``path``; a symbolic link is refused (:class:`DataError`)."""
    h = hashlib.sha256()
    with open_regular(path, "file") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)
