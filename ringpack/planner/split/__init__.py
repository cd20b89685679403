"""CP split strategies: cut one micro-batch's samples into pieces for C context-parallel ranks.

Every strategy takes the micro-batch's samples (in micro-batch order) with their lengths and
returns a :class:`~ringpack.shard_plan.MicroBatch`; none needs divisibility or padding (a sample
may be cut anywhere; empty chunks are absent). Import the strategies from here:

* :mod:`~ringpack.planner.split.baselines`: ``split_contiguous``, ``split_zigzag``,
  ``split_zigzag_even``, which ignore the cost model;
* :mod:`~ringpack.planner.split.balanced`: ``split_balanced`` and ``split_balanced_many``, the
  cost-balanced split, whose parts (``problem``, ``batch``, ``last_pieces``, ``best_fit``,
  ``suffix_cuts``, ``fallbacks``) each have a module;
* :mod:`~ringpack.planner.split.pieces`: piece costs and ``(slot, start, stop)`` shards.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

from ringpack.planner.split.balanced import (
    CP_BALANCE_TOLERANCE,
    LOCKSTEP_MIN_GROUPS,
    split_balanced,
    split_balanced_many,
)
from ringpack.planner.split.baselines import split_contiguous, split_zigzag, split_zigzag_even

__all__ = [
    "split_contiguous",
    "split_zigzag",
    "split_balanced",
    "split_balanced_many",
    "split_zigzag_even",
    "CP_BALANCE_TOLERANCE",
    "LOCKSTEP_MIN_GROUPS",
]
