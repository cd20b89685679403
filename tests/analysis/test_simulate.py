"""``ringpack simulate`` on a small synthetic epoch: every sample planned once, modes, chunking, CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.analysis.simulate import _plan_chunk as real_plan_chunk
from ringpack.analysis.simulate import simulate, synthetic_lengths
from ringpack.cli import main
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.shard_plan import PlanConfig
from tests.helpers.cli import assert_clean, run_cli


def config(**kw):
    base = dict(
        dp=4, cp=2, tokens_per_rank=4096, samples_per_step=40, overflow="split", cost=CostModel.preset("llama-1b")
    )
    base.update(kw)
    return PlanConfig(**base)


def test_simulate_small_epoch():
    lengths = synthetic_lengths(1500, "lognormal", seed=3, median=600, sigma=1.0)
    cfg = config()
    doc = simulate(lengths, cfg, chunk_steps=4, jobs=1, progress=False)
    assert doc["format"] == "ringpack-simulation"
    names = [p["name"] for p in doc["plans"]]
    assert names == ["balanced/balanced", "zigzag/balanced", "zigzag/first_fit", "contiguous/first_fit"]
    from ringpack.planner.epoch import expand_overflow

    docs_total = int(expand_overflow(lengths, cfg.group_capacity)[0].sum())
    for p in doc["plans"]:
        s = p["summary"]
        assert s["tokens"] == docs_total  # every token of the epoch planned exactly once
        assert s["steps"] == len(p["steps"]) >= 1500 // 40 - 1
        assert set(p["modes"]) == {"ring", "allgather"}
        for mode in p["modes"].values():
            assert mode["tokens_per_second"] > 0 and 0 <= mode["idle_fraction"] < 1
            assert mode["predicted_seconds"] >= s["predicted_seconds"] * (1 - 1e-12)  # comm never makes it faster
    best = doc["plans"][0]["summary"]
    worst = doc["plans"][-1]["summary"]
    assert best["idle_fraction"] < worst["idle_fraction"]
    json.dumps(doc, allow_nan=False)


def test_parallel_and_serial_agree():
    lengths = synthetic_lengths(600, "lognormal", seed=4, median=500, sigma=0.8)
    variants = [("balanced", "balanced"), ("contiguous", "first_fit")]
    a = simulate(lengths, config(), variants, chunk_steps=3, jobs=1, progress=False)
    b = simulate(lengths, config(), variants, chunk_steps=3, jobs=2, progress=False)
    for pa, pb in zip(a["plans"], b["plans"]):
        assert pa["summary"] == pb["summary"]


def test_simulate_cli(tmp_path, capsys):
    out = tmp_path / "sim"
    assert (
        main(
            [
                "simulate",
                "--world",
                "8,16",
                "--cp",
                "2",
                "--samples",
                "800",
                "--dist",
                "lognormal",
                "--median",
                "400",
                "--tokens-per-rank",
                "4096",
                "--overflow",
                "split",  # the lognormal tail holds samples longer than a CP group
                "--model",
                "llama-1b",
                "--jobs",
                "1",
                "--quiet",
                "--no-plots",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "DP=4 x CP=2" in printed and "DP=8 x CP=2" in printed and "ring tok/s" in printed
    for shape in ("dp4xcp2", "dp8xcp2"):
        doc = json.loads((out / shape / "report.json").read_text())
        assert doc["gpus"] in (8, 16)


def test_an_epoch_whose_samples_are_all_dropped_is_one_line():
    cfg = config(overflow="drop")
    with pytest.raises(ValueError, match=r"^all 3 samples are longer than a CP group holds .* 8192 tokens.*drop"):
        simulate(np.array([9000, 10000, 8193]), cfg, jobs=1, progress=False)
    kept = simulate(np.array([9000, 100, 8193, 50]), config(overflow="drop", dp=1), jobs=1, progress=False)
    assert kept["plans"] and all(p["summary"]["tokens"] == 150 for p in kept["plans"]), "the rest is simulated"


def test_comm_model_rejects_bad_values():
    with pytest.raises(ValueError):
        CommModel(mode="tree")
    with pytest.raises(ValueError):
        CommModel(bandwidth=0)


FIELDS = ("mb_exists", "tokens", "pairs", "segments", "cost", "kv_cross_tokens", "zigzag_padding", "samples")


def epoch_tasks(lengths, cfg, chunk_steps, peers=()):
    from ringpack.analysis.simulate import SIM_VARIANTS, _epoch_chunks, _tasks
    from ringpack.planner.epoch import overflow_documents

    docs = overflow_documents(lengths, cfg)
    chunks = _epoch_chunks(docs, cfg, chunk_steps)
    return docs, chunks, _tasks(docs, chunks, cfg, SIM_VARIANTS, peers, chunk_steps)


@pytest.mark.parametrize("mb, node", [(0, None), (1, None), (0, 2)])
def test_every_chunk_is_make_plans_plan(mb, node):
    """A chunk's packing is shared by the variants that use it, zigzag and contiguous are measured
    from it (node by node, as the planner splits, for a group over several nodes): every figure and
    bound is still the one make_plan's plan of the chunk gives."""
    from ringpack.analysis.metrics import evaluate_plan
    from ringpack.analysis.simulate import SIM_VARIANTS, _plan_chunk
    from ringpack.planner import make_plan

    lengths = synthetic_lengths(900, "lognormal", seed=6, median=700, sigma=1.2)
    cfg = config(microbatches_per_rank=mb, tokens_per_rank=4096 if mb == 0 else 32768)
    if node:  # 4 nodes of 2 ranks, planned node by node
        cfg = config(dp=2, cp=8, gpus_per_node=node, tokens_per_rank=1024, samples_per_step=60)
    docs, chunks, tasks = epoch_tasks(lengths, cfg, 3)
    assert len(tasks) == 2 * len(chunks)  # one per packing and chunk
    seen = set()
    for task in tasks:
        rows, _ = _plan_chunk(task)
        for row, metrics, bounds, digest, inputs in rows:
            assert digest is None and inputs == {}  # simulate hashes no plan, needs no piece table here
            strategy, packing = SIM_VARIANTS[row]
            import dataclasses

            plan = make_plan(docs[chunks[task.chunk]], dataclasses.replace(cfg, strategy=strategy, packing=packing))
            want = evaluate_plan(plan)
            assert metrics.name == want.name and bounds == [s.lower_bound for s in plan.steps]
            for field in FIELDS:
                assert (getattr(metrics, field) == getattr(want, field)).all(), (row, field)
            seen.add((row, task.chunk))
    assert seen == {(row, c) for row in range(len(SIM_VARIANTS)) for c in range(len(chunks))}


