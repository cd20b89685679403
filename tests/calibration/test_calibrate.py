"""``ringpack calibrate`` on the CPU: features against brute force, the NNLS fit, the dry run, the no-GPU exit."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from ringpack import cost_fit
from ringpack.attention.schedule import compile_schedule
from ringpack.calibration import cases as case_grid
from ringpack.calibration import features, fit, run, timing
from ringpack.cost import CostModel
from ringpack.planner.split import split_balanced, split_contiguous, split_zigzag
from ringpack.shard_plan import PlanConfig


# ------------------------------------------------------------------------------------ brute force
def brute_segment(lq: int, lk: int, causal: bool, bq: int, bk: int) -> tuple[int, int]:
    """(pairs, tiles touched) of one segment by enumerating its mask (bottom-right causal alignment)."""
    qi = np.arange(lq)[:, None]
    kj = np.arange(lk)[None, :]
    mask = (kj <= qi + lk - lq) if causal else np.ones((lq, lk), dtype=bool)
    tiles = {(int(i) // bq, int(j) // bk) for i, j in zip(*np.nonzero(mask))}
    return int(mask.sum()), len(tiles)


def brute_rank_pairs(case: case_grid.Case) -> int:
    """(query, key) pairs of one rank: same sample, key position <= query position, keys anywhere."""
    total = 0
    for p in case.pieces:
        for q in range(p.start, p.stop):
            total += q + 1
    return total


def brute_call_tiles(case: case_grid.Case, bq: int, bk: int) -> int:
    schedule = compile_schedule(case.microbatch, case.rank)
    total = 0
    for call in features.schedule_calls(schedule):
        cq, ck = call.cu_seqlens_q.tolist(), call.cu_seqlens_k.tolist()
        for b in range(len(cq) - 1):
            lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            if lq and lk:
                total += brute_segment(lq, lk, call.causal, bq, bk)[1]
    return total


@pytest.mark.parametrize("causal", [True, False])
def test_segment_pairs_and_tiles_match_brute_force(causal):
    rng = np.random.default_rng(0)
    for _ in range(150):
        lq = int(rng.integers(1, 70))
        lk = int(rng.integers(1, 70)) if not causal or rng.random() < 0.5 else lq
        bq, bk = (int(x) for x in rng.choice([4, 8, 16, 64], size=2))
        pairs, tiles = brute_segment(lq, lk, causal, bq, bk)
        assert features.segment_pairs([lq], [lk], causal)[0] == pairs, (lq, lk)
        assert features.segment_tiles([lq], [lk], causal, bq, bk)[0] == tiles, (lq, lk, bq, bk)


def test_segment_tiles_vectorised_over_segments():
    lq = np.array([1, 128, 129, 1000, 256])
    lk = lq.copy()
    got = features.segment_tiles(lq, lk, True, 128, 64)
    assert got.tolist() == [brute_segment(int(a), int(a), True, 128, 64)[1] for a in lq]
    # a multiple of the block: n(n+1)/2 tiles of 128x128 on the diagonal and below
    assert features.segment_tiles([1024], [1024], True, 128, 128)[0] == 8 * 9 // 2


def small_cases() -> list[case_grid.Case]:
    lengths = [37, 5, 90, 1, 64, 23]
    samples = list(range(len(lengths)))
    cases = case_grid.grid_cases("tiny")
    for cp in (2, 3, 4):
        for mb in (
            split_contiguous(samples, lengths, cp),
            split_zigzag(samples, lengths, cp),
            split_balanced(
                samples, lengths, cp, -(-sum(lengths) // cp) + 10, CostModel(token=1.0, pair=0.05, segment=3.0)
            ),
        ):
            cases += case_grid.rank_cases("t", mb, lengths, f"cp{cp}")
    return cases


def schedule_pairs(case: case_grid.Case) -> int:
    """(query, key) pairs the rank's scheduled kernel calls compute."""
    total = 0
    for call in features.schedule_calls(compile_schedule(case.microbatch, case.rank)):
        lq, lk = np.diff(call.cu_seqlens_q.numpy()), np.diff(call.cu_seqlens_k.numpy())
        total += int(features.segment_pairs(lq, lk, call.causal).sum())
    return total


def test_rank_features_match_brute_force_on_small_shards():
    for case in small_cases():
        f = features.rank_features(case, False, 16, 8)
        planner = features.planner_features(case)
        pairs = brute_rank_pairs(case)
        assert planner[2] == f["pairs"] == pairs  # the cost model's exact pairs
        assert schedule_pairs(case) == pairs  # what the schedule's kernel calls compute, exactly
        assert f["tiles"] == brute_call_tiles(case, 16, 8)
        assert 16 * 8 * f["tiles"] >= pairs
        assert f["tokens"] == planner[1] == sum(p.stop - p.start for p in case.pieces) and f["calls"] >= 1


# ---------------------------------------------------------------------------------------------- fit
TRUE = np.array([30e-6, 2.0e-9, 1.7e-13, 3.0e-6])  # overhead, per token, per pair, per piece (s)


