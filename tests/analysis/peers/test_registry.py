"""The peers in reports and simulate: their rows, the CLI, chunks joined, a peer that cannot plan."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ringpack.analysis.peers import PEERS, WLB, measure_peer, parse_peers, peer_rows
from ringpack.analysis.peers.megatron_dcp import (
    DCP,
)
from ringpack.analysis.peers.wlb import WLBConfig, make_wlb_plan
from ringpack.analysis.report import STEP_KEYS, SUMMARY_KEYS, build_report, format_table, result_of_plan
from ringpack.analysis.simulate import simulate
from ringpack.cli import main
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import expand_overflow
from ringpack.shard_plan import PlanConfig, PlanError
from tests.helpers import brute
from tests.helpers.peers import INSTANT, PER_TOKEN, config


def test_wlb_figures_against_brute_force():
    lengths = np.random.default_rng(11).integers(1, 700, size=60)
    cfg = config()
    part = measure_peer(WLB, lengths, cfg)
    want = brute.figures(make_wlb_plan(lengths, dataclasses.replace(cfg, strategy="zigzag")))
    got = part.metrics
    np.testing.assert_allclose(got.step_cost, [w["step_cost"] for w in want], rtol=1e-12)
    np.testing.assert_allclose(got.busy, [w["rank_busy"] for w in want], rtol=1e-12)
    assert got.kv_cross_tokens.sum(axis=(1, 2, 3)).tolist() == [w["kv_tokens"] for w in want]
    assert part.config["packing"] == WLB and part.config["strategy"] == "zigzag"


LENGTHS = np.random.default_rng(0).integers(1, 400, size=80)


def test_report_document_carries_the_peers():
    cfg = config(cost=CostModel.preset("tiny"))
    comm = CommModel.for_model(cfg.cost)
    plans = [make_plan(LENGTHS, dataclasses.replace(cfg, strategy=s, packing=p)) for s, p in (("zigzag", "first_fit"),)]
    doc = build_report([result_of_plan(p, comm) for p in plans], lengths=LENGTHS, peers=peer_rows(LENGTHS, cfg, comm))
    assert [p["name"] for p in doc["plans"]] == ["zigzag/first_fit"]
    assert [p["name"] for p in doc["peers"]] == list(PEERS)
    for peer in doc["peers"]:
        assert tuple(peer["summary"]) == SUMMARY_KEYS and peer["description"]
        assert all(tuple(row) == STEP_KEYS for row in peer["steps"])
        assert peer["summary"]["tokens"] == int(LENGTHS.sum())
        assert peer["summary"]["speedup_vs_baseline"] > 0
    dcp = doc["peers"][0]["summary"]
    assert dcp["dp_max_mean_mean"] is None and dcp["cp_max_mean_mean"] is None and dcp["microbatches"] is None
    json.dumps(doc, allow_nan=False)
    table = format_table(doc, steps_shown=1)
    assert "megatron-dcp (peer)" in table and "wlb (peer)" in table


@pytest.mark.slow  # a whole report from lengths, every strategy and peer
def test_report_cli_adds_peers_from_lengths(tmp_path, capsys):
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    argv = ["report", "--lengths", str(path), "--dp", "2", "--cp", "2", "--tokens-per-rank", "500", "--model", "tiny"]
    assert main([*argv, "--out", str(tmp_path / "a"), "--quiet", "--no-plots", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in doc["peers"]] == [DCP, WLB]
    assert main([*argv, "--peers", "wlb", "--baseline", "wlb", "--out", str(tmp_path / "b"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "wlb (peer) *" in printed and "megatron-dcp" not in printed
    doc = json.loads((tmp_path / "b" / "report.json").read_text())
    assert doc["baseline"] == WLB and doc["peers"][0]["summary"]["speedup_vs_baseline"] == 1.0
    assert (tmp_path / "b" / "rank_costs.png").is_file()
    assert main([*argv, "--peers", "none", "--out", str(tmp_path / "c"), "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / "c" / "report.json").read_text())["peers"] == []
    capsys.readouterr()
    assert main([*argv, "--peers", "nope", "--out", str(tmp_path / "d"), "--quiet"]) == 1
    assert "--peers" in capsys.readouterr().err


def test_report_cli_refuses_peers_for_plan_files(tmp_path, capsys):
    plan = make_plan(LENGTHS, config(cost=CostModel.preset("tiny")))
    plan.save(tmp_path / "plan.json")
    assert main(["report", str(tmp_path / "plan.json"), "--peers", DCP, "--out", str(tmp_path / "r"), "--quiet"]) == 1
    assert "--peers" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "r"), "--quiet", "--no-plots"]) == 0
    assert json.loads((tmp_path / "r" / "report.json").read_text())["peers"] == []


def test_simulate_joins_peer_chunks():
    lengths = np.random.default_rng(2).integers(1, 3000, size=400)
    cfg = config(dp=4, cp=2, tokens_per_rank=1024, samples_per_step=30, cost=CostModel.preset("llama-1b"))
    doc = simulate(lengths, cfg, chunk_steps=3, jobs=1, progress=False, peers=PEERS)
    docs = expand_overflow(lengths, cfg.group_capacity)[0]
    steps = {p["summary"]["steps"] for p in doc["plans"]}
    for peer in doc["peers"]:
        s = peer["summary"]
        assert s["tokens"] == int(docs.sum()) and s["samples"] == len(docs)
        assert {s["steps"]} == steps  # the same global batches as ringpack's plans
        assert set(peer["modes"]) == {"ring", "allgather"}
    assert [p["name"] for p in doc["peers"]] == list(PEERS)


def test_parse_peers():
    assert parse_peers("none") == []
    assert parse_peers(" wlb , megatron-dcp ") == [DCP, WLB]
    for bad in ("", "wlb,wlb", "none,wlb", "dcp"):
        with pytest.raises(ValueError, match="--peers"):
            parse_peers(bad)


def test_a_peer_that_cannot_plan_the_data_is_left_out(caplog):
    """A fixed micro-batch count too small for the last step's deferred documents."""
    cfg = PlanConfig(dp=1, cp=1, tokens_per_rank=10, samples_per_step=3, microbatches_per_rank=1, cost=PER_TOKEN)
    with pytest.raises(PlanError):
        make_wlb_plan([4] * 6, cfg, WLBConfig(outlier_fractions=()))
    rows = peer_rows([4] * 6, cfg, INSTANT, [WLB])
    assert rows == [] and "wlb left out" in caplog.text


