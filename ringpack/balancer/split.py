"""CP split strategies: cut one micro-batch's samples into pieces for C context-parallel ranks.

Every strategy takes the micro-batch's samples (in micro-batch order) with their lengths and
returns a :class:`~ringpack.balancer.plan.MicroBatch`. None needs any divisibility rule or padding:
a sample of any length >= 1 may be cut anywhere, and chunks that come out empty are simply absent.

This module is the strategies' one entry point (import them from here); each job has a module of
its own:

* :mod:`~ringpack.balancer.split_baselines`: ``split_contiguous``, ``split_zigzag`` and
  ``split_zigzag_even``, which ignore the cost model;
* :mod:`~ringpack.balancer.split_balanced`: ``split_balanced`` and ``split_balanced_many``, the
  cost-balanced split, with its tolerances; its steps are in
  :mod:`~ringpack.balancer.split_best_fit` (whole samples),
  :mod:`~ringpack.balancer.split_suffix_cuts` (samples cut from the back) and
  :mod:`~ringpack.balancer.split_fallbacks` (tight token budgets);
* :mod:`~ringpack.balancer.split_pieces`: piece costs and ``(slot, start, stop)`` shards, shared by all.
"""

from __future__ import annotations

from ringpack.balancer.split_balanced import (
    CP_BALANCE_TOLERANCE,
    LOCKSTEP_MIN_GROUPS,
    RECOMMENDED_TOKEN_SLACK,
    split_balanced,
    split_balanced_many,
)
from ringpack.balancer.split_baselines import split_contiguous, split_zigzag, split_zigzag_even

__all__ = [
    "split_contiguous",
    "split_zigzag",
    "split_balanced",
    "split_balanced_many",
    "split_zigzag_even",
    "CP_BALANCE_TOLERANCE",
    "RECOMMENDED_TOKEN_SLACK",
    "LOCKSTEP_MIN_GROUPS",
]
