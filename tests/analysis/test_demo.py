"""``ringpack demo``: plain progress lines in a log (stderr not a terminal), and its config holding a PlanConfig."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

import ringpack.cli.demo_run
import ringpack.progress
from ringpack.analysis.demo import DEMO_PLAN, DemoConfig
from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.errors import PlanError


@pytest.mark.slow
def test_demo_progress_in_a_log_is_plain_lines(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)  # every count logs: the test sees the lines
    assert main(["demo", "--quick", "--no-ring-check", "--out", str(tmp_path / "demo")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err and "█" not in err, err[:300]
    lines = err.splitlines()
    assert lines and all(line.startswith("ringpack demo: ") for line in lines), lines[:5]
    assert any("stages (" in line for line in lines) and "12/12 stages (100%)" in lines[-1]


@pytest.mark.slow
def test_quiet_demo_prints_no_progress(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)
    assert main(["demo", "--quick", "--no-ring-check", "--quiet", "--out", str(tmp_path / "demo")]) == 0
    assert capsys.readouterr().err == ""


def test_the_demo_config_holds_the_plan_config_whole_and_the_old_spelling_warns():
    """DemoConfig(plan=PlanConfig(...)) without a warning; the old plan fields one by one warn, naming the
    new spelling, and give the same plan; what is not a PlanConfig is refused naming the field."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = DemoConfig(plan=dataclasses.replace(DEMO_PLAN, dp=2, seed=3, samples_per_step=8))
    spelled = r"DemoConfig\(dp=..., samples_per_step=..., seed=...\) is deprecated: pass DemoConfig\(plan=PlanConfig"
    with pytest.warns(DeprecationWarning, match=spelled):
        old = DemoConfig(dp=2, samples_per_step=8, seed=3)
    assert old == new and old.plan.overflow == "split"
    assert new.samples_per_step_of(np.ones(100)) == 8 and new.cost_model().flops_per_second == new.tflops * 1e12
    assert "dp" not in {f.name for f in dataclasses.fields(DemoConfig)}  # no flag of its own: --dp sets plan.dp
    with pytest.raises(PlanError, match="^DemoConfig.plan must be a PlanConfig, got dict$"):
        DemoConfig(plan={"dp": 2})


def test_the_demo_flags_build_its_plan_config(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(ringpack.cli.demo_run, "run_demo", lambda config, progress: seen.append(config) or 0)
    argv = ["demo", "--dp", "2", "--cp", "8", "--tokens-per-rank", "4096", "--seed", "5", "--model", "tiny"]
    assert main([*argv, "--samples-per-step", "16", "--out", str(tmp_path / "d")]) == 0
    want = dataclasses.replace(
        DEMO_PLAN, dp=2, cp=8, tokens_per_rank=4096, seed=5, samples_per_step=16, cost=CostModel.preset("tiny")
    )
    assert seen[0].plan == want
