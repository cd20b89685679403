"""Index arithmetic of ringpack.ranges, against plain Python loops."""

import numpy as np
import pytest

from ringpack.ranges import concat_ranges, cumsum0, prefix_rows, run_starts


def test_concat_ranges_and_run_starts():
    lo, length = np.array([5, 0, 9, 2]), np.array([2, 0, 3, 1])
    assert concat_ranges(lo, length).tolist() == [5, 6, 9, 10, 11, 2]
    assert concat_ranges(lo, np.zeros(4, dtype=np.int64)).size == 0
    assert run_starts(np.array([3, 3, 1, 1, 1, 3])).tolist() == [True, False, True, False, False, True]


def test_cumsum0():
    assert cumsum0(np.array([2, 0, 5])).tolist() == [0, 2, 2, 7]
    assert cumsum0(np.zeros(0, dtype=np.int64)).tolist() == [0]


@pytest.mark.parametrize("shift", [0, 2**62 - 400], ids=["small-bounds", "bounds-that-overflow-the-key"])
def test_prefix_rows_matches_a_loop(shift):
    """Random groups of pieces and limits; bounds near 2**62 take the densely ranked search."""
    rng = np.random.default_rng(0)
    group, start, stop = [], [], []
    for g in range(30):
        cuts = np.sort(rng.choice(np.arange(1, 200), size=int(rng.integers(1, 6)), replace=False))
        for a, b in zip(cuts[:-1], cuts[1:]):
            group.append(g), start.append(int(a)), stop.append(int(b))
    group, start, stop = (np.array(x, dtype=np.int64) for x in (group, start, stop))
    start, stop = start + shift, stop + shift
    present = np.unique(group)
    first = np.searchsorted(group, present)
    holder = rng.integers(0, present.size, size=500)
    limit = rng.integers(int(start.min()) - 2, int(stop.max()) + 2, size=500)
    want = [
        sum(int(stop[i] - start[i]) for i in np.flatnonzero(group == present[h]) if stop[i] <= lim)
        for h, lim in zip(holder.tolist(), limit.tolist())
    ]
    assert prefix_rows(np.searchsorted(present, group), start, stop, first, holder, limit).tolist() == want
