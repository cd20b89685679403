"""Local worker processes: ranks joined by a gloo group (the demo's ring check, the CPU tests), and task pools.

:func:`run_ranks` starts ``world`` processes on a free loopback port, joins them in a gloo group
(every collective gets ``timeout_s``) and returns ``fn(rank, world, *args)`` of each; a hang or a
failed rank fails the call naming every failed rank with its traceback (the first to fail is not
always the one whose error explains the run), ranks left are killed after ``fail_grace_s``.
:func:`run_tasks` runs independent tasks on a few worker processes, longest first as given,
handing results home as they come; a task's exception is re-raised as it is, and a worker that
dies (killed, out of memory) raises :class:`WorkerDied`, one line naming its task and what to do.

Only the standard library at import time: torch is imported inside the functions, so
``import ringpack._spawn`` stays cheap.

See docs/analysis.md, "`ringpack demo`" and "`ringpack simulate`".
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["free_port", "run_ranks", "run_tasks", "WorkerDied"]


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


# ------------------------------------------------------------------------------------- task pools
class WorkerDied(ChildProcessError):
    """A worker process of :func:`run_tasks` ended without its task's result (killed, out of memory, crashed)."""


def _task_worker(conn: multiprocessing.connection.Connection, fn: Callable) -> None:
    """A pool worker: ``(index, task)`` in, ``("ok", index, fn(task))`` or ``("error", index, exc, text)`` out."""
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError):
            return
        if item is None:
            return
        index, task = item
        try:
            reply: tuple = ("ok", index, fn(task))
        except BaseException as exc:  # every failure goes home, never swallowed
            reply = ("error", index, exc, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:  # a result or an exception that does not pickle
            conn.send(("error", index, None, traceback.format_exc()))


def _exit_text(exitcode: int | None) -> str:
    """How a process ended, in words: a signal by name (SIGKILL is what an out-of-memory killer sends)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}" + (" (most often the system running out of memory)" if name == "SIGKILL" else "")
    return "exited" if exitcode is None else f"exited with code {exitcode}"


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    jobs: int,
    on_result: Callable[[int, Any], None],
    *,
    describe: Callable[[Any], str] = lambda task: "a task",
    hint: str = "",
    name: str = "worker",
) -> None:
    """Run ``fn(task)`` for every task on ``jobs`` worker processes; ``on_result(index, result)`` in this process.

    Tasks start in the order given (give the longest first, so the last to finish is short), one
    at a time per worker; ``jobs <= 1`` runs them here, in order. ``fn`` and the tasks must be
    picklable where processes are spawned; on Linux workers are forked, so they start in
    milliseconds with the modules this process has loaded. Workers are stopped before this returns
    or raises.

    Args:
        fn: the work of one task (a module-level function).
        tasks: the tasks.
        jobs: worker processes.
        on_result: called with each task's index and result as it arrives.
        describe: the task in words, for :class:`WorkerDied` (``"planning chunk 3 of zigzag"``).
        hint: what to do when a worker dies (``"run with fewer jobs"``), appended to the message.
        name: what a worker is called in messages.

    Raises:
        WorkerDied: a worker process ended without returning its task's result; one line naming
            the worker, its task, how it ended and ``hint``.
        Exception: the first exception a task raised, as the task raised it.
    """
    if jobs <= 1 or len(tasks) <= 1:
        for index, task in enumerate(tasks):
            on_result(index, fn(task))
        return
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else None
    ctx = multiprocessing.get_context(method)
    pending = deque(range(len(tasks)))
    workers: list[_Worker] = []
    try:
        for _ in range(min(jobs, len(tasks))):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_task_worker, args=(there, fn), daemon=True)
            proc.start()
            there.close()
            workers.append(_Worker(proc, here))
        for w in workers:
            w.take(pending, tasks)
        while any(w.index is not None for w in workers):
            busy = [w for w in workers if w.index is not None]
            multiprocessing.connection.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy])
            for w in busy:
                reply = w.reply()
                if reply is False:
                    continue
                if reply is None:
                    raise WorkerDied(
                        " ".join(
                            f"{name} process {w.proc.pid} {_exit_text(w.proc.exitcode)} while "
                            f"{describe(tasks[w.index])}; {hint}".split()
                        ).rstrip("; ")
                    )
                if reply[0] == "error":
                    _, _, exc, text = reply
                    if exc is None:
                        raise RuntimeError(f"{name} failed while {describe(tasks[w.index])}:\n{text}")
                    raise exc
                index, w.index = w.index, None
                on_result(index, reply[2])
                w.take(pending, tasks)
    finally:
        for w in workers:
            w.stop()


@dataclass
class _Worker:
    """One process of :func:`run_tasks`, its end of the pipe, and the index of the task it runs (``None``: idle)."""

    proc: Any
    conn: Any
    index: int | None = None

    def take(self, pending: deque, tasks: Sequence[Any]) -> None:
        """Start the next pending task here, if any (a worker gone by then shows at its next reply)."""
        if pending:
            self.index = pending.popleft()
            with contextlib.suppress(OSError):  # a worker that died shows in reply()
                self.conn.send((self.index, tasks[self.index]))

    def reply(self) -> tuple | None | bool:
        """The worker's reply if one is waiting, ``False`` while it works, ``None`` if it is gone without one."""
        try:
            if self.conn.poll():
                return self.conn.recv()
        except (EOFError, OSError):
            pass
        else:
            if self.proc.exitcode is None:
                return False
        self.proc.join(5)
        return None

    def stop(self) -> None:
        """Tell the worker to finish, and kill it if it does not within a moment."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(1)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self.conn.close()
