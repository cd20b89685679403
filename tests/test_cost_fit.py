"""The cost-model fits: NNLS against least squares, rank times fitted back to the prices that made them,
and every kind of bad observation left out and counted."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from ringpack.cost import CostModel
from ringpack.cost_fit import (
    MAX_COUNT,
    MIN_SECONDS,
    ROW,
    fit_rank_times,
    microbatch_features,
    nnls,
    price_change,
    usable_rows,
)
from ringpack.shard_plan import Piece, microbatch_from_shards
from tests.helpers.timings import FLOPS, OVERHEAD, TRUTH, synthetic_rows


def test_nnls_matches_lstsq_when_unconstrained_and_clamps_otherwise():
    rng = np.random.default_rng(1)
    a = rng.random((40, 4))
    x = np.array([1.0, 0.5, 2.0, 0.25])
    assert np.allclose(nnls(a, a @ x), x, rtol=1e-10)
    b = a @ np.array([1.0, -0.5, 2.0, 0.0]) + 0.01 * rng.standard_normal(40)
    got = nnls(a, b)
    assert (got >= 0).all() and got[1] == 0.0
    # KKT: the gradient vanishes on free coefficients and points outward on clamped ones
    grad = a.T @ (a @ got - b)
    assert np.allclose(grad[got > 0], 0.0, atol=1e-9) and (grad[got == 0] >= -1e-9).all()


def test_fit_recovers_the_true_prices_with_noise_outliers_and_coupled_microbatches():
    rng = np.random.default_rng(0)
    rows = synthetic_rows(rng, 200)
    rows[::37, -1] *= 3.0  # stragglers: a rank paused by something else
    fit = fit_rank_times(rows, FLOPS)
    assert fit is not None
    assert fit.model.unit == "s"
    assert fit.model.pair / fit.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.03)
    assert fit.model.token == pytest.approx(TRUTH.token, rel=0.05)
    assert fit.dropped >= len(rows[::37]) // 2, "outliers were dropped"
    assert fit.rms_error < 0.03


def test_fit_does_not_depend_on_row_order():
    rows = synthetic_rows(np.random.default_rng(1), 60)
    a = fit_rank_times(rows, FLOPS)
    b = fit_rank_times(rows[np.random.default_rng(2).permutation(len(rows))], FLOPS)
    assert a == b


def test_the_fit_carries_its_per_microbatch_constant():
    fit = fit_rank_times(synthetic_rows(np.random.default_rng(4), 120), FLOPS)
    assert fit.model.microbatch == fit.overhead == pytest.approx(OVERHEAD, rel=0.2)


def test_price_change_is_finite_or_infinite_never_a_warning():
    free_tokens = CostModel(token=0.0, pair=1e-10, unit="s")
    with np.errstate(all="raise"):
        assert price_change(FLOPS, free_tokens) == np.inf
        assert price_change(free_tokens, free_tokens) == 0.0
        assert price_change(free_tokens, FLOPS) == np.inf
        assert price_change(FLOPS, FLOPS) == 0.0


def test_fit_needs_enough_observations():
    rows = synthetic_rows(np.random.default_rng(3), 2, coupled_share=0.0)
    assert fit_rank_times(rows[:4], FLOPS) is None


def test_a_coupled_microbatch_is_one_observation_of_its_slowest_rank():
    """If every rank were taken at face value, the fast rank of a coupled micro-batch (which only
    waited) would pull the price of whatever it holds up; the fit must not be fooled."""
    rng = np.random.default_rng(4)
    rows = synthetic_rows(rng, 150, coupled_share=1.0, noise=0.0)
    fit = fit_rank_times(rows, FLOPS)
    assert fit.model.pair / fit.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.02)
    assert fit.used == 150


def test_microbatch_features():
    mb = microbatch_from_shards([0, 1], [[Piece(0, 0, 4), Piece(1, 0, 2)], [Piece(0, 4, 6)]], {0: 6, 1: 2})
    feats, coupled = microbatch_features(mb)
    assert coupled
    assert feats.tolist() == [[6, 10 + 3, 2], [2, 21 - 10, 1]]
    alone, coupled = microbatch_features(
        microbatch_from_shards([0, 1], [[Piece(0, 0, 6)], [Piece(1, 0, 2)]], {0: 6, 1: 2})
    )
    assert not coupled and alone[:, 0].tolist() == [6, 2]


def test_usable_rows_refuses_every_kind_of_bad_observation():
    good = (3, 0, 1, 0, 4096, 8e6, 2, 0, 0.01)
    cases = {
        "zero time": dict(seconds=0.0),
        "negative time": dict(seconds=-0.004),
        "nan time": dict(seconds=float("nan")),
        "inf time": dict(seconds=float("inf")),
        "subnormal time": dict(seconds=5e-324),
        "huge count": dict(pairs=1e308),
        "count past int64": dict(tokens=MAX_COUNT * 2),
        "negative count": dict(pairs=-(2.0**40)),
        "nan count": dict(pieces=float("nan")),
        "nan step": dict(step=float("nan")),
        "negative rank": dict(cp=-1),
        "fractional micro-batch": dict(microbatch=1.5),
        "step past int64": dict(step=1e308),
        "coupled not 0/1": dict(coupled=0.5),
    }
    rows = np.array([good] + [tuple(change.get(name, v) for name, v in zip(ROW, good)) for change in cases.values()])
    assert usable_rows(rows).tolist() == [True] + [False] * len(cases)
    assert usable_rows(np.array([dict(zip(ROW, good), seconds=MIN_SECONDS)[c] for c in ROW]))[0]


def _fit_quietly(rows):
    """fit_rank_times with every numpy warning an error: a bad row must not even warn."""
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        return fit_rank_times(rows, FLOPS)


@pytest.mark.parametrize("bad", [0.0, -0.003, float("nan"), float("inf"), 5e-324])
def test_fit_leaves_out_a_bad_time_and_counts_it(bad):
    rows = synthetic_rows(np.random.default_rng(5), 80, coupled_share=0.0)
    clean = _fit_quietly(rows)
    rows[[7, 30, 31], -1] = bad
    fit = _fit_quietly(rows)
    assert fit is not None and fit.unusable == 3
    assert fit.model.pair / fit.model.token == pytest.approx(clean.model.pair / clean.model.token, rel=0.01)


def test_fit_leaves_out_counts_that_would_overflow_it():
    rows = synthetic_rows(np.random.default_rng(6), 80, coupled_share=0.0)
    rows[3, 5] = 1e308  # pairs
    rows[9, 4] = -5.0  # tokens, as a wrapped int64 count would be
    rows[11, 6] = float("inf")
    fit = _fit_quietly(rows)
    assert fit is not None and fit.unusable == 3
    assert fit.model.pair / fit.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.03)


def test_a_coupled_microbatch_with_one_bad_time_is_left_out_whole():
    """Without the bad rank's time the others cannot say which rank was slowest: all its rows go."""
    rows = synthetic_rows(np.random.default_rng(7), 60, coupled_share=1.0, noise=0.0)
    rows[0, -1] = float("nan")  # rank 0 of the first micro-batch; rank 1 (row 1) goes with it
    fit = _fit_quietly(rows)
    assert fit.unusable == 2 and fit.used == 59


def test_fit_of_nothing_but_bad_rows_is_none_not_an_error():
    rows = synthetic_rows(np.random.default_rng(8), 20)
    rows[:, -1] = 0.0
    assert _fit_quietly(rows) is None
    with pytest.raises(ValueError, match=r"rows must be \[n, 9\]"):
        fit_rank_times(np.zeros((4, 3)), FLOPS)
