"""Greedy, first-fit and WLB least-workload packing against the plain loops that define them.

Each finds a bin through a heap or tree instead of scanning every bin per sample, and must place
every sample exactly where the scan does, ties included, on random and tight inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.analysis.peers.wlb import _pack_least_workload
from ringpack.planner.packing import PackingProblem, pack_first_fit, pack_greedy


def first_fit_scan(tokens: np.ndarray, capacity: int) -> list[list[int]]:
    """Samples in order to the first pack with room, by scanning every pack."""
    packs: list[list[int]] = []
    free: list[int] = []
    for i, t in enumerate(tokens.tolist()):
        for p in range(len(packs)):
            if free[p] >= t:
                packs[p].append(i)
                free[p] -= t
                break
        else:
            packs.append([i])
            free.append(capacity - t)
    return packs


def least_workload_scan(tokens: np.ndarray, weights: np.ndarray, num_bins: int, capacity: int) -> np.ndarray:
    """Longest first (ties: earlier), each to the bin of least ``(load, index)`` among those with room."""
    order = sorted(range(tokens.size), key=lambda i: (-int(tokens[i]), i))
    load = [0.0] * num_bins
    free = [capacity] * num_bins
    bins = np.full(tokens.size, -1, dtype=np.int64)
    for i in order:
        fits = [b for b in range(num_bins) if free[b] >= tokens[i]]
        if fits:
            b = min(fits, key=lambda q: (load[q], q))
            bins[i] = b
            free[b] -= int(tokens[i])
            load[b] += float(weights[i])
    return bins


@pytest.mark.parametrize("seed", range(4))
def test_first_fit_is_the_scan(seed):
    rng = np.random.default_rng(seed)
    for trial in range(150):
        n = int(rng.integers(1, 300))
        tokens = rng.integers(1, 60, n) if trial % 2 else rng.choice([3, 5, 8, 40], n)
        capacity, dp = int(rng.integers(60, 200)), int(rng.integers(1, 6))
        packs = first_fit_scan(tokens, capacity)
        m_fixed = int(rng.integers(0, 4))
        bins, m = pack_first_fit(tokens, dp, 1, m_fixed, capacity)
        assert m == (m_fixed or max(1, -(-len(packs) // dp)))
        if len(packs) > dp * m or n < dp * m:
            assert bins is None
            continue
        if len(packs) == dp * m:  # no pack was split to fill the bins: each pack is one bin
            members = sorted(sorted(np.flatnonzero(bins == b).tolist()) for b in range(dp * m))
            assert members == sorted(packs)


def test_first_fit_grows_past_many_packs():
    """More packs than the tree's first size: it grows, and every sample still goes where the scan puts it."""
    tokens = np.random.default_rng(9).integers(1, 1000, 5000)
    packs = first_fit_scan(tokens, 1500)
    bins, m = pack_first_fit(tokens, len(packs), 1, 1, 1500)
    assert len(packs) > 64 and m == 1
    assert sorted(sorted(np.flatnonzero(bins == b).tolist()) for b in range(len(packs))) == sorted(packs)


@pytest.mark.parametrize("seed", range(4))
def test_least_workload_is_the_scan(seed):
    rng = np.random.default_rng(seed)
    for trial in range(250):
        n, num_bins = int(rng.integers(1, 60)), int(rng.integers(1, 12))
        tokens = rng.integers(1, 50, n) if trial % 2 else rng.choice([3, 5, 8], n)
        weights = tokens.astype(float) ** rng.choice([1.0, 1.5]) if trial % 3 else np.ones(n)
        capacity = int(rng.integers(1, 120))  # tight: documents that fit no bin get -1
        assert _pack_least_workload(tokens, weights, num_bins, capacity).tolist() == (
            least_workload_scan(tokens, weights, num_bins, capacity).tolist()
        )


def greedy_scan(problem: PackingProblem) -> np.ndarray | None:
    """Heaviest first (ties: earlier), each to the rank of least ``(height, index)`` with a bin that
    fits, into its bin with the most free tokens (first on ties); ``None`` once a sample fits nowhere."""
    columns = problem.columns
    order = sorted(range(len(columns)), key=lambda i: (-float(columns[i].max()), i))
    loads = np.zeros((problem.dp, columns.shape[1]))
    free = [[problem.capacity] * problem.m for _ in range(problem.dp)]
    bins = np.zeros(len(columns), dtype=np.int64)
    for i in order:
        t = int(problem.tokens[i])
        fits = [d for d in range(problem.dp) if max(free[d]) >= t]
        if not fits:
            return None
        height = [float(loads[d, 0]) if columns.shape[1] == 1 else max(loads[d].tolist()) for d in range(problem.dp)]
        d = min(fits, key=lambda q: (height[q], q))
        b = free[d].index(max(free[d]))
        free[d][b] -= t
        bins[i] = d * problem.m + b
        loads[d] = [x + y for x, y in zip(loads[d].tolist(), columns[i].tolist())]
    return bins


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_the_scan(seed):
    rng = np.random.default_rng(seed)
    for trial in range(200):
        n, dp, m = int(rng.integers(1, 80)), int(rng.integers(1, 8)), int(rng.integers(1, 4))
        tokens = rng.integers(1, 60, n)
        if trial % 3 == 0:  # weights that do not follow length: bins with room come and go
            weights = rng.random(n)
        elif trial % 3 == 1:
            weights = np.column_stack([tokens * 1.0, tokens**1.7 / 10]) / [tokens.sum(), (tokens**1.7).sum() / 10]
        else:
            weights = tokens * 2.0
        capacity = int(rng.integers(60, 60 + int(tokens.sum()) // max(dp * m, 1) + 2))  # tight and loose
        problem = PackingProblem(weights, tokens, dp, m, capacity)
        got, want = pack_greedy(problem), greedy_scan(problem)
        assert (got is None and want is None) or (
            got is not None and want is not None and got.tolist() == want.tolist()
        )