def grid_features() -> np.ndarray:
    return np.stack([features.planner_features(c) for c in case_grid.grid_cases("quick")])


def test_fit_recovers_exact_coefficients():
    x = grid_features()
    for relative in (True, False):
        got = cost_fit.fit_nnls(x, x @ TRUE, relative=relative)
        assert np.allclose(got, TRUE, rtol=1e-6), (relative, got)


def test_fit_with_noise_is_close_and_never_negative():
    x = grid_features()
    rng = np.random.default_rng(2)
    times = (x @ TRUE) * (1 + 0.02 * rng.standard_normal(len(x)))
    got = cost_fit.fit_nnls(x, times)
    assert (got >= 0).all()
    assert abs(got[2] / TRUE[2] - 1) < 0.05  # the pair cost is what the planner needs most
    q = fit.quality(x @ TRUE, x @ got)
    assert q["r"] > 0.999 and q["max_rel_err"] < 0.06
    # a negative truth (a feature that makes things cheaper) is clamped to zero
    truth = TRUE * np.array([1, 1, 1, 0]) - np.array([0, 0, 0, 1e-6])
    got = cost_fit.fit_nnls(x, np.maximum(x @ truth, 1e-6))
    assert (got >= 0).all() and got[3] == 0.0


def test_fit_refuses_non_finite_input_in_one_line_and_scales_huge_counts_without_overflow():
    x = grid_features()
    times = x @ TRUE
    for bad_times, says in (
        (np.where(np.arange(len(x)) == 3, np.nan, times), "finite features and times"),
        (np.where(np.arange(len(x)) < 2, 0.0, times), r"positive times \(2 of"),
        (np.where(np.arange(len(x)) == 0, 5e-324, times), "overflows"),
    ):
        with pytest.raises(ValueError, match=says):
            cost_fit.fit_nnls(x, bad_times)
    with pytest.raises(ValueError, match="finite features"):
        cost_fit.fit_nnls(np.where(x == x[0, 0], np.inf, x), times)
    huge = x * np.array([1.0, 1.0, 1e180, 1.0])  # finite, but its squares overflow a plain norm
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        got = cost_fit.fit_nnls(huge, huge @ (TRUE / np.array([1.0, 1.0, 1e180, 1.0])))
    assert np.allclose(got * np.array([1.0, 1.0, 1e180, 1.0]), TRUE, rtol=1e-6)


def test_quality_and_pearson():
    q = fit.quality([1.0, 2.0, 4.0], [1.1, 2.0, 3.0])
    assert q["n"] == 3 and q["max_rel_err"] == pytest.approx(0.25) and q["mean_rel_err"] == pytest.approx(0.35 / 3)
    assert fit.pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert np.isnan(fit.pearson([1.0], [1.0]))


# --------------------------------------------------------------------------------------------- grid
def estimated_seconds(
    cases: list[case_grid.Case], shape: timing.AttentionShape, reps: int = 5, warmup: int = 1
) -> float:
    """Rough GPU time of timing ``cases``: whole tiles at 250 TFLOP/s plus 0.3 ms per run, repeated as ``time_case``."""
    total = 0.0
    for case in cases:
        one = features.rank_features(case)["tiles"] * 128 * 128 * shape.flops_per_pair() / 2.5e14 + 3e-4
        total += one * (warmup + max(1, reps if one < 0.05 else min(reps, 3)))
    return total


def test_default_grid_covers_the_shapes_and_fits_the_time_budget():
    cases = case_grid.grid_cases("full")
    held = case_grid.eval_cases("full", CostModel.preset("llama3-8b"))
    f = np.stack([features.planner_features(c) for c in cases])
    assert f[:, 1].max() == 65536 and f[:, 1].min() <= 128  # single samples 128 .. 64K
    assert {c.family for c in cases} == {"single", "pack", "mix", "split", "zigzag", "plan"}
    assert any(c.family == "pack" and len(c.pieces) >= 256 for c in cases)  # many short samples
    assert any(c.family == "split" and c.pieces[0].start > 0 for c in cases)  # suffix pieces: full blocks
    assert {c.family for c in held} == set(case_grid.EVAL_STRATEGIES) and len(held) >= 36
    assert all(len(c.microbatch.shards) == 2 for c in held)
    shape = timing.AttentionShape(32, 8, 128)
    # the GPU time of timing them, by whole 128x128 tiles, is well under a minute
    assert estimated_seconds(cases, shape) + estimated_seconds(held, shape) < 40


def test_compute_only_timer_runs_multi_step_schedules():
    case = case_grid.rank_cases("zigzag", split_zigzag([0, 1], [40, 13], 4), [40, 13], "z")[1]
    assert len(compile_schedule(case.microbatch, case.rank).steps) >= 2
    setup = timing.TimingSetup(
        timing.AttentionShape(2, 1, 8),
        "reference",
        torch.device("cpu"),
        torch.float32,
        timing.Clock("cpu"),
        reps=2,
        warmup=0,
    )
    assert timing.time_case(case, setup) > 0


