"""Local worker processes: ranks joined by a gloo group (the demo's ring check, the CPU tests), and task pools.

:func:`run_ranks` runs ``fn(rank, world, *args)`` on ``world`` processes joined in a gloo group
(every collective gets ``timeout_s``); a hang or a failed rank fails the call naming every failed
rank with its traceback, ranks left are killed after ``fail_grace_s``. :func:`run_tasks` runs
independent tasks on a few worker processes, longest first, handing results home as they come; a
task's exception is re-raised as it is, a worker that dies raises :class:`WorkerDied`, one line
naming its task and what to do. Nothing waits without an end: workers die with their parent
(Linux ``PR_SET_PDEATHSIG``, and a parent check in their heartbeat), each closes the pipe ends
of its siblings a fork handed it, and a busy worker silent for :data:`STALL_S` seconds (stopped,
frozen; ``$RINGPACK_WORKER_STALL_S``) is killed and named (:class:`WorkerStalled`).

Only the standard library at import time: torch is imported inside the functions.

See docs/analysis.md, "`ringpack demo`" and "`ringpack simulate`".
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = [
    "free_port",
    "run_ranks",
    "run_tasks",
    "stall_seconds",
    "WorkerDied",
    "WorkerStalled",
    "STALL_S",
    "STALL_ENV",
]


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
    _die_with_parent(None)  # a rank outlives neither the caller nor its forkserver
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


class WorkerStalled(WorkerDied, TimeoutError):
    """A worker process of :func:`run_tasks` sent no heartbeat for the stall limit (stopped, frozen); it was killed."""


#: Seconds a busy worker may go without a sign of life (a heartbeat or its result) before it is killed and named.
STALL_S = 60.0
#: The environment variable that replaces :data:`STALL_S` (seconds, a number > 0).
STALL_ENV = "RINGPACK_WORKER_STALL_S"
#: Longest pause between two heartbeats of a worker.
BEAT_S = 5.0
_BEAT = "beat"  # a worker's sign of life
_GONE = object()  # what a worker's receiver posts when the worker's end of the pipe closes
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stall_seconds(stall_s: float | None = None) -> float:
    """The stall limit: ``stall_s`` if given, else ``$RINGPACK_WORKER_STALL_S``, else :data:`STALL_S`.

    Raises:
        ValueError: the limit is not a finite number of seconds > 0 (the variable is named).
    """
    text = os.environ.get(STALL_ENV) if stall_s is None else stall_s
    if text is None:
        return STALL_S
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        where = STALL_ENV if stall_s is None else "stall_s"
        raise ValueError(f"{where}={text!r}: give the seconds a worker may stay silent, a number > 0")
    return value


def _die_with_parent(parent: int | None) -> None:
    """Have the kernel kill this process when its parent ends, however it ends (SIGTERM, SIGKILL, a crash).

    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere the heartbeat's parent check ends the
    worker. ``parent``: the pid the parent had, to catch a parent that ended before the request.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _beat(conn: multiprocessing.connection.Connection, lock: threading.Lock, every_s: float, parent: int) -> None:
    """A worker's heartbeat thread: a sign of life every ``every_s``; the worker ends once its parent is gone."""
    while True:
        time.sleep(every_s)
        if os.getppid() != parent:
            os._exit(1)
        try:
            with lock:
                conn.send(_BEAT)
        except OSError:  # the parent's end is closed
            os._exit(1)


