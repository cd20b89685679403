"""``ringpack calibrate --scope step`` on the CPU: fit, held-out check, predictions, model timer, CLI."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from ringpack.calibration.step import (
    CPU_ATTENTION_BYTES,
    DEFAULT_TOKENS_PER_RANK,
    StepCalibrationConfig,
    calibrate_step,
    check_cpu_budget,
    held_out_errors,
    model_config,
    predicted_busy,
    reference_attention_bytes,
    step_cases,
)
from ringpack.cost import PRESETS, CostModel
from ringpack.cost_fit import microbatch_features
from ringpack.errors import DataError, PlanError
from ringpack.progress import Progress
from ringpack.shard_plan import Piece, Step, microbatch_from_shards
from tests.helpers.cli import run_cli

TRUTH = CostModel(token=3e-6, pair=4e-10, segment=2e-5, unit="s", name="truth", microbatch=5e-3)
SMALL = dict(tokens_per_rank=4096, cp=2, device="cpu", fit_mixes=3, held_out_mixes=2)


def true_seconds(case) -> float:
    feats, _ = microbatch_features(case.microbatch)
    return float(TRUTH.cost(*feats[case.rank]) + TRUTH.microbatch)


def test_fit_recovers_the_step_prices_and_predicts_held_out_shards():
    rng = np.random.default_rng(0)
    result = calibrate_step(
        StepCalibrationConfig(**SMALL), time_shard=lambda c: true_seconds(c) * (1 + 0.002 * rng.standard_normal())
    )
    p = result.profile
    assert p.unit == "s" and p.name == "llama-1b"
    assert p.token == pytest.approx(TRUTH.token, rel=0.05)
    assert p.pair == pytest.approx(TRUTH.pair, rel=0.05)
    assert p.microbatch == pytest.approx(TRUTH.microbatch, rel=0.2)
    held = result.held_out
    assert held["shards"] > 0 and held["microbatches"] > 0
    assert held["shard_max"] < 0.02 and held["microbatch_max"] < 0.02
    fit_labels = {r["label"] for r in result.rows if r["set"] == "fit"}
    held_labels = {r["label"] for r in result.rows if r["set"] == "held-out"}
    assert fit_labels and held_labels and not fit_labels & held_labels
    # the report is plain JSON and names every timed micro-batch's geometry
    doc = json.loads(json.dumps(result.to_dict()))
    assert doc["format"] == "ringpack-step-calibration" and CostModel.from_dict(doc["profile"]) == p
    assert all(0 <= r["microbatch"] < len(doc["microbatches"]) for r in doc["rows"])


def test_fits_the_planner_must_not_use_are_refused_on_a_gpu_and_kept_with_a_warning_on_a_dry_run(caplog):
    def pairs_only(case) -> float:  # a timer that cannot see tokens: the fit prices them at zero
        feats, _ = microbatch_features(case.microbatch)
        return float(1e-9 * feats[case.rank][1] + 1e-3)

    with pytest.raises(ValueError, match="prices tokens at zero.*--tokens-per-rank"):
        calibrate_step(StepCalibrationConfig(**{**SMALL, "device": "cuda"}), time_shard=pairs_only)
    with caplog.at_level("WARNING", logger="ringpack.calibrate"):
        result = calibrate_step(StepCalibrationConfig(**SMALL), time_shard=pairs_only)
    assert result.profile.token == 0 and "dry run keeps it" in caplog.text


@pytest.mark.parametrize("bad", [0.0, float("nan"), -1e-3, float("inf")])
def test_bad_shard_timings_are_left_out_of_the_fit_and_the_held_out_check(bad, caplog):
    calls = []

    def glitchy(case) -> float:  # every 9th shard's clock misbehaves
        calls.append(case)
        return bad if len(calls) % 9 == 0 else true_seconds(case)

    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="ringpack.calibrate"):
        warnings.simplefilter("error")
        result = calibrate_step(StepCalibrationConfig(**SMALL), time_shard=glitchy)
    n_bad = len(calls) // 9
    assert f"{n_bad} of {len(calls)} shard timings are not a usable time" in caplog.text
    assert result.profile.pair == pytest.approx(TRUTH.pair, rel=0.01)
    fit_bad = sum(1 for r in result.rows if r["set"] == "fit" and not 0 < r["seconds"] < np.inf)
    assert result.fit.unusable >= fit_bad > 0
    held = result.held_out
    assert np.isfinite(held["shard_max"]) and held["shard_max"] < 0.01
    assert held["shards"] < sum(1 for r in result.rows if r["set"] == "held-out")


def test_shards_span_whole_samples_split_samples_and_small_microbatches():
    cases = step_cases(StepCalibrationConfig(**SMALL), seed=3, cost=CostModel.preset("llama-1b"))
    families = {c.family for c in cases}
    assert families == {"cp1", "balanced", "zigzag", "first-fit+contiguous"}
    tokens = [sum(p.stop - p.start for p in c.pieces) for c in cases]
    assert max(tokens) <= SMALL["tokens_per_rank"] and min(tokens) < SMALL["tokens_per_rank"] // 3
    assert any(microbatch_features(c.microbatch)[1] for c in cases), "some samples are split over ranks"
    assert all(len(c.microbatch.shards) == 1 for c in cases if c.family == "cp1")
    # at CP=1 the small first-fit shards stay: they tell the per-micro-batch constant from the token price
    whole = step_cases(StepCalibrationConfig(**{**SMALL, "cp": 1}), seed=3, cost=CostModel.preset("llama-1b"))
    assert {c.family for c in whole} == {"cp1", "first-fit+contiguous"}


def test_held_out_errors_by_hand():
    rows = [
        dict(microbatch=0, rank=0, tokens=100, pairs=0, pieces=0, seconds=2.0),
        dict(microbatch=0, rank=1, tokens=200, pairs=0, pieces=0, seconds=4.0),
        dict(microbatch=1, rank=0, tokens=100, pairs=0, pieces=0, seconds=1.0),
    ]
    model = CostModel(token=0.02, pair=0.0, unit="s")  # predicts 2, 4, 2 seconds
    errors = held_out_errors(model, rows)
    assert errors["shard_max"] == pytest.approx(1.0) and errors["shard_mean"] == pytest.approx(1 / 3)
    assert errors["microbatch_max"] == pytest.approx(1.0) and errors["microbatch_mean"] == pytest.approx(0.5)
    assert errors["shards"] == 3 and errors["microbatches"] == 2
    assert np.isnan(held_out_errors(model, [])["shard_mean"])


def test_predicted_busy_runs_coupled_ranks_at_their_slowest_pace():
    lengths = [100, 60, 40, 30]
    coupled = microbatch_from_shards([0], [[Piece(0, 0, 70)], [Piece(0, 70, 100)]], lengths)
    alone = microbatch_from_shards([1, 2], [[Piece(1, 0, 60)], [Piece(2, 0, 40)]], lengths)
    small = microbatch_from_shards([3], [[Piece(3, 0, 30)], []], lengths)
    step = Step(microbatches=((coupled, alone), (small,)), lower_bound=0.0)
    model = CostModel(token=1.0, pair=0.01, segment=0.5, unit="s", microbatch=3.0)

    def rank_cost(mb, c):
        pieces = mb.shards[c].pieces
        pairs = sum(q + 1 for p in pieces for q in range(p.start, p.stop))
        return sum(p.stop - p.start for p in pieces) + 0.01 * pairs + 0.5 * len(pieces)

    slowest = max(rank_cost(coupled, 0), rank_cost(coupled, 1))
    expected = np.array(
        [
            [slowest + rank_cost(alone, 0) + 6.0, slowest + rank_cost(alone, 1) + 6.0],
            [rank_cost(small, 0) + 3.0, 3.0],
        ]
    )
    assert np.allclose(predicted_busy(step, model), expected)


def test_model_config_of_presets_and_config_files(tmp_path):
    config, shape = model_config("tiny")
    assert shape == PRESETS["tiny"] and config.hidden_size == shape.hidden and config.vocab_size == shape.vocab
    (tmp_path / "mine.json").write_text(
        json.dumps(
            dict(
                model_type="llama",
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=100,
            )
        )
    )
    config, shape = model_config(str(tmp_path / "mine.json"))
    assert (shape.name, shape.hidden, shape.kv_heads, shape.head_dim, shape.vocab) == ("mine", 64, 2, 16, 100)
    with pytest.raises(ValueError, match="neither a preset"):
        model_config(str(tmp_path / "missing.json"))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps(dict(model_type="gpt2", n_embd=64, n_layer=2)))
    with pytest.raises(ValueError, match="'gpt'.*lacks.*intermediate_size"):
        model_config(str(tmp_path / "gpt" / "config.json"))


def test_the_model_timer_runs_the_whole_model_on_split_shards():
    """The real timer on a tiny Llama: remote K/V served from memory, gradients reach every weight."""
    from ringpack.calibration.step import ModelStepTimer

    config = StepCalibrationConfig(
        model="tiny", backend="reference", device="cpu", tokens_per_rank=128, reps=1, warmup=0, fit_mixes=1
    )
    timer = ModelStepTimer(config)
    cases = step_cases(config, seed=0, cost=CostModel.preset("tiny"))
    remote = next(c for c in cases if microbatch_features(c.microbatch)[1] and c.rank == 1)
    assert timer(remote) > 0
    grads = [p.grad for p in timer.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert timer.model.model.embed_tokens.weight.grad.abs().sum() > 0


@pytest.mark.slow
def test_cli_dry_run_writes_a_profile_the_planner_loads(tmp_path, monkeypatch):
    from ringpack.calibration.step import ModelStepTimer

    timed = []

    def deterministic(self, case):  # the real model runs (a tiny one); its CPU wall time is too noisy to fit
        timed.append(real(self, case))
        return true_seconds(case)

    real = ModelStepTimer.__call__
    monkeypatch.setattr(ModelStepTimer, "__call__", deterministic)
    out = tmp_path / "runs" / "step.json"
    out.parent.mkdir()
    run = run_cli(
        ["calibrate", "--scope", "step", "--model", "tiny", "--device", "cpu", "--backend", "reference"]
        + ["--tokens-per-rank", "128", "--fit-mixes", "2", "--held-out-mixes", "1", "--microbatches", "1"]
        + ["--reps", "1", "--warmup", "0", "--out", out]
    )
    assert run.code == 0, run.err
    assert timed and all(t > 0 for t in timed)
    profile = CostModel.load(out)
    assert profile.unit == "s" and profile.name == "tiny"
    assert profile.pair / profile.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=0.05)
    report = json.loads((tmp_path / "runs" / "step.report.json").read_text())
    assert report["format"] == "ringpack-step-calibration" and report["meta"]["config"]["model"] == "tiny"
    assert "held out:" in run.out and "ms/micro-batch" in run.out
    assert run.out.splitlines()[0].startswith("CPU dry run:")
    assert profile.fit_quality["scope"] == "step" and profile.fit_quality["device"] == "cpu"
    assert profile.fit_quality["held_out_shards"] == report["held_out"]["shards"] > 0
    assert profile.fit_quality["held_out_max_error"] == pytest.approx(report["held_out"]["shard_max"])


def test_quiet_prints_one_line_on_the_fit_and_the_profile_carries_it(tmp_path, monkeypatch, caplog):
    import ringpack.calibration.step as step
    import ringpack.cli.calibrate_run as command

    real, level = step.calibrate_step, step.log.level
    monkeypatch.setattr(command, "calibrate_step", lambda config, **kw: real(config, time_shard=true_seconds, **kw))
    out = tmp_path / "step.json"
    argv = ["calibrate", "--scope", "step", "--model", "tiny", "--device", "cpu", "--backend", "reference"]
    run = run_cli(
        [*argv, "--tokens-per-rank", "256", "--fit-mixes", "2", "--held-out-mixes", "1", "--quiet", "--out", out]
    )
    assert run.code == 0, run.err
    lines = run.out.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"wrote {out}"), lines
    assert lines[0].startswith("profile tiny: held-out error mean 0.0%, largest 0.0% over ")
    assert "timed on a CPU (a dry run)" in lines[0]
    assert step.log.level == level  # --quiet silenced this run only
    with caplog.at_level("WARNING", logger="ringpack.cost"):
        profile = CostModel.load(out)
    assert profile.fit_quality["device"] == "cpu" and "timed on a CPU" in caplog.text


def test_cli_refuses_what_step_scope_cannot_do(tmp_path, monkeypatch):
    report = tmp_path / "r.json"
    report.write_text("{}")
    for argv, says in (
        (
            ["--scope", "step", "--model", "tiny", "--refit", report],
            "does not apply to --scope step",
        ),
        (["--scope", "step", "--model", "tiny", "--grid", "tiny", "--timer", "wall"], "--grid tiny, --timer wall do"),
        (["--cp", "4", "--grad-ckpt"], "--grad-ckpt, --cp 4 do not apply to --scope kernels"),
        (["--scope", "step"], "--scope step needs --model"),
    ):
        run = run_cli(["calibrate", *argv, "--out", tmp_path / "p.json"])
        assert run.code != 0 and says in run.err and len(run.err.strip().splitlines()) == 1, (argv, run.err)
    run = run_cli(["calibrate", "--scope", "step", "--device", "cpu", "--model", tmp_path / "nope.json"])
    assert run.code != 0 and "neither a preset" in run.err and len(run.err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = run_cli(["calibrate", "--scope", "step", "--model", "tiny", "--out", tmp_path / "p.json"])
    assert run.code == 2 and "needs a GPU" not in run.err and "GPU" in run.err
    assert len(run.err.strip().splitlines()) == 1
    assert not (tmp_path / "p.json").exists()


# ------------------------------------------------------------------------------- the CPU dry run


def test_a_cpu_dry_run_defaults_to_a_cpu_sized_budget():
    assert StepCalibrationConfig(device="cpu").tokens_per_rank == DEFAULT_TOKENS_PER_RANK["cpu"] == 1024
    assert StepCalibrationConfig().tokens_per_rank == DEFAULT_TOKENS_PER_RANK["cuda"] == 65536
    assert StepCalibrationConfig(device="cpu", tokens_per_rank=2048).tokens_per_rank == 2048
    check_cpu_budget(StepCalibrationConfig(device="cpu"), PRESETS["llama-1b"])  # the default fits


@pytest.mark.parametrize(
    "field, value",
    [
        ("tokens_per_rank", 2.5),
        ("tokens_per_rank", 0),
        ("cp", True),
        ("reps", "2"),
        ("warmup", -1),
        ("max_len", 1.0),
        ("seed", None),
        ("device", "tpu"),
        ("model", ""),
        ("dtype", "fp8"),
        ("grad_ckpt", "yes"),
    ],
)
def test_config_refuses_a_bad_field_naming_it(field, value):
    with pytest.raises(PlanError, match=f"StepCalibrationConfig.{field} must be"):
        StepCalibrationConfig(**{field: value})


def test_cpu_budget_refuses_what_a_cpu_cannot_hold_naming_the_flag():
    tiny = PRESETS["tiny"]
    with pytest.raises(
        PlanError, match=r"--device cpu: at 65536 tokens per rank .* --tokens-per-rank of at most (\d+)"
    ) as info:
        check_cpu_budget(StepCalibrationConfig(device="cpu", tokens_per_rank=65536), tiny)
    most = int(str(info.value).split("at most ")[1].split()[0])
    assert reference_attention_bytes(most, tiny.heads) <= CPU_ATTENTION_BYTES < reference_attention_bytes(most + 1, 4)
    check_cpu_budget(StepCalibrationConfig(device="cpu", tokens_per_rank=most), tiny)
    check_cpu_budget(StepCalibrationConfig(tokens_per_rank=65536), tiny)  # a GPU is not the CPU's business
    with pytest.raises(PlanError, match="llama3-8b has 8.0B parameters.*--model tiny"):
        check_cpu_budget(StepCalibrationConfig(device="cpu"), PRESETS["llama3-8b"])


def _no_timing(monkeypatch):
    """Make any shard timing fail the test: bad input must be refused before the model is timed."""
    from ringpack.calibration.step import ModelStepTimer

    def timed(self, case):
        raise AssertionError("a shard was timed")

    monkeypatch.setattr(ModelStepTimer, "__call__", timed)


def test_cli_dry_run_without_a_budget_times_cpu_sized_shards(tmp_path, monkeypatch):
    from ringpack.calibration.step import ModelStepTimer

    budgets = []

    def deterministic(self, case):  # the shard is planned for real; the model is not run
        budgets.append(sum(p.stop - p.start for p in case.pieces))
        return true_seconds(case)

    monkeypatch.setattr(ModelStepTimer, "__call__", deterministic)
    out = tmp_path / "dry.json"
    run = run_cli(
        ["calibrate", "--scope", "step", "--device", "cpu", "--backend", "reference", "--model", "tiny"]
        + ["--fit-mixes", "2", "--held-out-mixes", "1", "--microbatches", "1", "--out", out]
    )
    assert run.code == 0, run.err
    assert budgets and max(budgets) <= 1024
    report = json.loads((tmp_path / "dry.report.json").read_text())
    assert report["meta"]["config"]["tokens_per_rank"] == 1024
    assert "at 1024 tokens per rank" in run.err


@pytest.mark.parametrize(
    "config, says",
    [
        ({"hidden_size": 64}, "has no model_type"),
        ({"model_type": "nosuchmodel"}, "model_type 'nosuchmodel' is not an architecture transformers knows"),
        ({"model_type": 7}, "model_type 7 is not an architecture"),
        ({"model_type": "llama", "hidden_size": "abc"}, "transformers refuses it: .*hidden_size"),
        ({"model_type": "llama", "num_attention_heads": 0}, "transformers refuses it"),
        ([1, 2], "is not a JSON object but a list"),
        ("{bad", "is not JSON"),
    ],
)
@pytest.mark.parametrize("as_folder", [False, True])
def test_model_config_refuses_a_bad_file_in_one_line_naming_it(tmp_path, config, says, as_folder):
    file = tmp_path / "m" / "config.json" if as_folder else tmp_path / "m.json"
    file.parent.mkdir(exist_ok=True)
    file.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(DataError, match=says) as info:
        model_config(str(file.parent if as_folder else file))
    assert str(file) in str(info.value) and "\n" not in str(info.value)


def test_model_config_refuses_a_folder_without_a_config(tmp_path):
    with pytest.raises(DataError, match="the folder holds no config.json"):
        model_config(str(tmp_path))


def test_cli_refuses_bad_outputs_before_any_timing(tmp_path, monkeypatch):
    _no_timing(monkeypatch)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "a").mkdir()
    report = tmp_path / "old.report.json"
    report.write_text("{}")
    step = ["calibrate", "--scope", "step", "--device", "cpu", "--backend", "reference", "--model", "tiny"]
    for argv, says in (
        (step + ["--out", tmp_path / "p.json", "--report", tmp_path / "p.json"], "is the --out profile"),
        (step + ["--out", tmp_path / "a" / ".." / "p.json", "--report", tmp_path / "p.json"], "is the --out profile"),
        (step + ["--out", tmp_path / "afile" / "p.json"], "afile is a file, not a folder"),
        (step + ["--out", tmp_path / "p.json", "--report", tmp_path / "afile" / "deep" / "r.json"], "is a file"),
        (step + ["--out", tmp_path], "is a directory"),
        (step + ["--out", tmp_path / "nodir" / "x.json"], f"x.json: folder {tmp_path / 'nodir'} does not exist"),
        (step + ["--tokens-per-rank", "65536", "--out", tmp_path / "p.json"], "--tokens-per-rank of at most"),
        (["calibrate", "--refit", report, "--out", report], "must not overwrite the measured report"),
    ):
        run = run_cli(argv)
        assert run.code == 1 and says in run.err and len(run.err.strip().splitlines()) == 1, (argv, run.err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "afile", "old.report.json"], "nothing written or made"


def test_a_cpu_dry_run_times_each_shard_once_and_fewer_micro_batches():
    cpu, gpu = StepCalibrationConfig(device="cpu"), StepCalibrationConfig()
    assert (cpu.microbatches, cpu.reps, cpu.warmup) == (1, 1, 0)
    assert (gpu.microbatches, gpu.reps, gpu.warmup) == (2, 2, 1)
    given = StepCalibrationConfig(device="cpu", microbatches=2, reps=3, warmup=1)
    assert (given.microbatches, given.reps, given.warmup) == (2, 3, 1)


def test_progress_counts_every_shard_timed_of_a_total_known_first():
    seen = []

    class Counter(Progress):
        def advance_to(self, done, total=None):
            seen.append((done, total if total is not None else self.total))
            super().advance_to(done, total)

    result = calibrate_step(StepCalibrationConfig(**SMALL), time_shard=true_seconds, progress=Counter("t", "shards"))
    shards = len(result.rows)
    assert seen[0] == (0, shards) and seen[-1] == (shards, shards)
    assert [done for done, _ in seen] == list(range(shards + 1))