@pytest.mark.parametrize("peer", PEERS)
def test_a_peer_starts_from_the_batches_as_drawn_whatever_the_window(peer):
    heavy = CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")
    lengths = np.clip(np.random.default_rng(5).lognormal(5.0, 1.3, 600).astype(np.int64), 1, 4096)
    cfg = PlanConfig(dp=4, cp=2, tokens_per_rank=2048, samples_per_step=80, cost=heavy)
    windowed = dataclasses.replace(cfg, batch_window=3)
    plain, moved = measure_peer(peer, lengths, cfg), measure_peer(peer, lengths, windowed)
    assert json.dumps(moved.config, sort_keys=True) == json.dumps(plain.config, sort_keys=True)
    a, b = plain.metrics, moved.metrics
    for name in ("step_cost", "busy") if peer == WLB else ("samples", "loss_tokens"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))


class _Instant:
    """A peer system of its own: every step takes no time. Registered, it shows up everywhere peers do."""

    name = "instant"
    description = "a test peer"

    def measure(self, lengths, config):
        return measure_peer(WLB, lengths, config).__class__(self.name, list(range(3)), [None] * 3, {"peer": self.name})

    def join(self, parts):
        return [m for p in parts for m in p.metrics]

    def timed(self, part, comm):
        return ("timed", len(part.metrics), comm.mode)


def test_a_peer_is_one_registry_entry_that_parse_rows_and_joins_follow(monkeypatch):
    from ringpack.analysis import peers

    monkeypatch.setitem(peers.SYSTEMS, "instant", _Instant())
    monkeypatch.setattr(peers, "PEERS", (*peers.PEERS, "instant"))
    assert parse_peers("instant") == ["instant"]
    lengths = np.random.default_rng(3).integers(1, 400, size=40)
    (row,) = peer_rows(lengths, config(), CommModel.for_model(CostModel.preset("tiny")), names=["instant"])
    assert (row.name, row.description, row.result) == ("instant", "a test peer", ("timed", 3, "ring"))
    part = measure_peer("instant", lengths, config())
    assert peers.join_peer_parts([part, part]).metrics == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError, match="unknown peer 'nobody'"):
        measure_peer("nobody", lengths, config())