def _task_worker(
    conn: multiprocessing.connection.Connection,
    fn: Callable,
    tasks: Sequence[Any],
    beat_s: float,
    parent: int,
    inherited: Sequence[multiprocessing.connection.Connection],
) -> None:
    """A pool worker: a task's index in, ``("ok", index, fn(task))`` or ``("error", index, exc, text)`` out.

    It closes the ends of its siblings' pipes that a fork handed it (so a sibling sees its parent
    go), dies with its parent, and sends a heartbeat every ``beat_s`` while it works or waits.
    """
    for other in inherited:
        other.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler the parent installed is the parent's
    _die_with_parent(parent)
    lock = threading.Lock()
    threading.Thread(target=_beat, args=(conn, lock, beat_s, parent), daemon=True).start()
    while True:
        try:
            index = conn.recv()
        except (EOFError, OSError):
            return
        if index is None:
            return
        try:
            reply: tuple = ("ok", index, fn(tasks[index]))
        except BaseException as exc:  # every failure goes home, never swallowed
            reply = ("error", index, exc, traceback.format_exc())
        try:
            data = ForkingPickler.dumps(reply)  # outside the lock: the heartbeat goes on while a result pickles
        except Exception:  # a result or an exception that does not pickle
            data = ForkingPickler.dumps(("error", index, None, traceback.format_exc()))
        try:
            with lock:
                conn.send_bytes(data)
        except OSError:
            return


