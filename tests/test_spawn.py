"""ringpack._spawn.run_ranks: results by rank, a child's exception re-raised naming the rank, hangs killed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from ringpack._spawn import run_ranks

FAST = dict(start_method="forkserver", preload=["torch", "torch.distributed"])


def sum_ranks(rank: int, world: int, offset: int) -> dict:
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)  # the group is really joined
    return {"rank": rank, "world": world, "sum": float(t), "offset": offset, "threads": torch.get_num_threads()}


def fail_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def fail_while_peer_waits(rank: int, world: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        raise KeyError("rank 0 gives up")
    dist.barrier()  # never completes: rank 0 is gone


def hang_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(120)
    return rank


@pytest.mark.slow
def test_import_is_cheap():
    code = "import sys, ringpack._spawn; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.slow
def test_results_come_back_per_rank():
    results = run_ranks(sum_ranks, 3, (7,), **FAST)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world"] == 3 and r["sum"] == 6.0 and r["offset"] == 7 and r["threads"] == 1 for r in results)


@pytest.mark.slow
def test_spawn_start_method():
    results = run_ranks(sum_ranks, 2, (0,), start_method="spawn")
    assert [(r["rank"], r["sum"]) for r in results] == [(0, 3.0), (1, 3.0)]


@pytest.mark.slow
def test_child_exception_is_reraised_with_rank_and_traceback():
    with pytest.raises(RuntimeError) as info:
        run_ranks(fail_on_rank_1, 2, name="demo", **FAST)
    msg = str(info.value)
    assert "demo: rank 1 failed" in msg
    assert "ValueError: boom on purpose" in msg and "Traceback" in msg and "fail_on_rank_1" in msg
    assert "rank 0" not in msg


@pytest.mark.slow
def test_failure_does_not_wait_out_a_blocked_peer():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 failed") as info:
        run_ranks(fail_while_peer_waits, 2, timeout_s=60, join_s=60, fail_grace_s=2, **FAST)
    assert "KeyError" in str(info.value)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_hung_child_is_killed_and_reported():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 1 did not finish within 3 s \(killed\)"):
        run_ranks(hang_on_rank_1, 2, join_s=3, **FAST)
    assert time.monotonic() - t0 < 30


def test_bad_start_method():
    with pytest.raises(ValueError, match="start_method"):
        run_ranks(sum_ranks, 1, (0,), start_method="fork")
