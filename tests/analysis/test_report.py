"""``ringpack report``: from a plan file, from lengths + config, from a shard manifest; stable JSON; plots."""

from __future__ import annotations

import dataclasses
import json

import datasets
import numpy as np
import pytest

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
from ringpack.comm_model import CommModel
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
    assert "plan.parquet" in printed and "busy time per GPU" in printed
    doc = json.loads((out / "report.json").read_text())
    want = brute.figures(plan)
    got = doc["plans"][0]["steps"]
    for g, w in zip(got, want):
        assert g["step_cost"] == pytest.approx(w["step_cost"], rel=1e-9)
        assert g["idle_fraction"] == pytest.approx(w["idle_fraction"], rel=1e-9, abs=1e-12)
        assert g["zigzag_rule_padding_tokens"] == w["zigzag_rule_padding_tokens"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()


@pytest.mark.slow  # seconds: every strategy planned
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


def _doc_with_idle(idle_by_plan: dict[str, list[float]], baseline: str) -> dict:
    """A minimal report document whose plans have the given per-step idle shares (imbalance 1/(1-idle))."""
    plans = [
        {
            "name": name,
            "steps": [
                {"step": s, "idle_fraction": x, "imbalance": 1 / (1 - x), "rank_busy": [[1.0]], "step_seconds": 1.0}
                for s, x in enumerate(idle)
            ],
        }
        for name, idle in idle_by_plan.items()
    ]
    return {"plans": plans, "baseline": baseline, "dp": 1, "cp": 1}


def test_the_default_per_gpu_step_is_typical_of_every_plan():
    """The baseline's median step here is ringpack's worst: the step shown must be neither plan's extreme."""
    from ringpack.analysis.plots import default_rank_step

    doc = _doc_with_idle(
        {"ringpack": [0.02, 0.03, 0.01, 0.025, 0.15], "zigzag/first_fit *": [0.1, 0.4, 0.2, 0.3, 0.25]},
        baseline="zigzag/first_fit *",
    )
    step = default_rank_step(doc)
    for p in doc["plans"]:
        idle = [r["idle_fraction"] for r in p["steps"]]
        assert idle[step] not in (min(idle), max(idle)), (p["name"], step)
    assert step == 3  # the baseline's median step, 4, is ringpack's worst


def test_per_gpu_grid_names_the_plans_median_step():
    from ringpack.analysis.report import format_ranks

    plans = [small_plan(s, "first_fit") for s in ("balanced", "zigzag")]
    comm = CommModel.for_model(plans[0].config.cost)
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS)
    idle = sorted(r["idle_fraction"] for r in doc["plans"][0]["steps"])
    median = float(np.median(idle))
    text = format_ranks(doc, doc["plans"][0]["name"], 0)
    assert f"(median step of the plan: {100 * median:.1f}%)" in text.splitlines()[0]


def test_imbalance_plot_shows_a_line_that_covers_another(tmp_path, monkeypatch):
    """Plans with the same per-step imbalance are drawn on top of each other: each keeps its own
    marker, the covering line is dotted and the legend names the line it covers."""
    from ringpack.analysis import plots

    doc = _doc_with_idle(
        {"a": [0.1, 0.2, 0.3], "b": [0.1, 0.2, 0.3], "c": [0.5, 0.1, 0.2], "d": [0.1, 0.2, 0.3]}, baseline="c"
    )
    assert plots.overlapping_lines(doc) == {"b": "a", "d": "a"}
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    plots.plot_imbalance(doc, tmp_path / "imbalance.png")
    ax = figures[0].axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["a", "b (on top of a)", "c", "d (on top of a)"]
    lines = {line.get_label(): line for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert len({line.get_marker() for line in lines.values()}) == 4
    assert lines["b (on top of a)"].get_linestyle() != lines["a"].get_linestyle()


def test_markdown_report_keeps_apostrophes(tmp_path):
    plans = [small_plan(s) for s in ("balanced", "zigzag")]
    comm = CommModel.for_model(plans[0].config.cost)
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS)
    paths = write_report(doc, tmp_path, plots=False)
    markdown = paths["md"].read_text()
    assert "one CP rank's shard" in markdown
    assert "&#x27;" not in markdown and "&\\#x27;" not in markdown and "&\\#" not in markdown


