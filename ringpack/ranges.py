"""Index arithmetic on runs of rows and of equal values, shared by the piece table, the schedule
compiler and the exchange map.

See docs/attention.md, "The schedule".
"""

from __future__ import annotations

import numpy as np

__all__ = ["concat_ranges", "cumsum0", "prefix_rows", "run_starts"]


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


def cumsum0(x: np.ndarray) -> np.ndarray:
    """int64 ``[0, x[0], x[0] + x[1], ...]`` (``x.size + 1`` entries)."""
    out = np.zeros(x.size + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def prefix_rows(group, start, stop, first, holder, limit) -> np.ndarray:
    """For each query ``i``: the rows of the pieces of group ``holder[i]`` that end at or before
    ``limit[i]``.

    Args:
        group, start, stop: every piece's group (ascending, non-empty) and bounds (int64 ``[P]``);
            a group's pieces are consecutive, their stops ascending.
        first: group ``g``'s first piece.
        holder, limit: the queries (int64 ``[Q]``).

    Returns:
        int64 ``[Q]``: one vectorised search over all queries on ``group * width + stop`` keys
        (stops ranked densely where that could overflow).
    """
    cum = cumsum0(stop - start)
    width = max(int(stop.max()), int(limit.max()) if limit.size else 0) + 1
    if (int(group[-1]) + 1) * width < 2**62:
        pos = np.searchsorted(group * width + stop, holder * width + limit, side="right")
    else:  # ranked densely: bounds this large would overflow the key
        values = np.unique(np.concatenate((stop, limit)))
        width = values.size + 1
        keys = group * width + np.searchsorted(values, stop)
        pos = np.searchsorted(keys, holder * width + np.searchsorted(values, limit), side="right")
    return cum[pos] - cum[first[holder]]
