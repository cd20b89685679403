"""The cost model learned from the run: the fit, and the learner over a real process group.

Timings are synthetic (a hidden "true" linear model plus noise), so the tests can say what the
fit must recover; the learner, the sampler switches and the collectives are the real ones (gloo).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from ringpack._spawn import run_ranks
from ringpack.cost import CostModel
from ringpack.cost_fit import (
    ROW,
    FitResult,
    microbatch_features,
)
from ringpack.errors import DataError, PlanError
from ringpack.training.cost_learner import CostLearner, LearnerConfig
from tests.helpers.timings import FLOPS, TRUTH, true_seconds


def test_fits_that_cannot_tell_tokens_from_pairs_are_not_switched_to():
    """Zigzag ranks all hold the same tokens and pairs: the fit may put everything on one price."""
    learner = SimpleNamespace(config=LearnerConfig(), model=FLOPS, _acceptable=None)
    learner._acceptable = functools.partial(CostLearner._acceptable, learner)
    good = CostModel(token=2e-6, pair=1.5e-10, unit="s", name="learned")
    assert learner._acceptable(FitResult(good, 0.0, 0.01, 0.02, 20, 0))
    for blind in (CostModel(token=0.0, pair=3e-10, unit="s"), CostModel(token=2e-6, pair=0.0, unit="s")):
        assert not learner._acceptable(FitResult(blind, 0.0, 0.01, 0.02, 20, 0))


def test_config_is_validated():
    with pytest.raises(ValueError, match="refit_every"):
        LearnerConfig(refit_every=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("warmup_steps", 1.5),
        ("warmup_steps", -1),
        ("warmup_steps", True),
        ("first_fit_after", 0),
        ("window_steps", "8"),
        ("min_observations", 2.0),
        ("lead_steps", None),
        ("max_error", float("nan")),
        ("max_error", 0.0),
        ("max_error", -0.1),
        ("max_error", float("inf")),
        ("min_change", float("nan")),
        ("min_change", -0.01),
        ("min_change", "0.1"),
    ],
)
def test_config_refuses_a_bad_value_naming_the_field(field, value):
    with pytest.raises(PlanError, match=f"LearnerConfig.{field} must be") as info:
        LearnerConfig(**{field: value})
    assert "\n" not in str(info.value)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        LearnerConfig(1, 3)  # which field is which is not for the reader to guess
    assert LearnerConfig(min_change=0).min_change == 0


# ------------------------------------------------------------------------------ bad observations


def _single_rank_sampler():
    """The sampler of a one-GPU run: one rank, 4096 tokens, 32 samples a step."""
    from ringpack.data import BalancedBatchSampler

    lengths = np.random.default_rng(11).integers(100, 4000, 2_000).tolist()
    return BalancedBatchSampler(lengths, 0, 1, 1, 4096, samples_per_step=32)


def _train(learner, tickets, steps: int, seconds_of=None) -> list:
    """Feed ``steps`` steps of true times (``seconds_of(k, true)`` replaces the k-th micro-batch's) to the learner."""
    results = []
    for k, ticket in enumerate(tickets):
        feats, _ = microbatch_features(ticket.microbatch)
        seconds = float(true_seconds(feats)[0])
        learner.record({"microbatch": ticket.microbatch, "microbatch_index": ticket.index}, seconds_of(k, seconds))
        if ticket.index + 1 == ticket.microbatches_in_step:
            results.append(learner.end_step())
            if len(results) == steps:
                break
    return results


@pytest.mark.parametrize("bad", [0.0, float("nan"), -0.002, float("inf")])
def test_one_bad_timing_does_not_stop_the_run(one_rank_group, bad, caplog):
    """One bad micro-batch time among good ones: end_step() goes on, the fit is made, the bad one counted."""
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0)
    with caplog.at_level(logging.WARNING, logger="ringpack.training.cost_learner"):
        results = _train(learner, iter(sampler), 12, lambda k, s: bad if k in (40, 41, 90) else s)
    assert learner.bad_observations == 3
    assert any(results), "a fit was accepted"
    assert learner.model.pair / learner.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.01)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "bad observation" in warned[0].getMessage(), "logged once"