def test_chunk_memory_and_result_do_not_grow_with_cp(monkeypatch):
    """The same 256 GPUs and tokens per rank as DP=128 x CP=2 and DP=4 x CP=64: zigzag cuts every
    sample into 4 or 128 pieces, yet a chunk's peak memory and its result (what a worker sends
    home: per-rank figures) stay the same size."""
    import pickle
    import tracemalloc

    import ringpack.analysis.metrics as metrics
    from ringpack.analysis.simulate import _plan_chunk

    monkeypatch.setattr(metrics, "BLOCK_ENTRIES", 1 << 14)
    lengths = synthetic_lengths(6000, "lognormal", seed=2, median=800, sigma=0.6, max_len=8192)
    measured = {}
    for dp, cp in ((128, 2), (4, 64)):
        cfg = config(dp=dp, cp=cp, tokens_per_rank=4096, samples_per_step=1500, packing="first_fit")
        _, _, tasks = epoch_tasks(lengths, cfg, 2)
        task = next(t for t in tasks if t.config.packing == "first_fit")  # zigzag and contiguous
        tracemalloc.start()
        try:
            result = _plan_chunk(task)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        measured[cp] = (peak, len(pickle.dumps(result)))
    (peak2, size2), (peak64, size64) = measured[2], measured[64]
    assert size64 < 1.5 * size2, measured
    assert peak64 < 2 * peak2, measured


