"""``ringpack report | simulate | calibrate | demo``."""

from __future__ import annotations

import argparse

from ringpack._commands import not_done


def register(subparsers: argparse._SubParsersAction) -> None:
    from ringpack.analysis import demo

    p = subparsers.add_parser("report", help="imbalance report of a plan, shard manifest or lengths")
    p.set_defaults(handler=not_done("issue 6, analysis"))
    p = subparsers.add_parser("simulate", help="simulate an epoch at cluster scale")
    p.set_defaults(handler=not_done("issue 6, analysis"))
    p = subparsers.add_parser("calibrate", help="fit the cost model to measured GPU kernel times")
    p.set_defaults(handler=not_done("issue 8, GPU performance"))
    p = subparsers.add_parser("demo", help="the embedded standard-library corpus through the planner, with exact costs")
    demo.add_arguments(p)
    p.set_defaults(handler=demo.run)