def test_a_fit_numpy_cannot_make_keeps_the_model_and_is_logged_once(one_rank_group, monkeypatch, caplog):
    from ringpack.training import cost_learner as online

    def hopeless(rows, prior):
        raise np.linalg.LinAlgError("SVD did not converge in Linear Least Squares")

    monkeypatch.setattr(online, "fit_rank_times", hopeless)
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0, config=LearnerConfig(warmup_steps=0, first_fit_after=1))
    before = learner.model
    with caplog.at_level(logging.WARNING, logger="ringpack.training.cost_learner"):
        results = _train(learner, iter(sampler), 6, lambda k, s: s)
    assert results == [None] * 6 and learner.model == before and not learner.history
    assert [r.getMessage() for r in caplog.records] == [
        "CostLearner: no fit could be made (SVD did not converge in Linear Least Squares); "
        "the planner keeps its cost model"
    ]


def test_absurd_timings_never_install_a_model_that_cannot_plan(one_rank_group, caplog):
    """Times of 1e300 s fit prices above MAX_PRICE: the fit is refused (logged once) and planning goes on."""
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0, config=LearnerConfig(warmup_steps=0, first_fit_after=1))
    before = learner.model
    tickets = iter(sampler)
    with caplog.at_level(logging.WARNING, logger="ringpack.training.cost_learner"):
        results = _train(learner, tickets, 8, lambda k, s: s * 1e300)
    assert results == [None] * 8 and learner.model == before and not learner.history
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "no fit could be made" in messages[0] and "is above 1e+100" in messages[0], messages
    assert sum(1 for _ in tickets) > 0, "the sampler plans the next steps"


def test_record_refuses_what_is_not_a_time():
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0)
    ticket = next(iter(sampler))
    batch = {"microbatch": ticket.microbatch, "microbatch_index": ticket.index}
    for seconds in ("0.1", None, True, np.array([0.1, 0.2])):
        with pytest.raises(TypeError, match="CostLearner.record: seconds must be"):
            learner.record(batch, seconds)
    with pytest.raises(TypeError, match="'microbatch' and 'microbatch_index'"):
        learner.record({"input_ids": 1}, 0.1)
    learner.record(batch, np.float32(0.01))
    import torch

    learner.record(batch, torch.tensor(0.01))
    with pytest.raises(TypeError, match="sampler must be a BalancedBatchSampler"):
        CostLearner(None, 0)
    with pytest.raises(PlanError, match="cp_rank must be a whole number"):
        CostLearner(sampler, 1)
    with pytest.raises(TypeError, match="config must be a LearnerConfig"):
        CostLearner(sampler, 0, config={"warmup_steps": 0})


# ------------------------------------------------------------------------------- learner state


def _state_with_rows(steps: int = 6):
    """A single-rank learner's state after ``steps`` steps without a fit (no group needed)."""
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0, config=LearnerConfig(first_fit_after=100))
    _train(learner, iter(sampler), steps, lambda k, s: s)
    return json.loads(json.dumps(learner.state_dict()))


@pytest.mark.parametrize(
    "change, says",
    [
        (dict(step=-5), "CostLearner state step: -5 is not a count"),
        (dict(step=2.7), "CostLearner state step: 2.7 is not a count"),
        (dict(last_fit="3"), "CostLearner state last_fit: '3' is not a count"),
        (dict(last_fit=10**6), "CostLearner state last_fit: 1000000 is after step"),
        (dict(version=7), "CostLearner state version 7"),
        (dict(history=[[1.0, 2e-6]]), r"CostLearner state history\[0\]: not a fit"),
        (dict(history=[[1.0, -2e-6, 1e-10, 0, 0, 0, 0, 0, 0]]), r"history\[0\]: not a fit"),
        (dict(history="none"), "CostLearner state history: a list of fits"),
        (dict(rows=[[1.0, 2.0]]), "CostLearner state rows: every row needs 9 values"),
        (dict(unread={"a": 1}), "CostLearner state unread: every row needs 9 values"),
        (dict(bad_observations=-1), "CostLearner state bad_observations: -1 is not a count"),
        (dict(void=[[1, 2]]), "CostLearner state void: every row needs 3 values"),
    ],
)
def test_load_refuses_a_malformed_state_in_one_line_naming_the_key(change, says):
    state = _state_with_rows()
    learner = CostLearner(_single_rank_sampler(), 0)
    before = learner.state_dict()
    with pytest.raises(DataError, match=says) as info:
        learner.load_state_dict({**state, **change})
    assert "\n" not in str(info.value)
    assert learner.state_dict() == before, "a refused state installs nothing"


def test_load_refuses_string_seconds_naming_the_row_and_column():
    state = _state_with_rows()
    state["rows"][2][-1] = "0.01"
    with pytest.raises(DataError, match=r"CostLearner state rows\[2\] seconds: '0.01' is not a number"):
        CostLearner(_single_rank_sampler(), 0).load_state_dict(state)


