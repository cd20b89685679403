"""The ``ringpack`` command line: ``plan | shard | report | simulate | calibrate | demo``.

One module per command (:mod:`~ringpack.cli.plan`, ...), the flags they share in
:mod:`~ringpack.cli.flags` (those of lengths and texts in :mod:`~ringpack.cli.lengths_input`),
``--config`` files in :mod:`~ringpack.cli.config_file`, the parser and :func:`main` in
:mod:`~ringpack.cli.app`, which imports only the command that runs; a command whose running needs
torch runs from a module of its own (:mod:`~ringpack.cli.calibrate_run`,
:mod:`~ringpack.cli.demo_run`), so its ``--help`` needs none. Results go to stdout; notes, warnings
and progress to stderr (``ringpack COMMAND: ...``; off with ``--quiet``). Bad input ends in one line
on stderr and exit 1; hints in it name flags (``--overflow split``), not Python keywords.

See docs/planner.md, "`ringpack plan`", and docs/analysis.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringpack._lazy import lazy_face

_EXPORTS = {
    "LENGTHS_HELP": "ringpack.cli.lengths_input",
    "build_parser": "ringpack.cli.app",
    "main": "ringpack.cli.app",
    "parse": "ringpack.cli.app",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from ringpack.cli.app import build_parser, main, parse  # noqa: F401
    from ringpack.cli.lengths_input import LENGTHS_HELP  # noqa: F401

__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
