"""Index arithmetic on runs of rows and of equal values, shared by the piece table, the schedule
compiler and the exchange map.

See docs/attention.md, "The schedule".
"""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges", "run_starts"]


def concat_ranges(lo: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``concat(arange(lo[i], lo[i] + length[i]))`` as int64, without a Python loop."""
    length = np.asarray(length, dtype=np.int64)
    total = int(length.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    seg_start = np.cumsum(length) - length
    return np.arange(total, dtype=np.int64) + np.repeat(np.asarray(lo, dtype=np.int64) - seg_start, length)


def run_starts(x: np.ndarray) -> np.ndarray:
    """Where a run of equal values of ``x`` (non-empty) begins."""
    head = np.empty(x.size, dtype=bool)
    head[0] = True
    np.not_equal(x[1:], x[:-1], out=head[1:])
    return head