@pytest.mark.parametrize("key", ["version", "step", "last_fit", "history", "rows", "unread", "open"])
def test_load_names_a_missing_key(key):
    state = _state_with_rows()
    del state[key]
    with pytest.raises(DataError, match=f"CostLearner state lacks '{key}'"):
        CostLearner(_single_rank_sampler(), 0).load_state_dict(state)
    with pytest.raises(DataError, match="not a CostLearner state"):
        CostLearner(_single_rank_sampler(), 0).load_state_dict([state])


def test_a_state_with_bad_rows_loads_counts_them_and_fits_next(one_rank_group, caplog):
    state = _state_with_rows()
    assert len(state["rows"]) > 20
    state["rows"][0][-1] = 0.0
    state["rows"][1][-1] = float("nan")  # what json writes and reads back for a NaN
    state["rows"][2][-1] = -1.0
    state["rows"][3][5] = 1e308
    state["unread"][0][-1] = float("inf")
    sampler = _single_rank_sampler()
    learner = CostLearner(sampler, 0, config=LearnerConfig(first_fit_after=1))
    with caplog.at_level(logging.WARNING, logger="ringpack.training.cost_learner"):
        learner.load_state_dict(state)
    assert learner.bad_observations == 5
    assert "dropped 5 bad observation(s)" in caplog.text
    assert len(learner.state_dict()["rows"]) == len(state["rows"]) - 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = learner.end_step()  # the next fit: over the rows that were kept
    assert fit is not None and fit.unusable == 0
    assert learner.model.pair / learner.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.01)
    again = CostLearner(_single_rank_sampler(), 0)
    again.load_state_dict(json.loads(json.dumps(learner.state_dict())))
    assert again.bad_observations == 5 and again.history == learner.history


def test_a_state_of_an_earlier_version_without_the_new_keys_still_loads():
    state = _state_with_rows()
    for key in ("void", "bad_observations"):
        del state[key]
    state["history"] = [[1.0, 2e-6, 1.5e-10, 3e-5, 4e-3, 0.01, 0.02, 30 + 1e6 * 2]]  # 8 values: no unusable count
    learner = CostLearner(_single_rank_sampler(), 0)
    learner.load_state_dict(state)
    assert learner.bad_observations == 0
    assert learner.history[0].used == 30 and learner.history[0].dropped == 2 and learner.history[0].unusable == 0


# ------------------------------------------------------------------------------ over real ranks

DP, CP = 2, 2
#: The pool layout: one CP group of all four ranks, split over two nodes of two.
POOL = {"dp": 1, "cp": 4, "gpus_per_node": 2}


def _lengths() -> list[int]:
    rng = np.random.default_rng(7)
    return np.clip((rng.pareto(1.1, 600) * 400 + 1).astype(int), 1, 12_000).tolist()


def _sampler(dp_rank: int, layout: dict | None = None):
    from ringpack.data import BalancedBatchSampler

    layout = layout or {"dp": DP, "cp": CP}
    extra = {k: v for k, v in layout.items() if k not in ("dp", "cp")}
    return BalancedBatchSampler(
        _lengths(), dp_rank, layout["dp"], layout["cp"], 6_000, samples_per_step=40, seed=3, cost=FLOPS, **extra
    )


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


def _learner_worker(rank: int, world: int, layout: dict | None = None) -> dict:
    dp_rank, cp_rank = divmod(rank, (layout or {"cp": CP})["cp"])
    sampler = _sampler(dp_rank, layout)
    config = LearnerConfig(warmup_steps=1, first_fit_after=2, refit_every=3, min_change=0.03)
    learner = CostLearner(sampler, cp_rank, config=config)
    tickets = iter(sampler)
    _run_steps(tickets, learner, cp_rank, steps=8)
    state = sampler.state_dict()
    rest = _run_steps(tickets, learner, cp_rank, steps=1000, start_step=8)
    resumed = _sampler(dp_rank, layout)
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


@pytest.fixture(scope="module")
def learned_pool():
    return run_ranks(_learner_worker, 4, (POOL,), timeout_s=60, join_s=180, name="learner on the pool")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["learned", "learned_pool"])
def test_every_rank_learns_the_same_model_and_switches_at_the_same_step(layout, request):
    learned = request.getfixturevalue(layout)
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


