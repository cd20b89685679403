"""``ringpack report``: from a plan file, from lengths + config, from a shard manifest; stable JSON; plots."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from ringpack.analysis.comm_model import CommModel
from ringpack.analysis.report import (
    REPORT_FORMAT,
    REPORT_VERSION,
    STEP_KEYS,
    SUMMARY_KEYS,
    build_report,
    format_table,
    result_of_plan,
    write_report,
)
from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.shard_plan import PlanConfig
from tests.helpers import brute

LENGTHS = np.random.default_rng(0).integers(1, 400, size=80)


def small_plan(strategy="balanced", packing="balanced", **kw):
    cfg = PlanConfig(
        dp=2,
        cp=2,
        tokens_per_rank=500,
        strategy=strategy,
        packing=packing,
        samples_per_step=20,
        cost=CostModel.preset("tiny"),
        **kw,
    )
    return make_plan(LENGTHS, cfg)


def test_json_schema_is_stable():
    plans = [small_plan(s, p) for s, p in (("balanced", "balanced"), ("zigzag", "first_fit"))]
    comm = CommModel.for_model(plans[0].config.cost)
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS)
    assert doc["format"] == REPORT_FORMAT and doc["version"] == REPORT_VERSION == 1
    assert doc["baseline"] == "zigzag/first_fit"
    assert {"dp", "cp", "gpus", "cost_model", "cost_unit", "comm_model", "definitions", "lengths", "plans"} <= set(doc)
    for p in doc["plans"]:
        assert set(p) >= {"name", "hash", "config", "summary", "steps"}
        assert tuple(p["summary"]) == SUMMARY_KEYS
        for row in p["steps"]:
            assert tuple(row) == STEP_KEYS
        assert (
            p["hash"] == next(x for x in plans if f"{x.config.strategy}/{x.config.packing}" == p["name"]).content_hash
        )
    text = json.dumps(doc, allow_nan=False)  # strict JSON: no NaN/inf anywhere
    assert json.loads(text)["plans"][0]["name"] == "balanced/balanced"
    assert sum(doc["lengths"]["histogram"]["counts"]) == LENGTHS.size
    base = next(p for p in doc["plans"] if p["name"] == doc["baseline"])["summary"]
    assert base["speedup_vs_baseline"] == 1.0 and base["idle_gpu_seconds_saved"] == 0.0
    table = format_table(doc, steps_shown=2)
    assert "balanced/balanced" in table and "zigzag/first_fit *" in table


def test_report_cli_from_plan_file(tmp_path, capsys):
    plan = small_plan("zigzag", "first_fit")
    path = tmp_path / "plan.parquet"
    plan.save(path)
    out = tmp_path / "rep"
    assert main(["report", str(path), "--out", str(out), "--no-plots", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "zigzag/first_fit" in printed and "busy time per GPU" in printed
    doc = json.loads((out / "report.json").read_text())
    want = brute.figures(plan)
    got = doc["plans"][0]["steps"]
    for g, w in zip(got, want):
        assert g["step_cost"] == pytest.approx(w["step_cost"], rel=1e-9)
        assert g["idle_fraction"] == pytest.approx(w["idle_fraction"], rel=1e-9, abs=1e-12)
        assert g["zigzag_rule_padding_tokens"] == w["zigzag_rule_padding_tokens"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()


def test_report_cli_from_lengths_plans_every_strategy(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    out = tmp_path / "rep"
    assert (
        main(
            [
                "report",
                "--lengths",
                str(path),
                "--dp",
                "2",
                "--cp",
                "2",
                "--tokens-per-rank",
                "500",
                "--model",
                "tiny",
                "--out",
                str(out),
                "--quiet",
                "--json",
                "-",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    names = [p["name"] for p in doc["plans"]]
    assert sorted(names) == sorted(
        f"{s}/{p}" for s in ("balanced", "zigzag", "contiguous") for p in ("balanced", "first_fit")
    )
    for p in doc["plans"]:
        assert p["summary"]["tokens"] == int(LENGTHS.sum())
        assert p["summary"]["padding_tokens"] == 0
    pngs = sorted(x.name for x in out.glob("*.png"))
    assert pngs == ["idle_saved.png", "imbalance.png", "lengths.png", "rank_costs.png"]
    assert all((out / x).stat().st_size > 10_000 for x in pngs)
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 4  # self-contained


def test_report_cli_from_shard_manifest(tmp_path, capsys):
    from ringpack.data.shard_writer import write_shards

    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 100, size=int(n)).tolist() for n in LENGTHS[:40]]
    ds = datasets.Dataset.from_dict({"input_ids": rows})
    cfg = PlanConfig(dp=2, cp=2, tokens_per_rank=500, samples_per_step=20, cost=CostModel.preset("tiny"))
    write_shards(ds, tmp_path / "shards", cfg, progress=False)
    assert (
        main(
            [
                "report",
                "--manifest",
                str(tmp_path / "shards" / "manifest.json"),
                "--out",
                str(tmp_path / "rep"),
                "--no-plots",
                "--quiet",
            ]
        )
        == 0
    )
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["plans"][0]["summary"]["tokens"] == int(LENGTHS[:40].sum())


def test_report_cli_errors(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path)]) == 1
    assert "exactly one input" in capsys.readouterr().err
    assert main(["report", "--corpus", "stdlib", "--strategies", "nope", "--out", str(tmp_path)]) == 1


def test_plots_render(tmp_path):
    plans = [small_plan(s, "first_fit") for s in ("balanced", "zigzag", "contiguous")]
    comm = CommModel.for_model(plans[0].config.cost)
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS)
    paths = write_report(doc, tmp_path, rank_step=0)
    for key in ("lengths", "rank_costs", "imbalance", "idle_saved"):
        assert paths[key].stat().st_size > 10_000