def test_peer_rows_are_explained_under_the_table_and_in_the_pages(tmp_path):
    """A peer can win a report; the table, report.md and report.html say what its figures compare."""
    from ringpack.analysis.peers import peer_rows

    plan = small_plan("zigzag", "first_fit")
    comm = CommModel.for_model(plan.config.cost)
    peers = peer_rows(LENGTHS, plan.config, comm)
    doc = build_report([result_of_plan(plan, comm)], lengths=LENGTHS, peers=peers)
    table = format_table(doc)
    notes = " ".join(table.split("(* baseline", 1)[1].split())  # the legend and the notes, unwrapped
    assert "wlb (peer): WLB-LLM" in notes and "megatron-dcp (peer): Megatron-Core" in notes
    assert "move long documents into later global batches" in notes
    assert "gap is against the lower bound of the documents it put in each step" in notes
    assert "no gap (the lower bound assumes fixed CP groups)" in notes
    assert all(len(line) <= 110 for line in table.split("(* baseline", 1)[1].splitlines()[1:])
    paths = write_report(doc, tmp_path, plots=False)
    for page in (paths["md"], paths["html"]):
        text = " ".join(page.read_text().split())
        assert "move long documents into later global batches" in text, page.name


def test_gap_definition_names_its_bound():
    from ringpack.analysis.report import DEFINITIONS

    assert "lower bound of the step's documents" in DEFINITIONS["gap"]
    assert "bound of its own steps" in DEFINITIONS["gap"]


@pytest.mark.parametrize(
    "jobs,pool,mode",
    [(1, False, "ring"), (1, True, "ring"), (1, True, "p2p"), pytest.param(2, False, "ring", marks=pytest.mark.slow)],
)
def test_report_rows_are_the_plans_rows(jobs, pool, mode):
    """The report of lengths packs each step once per packing and measures zigzag and contiguous
    without plan objects; its document, plan hashes included, is the one the plans give. Also for
    a pool plan over nodes, whose split lists a micro-batch's samples in another order than the packing,
    and timed with its node-relayed targeted exchange (the peers with the ring they run)."""
    from ringpack.analysis.peers import peer_rows
    from ringpack.analysis.report import DEFAULT_VARIANTS, plan_strategies
    from ringpack.analysis.simulate import measure_variants

    lengths = np.random.default_rng(4).integers(1, 1500, size=300)
    cfg = PlanConfig(
        dp=3, cp=4, tokens_per_rank=600, samples_per_step=60, overflow="split", cost=CostModel.preset("tiny")
    )
    if pool:
        lengths = np.clip(np.round(np.random.default_rng(0).lognormal(np.log(400), 1.3, 600)), 1, 8000)
        cfg = PlanConfig(dp=1, cp=16, gpus_per_node=2, tokens_per_rank=1024, samples_per_step=200)
    comm = CommModel.for_model(cfg.cost, mode=mode, gpus_per_node=cfg.gpus_per_node)
    plans = plan_strategies(lengths, cfg, DEFAULT_VARIANTS)
    want = build_report([result_of_plan(p, comm) for p in plans], lengths=lengths, peers=peer_rows(lengths, cfg, comm))
    results, peers = measure_variants(lengths, cfg, DEFAULT_VARIANTS, comm, peers=("megatron-dcp", "wlb"), jobs=jobs)
    got = build_report(results, lengths=lengths, peers=peers)
    assert [p["hash"] for p in got["plans"]] == [p.content_hash for p in plans]
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    if mode == "p2p":  # the exchange is timed, not left out: it moves K/V between nodes
        assert all(p["summary"]["exposed_comm_seconds"] > 0 for p in got["plans"])
        ring = dataclasses.replace(comm, mode="ring")
        assert [p.result.summary() for p in peers] == [p.result.summary() for p in peer_rows(lengths, cfg, ring)]
