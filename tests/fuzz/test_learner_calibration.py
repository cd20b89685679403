"""Bad measurements never stop a training run, and bad step-calibration input ends in one line.

The learner runs on a one-process gloo group (a one-GPU run's world) with times from a hidden
linear model, poisoned with every kind of bad time (0, negative, NaN, infinity, subnormal) and,
through a saved state, with counts no fit can hold (1e308, past int64, negative, NaN). The loop
must never raise or warn, every bad row must be counted, and the fits must still find the true
prices. The step-calibration command is fed every kind of bad input: each must end in exit 1 or 2
with one error line and no traceback, before any model is built or timed.
"""

from __future__ import annotations

import json
import logging
import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.cost import CostModel
from ringpack.cost_fit import microbatch_features, usable_rows
from ringpack.data import BalancedBatchSampler
from ringpack.training.cost_learner import CostLearner, LearnerConfig
from tests.helpers.cli import assert_clean, run_cli

TRUTH = CostModel(token=2e-6, pair=1.5e-10, segment=3e-5, unit="s", name="truth")
OVERHEAD = 4e-3
BAD_TIMES = (0.0, -0.0, -1e-3, -3600.0, math.nan, math.inf, -math.inf, 5e-324, 1e-12)
BAD_COUNTS = (1e308, 2.0**64, -1.0, -(2.0**40), math.nan, math.inf)
LOGGER = "ringpack.training.cost_learner"


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-process gloo group in this process, for every learner test of the module."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path_factory.mktemp('group') / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _sampler() -> BalancedBatchSampler:
    """One rank, 4096 tokens, 32 samples a step: about 17 micro-batches a step, 31 steps an epoch."""
    lengths = np.random.default_rng(11).integers(100, 4000, 1_000).tolist()
    return BalancedBatchSampler(lengths, 0, 1, 1, 4096, samples_per_step=32)


def _true_seconds(ticket) -> float:
    feats, _ = microbatch_features(ticket.microbatch)
    return float(TRUTH.cost(*feats[0]) + OVERHEAD)


def _run(config: LearnerConfig, steps: int, bad: dict[int, float], corrupt_at=None, corrupt=()):
    """Train ``steps`` steps; micro-batch ``k`` (counted over the run) gets time ``bad[k]`` if given.

    After step ``corrupt_at`` the learner is saved (through JSON), ``corrupt`` = ``[(row, column,
    value)]`` is written into the state's rows, and a new learner continues from it.

    Returns:
        ``(learner, expected bad count, learners made)``.
    """
    sampler = _sampler()
    learner = CostLearner(sampler, 0, config=config)
    learners, expected, step, k = 1, 0, 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not even a numpy RuntimeWarning
        for ticket in sampler:
            seconds = bad.get(k, _true_seconds(ticket))
            if k in bad and ticket.step >= config.warmup_steps:
                expected += 1  # warm-up timings are never read
            k += 1
            learner.record({"microbatch": ticket.microbatch, "microbatch_index": ticket.index}, seconds)
            if ticket.index + 1 < ticket.microbatches_in_step:
                continue
            learner.end_step()
            step += 1
            if step == corrupt_at:
                state = json.loads(json.dumps(learner.state_dict()))
                rows = {r for r, _, _ in corrupt if r < len(state["rows"])}
                for r, column, value in corrupt:
                    if r in rows:
                        state["rows"][r][column] = value
                expected += len(rows)
                learner = CostLearner(sampler, 0, config=config)
                learner.load_state_dict(state)
                learners += 1
            if step == steps:
                break
    final = learner.state_dict()
    unread = final["unread"] + final["open"]
    expected -= int((~usable_rows(np.asarray(unread, dtype=np.float64).reshape(-1, 9))).sum())  # not read yet
    return learner, expected, learners


def _assert_learned(learner: CostLearner) -> None:
    """Every accepted fit is the truth: the times are exactly linear, the bad ones left out."""
    for fit in learner.history:
        assert fit.model.pair / fit.model.token == pytest.approx(TRUTH.pair / TRUTH.token, rel=1e-3)
        assert fit.model.microbatch == pytest.approx(OVERHEAD, rel=1e-3)


@pytest.mark.parametrize("bad_time", BAD_TIMES)
def test_every_kind_of_bad_time_is_left_out_counted_and_logged_once(group, bad_time, caplog):
    config = LearnerConfig(warmup_steps=1, first_fit_after=2, refit_every=3)
    bad = dict.fromkeys(range(0, 600, 7), bad_time)  # every 7th micro-batch, warm-up included
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        learner, expected, _ = _run(config, steps=20, bad=bad)
    assert learner.bad_observations == expected > 40
    assert learner.history, "the fits went on without the bad times"
    _assert_learned(learner)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["CostLearner: left out a bad observation"]


