"""The cost model: exact pair counts against a brute-force dense mask, coefficients, integer scaling."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ringpack.cost import MAX_PRICE, PRESETS, CostModel, ModelShape, piece_pairs, rank_costs, scale_to_int
from tests.helpers.cli import assert_clean, run_cli
from tests.helpers.plans import random_plan


def dense_mask_pairs(mb, rank: int) -> int:
    """Brute force: build every token of the micro-batch (sample, position) on all ranks, the full
    [local queries x all keys] causal document mask, and count its ones."""
    keys = [(p.sample, pos) for shard in mb.shards for p in shard.pieces for pos in range(p.start, p.stop)]
    queries = [(p.sample, pos) for p in mb.shards[rank].pieces for pos in range(p.start, p.stop)]
    if not queries:
        return 0
    k_sample = np.array([k[0] for k in keys])[None, :]
    k_pos = np.array([k[1] for k in keys])[None, :]
    q_sample = np.array([q[0] for q in queries])[:, None]
    q_pos = np.array([q[1] for q in queries])[:, None]
    mask = (q_sample == k_sample) & (k_pos <= q_pos)
    return int(mask.sum())


@given(random_plan(max_samples=10, max_len=30))
def test_pairs_match_dense_mask(plan):
    for _, _, _, mb in plan.iter_microbatches():
        for rank, shard in enumerate(mb.shards):
            starts = [p.start for p in shard.pieces]
            stops = [p.stop for p in shard.pieces]
            assert int(piece_pairs(starts, stops).sum()) == dense_mask_pairs(mb, rank)


def test_piece_pairs_closed_form_and_vectorised():
    assert piece_pairs(0, 1) == 1  # one token attends to itself
    assert piece_pairs(0, 4) == 1 + 2 + 3 + 4
    assert piece_pairs(2, 4) == 3 + 4
    starts = np.array([0, 5, 100_000])
    stops = np.array([5, 9, 131_072])
    expected = [sum(q + 1 for q in range(a, b)) for a, b in zip(starts, stops)]
    assert piece_pairs(starts, stops).tolist() == expected
    # no overflow at the longest contexts people train on
    assert piece_pairs(0, 10_000_000) == 10_000_000 * 10_000_001 // 2


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=50))
def test_splitting_a_sample_conserves_pairs(lengths):
    """However a sample is cut, its pieces' pairs sum to the whole sample's pairs."""
    for length in lengths:
        cuts = np.unique(np.linspace(0, length, 5).astype(np.int64))
        assert piece_pairs(cuts[:-1], cuts[1:]).sum() == piece_pairs(0, length)


@given(random_plan(max_samples=10, max_len=30))
def test_rank_costs_combine_tokens_pairs_segments(plan):
    model = CostModel(token=3.0, pair=0.5, segment=7.0)
    for _, _, _, mb in plan.iter_microbatches():
        costs = rank_costs(mb.shards, model)
        for rank, shard in enumerate(mb.shards):
            expect = 3.0 * shard.num_tokens + 0.5 * dense_mask_pairs(mb, rank) + 7.0 * len(shard.pieces)
            assert costs[rank] == pytest.approx(expect)


def test_shape_presets_give_flops():
    llama = PRESETS["llama3-8b"]
    assert llama.head_dim == 128
    # ~8.0e9 parameters for Llama-3-8B (untied embeddings)
    assert 7.5e9 < llama.params < 8.1e9
    model = CostModel.from_shape(llama)
    assert model.token == 6 * llama.params
    assert model.pair == 4 * 128 * 32 * 3.5 * 32
    assert set(PRESETS) >= {"llama3-8b", "tiny"}
    # attention dominates past a few thousand tokens for an 8B model: the quadratic term matters
    assert model.sample_cost([32768])[0] > 1.3 * model.token * 32768


def test_sample_cost_matches_rank_cost_of_a_whole_sample():
    model = CostModel.preset("tiny")
    assert model.sample_cost([10])[0] == pytest.approx(model.cost(10, 55, 1))


def test_scale_to_int_is_upper_bound_and_bounded():
    costs = np.array([0.0, 1.5, 1e15, 3.3e14])
    ints, scale = scale_to_int(costs, max_value=2**30)
    assert ints.max() <= 2**30
    assert np.all(ints * scale >= costs - 1e-6)
    assert np.all(ints * scale - costs <= scale)
    with pytest.raises(ValueError):
        scale_to_int([-1.0])


def test_bad_models_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        ModelShape("odd", hidden=64, layers=1, heads=6, kv_heads=4, ffn=128)
    with pytest.raises(ValueError, match="both zero"):
        CostModel(token=0, pair=0)
    with pytest.raises(ValueError, match="unknown model preset"):
        CostModel.preset("gpt-9")
    model = CostModel(token=1e-9, pair=2e-12, segment=3e-6, unit="s", name="calibrated")
    model.save(tmp_path / "profile.json")
    assert CostModel.load(tmp_path / "profile.json") == model
    assert model.seconds(5.0) == 5.0


@pytest.mark.parametrize("field", ["token", "pair", "segment", "microbatch"])
def test_a_price_whose_costs_would_overflow_float64_is_refused(tmp_path, field):
    prices = {"token": 1e-9, "pair": 1e-12, "unit": "s"}
    CostModel(**{**prices, field: MAX_PRICE})
    with pytest.raises(ValueError, match=f"CostModel 'custom': {field} 1e\\+154 is above 1e\\+100"):
        CostModel(**{**prices, field: 1e154})
    (tmp_path / "huge.json").write_text(json.dumps({**prices, field: 1e308}))
    with pytest.raises(ValueError, match=f"cost profile {tmp_path / 'huge.json'}: .*{field} 1e\\+308 is above"):
        CostModel.load(tmp_path / "huge.json")
    with pytest.raises(ValueError, match="flops_per_second 1e-300 is below 1e-100"):
        CostModel(token=1.0, pair=1.0, flops_per_second=1e-300)


@pytest.mark.parametrize("command", ["plan", "report", "simulate"])
@pytest.mark.parametrize("price", [1e155, 1e308])
def test_the_commands_refuse_a_huge_price_in_one_line(tmp_path, command, price):
    np.save(tmp_path / "lengths.npy", np.arange(1, 400) * 7)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"token": price, "pair": 1e-12, "unit": "s"}))
    mesh = ["--cp", 2, "--tokens-per-rank", 2048]
    argv = {
        "plan": ["plan", "--dp", 2, *mesh, "--cost-profile", profile, "--out", tmp_path / "plan.json"],
        "report": ["report", "--dp", 2, *mesh, "--cost-profile", profile, "--no-plots"],
        "simulate": ["simulate", "--world", 4, *mesh, "--model", profile, "--no-plots"],
    }[command]
    run = run_cli([*argv, "--lengths", tmp_path / "lengths.npy"])
    assert_clean(run)
    assert run.code == 1 and f"cost profile {profile}: CostModel 'custom': token {price:g}" in run.err, run.err
    assert len(run.err.splitlines()) == 1, run.err


def test_the_per_microbatch_constant_is_stored_only_when_set(tmp_path):
    plain = CostModel(token=1e-9, pair=2e-12, unit="s")
    assert "microbatch" not in plain.to_dict()  # plan hashes of models without one are unaffected
    timed = CostModel(token=1e-9, pair=2e-12, unit="s", microbatch=4e-3)
    assert timed.to_dict()["microbatch"] == 4e-3
    timed.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json") == timed
    assert np.array_equal(timed.cost([10, 20], [5, 6]), plain.cost([10, 20], [5, 6])), "rank costs leave it out"
    with pytest.raises(ValueError, match="microbatch"):
        CostModel(token=1e-9, pair=2e-12, microbatch=-1.0)


@given(random_plan())
def test_plan_costs_and_reports_leave_the_per_microbatch_constant_out(plan):
    from ringpack.analysis.metrics import evaluate_plan
    from ringpack.planner.bounds import plan_costs

    timed = dataclasses.replace(plan.config, cost=dataclasses.replace(plan.config.cost, microbatch=7.0))
    again = dataclasses.replace(plan, config=timed)
    assert np.array_equal(evaluate_plan(again).cost, evaluate_plan(plan).cost)
    costs, costs_again = plan_costs(plan), plan_costs(again)
    assert all(np.array_equal(costs[k], costs_again[k], equal_nan=True) for k in costs)


GOOD_FIT = dict(
    scope="step", device="NVIDIA H200", held_out_max_error=0.03, held_out_mean_error=0.008, held_out_shards=48
)


def test_fit_quality_travels_with_the_profile_and_leaves_prices_and_plan_hashes_alone(tmp_path):
    import ringpack

    plain = CostModel(token=1e-6, pair=2e-10, segment=1e-5, unit="s", name="llama-1b")
    measured = dataclasses.replace(plain, fit_quality=GOOD_FIT)
    assert measured == plain and hash(measured) == hash(plain) and measured.to_dict() == plain.to_dict()
    plain.save(tmp_path / "plain.json")
    measured.save(tmp_path / "measured.json")
    assert "fit_quality" not in (tmp_path / "plain.json").read_text()  # files of unmeasured models unchanged
    loaded = CostModel.load(tmp_path / "measured.json")
    assert loaded.fit_quality == GOOD_FIT and loaded.fit_problem() is None
    lengths = np.random.default_rng(1).integers(1, 3000, 300)
    config = dict(dp=2, cp=2, tokens_per_rank=4096, samples_per_step=64)
    with_fit = ringpack.plan(lengths, cost=loaded, **config)
    assert with_fit.content_hash == ringpack.plan(lengths, cost=plain, **config).content_hash
    with_fit.save(tmp_path / "plan.json")
    assert ringpack.Plan.load(tmp_path / "plan.json").content_hash == with_fit.content_hash


@pytest.mark.parametrize(
    "quality, says",
    [
        ({**GOOD_FIT, "held_out_max_error": 0.31}, "its held-out timings were off by up to 31% (over 20%)"),
        ({**GOOD_FIT, "device": "cpu"}, "it was timed on a CPU (a dry run), so its prices are not a GPU's"),
    ],
)
def test_loading_a_poor_profile_warns_once_in_one_line(tmp_path, caplog, quality, says):
    path = tmp_path / "profile.json"
    CostModel(token=1e-6, pair=2e-10, unit="s", fit_quality=quality).save(path)
    with caplog.at_level("WARNING", logger="ringpack.cost"):
        CostModel.load(path)
        CostModel.load(path)
    messages = [r.getMessage() for r in caplog.records if r.name == "ringpack.cost"]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert messages[0].startswith(f"cost profile {path}: {says}; plans balanced by it may be unbalanced")


def test_loading_a_good_or_unmeasured_profile_is_silent(tmp_path, caplog):
    for name, quality in (("good.json", GOOD_FIT), ("plain.json", None), ("no-errors.json", {"scope": "step"})):
        CostModel(token=1e-6, pair=2e-10, unit="s", fit_quality=quality).save(tmp_path / name)
        with caplog.at_level("WARNING", logger="ringpack.cost"):
            CostModel.load(tmp_path / name)
    assert not [r for r in caplog.records if r.name == "ringpack.cost"]


@pytest.mark.parametrize(
    "quality, says",
    [
        ("bad", "fit_quality must be a mapping"),
        ({"held_out_max_error": "3%"}, "fit_quality held_out_max_error must be a number"),
        ({"held_out_mean_error": True}, "fit_quality held_out_mean_error must be a number"),
        ({"device": 0}, "fit_quality device must be a string"),
    ],
)
def test_a_bad_fit_quality_is_refused_naming_the_field(tmp_path, quality, says):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"token": 1e-6, "pair": 2e-10, "unit": "s", "fit_quality": quality}))
    with pytest.raises(ValueError, match=f"cost profile {path}: .*{says}"):
        CostModel.load(path)


def test_plan_with_a_dry_run_profile_warns_in_one_line_and_plans_as_without_its_fit(tmp_path):
    from tests.helpers.cli import run_cli

    np.save(tmp_path / "lengths.npy", np.random.default_rng(2).integers(1, 3000, 200))
    plain = CostModel(token=2.5, pair=1.2e-5, segment=0.11, unit="s", name="llama3-8b")
    dry = dataclasses.replace(plain, fit_quality={**GOOD_FIT, "device": "cpu", "held_out_max_error": 3.1})
    hashes = []
    for name, model in (("plain", plain), ("dry", dry)):
        model.save(tmp_path / f"{name}.json")
        argv = ["plan", "--lengths", tmp_path / "lengths.npy", "--dp", "2", "--cp", "2", "--tokens-per-rank", "4096"]
        argv += ["--samples-per-step", "64", "--cost-profile", tmp_path / f"{name}.json", "--json"]
        run = run_cli([*argv, "--quiet", "--out", tmp_path / f"{name}.plan.json"])
        assert run.code == 0, run.err
        hashes.append(json.loads((tmp_path / f"{name}.plan.json").read_text())["hash"])
        warnings = [line for line in run.err.splitlines() if "warning" in line]
        assert warnings == ([] if name == "plain" else [warnings[0]])
    assert hashes[0] == hashes[1]
    assert warnings[0].startswith(
        f"ringpack plan: warning: cost profile {tmp_path / 'dry.json'}: it was timed on a CPU"
    )
    assert "off by up to 310% (over 20%)" in warnings[0]
