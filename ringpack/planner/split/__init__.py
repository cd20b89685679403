"""CP split strategies: cut one micro-batch's samples into pieces for C context-parallel ranks.

Every strategy takes the micro-batch's samples (in micro-batch order) with their lengths and
returns a :class:`~ringpack.shard_plan.MicroBatch`. None needs any divisibility rule or padding:
a sample of any length >= 1 may be cut anywhere, and chunks that come out empty are simply absent.

This module is the strategies' one entry point (import them from here); each job has a module of
its own:

* :mod:`~ringpack.planner.split.baselines`: ``split_contiguous``, ``split_zigzag`` and
  ``split_zigzag_even``, which ignore the cost model;
* :mod:`~ringpack.planner.split.balanced`: ``split_balanced`` and ``split_balanced_many``, the
  cost-balanced split, with its tolerances and the flow of one micro-batch through its parts:
  :mod:`~ringpack.planner.split.problem` (the problem and the ranks being filled),
  :mod:`~ringpack.planner.split.batch` (many micro-batches' problems built at once),
  :mod:`~ringpack.planner.split.last_pieces` (last pieces of samples too big for any rank get
  ranks of their own), :mod:`~ringpack.planner.split.best_fit` (samples placed whole),
  :mod:`~ringpack.planner.split.suffix_cuts` (samples cut from the back) and
  :mod:`~ringpack.planner.split.fallbacks` (tight token budgets);
* :mod:`~ringpack.planner.split.pieces`: piece costs and ``(slot, start, stop)`` shards, shared by all.
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
