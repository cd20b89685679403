"""How a message names an option: the command line's flag under ``ringpack``, the Python keyword otherwise.

Error messages end with a hint ("raise tokens_per_rank, or set overflow='split'"). A user of the
command line needs the flag (``--tokens-per-rank``, ``--overflow split``), a user of the library
the keyword. The CLI runs every command inside :func:`command_line_hints`; library code spells each
option it suggests through :func:`option`, which reads that context. A flag is the keyword with
dashes (``tokens_per_rank`` -> ``--tokens-per-rank``), which holds for every option suggested.

See docs/planner.md, "`ringpack plan`" (error hints name flags).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["command_line_hints", "on_command_line", "option"]

_UNSET: Any = object()
_COMMAND_LINE = contextvars.ContextVar("ringpack_command_line", default=False)


def option(name: str, value: Any = _UNSET) -> str:
    """The option ``name`` (set to ``value``, if given) as the caller spells it.

    Args:
        name: the Python keyword (``"overflow"``, ``"tokens_per_rank"``).
        value: the value to suggest; ``True`` under the command line is a switch (the flag alone).

    Returns:
        ``"--overflow split"`` / ``"--tokens-per-rank"`` inside :func:`command_line_hints`,
        else ``"overflow='split'"`` / ``"tokens_per_rank"``.
    """
    if _COMMAND_LINE.get():
        flag = "--" + name.replace("_", "-")
        return flag if value is _UNSET or value is True else f"{flag} {value}"
    return name if value is _UNSET else f"{name}={value!r}"


def on_command_line() -> bool:
    """Whether the caller is the ``ringpack`` command line (inside :func:`command_line_hints`)."""
    return _COMMAND_LINE.get()


@contextmanager
def command_line_hints() -> Iterator[None]:
    """Within this block :func:`option` names command-line flags (the CLI wraps every command in it)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)