def test_a_step_no_packing_fits_fails_before_planning(monkeypatch):
    import ringpack.analysis.simulate as sim
    from ringpack.errors import PlanError

    def never(task):
        raise AssertionError("planning started")

    monkeypatch.setattr(sim, "_plan_chunk", never)
    lengths = synthetic_lengths(800, "lognormal", seed=1, median=1000, sigma=0.5)
    cfg = config(microbatches_per_rank=1, tokens_per_rank=1024, samples_per_step=40)  # ~40K tokens, room for 8K
    with pytest.raises(PlanError, match=r"^step 0: 40 samples \(.* tokens\) are more than dp=4 x 1 micro-batches"):
        simulate(lengths, cfg, chunk_steps=2, jobs=2, progress=False)


def kill_chunk_one(task):
    """A worker task that dies as an out-of-memory kill would, on chunk 1."""
    import os
    import signal

    if task.chunk == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return real_plan_chunk(task)


@pytest.mark.slow
def test_a_killed_worker_is_one_line_and_a_failed_exit(tmp_path, capsys, monkeypatch):
    import ringpack.analysis.simulate as sim

    monkeypatch.setattr(sim, "_plan_chunk", kill_chunk_one)
    argv = ["simulate", "--world", "8", "--cp", "2", "--samples", "800", "--dist", "lognormal", "--median", "400"]
    argv += ["--tokens-per-rank", "4096", "--overflow", "split", "--model", "llama-1b", "--jobs", "2"]
    argv += ["--chunk-steps", "2", "--quiet", "--no-plots", "--out", str(tmp_path / "sim")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    line = err[0]
    assert line.startswith("ringpack simulate: error: worker process ")
    killed = "was killed by SIGKILL (most often the system running out of memory)"
    assert f"{killed} while planning chunk 1 (epoch steps from 2) (" in line
    assert line.endswith(
        "run with fewer --jobs (now 2) or a smaller --chunk-steps (now 2), or on a machine with more memory"
    )


def test_the_targeted_exchange_is_timed_chunk_by_chunk_as_each_plan():
    """Under ``p2p`` (nodes of 2, a group over 4 of them, planned node by node) every variant's
    epoch is timed from its chunks' exchange volumes: the per-step times are those of each chunk's
    plan by :func:`result_of_plan`; the peers are timed with the ring."""
    import dataclasses

    from ringpack.analysis.report import result_of_plan
    from ringpack.analysis.simulate import SIM_VARIANTS, simulate
    from ringpack.comm_model import CommModel
    from ringpack.planner import make_plan

    lengths = synthetic_lengths(900, "lognormal", seed=6, median=700, sigma=1.2)
    cfg = config(dp=2, cp=8, gpus_per_node=2, tokens_per_rank=1024, samples_per_step=60)
    p2p = CommModel.for_model(cfg.cost, mode="p2p", gpus_per_node=2)
    ring = dataclasses.replace(p2p, mode="ring")
    doc = simulate(lengths, cfg, comms=[p2p, ring], chunk_steps=3, jobs=1, progress=False, peers=("wlb",))
    docs, chunks, _ = epoch_tasks(lengths, cfg, 3)
    for (strategy, packing), plan_doc in zip(SIM_VARIANTS, doc["plans"]):
        variant = dataclasses.replace(cfg, strategy=strategy, packing=packing)
        want = sum(float(result_of_plan(make_plan(docs[ids], variant), p2p).step_seconds_comm.sum()) for ids in chunks)
        got = plan_doc["modes"]["p2p"]["predicted_seconds"]
        assert got == pytest.approx(want, rel=1e-12), (strategy, packing)
        assert plan_doc["modes"]["p2p"]["exposed_comm_seconds"] > 0
    (peer,) = doc["peers"]
    assert peer["modes"]["p2p"]["predicted_seconds"] == pytest.approx(peer["modes"]["ring"]["predicted_seconds"])


@pytest.mark.parametrize("mode", ["ulysses", "ulysses+p2p", "ulysses+ring"])
def test_the_head_parallel_modes_are_timed_as_each_chunks_plan(mode):
    """Under a head-parallel mode (nodes of 2, a group over 4 of them) every variant's epoch equals
    the communication model's per-rank times of each chunk's plan (:func:`rank_seconds`, from the
    piece table alone); the peers are timed with the ring."""
    import dataclasses

    from ringpack.analysis.simulate import SIM_VARIANTS, simulate
    from ringpack.comm_model import CommModel, rank_seconds
    from ringpack.planner import make_plan

    lengths = synthetic_lengths(700, "lognormal", seed=7, median=700, sigma=1.2)
    cfg = config(dp=2, cp=8, gpus_per_node=2, tokens_per_rank=1024, samples_per_step=60)
    comm = CommModel.for_model(cfg.cost, mode=mode, gpus_per_node=2)
    ring = dataclasses.replace(comm, mode="ring")
    doc = simulate(lengths, cfg, comms=[comm, ring], chunk_steps=3, jobs=1, progress=False, peers=("wlb",))
    docs, chunks, _ = epoch_tasks(lengths, cfg, 3)
    for (strategy, packing), plan_doc in zip(SIM_VARIANTS, doc["plans"]):
        want = 0.0
        for ids in chunks:
            plan = make_plan(docs[ids], dataclasses.replace(cfg, strategy=strategy, packing=packing))
            shape = (plan.num_steps, cfg.dp, max(len(s.microbatches[0]) for s in plan.steps))
            seconds, _ = rank_seconds(plan.piece_arrays, cfg.cp, shape, cfg.cost, comm)
            want += float(seconds.max(axis=3).sum(axis=2).max(axis=1).sum())
        assert plan_doc["modes"][mode]["predicted_seconds"] == pytest.approx(want, rel=1e-12), (strategy, packing)
    (peer,) = doc["peers"]
    assert peer["modes"][mode]["predicted_seconds"] == pytest.approx(peer["modes"]["ring"]["predicted_seconds"])


def test_a_long_run_says_up_front_how_long_it_will_take(monkeypatch, caplog):
    import ringpack.analysis.simulate as sim

    lengths = synthetic_lengths(400, "lognormal", seed=1, median=600, sigma=1.0)
    monkeypatch.setattr(sim, "SECONDS_PER_SAMPLE_ROW", 1.0)  # as slow as a run of millions of samples
    with caplog.at_level("INFO", logger="ringpack.progress"):
        simulate(lengths, config(), chunk_steps=4, jobs=1, progress=True)
    first = caplog.records[0].getMessage()
    assert first.startswith("planning 402 samples x 4 strategies in 6 tasks on 1 worker: about 26m48s")  # 402 x 4 s
    assert "fewer samples or more jobs finish sooner" in first
    caplog.clear()
    with caplog.at_level("INFO", logger="ringpack.progress"):
        simulate(lengths, config(), chunk_steps=4, jobs=1, progress=False)
    assert not caplog.records


def stop_chunk_one(task):
    import os
    import signal

    if task.chunk == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    return real_plan_chunk(task)


@pytest.mark.slow
def test_a_stopped_worker_ends_the_run_in_one_line_naming_it(tmp_path, capsys, monkeypatch):
    import ringpack.analysis.simulate as sim
    from ringpack._spawn import STALL_ENV

    monkeypatch.setattr(sim, "_plan_chunk", stop_chunk_one)
    monkeypatch.setenv(STALL_ENV, "3")
    argv = ["simulate", "--world", "8", "--cp", "2", "--samples", "800", "--dist", "lognormal", "--median", "400"]
    argv += ["--tokens-per-rank", "4096", "--overflow", "split", "--model", "llama-1b", "--jobs", "2"]
    argv += ["--chunk-steps", "2", "--quiet", "--no-plots", "--out", str(tmp_path / "sim")]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("ringpack simulate: error: worker process ")
    assert "sent no heartbeat for 3 s (it is stopped: SIGSTOP or a debugger) while planning chunk 1 " in err[0]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_ends_a_run_and_its_workers(tmp_path):
    import os
    import subprocess
    import sys
    import time

    argv = ["simulate", "--world", "64", "--cp", "8", "--samples", "50000", "--jobs", "2", "--chunk-steps", "1"]
    argv += ["--quiet", "--no-plots", "--out", str(tmp_path / "sim")]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.Popen([sys.executable, "-m", "ringpack.cli", *argv], stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 400  # imports alone take minutes on a loaded two-core machine
        while len(_children(run.pid)) < 2 and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(run.pid)
        assert len(workers) == 2, "the workers did not start"
        run.terminate()
        assert run.wait(30) == 143
        assert run.stderr.read().strip().splitlines()[-1] == "ringpack simulate: terminated (SIGTERM)"
        deadline = time.monotonic() + 5
        while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in workers), f"workers {workers} outlived the run"
    finally:
        run.kill()
        run.wait()


def test_a_sampled_epoch_plans_the_same_chunks_every_time_and_says_it_is_an_estimate():
    lengths = synthetic_lengths(3000, "lognormal", seed=3, median=600, sigma=1.0)
    cfg = config()
    first = simulate(lengths, cfg, chunk_steps=4, jobs=1, progress=False, sample_steps=8, peers=())
    again = simulate(lengths, cfg, chunk_steps=4, jobs=1, progress=False, sample_steps=8, peers=())
    sample = first["sample"]
    assert sample == again["sample"] and sample["estimate"] and sample["chunks"] == 2
    assert sample["global_batches"] == 8 < sample["epoch_global_batches"]
    assert "an estimate" in sample["basis"] and "estimate from 8 of" in first["title"]
    for p, q in zip(first["plans"], again["plans"]):
        assert p["summary"] == q["summary"]
        for mode in p["modes"].values():
            assert mode["epoch_seconds"] == pytest.approx(mode["predicted_seconds"] / sample["tokens_fraction"])
    whole = simulate(lengths, cfg, chunk_steps=4, jobs=1, progress=False, peers=())
    assert not whole["sample"]["estimate"] and whole["sample"]["tokens_fraction"] == 1.0


def test_cp_auto_times_the_epoch_with_the_exchange_it_chose(tmp_path):
    """The simulated epoch's headline mode is the layout choice's, by default, and the table says so."""
    path = tmp_path / "heavy.npy"
    rng = np.random.default_rng(0)
    np.save(path, np.clip(np.round(rng.lognormal(np.log(400), 1.3, 1500)), 1, 8000).astype(np.int64))
    out = tmp_path / "sim.json"
    argv = ["simulate", "--lengths", path, "--world", "16", "--cp", "auto", "--gpus-per-node", "2",
            "--tokens-per-rank", "1024", "--model", "llama3-8b", "--global-batch-tokens", "auto", "--peers", "none",
            "--no-plots", "--jobs", "1", "--quiet", "--out", tmp_path / "sim", "--json", out]  # fmt: skip
    run = run_cli(argv)
    assert_clean(run)
    assert run.code == 0, run.err
    doc = json.loads(out.read_text())
    chosen = doc["layout"]["candidates"][0]["mode"]
    assert doc["comm_model"]["mode"] == chosen
    assert list(doc["plans"][0]["modes"])[0] == chosen
    assert f"headline exchange: {chosen} (the layout choice's)" in run.out
    assert doc["sample"]["global_batches"] <= 8 and ("estimate:" in run.out) == doc["sample"]["estimate"]