def _bad_times_worker(rank: int, world: int) -> dict:
    """DP=1 x CP=2: rank 1 reports a bad time for every 5th micro-batch, rank 0 never does."""
    from ringpack.data import BalancedBatchSampler

    sampler = BalancedBatchSampler(_lengths(), 0, 1, 2, 6_000, samples_per_step=40, seed=3, cost=FLOPS)
    learner = CostLearner(sampler, rank, config=LearnerConfig(warmup_steps=1, first_fit_after=2, refit_every=2))
    fitted, fit = [], learner._fit
    learner._fit = lambda rows: (fitted.append(rows.tolist()), fit(rows))[1]  # what each fit was given
    steps = coupled_bad = 0
    for k, ticket in enumerate(sampler):
        feats, coupled = microbatch_features(ticket.microbatch)
        seconds = true_seconds(feats)
        seconds = float(seconds.max() if coupled else seconds[rank])
        if rank == 1 and k % 5 == 0:
            seconds = [0.0, float("nan"), -1.0, float("inf")][k % 4]
            coupled_bad += bool(coupled) and ticket.step >= 1
        learner.record({"microbatch": ticket.microbatch, "microbatch_index": ticket.index}, seconds)
        if ticket.index + 1 == ticket.microbatches_in_step:
            learner.end_step()
            steps += 1
            if steps == 12:
                break
    return {
        "model": learner.model.to_dict(),
        "switches": sampler.state_dict()["cost_switches"],
        "fits": [dataclasses.asdict(f) for f in learner.history],
        "bad": learner.bad_observations,
        "coupled_bad": coupled_bad,
        "fitted": fitted,
        "void": learner.state_dict()["void"],
    }


@pytest.mark.slow
def test_ranks_agree_when_one_rank_has_bad_times():
    """Only rank 1 sees bad times: both ranks still fit the same rows, switch at the same step, never hang."""
    first, second = run_ranks(_bad_times_worker, 2, timeout_s=60, join_s=180, name="bad-times")
    assert first["bad"] == 0 and second["bad"] > 0
    assert second["coupled_bad"] > 0, "some bad times hit micro-batches whose ranks wait on each other"
    assert first["switches"] and first["switches"] == second["switches"]
    assert first["model"] == second["model"] and first["fits"] == second["fits"]
    assert all(f["unusable"] == 0 for f in first["fits"]), "the bad rows never reached the fit"
    assert first["fitted"] == second["fitted"], "every rank fits the same rows"
    void = {tuple(key) for key in second["void"]}
    assert void, "rank 1 lost its time of some coupled micro-batches"
    seen = {tuple(row[:3]) for rows in first["fitted"] for row in rows if row[7]}
    assert seen and not seen & void, "rank 0's time of such a micro-batch is left out too"
    model = CostModel.from_dict(first["model"])
    assert model.pair / model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.01)


def _extra_end_step_worker(rank: int, world: int) -> str:
    """DP=1 x CP=2: rank 1 calls end_step once too often, before its first step; returns what end_step raised."""
    from ringpack.data import BalancedBatchSampler

    sampler = BalancedBatchSampler(_lengths(), 0, 1, 2, 6_000, samples_per_step=40, seed=3, cost=FLOPS)
    learner = CostLearner(sampler, rank, config=LearnerConfig(warmup_steps=1, first_fit_after=2))
    if rank == 1:
        learner.end_step()
    for ticket in sampler:
        feats, _ = microbatch_features(ticket.microbatch)
        batch = {"microbatch": ticket.microbatch, "microbatch_index": ticket.index, "epoch": 0, "step": ticket.step}
        learner.record(batch, float(true_seconds(feats)[rank]))
        if ticket.index + 1 == ticket.microbatches_in_step:
            try:
                learner.end_step()
            except PlanError as exc:
                return str(exc)
    return "end_step never raised"


@pytest.mark.slow
def test_ranks_whose_end_step_calls_differ_by_one_both_raise_naming_the_steps():
    first, second = run_ranks(_extra_end_step_worker, 2, timeout_s=60, join_s=180, name="extra end_step")
    assert first == second, (first, second)
    assert first.startswith("CostLearner.end_step: the ranks end different training steps at the learner's step 4 ")
    assert "(step 2 of epoch 0 on rank(s) [1]; step 3 of epoch 0 on rank(s) [0])" in first, first


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


def test_the_learner_imports_from_every_documented_path():
    import ringpack
    from ringpack.training import CostLearner as New

    assert New is ringpack.CostLearner and New.__module__ == "ringpack.training.cost_learner"
