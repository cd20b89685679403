"""Helpers shared by the subpackages' ``commands`` modules (kept out of ``cli`` so that nothing imports ``cli``)."""

from __future__ import annotations

import argparse
import sys
from typing import Callable


def not_done(issue: str) -> Callable[[argparse.Namespace], int]:
    """Handler for a subcommand whose issue has not landed: exit code 2 and a clear message."""

    def handler(args: argparse.Namespace) -> int:
        print(f"ringpack {args.command}: not implemented yet ({issue})", file=sys.stderr)
        return 2

    return handler