# ---------------------------------------------------------------------------------------------- CLI
class FlopClock(timing.Clock):
    """A deterministic clock: a repetition takes its FLOPs (as torch's ``FlopCounterMode`` counts them) at 1 GFLOP/s.

    The dry run's shards take about a millisecond each on the CPU, so on a loaded machine wall-clock
    noise can swamp their differences and leave the fit no signal; counted work has none.
    """

    def __init__(self) -> None:
        super().__init__("cpu")

    @property
    def kind(self) -> str:
        return "flops"

    def measure(self, fn, warmup: int, reps: int) -> list[float]:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            with FlopCounterMode(display=False) as counter:
                fn()
            times.append(counter.get_total_flops() * 1e-9)
        return times


def test_cpu_dry_run_writes_a_loadable_profile(tmp_path, caplog):
    out = tmp_path / "prof" / "profile.json"
    config = run.KernelCalibrationConfig(
        device="cpu", backend="reference", model="tiny", heads=2, kv_heads=1, head_dim=16, reps=1, warmup=0
    )
    result = run.calibrate_kernels(config, clock=FlopClock(), log=lambda _: None)
    profile = run.with_fit_quality(result, "kernels")
    assert run.save_calibration(result, out, profile=profile) == (out, tmp_path / "prof" / "profile.report.json")
    text = run.format_summary(result)
    assert text.startswith("CPU dry run:") and "held-out" in text and "r=" in text and "max error" in text
    pairs = next(line for line in text.splitlines() if "pairs at" in line)
    assert "pairs at 0 " not in pairs and "FLOP/s" in pairs  # a CPU's rate in its own unit
    line = run.quality_line(profile)
    assert line.startswith("profile tiny-h2kv1d16: held-out error mean ") and "timed on a CPU" in line
    with caplog.at_level("WARNING", logger="ringpack.cost"):
        profile = CostModel.load(out)
    assert profile.fit_quality["device"] == "cpu" and profile.fit_quality["scope"] == "kernels"
    warned = [r.getMessage() for r in caplog.records if r.name == "ringpack.cost"]
    assert len(warned) == 1 and str(out) in warned[0] and profile.fit_problem() in warned[0]
    assert profile.unit == "s" and profile.token > 0 and profile.pair > 0 and profile.segment >= 0
    assert profile.name == "tiny-h2kv1d16"
    report = json.loads((tmp_path / "prof" / "profile.report.json").read_text())
    assert report["format"] == "ringpack-calibration" and report["meta"]["backend"] == "reference"
    assert report["meta"]["timer"] == "flops"  # the clock the run was given timed it
    assert report["linear"]["layer_token_s"] > 0  # mode linear (default) timed the tiny preset's GEMMs
    assert report["profile"] == profile.to_dict()
    assert len(report["eval_rows"]) == report["held_out"]["n"] >= 4
    assert {"r", "max_rel_err", "mean_rel_err"} <= set(report["held_out"])
    # the planner takes it as any cost model
    cfg = PlanConfig(dp=1, cp=2, tokens_per_rank=512, cost=CostModel.load(out))
    mb = split_balanced([0, 1, 2], [300, 200, 100], 2, cfg.tokens_per_rank, cfg.cost)
    assert sum(s.num_tokens for s in mb.shards) == 600


@pytest.mark.parametrize("quiet", [True, False])
def test_quiet_prints_one_line_on_the_fit_and_one_on_the_files(tmp_path, capsys, quiet):
    from ringpack.cli import main

    out = tmp_path / "profile.json"
    argv = ["calibrate", "--device", "cpu", "--backend", "reference", "--model", "tiny", "--heads", "2"]
    argv += ["--kv-heads", "1", "--head-dim", "16", "--reps", "1", "--warmup", "0", "--out", str(out)]
    assert main(argv + (["--quiet"] if quiet else [])) == 0
    lines = capsys.readouterr().out.splitlines()
    if quiet:
        assert len(lines) == 2 and lines[0].startswith("profile tiny-h2kv1d16: held-out error mean ")
        assert lines[1].startswith(f"wrote {out}")
    else:
        assert lines[0].startswith("CPU dry run:") and len(lines) > 4
    assert CostModel.load(out).fit_quality["scope"] == "kernels"


def test_no_cuda_exits_2_with_a_clear_message(monkeypatch, capsys, tmp_path):
    from ringpack.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["calibrate", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ringpack calibrate: error:")
    assert "needs a CUDA device" in err[0] and "--device cpu --backend reference" in err[0]
    assert not (tmp_path / "p.json").exists()
    assert main(["calibrate", "--device", "cpu", "--backend", "torch_flash"]) == 2
    assert "reference" in capsys.readouterr().err


def test_unknown_model_is_a_user_error():
    with pytest.raises(ValueError, match="not a preset"):
        run.KernelCalibrationConfig(device="cpu", model="gpt-5")


def test_the_cpu_dry_run_times_the_tiny_model_unless_told():
    assert run.KernelCalibrationConfig(device="cpu").model == "tiny"
    assert run.KernelCalibrationConfig().model == "llama3-8b"
    assert run.KernelCalibrationConfig(device="cpu", model="llama-1b").model == "llama-1b"
