"""The cost model learned from the run: the fit, and the learner over a real process group.

Timings are synthetic (a hidden "true" linear model plus noise), so the tests can say what the
fit must recover; the learner, the sampler switches and the collectives are the real ones (gloo).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from ringpack._spawn import run_ranks
from ringpack.analysis.calibration.online import (
    ROW,
    CostLearner,
    FitResult,
    LearnerConfig,
    fit_rank_times,
    microbatch_features,
    price_change,
)
from ringpack.cost import CostModel
from ringpack.shard_plan import Piece, microbatch_from_shards

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


def test_fits_that_cannot_tell_tokens_from_pairs_are_not_switched_to():
    """Zigzag ranks all hold the same tokens and pairs: the fit may put everything on one price."""
    learner = SimpleNamespace(config=LearnerConfig(), model=FLOPS, _acceptable=None)
    learner._acceptable = functools.partial(CostLearner._acceptable, learner)
    good = CostModel(token=2e-6, pair=1.5e-10, unit="s", name="learned")
    assert learner._acceptable(FitResult(good, 0.0, 0.01, 0.02, 20, 0))
    for blind in (CostModel(token=0.0, pair=3e-10, unit="s"), CostModel(token=2e-6, pair=0.0, unit="s")):
        assert not learner._acceptable(FitResult(blind, 0.0, 0.01, 0.02, 20, 0))


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


def test_config_is_validated():
    with pytest.raises(ValueError, match="refit_every"):
        LearnerConfig(refit_every=0)


# ------------------------------------------------------------------------------ over real ranks

DP, CP = 2, 2


def _lengths() -> list[int]:
    rng = np.random.default_rng(7)
    return np.clip((rng.pareto(1.1, 600) * 400 + 1).astype(int), 1, 12_000).tolist()


def _sampler(dp_rank: int):
    from ringpack.data import BalancedBatchSampler

    return BalancedBatchSampler(_lengths(), dp_rank, DP, CP, 6_000, samples_per_step=40, seed=3, cost=FLOPS)


def _run_steps(tickets, learner, cp_rank: int, steps: int, start_step: int = 0) -> list[str]:
    """Feed the learner synthetic times (the slower rank's for coupled micro-batches) for ``steps`` steps."""
    seen = []
    for ticket in tickets:
        feats, coupled = microbatch_features(ticket.microbatch)
        seconds = true_seconds(feats)
        batch = {"microbatch": ticket.microbatch, "microbatch_index": ticket.index}
        learner.record(batch, float(seconds.max() if coupled else seconds[cp_rank]))
        seen.append(f"{ticket.step}:{ticket.index}:{list(ticket)}")
        if ticket.index + 1 == ticket.microbatches_in_step:
            learner.end_step()
            if ticket.step + 1 - start_step >= steps:
                break
    return seen


def _learner_worker(rank: int, world: int) -> dict:
    dp_rank, cp_rank = divmod(rank, CP)
    sampler = _sampler(dp_rank)
    config = LearnerConfig(warmup_steps=1, first_fit_after=2, refit_every=3, min_change=0.03)
    learner = CostLearner(sampler, cp_rank, config=config)
    tickets = iter(sampler)
    _run_steps(tickets, learner, cp_rank, steps=8)
    state = sampler.state_dict()
    rest = _run_steps(tickets, learner, cp_rank, steps=1000, start_step=8)
    resumed = _sampler(dp_rank)
    resumed.load_state_dict(state)
    again = [f"{t.step}:{t.index}:{list(t)}" for t in resumed]
    return {
        "hash": sampler.plan_hash,
        "switches": state["cost_switches"],
        "model": learner.model.to_dict(),
        "fits": len(learner.history),
        "rest_matches_resume": rest == again,
        "steps": sampler.num_steps,
    }


@pytest.fixture(scope="module")
def learned():
    return run_ranks(_learner_worker, DP * CP, timeout_s=60, join_s=180, name="learner")


@pytest.mark.slow
def test_every_rank_learns_the_same_model_and_switches_at_the_same_step(learned):
    first = learned[0]
    assert first["switches"], "the learner switched the planner to a fitted model"
    assert all(r["switches"] == first["switches"] and r["model"] == first["model"] for r in learned)
    assert all(r["hash"] == first["hash"] for r in learned), "every rank holds the same spliced plan"
    model = CostModel.from_dict(first["model"])
    assert model.pair / model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.03)
    epoch, step, _ = first["switches"][0]
    assert epoch == 0 and 3 <= step < first["steps"], "switched after the first fit, at a step not yet planned"


@pytest.mark.slow
def test_a_resumed_sampler_replays_the_switches(learned):
    assert all(r["rest_matches_resume"] for r in learned)


def test_rows_have_the_documented_columns():
    assert ROW[-1] == "seconds" and len(ROW) == 9


def test_sampler_switch_keeps_earlier_steps_and_refuses_steps_already_handed_out():
    sampler = _sampler(0)
    before = sampler.plan()
    tickets = iter(sampler)
    first = [next(tickets) for _ in range(3)]
    through = sampler.planned_through()
    assert through == (0, first[-1].step)
    with pytest.raises(ValueError, match="already planned past"):
        sampler.set_cost_model(TRUTH, after=(0, through[1] - 1), lead_steps=0)
    epoch, step = sampler.set_cost_model(TRUTH, after=through, lead_steps=1)
    assert (epoch, step) == (0, through[1] + 2)
    after = sampler.plan()
    assert after.steps[:step] == before.steps[:step]
    assert after.steps[step:] != before.steps[step:], "later steps are re-planned with the new prices"
    assert [sorted(s for mbs in st.microbatches for mb in mbs for s in mb.samples) for st in after.steps] == [
        sorted(s for mbs in st.microbatches for mb in mbs for s in mb.samples) for st in before.steps
    ], "every step keeps its samples"
    rest = list(tickets)
    seen = sorted(s for t in first + rest for s in t)
    assert seen == sorted(s for st in after.steps for mb in st.microbatches[0] for s in mb.samples)
    assert [t.microbatch for t in rest] == [mb for st in after.steps for mb in st.microbatches[0]][len(first) :]
