"""``ringpack plan``: lengths in, shard plan out."""

from __future__ import annotations

import argparse

from ringpack._commands import not_done


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan sample lengths into a DP x CP shard plan")
    p.set_defaults(handler=not_done("issue 3, the balancer"))
