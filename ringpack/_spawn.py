"""One launcher for N local processes joined by a gloo group (the demo's ring check and the CPU tests).

:func:`run_ranks` picks a free loopback port, starts ``world`` processes, and in each one sets the
intra-op threads, joins the gloo group (every collective gets ``timeout_s``), calls
``fn(rank, world, *args)`` and sends its picklable result home through a file in a temporary
folder. The parent waits at most ``join_s`` in all; ranks still alive then are killed and reported,
so a hang fails instead of stalling. A child's exception is re-raised in the parent naming the rank,
with the child's traceback text; once one rank has failed, the others get ``fail_grace_s`` to finish
(a peer blocked in a collective with a dead rank would otherwise sit out its timeout) and are then
killed. Every failure is reported, not only the first: the rank that fails first is not always the
one whose error explains the run.

Only the standard library at import time: torch is imported inside the functions, so
``import ringpack._spawn`` stays cheap.

See docs/analysis.md, "`ringpack demo`".
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class _Launch:
    """What every rank process of one :func:`run_ranks` call gets (picklable)."""

    world: int
    port: int
    fn: Callable
    args: tuple
    out_dir: str
    timeout_s: float
    threads: int | None

    def result_path(self, rank: int) -> str:
        return os.path.join(self.out_dir, f"rank{rank}.pkl")


def _child(rank: int, launch: _Launch) -> None:
    result: Any
    dist = None
    try:
        import torch
        import torch.distributed as dist

        if launch.threads is not None:
            torch.set_num_threads(launch.threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{launch.port}",
            rank=rank,
            world_size=launch.world,
            timeout=timedelta(seconds=launch.timeout_s),
        )
        result = ("ok", launch.fn(rank, launch.world, *launch.args))
        payload = pickle.dumps(result)
    except BaseException:  # everything goes to the parent, never swallowed
        result = ("error", traceback.format_exc())
        payload = pickle.dumps(result)
    finally:
        if dist is not None:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:
                pass
    path = launch.result_path(rank)
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)  # the parent never reads half a result
    if result[0] == "error":
        raise SystemExit(1)  # a non-zero exit code tells the parent at once (and prints nothing more)


def run_ranks(
    fn: Callable,
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 60.0,
    join_s: float = 240.0,
    start_method: str = "spawn",
    preload: Sequence[str] = (),
    threads: int | None = 1,
    fail_grace_s: float = 5.0,
    name: str = "",
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` fresh processes joined by a gloo group; return the results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function). ``timeout_s`` is the
    gloo collective timeout; ``join_s`` bounds the whole run. ``start_method`` is ``"spawn"`` or
    ``"forkserver"``; with ``forkserver``, ``preload`` names modules the server imports once so each
    rank is forked with them already loaded (spawn imports them once per rank: seconds each on a
    small machine). The server is shared by the whole parent process, so only the first forkserver
    run's ``preload`` counts. ``threads`` is each rank's ``torch.set_num_threads`` (``None``: leave).
    ``name`` prefixes error messages.

    Raises :class:`RuntimeError` naming every failed rank with its traceback (and any killed ones),
    or :class:`TimeoutError` when the only problem is ranks that did not finish within ``join_s``.
    """
    import torch.multiprocessing as mp

    if start_method not in ("spawn", "forkserver"):
        raise ValueError(f"start_method must be 'spawn' or 'forkserver', not {start_method!r}")
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(list(dict.fromkeys([*preload, __name__])))
    prefix = f"{name}: " if name else ""
    with tempfile.TemporaryDirectory(prefix="ringpack-ranks-") as out_dir:
        launch = _Launch(world, free_port(), fn, tuple(args), out_dir, timeout_s, threads)
        procs = [ctx.Process(target=_child, args=(r, launch)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            failed_at = _wait(procs, join_s, fail_grace_s)
        finally:
            killed = _kill_and_join(procs)
        results, failures = _collect(procs, launch, killed, prefix)
    if killed:
        who = f"rank {killed[0]}" if len(killed) == 1 else f"ranks {killed}"
        why = (
            f"did not finish within {join_s:g} s"
            if failed_at is None
            else f"still running {fail_grace_s:g} s after another rank failed"
        )
        hung = f"{prefix}{who} {why} (killed)"
        if not failures:
            raise TimeoutError(hung)
        failures.append(hung)
    if failures:
        raise RuntimeError("\n\n".join(failures))
    return results


def _wait(procs: list, join_s: float, fail_grace_s: float) -> float | None:
    """Wait until every rank exits, ``join_s`` passes, or ``fail_grace_s`` after the first failure.

    Returns the monotonic time of the first failure seen, or ``None``.
    """
    deadline = time.monotonic() + join_s
    first_failure = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            return first_failure
        now = time.monotonic()
        if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
            first_failure = now
        limit = deadline if first_failure is None else min(deadline, first_failure + fail_grace_s)
        if now >= limit:
            return first_failure
        multiprocessing.connection.wait([p.sentinel for p in alive], timeout=limit - now)


def _kill_and_join(procs: list) -> list[int]:
    """Kill the ranks still running, join every started one; the killed ranks."""
    killed = [r for r, p in enumerate(procs) if p.exitcode is None and p.pid is not None]
    for r in killed:
        procs[r].kill()
    for p in procs:
        if p.pid is not None:
            p.join()
    return killed


def _collect(procs: list, launch: _Launch, killed: list[int], prefix: str) -> tuple[list[Any], list[str]]:
    """Every rank's result (``None`` where it failed or was killed) and a message per failed rank."""
    results: list[Any] = []
    failures: list[str] = []
    for r, p in enumerate(procs):
        path = launch.result_path(r)
        if r in killed:
            results.append(None)
            continue
        if not os.path.exists(path):
            failures.append(f"{prefix}rank {r} died without a result (exit code {p.exitcode})")
            results.append(None)
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            failures.append(f"{prefix}rank {r} failed:\n{value}")
            value = None
        results.append(value)
    return results, failures