def _exit_text(exitcode: int | None) -> str:
    """How a process ended, in words: a signal by name (SIGKILL is what an out-of-memory killer sends)."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}" + (" (most often the system running out of memory)" if name == "SIGKILL" else "")
    return "exited" if exitcode is None else f"exited with code {exitcode}"


def _has_data(conn: multiprocessing.connection.Connection) -> bool:
    """Whether something the worker sent waits unread on ``conn`` (its receiver thread reads it next)."""
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return False


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, a debugger); ``False`` where ``/proc`` does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: Sequence[Any],
    jobs: int,
    on_result: Callable[[int, Any], None],
    *,
    describe: Callable[[Any], str] = lambda task: "a task",
    hint: str = "",
    name: str = "worker",
    stall_s: float | None = None,
) -> None:
    """Run ``fn(task)`` for every task on ``jobs`` worker processes; ``on_result(index, result)`` in this process.

    Tasks start in the order given (give the longest first, so the last to finish is short), one
    at a time per worker; ``jobs <= 1`` runs them here, in order. ``fn`` and the tasks must be
    picklable where processes are spawned; on Linux workers are forked, so they start in
    milliseconds with the modules and tasks this process has (a task is sent as its index).
    Workers are stopped before this returns or raises, die with this process however it ends
    (Linux), and send a heartbeat every few seconds: a busy worker silent for ``stall_s`` is
    killed and named.

    Args:
        fn: the work of one task (a module-level function).
        tasks: the tasks.
        jobs: worker processes.
        on_result: called with each task's index and result as it arrives.
        describe: the task in words, for :class:`WorkerDied` (``"planning chunk 3 of zigzag"``).
        hint: what to do when a worker dies (``"run with fewer jobs"``), appended to the message.
        name: what a worker is called in messages.
        stall_s: seconds a busy worker may stay silent (``None``: :func:`stall_seconds`).

    Raises:
        WorkerDied: a worker process ended without returning its task's result; one line naming
            the worker, its task, how it ended and ``hint``.
        WorkerStalled: a busy worker sent no heartbeat for ``stall_s`` (stopped, frozen); one line
            naming the worker and its task (a ``WorkerDied`` and a ``TimeoutError``).
        Exception: the first exception a task raised, as the task raised it.
        ValueError: ``stall_s`` (or the variable) is not a number of seconds > 0.
    """
    stall = stall_seconds(stall_s)
    if jobs <= 1 or len(tasks) <= 1:
        for index, task in enumerate(tasks):
            on_result(index, fn(task))
        return
    with _Pool(fn, tasks, min(jobs, len(tasks)), stall) as pool:
        pending = deque(range(len(tasks)))
        for w in pool.workers:
            w.take(pending)
        while any(w.index is not None for w in pool.workers):
            w, message = pool.next_message(describe, tasks)
            if message == _BEAT or w.index is None:  # a sign of life, or a worker leaving once all tasks are out
                continue
            if message is _GONE:
                w.proc.join(5)
                raise WorkerDied(
                    " ".join(
                        f"{name} process {w.proc.pid} {_exit_text(w.proc.exitcode)} while "
                        f"{describe(tasks[w.index])}; {hint}".split()
                    ).rstrip("; ")
                )
            if message[0] == "error":
                _, _, exc, text = message
                if exc is None:
                    raise RuntimeError(f"{name} failed while {describe(tasks[w.index])}:\n{text}")
                raise exc
            index, w.index = w.index, None
            on_result(index, message[2])
            w.take(pending)


class _Pool:
    """The worker processes of one :func:`run_tasks` call, and one inbox of everything they send.

    Every worker is started before any receiver thread (a fork copies only the forking thread);
    a worker forked later closes the ends of its elder siblings' pipes it inherited.
    """

    def __init__(self, fn: Callable, tasks: Sequence[Any], jobs: int, stall_s: float) -> None:
        fork = "fork" in multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("fork" if fork else None)
        self.stall_s = stall_s
        self.inbox: queue.Queue = queue.Queue()
        self.workers: list[_Worker] = []
        beat_s = min(BEAT_S, stall_s / 4)
        try:
            for _ in range(jobs):
                here, there = ctx.Pipe()
                inherited = [w.conn for w in self.workers] + [here] if fork else []
                args = (there, fn, tasks, beat_s, os.getpid(), inherited)
                proc = ctx.Process(target=_task_worker, args=args, daemon=True)
                proc.start()
                there.close()
                self.workers.append(_Worker(proc, here))
        except BaseException:
            self.close()
            raise
        for w in self.workers:
            w.listen(self.inbox)

    def next_message(self, describe: Callable[[Any], str], tasks: Sequence[Any]) -> tuple[_Worker, Any]:
        """The next ``(worker, message)``; a busy worker silent for the stall limit raises :class:`WorkerStalled`."""
        while True:
            busy = [w for w in self.workers if w.index is not None]
            quiet = min(busy, key=lambda w: w.heard)
            wait_s = quiet.heard + self.stall_s - time.monotonic()
            if wait_s <= 0:
                if not _has_data(quiet.conn):  # (a busy machine can leave a sent beat unread a moment)
                    self.stalled(quiet, describe(tasks[quiet.index]))
                wait_s = 0.1
            try:
                w, message = self.inbox.get(timeout=wait_s)
            except queue.Empty:
                continue
            w.heard = time.monotonic()
            return w, message

    def stalled(self, w: _Worker, task: str) -> None:
        """Kill the silent worker ``w`` and raise :class:`WorkerStalled` naming it and ``task``."""
        stopped = " (it is stopped: SIGSTOP or a debugger)" if _is_stopped(w.proc.pid) else ""
        w.proc.kill()
        raise WorkerStalled(
            f"worker process {w.proc.pid} sent no heartbeat for {self.stall_s:g} s{stopped} while {task}; "
            f"it was killed ({STALL_ENV} sets how long a worker may stay silent)"
        )

    def close(self) -> None:
        for w in self.workers:
            w.stop()

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


@dataclass
class _Worker:
    """One process of :func:`run_tasks`, its end of the pipe, the task it runs (``None``: idle), when it was heard."""

    proc: Any
    conn: Any
    index: int | None = None
    heard: float = 0.0
    receiver: threading.Thread | None = None

    def listen(self, inbox: queue.Queue) -> None:
        """Post everything the worker sends to ``inbox`` as ``(self, message)``, then ``(self, _GONE)``."""
        self.heard = time.monotonic()
        self.receiver = threading.Thread(target=self._receive, args=(inbox,), daemon=True)
        self.receiver.start()

    def _receive(self, inbox: queue.Queue) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                inbox.put((self, _GONE))
                return
            inbox.put((self, message))

    def take(self, pending: deque) -> None:
        """Start the next pending task here, if any (a worker gone by then shows as gone in the inbox)."""
        if pending:
            self.index = pending.popleft()
            self.heard = time.monotonic()
            with contextlib.suppress(OSError):
                self.conn.send(self.index)

    def stop(self) -> None:
        """Tell the worker to finish, and kill it if it does not within a moment."""
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(1)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        if self.receiver is not None:
            self.receiver.join(5)
        self.conn.close()
