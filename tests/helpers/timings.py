"""What the cost-fit and learner tests share: true prices, and observation rows timed under them."""

from __future__ import annotations

import numpy as np

from ringpack.cost import CostModel

TRUTH = CostModel(token=2e-6, pair=1.5e-10, segment=3e-5, unit="s", name="truth")
OVERHEAD = 4e-3
FLOPS = CostModel.preset("llama-1b")


def true_seconds(feats: np.ndarray) -> np.ndarray:
    return TRUTH.cost(*feats.T) + OVERHEAD


def synthetic_rows(rng: np.random.Generator, n: int, coupled_share: float = 0.3, noise: float = 0.01) -> np.ndarray:
    """Rows of 2-rank micro-batches; coupled ones report the slower rank's time on both ranks."""
    rows = []
    for mb in range(n):
        feats = np.column_stack(
            [rng.integers(2_000, 60_000, 2), rng.integers(10**6, 10**9, 2), rng.integers(1, 40, 2)]
        ).astype(float)
        seconds = true_seconds(feats) * (1 + noise * rng.standard_normal(2))
        coupled = rng.random() < coupled_share
        if coupled:
            seconds[:] = seconds.max()
        for c in range(2):
            rows.append((mb // 4, 0, mb % 4, c, *feats[c], float(coupled), seconds[c]))
    return np.asarray(rows)
