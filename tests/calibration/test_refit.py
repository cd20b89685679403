"""``ringpack calibrate --refit``: the profile and kernel models refitted on the stored H200 measurements (CPU only).

``data/h200-llama-1b-*.rows.json.gz`` hold the measured rows of ``benchmarks/profiles/*.report.json``
(one attention layer forward+backward per rank shard, timed on an H200 with the ``wall`` timer)
together with the geometry of every micro-batch, so these tests do not depend on the planner
cutting the held-out micro-batches the same way today.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from ringpack.calibration import cases as case_grid
from ringpack.calibration import features, fit, run
from ringpack.cli import main
from ringpack.cost import CostModel
from ringpack.planner.split import split_zigzag

DATA = Path(__file__).parent / "data"
PROFILES = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"
BACKENDS = ("torch_flash", "cudnn_hybrid")


def stored_rows(backend: str) -> dict:
    with gzip.open(DATA / f"h200-llama-1b-{backend}.rows.json.gz") as f:
        return json.loads(f.read())


@pytest.fixture(scope="module")
def refits() -> dict[str, fit.Calibration]:
    return {b: run.refit(stored_rows(b)) for b in BACKENDS}


@pytest.mark.parametrize("backend", BACKENDS)
def test_refit_beats_the_gpu_run_and_the_kernel_model_explains_the_rest(refits, backend):
    res = refits[backend]
    first = json.loads((PROFILES / f"h200-llama-1b-{backend}.report.json").read_text())["held_out"]
    h, k = res.held_out, res.kernel_model["held_out"]
    assert h["n"] == k["n"] == 54 and res.train["n"] == 114  # nothing dropped, nothing held out fitted
    # the profile model (what the planner loads, plus per-micro-batch constants) improves on the first fit ...
    assert h["max_rel_err"] < first["max_rel_err"] - 0.04 and h["mean_rel_err"] < first["mean_rel_err"]
    assert h["r"] > 0.96
    # ... and the kernel model (launch grid, calls, ring rows, dense calls) is far better on every measure
    assert k["r"] > 0.995 and k["max_rel_err"] < 0.30 and k["mean_rel_err"] < 0.07
    assert k["max_rel_err"] < h["max_rel_err"] - 0.1 and k["slowest_rank_hit"] >= h["slowest_rank_hit"]
    # the launch-grid terms carry weight: dropping them costs accuracy
    assert res.kernel_model["coef"]["grid_k"] > 0
    # the profile is the planner's CostModel: seconds, non-negative, the constants left out
    p = res.profile
    assert p.unit == "s" and p.token > 0 and p.pair > 0 and p.segment >= 0 and p.name == "llama-1b"
    assert res.per_layer["overhead_s"] > 1e-4 and res.per_layer["ring_overhead_s"] > 1e-4
    assert p.pair == pytest.approx(16 * res.per_layer["pair_s"])
    # rows: predictions are the stated models applied to the rows
    row = res.eval_rows[0]
    pl = res.per_layer
    expect = (
        pl["overhead_s"]
        + pl["ring_overhead_s"] * row["ring"]
        + pl["token_s"] * row["tokens"]
        + pl["pair_s"] * row["pairs"]
        + pl["segment_s"] * row["pieces"]
    )
    assert row["predicted_s"] == pytest.approx(expect, rel=1e-9)


def test_dense_terms_only_for_the_hybrid_backend(refits):
    assert refits["torch_flash"].kernel_model["coef"]["dense_calls"] == 0.0
    assert refits["torch_flash"].kernel_model["coef"]["dense_tiles"] == 0.0
    cudnn = refits["cudnn_hybrid"].kernel_model["coef"]
    assert (
        cudnn["dense_tiles"] > 0 and cudnn["dense_tiles"] < cudnn["tiles"]
    )  # cuDNN's long segments are cheaper per tile
    assert any(r["dense_calls"] for r in refits["cudnn_hybrid"].eval_rows)


def test_refit_of_a_refit_is_stable(refits):
    """A version-2 report (geometry stored) refits to the same numbers: nothing depends on regenerating shards."""
    res = refits["torch_flash"]
    again = run.refit(json.loads(json.dumps(res.to_dict(), default=run._json_default)))
    assert again.per_layer == pytest.approx(res.per_layer, rel=1e-12)
    assert again.held_out["max_rel_err"] == pytest.approx(res.held_out["max_rel_err"], rel=1e-12)
    assert [r["label"] for r in again.eval_rows] == [r["label"] for r in res.eval_rows]


def test_analyse_recovers_a_known_kernel_model():
    """Synthetic times from the kernel model: it is fitted exactly and held-out errors vanish."""
    cases = case_grid.grid_cases("quick")
    held = case_grid.eval_cases("quick", CostModel.preset("llama3-8b"))
    truth = dict(
        overhead=3e-4,
        ring=4e-4,
        calls=2e-4,
        tokens=1e-8,
        tiles=1.6e-6,
        grid_q=2e-7,
        grid_k=4e-7,
        remote_rows=3e-8,
        buffer_tokens=1e-8,
        dense_calls=0.0,
        dense_tiles=0.0,
    )
    t = [sum(truth[n] * features.rank_features(c)[n] for n in features.KERNEL_FEATURES) for c in cases + held]
    res = fit.analyse(
        list(zip(cases, t[: len(cases)])),
        list(zip(held, t[len(cases) :])),
        hybrid=False,
        layers=2,
        linear=dict(layer_token_s=0.0, head_token_s=0.0),
        name="x",
        meta={},
    )
    assert res.kernel_model["block"] == [128, 128]
    assert res.kernel_model["held_out"]["max_rel_err"] < 1e-6
    for n in ("tiles", "grid_k", "calls"):
        assert res.kernel_model["coef"][n] == pytest.approx(truth[n], rel=1e-4)
    # the profile model cannot see the launch grid: it is worse, and says so
    assert res.held_out["max_rel_err"] > 10 * res.kernel_model["held_out"]["max_rel_err"]


def test_launch_grid_counts_every_segment_times_the_longest():
    lengths = [3000, 40, 50, 60]
    mb = split_zigzag(list(range(4)), lengths, 2)
    case = case_grid.rank_cases("z", mb, lengths, "z")[0]
    f = features.rank_features(case)
    sched = features.compiled_schedule(case)
    local = sched.local
    nseg = local.cu_seqlens_q.numel() - 1
    assert nseg == 4 and local.max_seqlen_q == 1500
    assert f["grid_q"] >= nseg * 12  # 4 segments x ceil(1500 / 128) launched query tiles in the local call alone
    lq = np.diff(local.cu_seqlens_q.numpy())
    assert int((-(-lq // 128)).sum()) == 12 + 3 < nseg * 12  # query tiles with work: most launched ones are empty
    assert f["ring"] == 1.0 and f["remote_rows"] > 0 and f["buffer_tokens"] > 0


def test_reports_of_an_older_format_are_refused_in_one_line(tmp_path, capsys):
    """A report without micro-batch geometry (format version 1) cannot be refitted: a clear error, exit 1."""
    old = PROFILES / "h200-llama-1b-cudnn_hybrid.report.json"
    report = json.loads(old.read_text())
    assert "microbatches" not in report and report.get("version", 1) == 1
    with pytest.raises(ValueError, match="version 1 cannot be refitted"):
        run.refit(report)
    assert main(["calibrate", "--refit", str(old), "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be refitted" in err[0]
    assert not (tmp_path / "p.json").exists()


def report_max_error(path) -> float:
    """The held-out max error a refit of the stored report gives (the profile's fit quality)."""
    return run.refit(json.loads(path.read_text())).held_out["max_rel_err"]


def test_cli_refit_writes_a_loadable_profile_and_never_overwrites_the_source(tmp_path, capsys):
    src = tmp_path / "old.report.json"
    src.write_bytes(gzip.decompress((DATA / "h200-llama-1b-torch_flash.rows.json.gz").read_bytes()))
    assert main(["calibrate", "--refit", str(src), "--out", str(tmp_path / "new.json"), "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0].startswith("profile llama-1b: held-out error mean")  # --quiet: no table
    profile = CostModel.load(tmp_path / "new.json")
    assert profile.fit_quality["held_out_max_error"] == pytest.approx(report_max_error(src))
    report = json.loads((tmp_path / "new.report.json").read_text())
    assert report["version"] == 2 and report["profile"] == profile.to_dict()
    assert len(report["microbatches"]) == 1 + max(r["microbatch"] for r in report["grid_rows"] + report["eval_rows"])
    assert np.isfinite(report["kernel_model"]["held_out"]["r"])
    with pytest.raises(ValueError, match="overwrite"):
        run.check_outputs(tmp_path / "x.json", report=src, refit=src)
    assert main(["calibrate", "--refit", str(src), "--out", str(tmp_path / "x.json"), "--report", str(src)]) == 1
    assert "must not overwrite" in capsys.readouterr().err


def test_hybrid_features_follow_the_dense_shape_buckets():
    """Reports record the schedule's dense buckets; features count a dense part's key tail as a varlen call."""
    import inspect

    from ringpack.attention import compile_schedule
    from ringpack.attention.schedule import DEFAULT_DENSE_BUCKETS, DEFAULT_DENSE_THRESHOLD
    from ringpack.calibration.features import DENSE_BATCHES, DENSE_BUCKETS, DENSE_THRESHOLD, EngineSettings

    assert DENSE_BUCKETS == DEFAULT_DENSE_BUCKETS and DENSE_THRESHOLD == DEFAULT_DENSE_THRESHOLD
    assert inspect.signature(compile_schedule).parameters["dense_batches"].default == DENSE_BATCHES
    lengths = [30000, 21000]  # split over 2 ranks: long local squares and a full remote block, none on a bucket length
    mb = split_zigzag(list(range(2)), lengths, 2)
    case = case_grid.rank_cases("z", mb, lengths, "z")[1]
    exact = features.rank_features(case, hybrid=True, settings=EngineSettings(dense_buckets=None))
    cut = features.rank_features(case, hybrid=True, settings=EngineSettings(dense_buckets=DENSE_BUCKETS))
    sched = features.compiled_schedule(case, EngineSettings(dense_buckets=DENSE_BUCKETS))
    tails = sum(1 for c in features.schedule_calls(sched) for d in c.dense if d[5] < d[3])
    padded = sum(1 for c in features.schedule_calls(sched) for d in c.dense if d[4] > d[1])
    assert tails > 0 and padded > 0 and cut["dense_calls"] == exact["dense_calls"]
    assert cut["dense_pairs"] != exact["dense_pairs"] and cut["calls"] == exact["calls"] + tails
    assert features.rank_features(case, hybrid=True) == cut  # the default is this version's buckets


@pytest.mark.parametrize("drop", ["grid_rows", "microbatches", "eval_rows"])
def test_cli_refit_names_an_incomplete_report(tmp_path, capsys, drop):
    report = json.loads(gzip.decompress((DATA / "h200-llama-1b-torch_flash.rows.json.gz").read_bytes()))
    del report[drop]
    broken = tmp_path / "broken.report.json"
    broken.write_text(json.dumps(report))
    assert main(["calibrate", "--refit", str(broken), "--out", str(tmp_path / "p.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "broken.report.json" in err[0] and "Traceback" not in err[0]
