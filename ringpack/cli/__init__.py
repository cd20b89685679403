"""The ``ringpack`` command line: ``plan | shard | report | simulate | calibrate | demo``.

One module per command (:mod:`~ringpack.cli.plan`, ...), the flags they share in
:mod:`~ringpack.cli.flags`, ``--config`` files in :mod:`~ringpack.cli.config_file`, the parser and
:func:`main` in :mod:`~ringpack.cli.app`. Results go to stdout; notes, warnings and progress to
stderr (``ringpack COMMAND: ...``; off with ``--quiet``). Bad input ends in one line on stderr and
exit 1; hints in it name flags (``--overflow split``), not Python keywords.

See docs/planner.md, "`ringpack plan`", and docs/analysis.md.
"""

from ringpack.cli.app import build_parser, main, parse
from ringpack.cli.flags import LENGTHS_HELP

__all__ = ["LENGTHS_HELP", "build_parser", "main", "parse"]
