"""The ``ringpack`` command line: ``plan | report | shard | simulate | calibrate | demo``.

Each subpackage owns its subcommands in a ``commands`` module exposing ``register(subparsers)``;
this file only assembles them, so a part of the system can grow its command without touching the
others. A handler returns the process exit code.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module
from typing import Sequence

# Subpackages whose ``commands`` module registers subcommands, in the order ``--help`` lists them.
COMMAND_MODULES = ("ringpack.balancer.commands", "ringpack.dataloaders.commands", "ringpack.analysis.commands")


def build_parser() -> argparse.ArgumentParser:
    from ringpack import __version__

    parser = argparse.ArgumentParser(
        prog="ringpack",
        description="Cost-balanced packing and DP x CP sharding of variable-length samples, and its analysis.",
    )
    parser.add_argument("--version", action="version", version=f"ringpack {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except (ValueError, FileNotFoundError) as exc:  # user mistakes: one clear line, no traceback
        print(f"ringpack {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