@pytest.mark.parametrize("column, value", [(c, v) for c in range(8) for v in BAD_COUNTS] + [(8, v) for v in BAD_TIMES])
def test_a_saved_state_with_bad_rows_loads_and_the_next_fit_runs(group, column, value):
    """Every column of a stored row poisoned with every bad number: loaded, counted, and the fits go on."""
    config = LearnerConfig(warmup_steps=0, first_fit_after=1, refit_every=2)
    corrupt = [(r, column, value) for r in (0, 3, 4, 10)]
    learner, expected, learners = _run(config, steps=9, bad={}, corrupt_at=4, corrupt=corrupt)
    assert learners == 2 and learner.bad_observations == expected == 4
    assert learner.history
    _assert_learned(learner)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(
    steps=st.integers(2, 14),
    warmup=st.integers(0, 2),
    first=st.integers(1, 4),
    refit=st.integers(1, 5),
    bad=st.dictionaries(st.integers(0, 250), st.sampled_from(BAD_TIMES), max_size=80),
    corrupt_at=st.integers(1, 14),
    corrupt=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8), st.integers(0, 99)), max_size=8),
)
def test_random_bad_times_and_states_never_stop_the_loop(group, steps, warmup, first, refit, bad, corrupt_at, corrupt):
    config = LearnerConfig(warmup_steps=warmup, first_fit_after=first, refit_every=refit)
    # a bad count in a count or key column; a bad time in the time column
    corrupt = [
        (r, c, BAD_TIMES[i % len(BAD_TIMES)] if c == 8 else BAD_COUNTS[i % len(BAD_COUNTS)]) for r, c, i in corrupt
    ]
    learner, expected, _ = _run(config, steps, bad, corrupt_at, corrupt)
    assert learner.bad_observations == expected
    _assert_learned(learner)


# ---------------------------------------------------------------------------------- step calibration


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if a model is built or a shard timed: bad input is refused before either."""
    import transformers

    from ringpack.calibration.step import ModelStepTimer

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    def timed(self, case):
        raise AssertionError("a shard was timed")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", built)
    monkeypatch.setattr(ModelStepTimer, "__call__", timed)


def _model_files(root) -> dict[str, str]:
    """Bad model configs by name: files and folders."""
    files = {
        "no-type.json": json.dumps({"hidden_size": 64, "num_hidden_layers": 2}),
        "unknown-type.json": json.dumps({"model_type": "nosuchmodel"}),
        "numeric-type.json": json.dumps({"model_type": 3}),
        "bad-field.json": json.dumps({"model_type": "llama", "hidden_size": "wide"}),
        "zero-heads.json": json.dumps({"model_type": "llama", "num_attention_heads": 0}),
        "no-decoder.json": json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2}),
        "list.json": "[1, 2]",
        "truncated.json": '{"model_type": "llama", ',
        "empty.json": "",
    }
    out = {}
    for name, text in files.items():
        (root / name).write_text(text)
        out[name] = str(root / name)
    (root / "binary.json").write_bytes(b"\xff\xfe\x00")
    out["binary.json"] = str(root / "binary.json")
    (root / "no-type").mkdir()
    (root / "no-type" / "config.json").write_text(files["no-type.json"])
    out["no-type/"] = str(root / "no-type")
    (root / "empty-folder").mkdir()
    out["empty-folder/"] = str(root / "empty-folder")
    out["missing"] = str(root / "missing.json")
    return out


def test_every_bad_step_calibration_input_ends_in_one_line(tmp_path, nothing_built, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "afile").write_text("x")
    cpu = ["--device", "cpu", "--backend", "reference"]
    cases = [[*cpu, "--model", path] for path in _model_files(models).values()]
    cases += [
        [*cpu, "--model", "tiny", "--tokens-per-rank", "65536"],
        [*cpu, "--model", "tiny", "--tokens-per-rank", "9000"],
        [*cpu, "--model", "llama3-8b"],
        [*cpu, "--model", "llama-1b", "--tokens-per-rank", "4096"],
        ["--device", "cpu", "--backend", "flash_attn", "--model", "tiny"],
        ["--device", "cpu", "--backend", "nosuch", "--model", "tiny"],
        [*cpu, "--model", "tiny", "--out", str(out)],
        [*cpu, "--model", "tiny", "--out", str(out / "afile" / "p.json")],
        [*cpu, "--model", "tiny", "--report", str(out / "afile" / "r" / "p.json")],
        [*cpu, "--model", "tiny", "--out", str(out / "p.json"), "--report", str(out / "p.json")],
        [*cpu, "--model", "tiny", "--report", str(out)],
        [*cpu, "--model", "tiny", "--grid", "tiny"],
        [*cpu],
        ["--device", "tpu", "--model", "tiny"],
        *(
            [*cpu, "--model", "tiny", flag, value]
            for flag in ("--tokens-per-rank", "--cp")
            for value in ("0", "x", "1.5")
        ),
        *([*cpu, "--model", "tiny", flag, "-1"] for flag in ("--fit-mixes", "--held-out-mixes", "--microbatches")),
        *([*cpu, "--model", "tiny", flag, "0"] for flag in ("--reps", "--fit-mixes")),
        [*cpu, "--model", "tiny", "--max-len", "-1"],
        [*cpu, "--model", "tiny", "--warmup", "-1"],
    ]
    for argv in cases:
        if "--out" not in argv:
            argv = [*argv, "--out", str(out / "p.json")]
        run = run_cli(["calibrate", "--scope", "step", *argv, "--quiet"])
        assert_clean(run)
        assert run.code in (1, 2), (argv, run.code, run.err)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = run_cli(["calibrate", "--scope", "step", "--model", "tiny", "--out", str(out / "p.json")])
    assert_clean(run)
    assert run.code == 2 and "--device cpu" in run.err
    assert sorted(p.name for p in out.iterdir()) == ["afile"], "nothing was written"
