"""Steps of one epoch's plan, planned a few steps ahead of their consumer, in a planner process or a thread.

:class:`StepStream` plans step ``s`` exactly as :func:`~ringpack.planner.epoch.make_plan` plans
``steps[s]``, with the cost model in force at that step, so a streamed epoch equals the whole-epoch
plan on every rank, with no communication. Only a window of steps is kept (the one asked for last
and ``lookahead`` after it), and each planned step's count and digest. A background thread plans
whatever the window lacks, lowest step first, so no cost switch or jump leaves a step unplanned;
it sleeps while the window is full and ends with the epoch, the stream, or the interpreter. With
``planner="process"`` it has a forked planner process plan each step and send back one DP rank's
micro-batches as arrays, so a Python-heavy training loop keeps the interpreter lock; the process
dies with its thread and its parent, and one that dies or stalls is :class:`PlannerDied`, raised
for its step. An exception planning a step is raised again where that step is asked for; a
forked child plans in a thread (and process) of its own.

See docs/data.md, "The sampler".
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import dataclasses
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import warnings
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ringpack._spawn import _BEAT, BEAT_S, STALL_ENV, _beat, _die_with_parent, _exit_text, _is_stopped, stall_seconds
from ringpack.cost import CostModel
from ringpack.errors import PlanError
from ringpack.piece_table import PieceTable, piece_table, remember_piece_table
from ringpack.planner.epoch import GlobalBatches, global_batches, plan_step
from ringpack.shard_plan import ColumnShards, MicroBatch, PlanConfig, Step
from ringpack.traffic import OVER_BUDGET_SLOT, remember_over_budget

__all__ = [
    "StepStream",
    "RankStep",
    "PackedMicroBatch",
    "PlannerDied",
    "step_digest",
    "LOOKAHEAD_STEPS",
    "PLANNERS",
    "PROCESS_FROM_SAMPLES",
]

#: Steps planned ahead of the one asked for last.
LOOKAHEAD_STEPS = 2
#: Where steps are planned: ``"auto"`` (the rule below), ``"thread"`` or ``"process"``.
PLANNERS = ("auto", "thread", "process")
#: ``planner="auto"`` plans in a process (on Linux) when a global batch holds this many samples on
#: average, or more: such a step takes tens of milliseconds or more to plan, which a thread would
#: take from the training loop; smaller steps plan in about a millisecond, less than forking costs.
PROCESS_FROM_SAMPLES = 1024
#: Seconds a waiting thread sleeps between checks (that the planner lives; that the stream is used).
_POLL_S = 0.5

_LIVE: weakref.WeakSet[StepStream] = weakref.WeakSet()
_PROCESSES: weakref.WeakSet[_PlannerProcess] = weakref.WeakSet()  # live planner processes, by their parent end
_PROCESSES_LOCK = threading.Lock()


@atexit.register
def _close_all() -> None:
    """Stop every planning thread before the interpreter tears down the modules they use."""
    for stream in list(_LIVE):
        stream.close(join_s=5.0)


class PlannerDied(PlanError):
    """The planner process of a :class:`StepStream` ended (killed, out of memory, crashed) or stopped
    answering before it sent a step; the message, one line, names the process, how it ended and the step."""


@dataclasses.dataclass(frozen=True, eq=False)
class PackedMicroBatch:
    """A :class:`MicroBatch` as int64 arrays: a few bytes to pickle, and unpacked only where used.

    Attributes:
        samples: ``[n]``, the micro-batch's samples in canonical order.
        table: its checked :class:`~ringpack.piece_table.PieceTable` with the derived parts, built
            in the planner's process: the pieces themselves (CP rank after CP rank), and what
            compiling a rank's schedule reads of the others, kept on the unpacked micro-batch.
        loss_tokens: as the micro-batch's.
        over_budget: the partner-budget outcomes the planner decided for it
            (:data:`~ringpack.traffic.OVER_BUDGET_SLOT`), kept on the unpacked micro-batch.
        fingerprint: its :attr:`~MicroBatch.fingerprint`, computed in the planner's process and
            kept on the unpacked micro-batch (every schedule of it carries it).
    """

    samples: np.ndarray
    table: PieceTable
    loss_tokens: int
    over_budget: tuple[tuple[int | None, int, bool], ...] = ()
    fingerprint: int | None = None

    @classmethod
    def of(cls, mb: MicroBatch) -> PackedMicroBatch:
        """``mb`` packed.

        Raises:
            PlanError: pieces that do not tile ``mb``'s samples (:meth:`PieceTable.from_microbatch`).
        """
        decided = tuple((node, budget, over) for (node, budget), over in vars(mb).get(OVER_BUDGET_SLOT, {}).items())
        samples = np.asarray(mb.samples, dtype=np.int64)
        return cls(samples, piece_table(mb).with_derived(), int(mb.loss_tokens), decided, mb.fingerprint)

    def fields(self) -> tuple:
        """The fields in order, plain values (``PackedMicroBatch(*packed.fields())`` equals it)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    def unpack(self) -> MicroBatch:
        """The :class:`MicroBatch` (equal to the one packed) on the arrays: its shards are
        :class:`~ringpack.shard_plan.ColumnShards`, each rank's built on first use, and its
        :attr:`~MicroBatch.piece_columns` read from the arrays. O(samples) Python work, not
        O(pieces): a loader compiling one rank's schedule of a pool-wide micro-batch builds that
        rank's pieces only."""
        t = self.table
        pieces = np.stack((self.samples[t.slot], t.start, t.stop), axis=1)
        bounds = np.searchsorted(t.rank, np.arange(t.cp_size + 1))  # rows are rank by rank
        mb = MicroBatch(
            samples=tuple(self.samples.tolist()), shards=ColumnShards(pieces, bounds), loss_tokens=self.loss_tokens
        )
        remember_piece_table(mb, t)
        for node, budget, over in self.over_budget:
            remember_over_budget(mb, node, budget, over)
        if self.fingerprint is not None:
            mb.__dict__["fingerprint"] = self.fingerprint  # the cached property's slot
        return mb


@dataclasses.dataclass(frozen=True, eq=False)
class RankStep:
    """What one DP rank needs of a step: its micro-batches and the step's totals.

    Attributes:
        index: the step.
        rank: the DP rank.
        parts: ``step.microbatches[rank]``, each a :class:`MicroBatch` or, as the planner process
            sends them, a :class:`PackedMicroBatch` (:attr:`microbatches` unpacks them).
        count: micro-batches per DP rank (equal on every DP rank).
        loss_tokens: ``step.loss_tokens``: loss tokens of the whole global batch, every DP rank.
        digest: :func:`step_digest` of the whole step.
    """

    index: int
    rank: int
    parts: tuple[MicroBatch | PackedMicroBatch, ...]
    count: int
    loss_tokens: int
    digest: str

    @property
    def microbatches(self) -> tuple[MicroBatch, ...]:
        """``step.microbatches[rank]`` (packed parts unpacked, on every call)."""
        return tuple(p.unpack() if isinstance(p, PackedMicroBatch) else p for p in self.parts)

    @classmethod
    def of(cls, step: Step, index: int, rank: int, digest: str, pack: bool = False) -> RankStep:
        """DP rank ``rank``'s part of ``step`` (step ``index``, whose :func:`step_digest` is
        ``digest``), its micro-batches packed with ``pack``."""
        mbs = step.microbatches[rank]
        parts = tuple(PackedMicroBatch.of(mb) for mb in mbs) if pack else mbs
        return cls(index, rank, parts, len(step.microbatches[0]), step.loss_tokens, digest)


def step_digest(step: Step) -> str:
    """SHA-256 (hex) of a step's micro-batches: their samples and every CP rank's pieces, in order."""
    values: list[int] = []
    for d, rank in enumerate(step.microbatches):
        for i, mb in enumerate(rank):
            values += (-1, d, i, len(mb.samples), *mb.samples)
            for c, shard in enumerate(mb.shards):
                values.append(-2 - c)
                for p in shard.pieces:
                    values += (p.sample, p.start, p.stop)
    return hashlib.sha256(np.asarray(values, dtype="<i8").tobytes()).hexdigest()


def _can_fork() -> bool:
    return "fork" in multiprocessing.get_all_start_methods()


class StepStream:
    """The steps of one epoch, planned in order in the background, ``lookahead`` ahead of :meth:`get`.

    Args:
        lengths: the planner's input (one length per sample), as for ``make_plan``.
        config: the plan config of the epoch (its ``seed`` and ``epoch`` decide the global batches;
            its cost model is the one of step 0 unless ``costs`` says otherwise).
        costs: ``[(first step, cost model), ...]`` ascending: each model plans from its step on.
        lookahead: steps planned past the one asked for last (>= 0).
        batches: ``global_batches(lengths, config)`` when the caller has it already.
        planner: ``"process"`` (a forked planner process plans; needs the ``fork`` start method),
            ``"thread"`` (the background thread plans, holding the interpreter lock while it
            works) or ``"auto"``: the process on Linux when a global batch holds
            :data:`PROCESS_FROM_SAMPLES` samples or more on average, else the thread.
        rank: the DP rank whose micro-batches the consumer takes (:meth:`get_rank`); with the
            process, only that rank's micro-batches come back from it, and :meth:`get` (the
            whole step) is refused. ``None``: whole steps.

    Raises:
        PlanError: as :func:`~ringpack.planner.epoch.global_batches` (bad lengths, overflow, ...);
            ``planner`` not one of :data:`PLANNERS`, ``"process"`` where processes cannot be
            forked, or ``rank`` outside ``[0, config.dp)``.
    """

    def __init__(
        self,
        lengths: Any,
        config: PlanConfig,
        costs: list[tuple[int, CostModel]] | None = None,
        lookahead: int = LOOKAHEAD_STEPS,
        batches: GlobalBatches | None = None,
        *,
        planner: str = "auto",
        rank: int | None = None,
    ) -> None:
        if planner not in PLANNERS:
            raise PlanError(f"planner must be one of {list(PLANNERS)}, got {planner!r}")
        if planner == "process" and not _can_fork():
            raise PlanError("planner='process' needs the 'fork' start method, which this platform lacks; use 'thread'")
        if rank is not None and not (isinstance(rank, (int, np.integer)) and 0 <= rank < config.dp):
            raise PlanError(f"rank must be a DP rank in [0, {config.dp}) or None, got {rank!r}")
        self.batches = global_batches(lengths, config) if batches is None else batches
        self.config = config
        self.num_steps = len(self.batches.windows)
        if planner == "auto":
            planned = len(self.batches.lengths) - len(self.batches.dropped)
            large = planned >= PROCESS_FROM_SAMPLES * self.num_steps
            planner = "process" if large and sys.platform.startswith("linux") and _can_fork() else "thread"
        #: ``"thread"`` or ``"process"``: where this stream's steps are planned.
        self.planner = planner
        self.rank = None if rank is None else int(rank)
        self._costs = _schedule(config.cost, costs or [])
        self._lookahead = max(0, int(lookahead))
        self._length_list: list[int] | None = None  # the documents' lengths as a list, made once
        self._cond = threading.Condition()
        self._steps: dict[int, Step | RankStep] = {}  # the window's planned steps
        self.counts: dict[int, int] = {}  # micro-batches per DP rank of every step planned so far
        self.digests: dict[int, str] = {}  # step_digest of every step planned so far
        self._first = 0  # the step asked for last: the window is [first, first + lookahead]
        self._busy: int | None = None  # the step the thread is planning
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.planned: list[int] = []  # every step the thread planned, in order (re-plans included)
        self.process_pid: int | None = None  # the planner process last forked (planner="process")
        _LIVE.add(self)

    @property
    def _rank_only(self) -> bool:
        """Whether the window holds one DP rank's parts (:class:`RankStep`), not whole steps."""
        return self.planner == "process" and self.rank is not None

    # ------------------------------------------------------------------ consumers
    def get(self, s: int) -> Step:
        """Step ``s``, waiting for the background planner; the window then starts at ``s`` (it
        plans on from there: ask for steps in order). Raises what planning step ``s`` raised (the
        same exception object with the thread), :class:`PlannerDied`, or ``IndexError``; a
        ``RuntimeError`` where the process sends only ``rank``'s part (:meth:`get_rank`)."""
        if self._rank_only:
            raise RuntimeError(
                f"this stream's planner process sends DP rank {self.rank}'s micro-batches only: "
                "get_rank(s), or peek(s) for the whole step"
            )
        self._check_index(s)
        self._after_fork()
        with self._cond:
            self._move_window(s)
            return self._wait(s)

    def get_rank(self, s: int) -> RankStep:
        """DP rank ``rank``'s part of step ``s`` (``rank`` as given to the constructor), as
        :meth:`get` waits for and moves the window. Raises as :meth:`get`, and ``RuntimeError``
        for a stream made without ``rank``."""
        if self.rank is None:
            raise RuntimeError("this stream was made without rank=: get(s) gives whole steps")
        self._check_index(s)
        self._after_fork()
        with self._cond:
            self._move_window(s)
            item = self._wait(s)
            if isinstance(item, RankStep):
                return item
            return RankStep.of(item, s, self.rank, self.digests[s])

    def peek(self, s: int) -> Step:
        """Step ``s`` without moving the window: from the window or the thread, else planned here
        (always planned here where the process sends one rank's part)."""
        self._check_index(s)
        self._after_fork()
        if not self._rank_only:
            with self._cond:
                if s in self._steps or self._first <= s <= self._first + self._lookahead:
                    return self._wait(s)
        return self._plan_here(s)

    def count(self, s: int) -> int:
        """Micro-batches per DP rank of step ``s`` (planned, see :meth:`peek`, if not known yet)."""
        with self._cond:
            known = self.counts.get(s)
        return known if known is not None else len(self.peek(s).microbatches[0])

    def digest(self, s: int) -> str:
        """:func:`step_digest` of step ``s`` (planned, see :meth:`peek`, if not known yet)."""
        with self._cond:
            known = self.digests.get(s)
        return known if known is not None else step_digest(self.peek(s))

    def cost_at(self, s: int) -> CostModel:
        """The cost model that plans step ``s``."""
        with self._cond:
            return _model_at(self._costs, s)

    def set_costs(self, costs: list[tuple[int, CostModel]]) -> None:
        """A new cost schedule (as for the constructor): steps from the first it changes are planned again."""
        new = _schedule(self.config.cost, costs)
        with self._cond:
            first = next(
                (s for s in range(self.num_steps) if _model_at(new, s) != _model_at(self._costs, s)), self.num_steps
            )
            self._costs = new
            if first >= self.num_steps:
                return
            for table in (self._steps, self.counts, self.digests):
                for s in [s for s in table if s >= first]:
                    del table[s]
            if self._error is not None and self._error[0] >= first:
                self._error = None
            self._cond.notify_all()

    def close(self, join_s: float = 0.0) -> None:
        """Stop the thread (it finishes the step it is planning, then stops its planner process)
        and wait up to ``join_s`` for it."""
        with self._cond:
            self._closed = True
            self._steps.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and join_s > 0 and thread is not threading.current_thread():
            thread.join(join_s)

    @property
    def thread(self) -> threading.Thread | None:
        """The planning thread last started (``None`` before the first :meth:`get`)."""
        return self._thread

    # ------------------------------------------------------------------ internals
    def _check_index(self, s: int) -> None:
        if not 0 <= s < self.num_steps:
            raise IndexError(f"step {s} outside [0, {self.num_steps})")

    def _wait(self, s: int) -> Step | RankStep:
        """Step ``s`` once the thread has planned it (under the lock); raises what planning it raised."""
        while s not in self._steps:
            if self._error is not None and self._error[0] <= s:
                raise self._error[1]
            self._ensure_thread()
            self._cond.wait(_POLL_S)
        return self._steps[s]

    def _move_window(self, s: int) -> None:
        """Start the window at ``s`` (under the lock): steps outside it go, the thread plans what it lacks."""
        if s == self._first:
            return
        for old in [old for old in self._steps if not s <= old <= s + self._lookahead]:
            del self._steps[old]
        self._first = s
        if self._error is not None and self._error[0] < s:
            self._error = None  # a jump past a failed step: it is not asked for any more
        self._cond.notify_all()

    def _ensure_thread(self) -> None:
        """Start the planning thread if none runs (under the lock)."""
        if self._closed:
            raise RuntimeError("this step stream is closed")
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(
                target=_run, args=(weakref.ref(self),), name="ringpack-planner", daemon=True
            )
            self._thread.start()

    def _after_fork(self) -> None:
        """In a forked child: a fresh lock, no thread, no step in planning (the parent's are not there)."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._cond = threading.Condition()
            self._thread = None
            self._busy = None

    def _config_for(self, cost: CostModel) -> PlanConfig:
        return self.config if cost == self.config.cost else dataclasses.replace(self.config, cost=cost)

    def _plan(self, s: int, cost: CostModel) -> Step:
        """Step ``s`` planned with ``cost`` (in any thread)."""
        config = self._config_for(cost)
        if self._length_list is None and config.strategy != "balanced":  # the other splits read it
            self._length_list = self.batches.lengths.tolist()
        return plan_step(self.batches, s, config, self._length_list)

    def _plan_here(self, s: int) -> Step:
        """Step ``s`` planned in the caller's thread; its count and digest are kept."""
        with self._cond:
            cost = _model_at(self._costs, s)
        step = self._plan(s, cost)
        digest = step_digest(step)
        with self._cond:
            if cost == _model_at(self._costs, s):
                self.counts[s] = len(step.microbatches[0])
                self.digests[s] = digest
        return step

    def _claim(self) -> tuple[int, CostModel] | tuple[()] | None:
        """The next step for the thread to plan (under the lock): ``(step, cost)``, ``()`` to wait
        (every step of the window is planned or being planned), ``None`` to end the thread.

        The work is whatever the window lacks, lowest step first, so a step whose plan was
        dropped (a cost switch, a jump) is planned again by construction. Steps at or after a
        failed one are not planned: asking for them raises the failure.
        """
        if self._closed:
            return None
        last = min(self._first + self._lookahead, self.num_steps - 1)
        if self._error is not None:
            last = min(last, self._error[0] - 1)
        for s in range(self._first, last + 1):
            if s not in self._steps and s != self._busy:
                self._busy = s
                return s, _model_at(self._costs, s)
        ends = self._error is not None or self._first + self._lookahead >= self.num_steps - 1
        return None if ends else ()

    def _record(
        self, s: int, cost: CostModel, step: Step | RankStep | None, digest: str, error: BaseException | None
    ) -> None:
        """What planning step ``s`` with ``cost`` gave (under the lock); dropped if step ``s`` has
        another model by now (a cost switch while it was planned)."""
        self._busy = None
        self._cond.notify_all()
        if self._closed or cost != _model_at(self._costs, s):
            return
        self.planned.append(s)
        if error is not None:
            self._error = (s, error)
        else:
            self.counts[s] = step.count if isinstance(step, RankStep) else len(step.microbatches[0])
            self.digests[s] = digest
            if self._first <= s <= self._first + self._lookahead:
                self._steps[s] = step


def _schedule(base: CostModel, costs: list[tuple[int, CostModel]]) -> list[tuple[int, CostModel]]:
    """``costs`` with ``base`` from step 0 where it starts later, ordered by step."""
    ordered = sorted(((int(s), model) for s, model in costs), key=lambda x: x[0])
    return ordered if ordered and ordered[0][0] <= 0 else [(0, base), *ordered]


def _model_at(costs: list[tuple[int, CostModel]], s: int) -> CostModel:
    """The model of step ``s`` in a schedule: the last one starting at or before it."""
    return costs[bisect.bisect_right([first for first, _ in costs], s) - 1][1]


def _run(ref: weakref.ReferenceType[StepStream]) -> None:
    """The planning thread. It holds its stream weakly except while a step is planned or briefly
    waiting, so a stream nobody uses any more is collected and the thread ends. With
    ``planner="process"`` it forks the planner process on its first step and stops it when it ends."""
    process: _PlannerProcess | None = None
    try:
        while True:
            stream = ref()
            if stream is None:
                return
            with stream._cond:
                work = stream._claim()
                if work == ():
                    stream._cond.wait(_POLL_S)
                    del stream
                    continue
            if work is None:
                return
            s, cost = work
            step, digest, error = None, "", None
            try:
                if stream.planner == "process":
                    if process is None:
                        process = _PlannerProcess(stream)
                        stream.process_pid = process.pid
                    step, digest = process.plan(s, cost)
                else:
                    step = stream._plan(s, cost)
                    digest = step_digest(step)
            except BaseException as exc:  # kept, and raised in the thread that asks for step s
                error = exc
            with stream._cond:
                stream._record(s, cost, step, digest, error)
            if isinstance(error, PlannerDied) and process is not None:
                process.close()
                process = None
            del stream, step
    finally:
        if process is not None:
            process.close()


# ------------------------------------------------------------------------------ the planner process
class _PlannerProcess:
    """A forked process that plans the steps its thread sends, one at a time, and sends them back.

    Forked by the stream's planning thread, it dies with that thread (``PR_SET_PDEATHSIG``) and
    with this process (its heartbeat checks the parent), so it outlives neither. A reply that
    does not come because the process ended, or because it sent no heartbeat for the stall limit
    (``$RINGPACK_WORKER_STALL_S``), is :class:`PlannerDied` naming it.
    """

    def __init__(self, stream: StepStream) -> None:
        ctx = multiprocessing.get_context("fork")
        self.stall_s = stall_seconds()
        self.epoch = stream.config.epoch
        here, there = ctx.Pipe()
        with _PROCESSES_LOCK:  # closed in the child: another planner's pipe is this process's alone
            others = [p.conn for p in _PROCESSES]
        args = (there, stream.batches, stream.config, stream.rank, os.getpid(), min(BEAT_S, self.stall_s / 4), others)
        self.proc = ctx.Process(target=_planner_main, args=args, name="ringpack-planner", daemon=True)
        with warnings.catch_warnings():  # a fork while other threads run: the child only plans, in Python
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning)
            self.proc.start()
        there.close()
        self.conn = here
        self.pid = self.proc.pid
        with _PROCESSES_LOCK:
            _PROCESSES.add(self)

    def plan(self, s: int, cost: CostModel) -> tuple[Step | RankStep, str]:
        """Step ``s`` planned with ``cost`` by the process: ``(step or rank part, digest)``.

        Raises:
            PlannerDied: the process ended, or sent nothing for the stall limit (it is killed).
            Exception: what planning the step raised in the process (a copy).
        """
        try:
            self.conn.send((s, cost))
        except OSError:
            raise self._died(s) from None
        heard = time.monotonic()
        while True:
            wait_s = heard + self.stall_s - time.monotonic()
            ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout=min(max(wait_s, 0), 1.0))
            if self.conn in ready or _has_data(self.conn):
                try:
                    reply = self.conn.recv()
                except (EOFError, OSError):
                    raise self._died(s) from None
                heard = time.monotonic()
                if reply == _BEAT:
                    continue
                if reply[0] == "ok":
                    return reply[2], reply[3]
                _, _, exc, text = reply
                if exc is None:  # an exception that does not pickle: its last line
                    raise PlanError(f"planning step {s} failed in the planner process: {text.strip().splitlines()[-1]}")
                raise exc
            if self.proc.exitcode is not None or not self.proc.is_alive():
                raise self._died(s)
            if time.monotonic() - heard >= self.stall_s:
                stopped = " (it is stopped: SIGSTOP or a debugger)" if _is_stopped(self.pid) else ""
                self.proc.kill()
                self.proc.join(5)
                raise PlannerDied(
                    f"the planner process {self.pid} sent no heartbeat for {self.stall_s:g} s{stopped} while "
                    f"planning step {s} of epoch {self.epoch}; it was killed ({STALL_ENV} sets how long it may stay "
                    "silent)"
                )

    def _died(self, s: int) -> PlannerDied:
        self.proc.join(5)
        return PlannerDied(
            f"the planner process {self.pid} {_exit_text(self.proc.exitcode)} while planning step {s} of epoch "
            f"{self.epoch}; the steps from {s} on cannot be delivered (planner='thread' plans in this process)"
        )

    def close(self) -> None:
        """Tell the process to end, and kill it if it has not within a moment."""
        with _PROCESSES_LOCK:
            _PROCESSES.discard(self)
        with contextlib.suppress(OSError):
            self.conn.send(None)
        self.proc.join(1)
        if self.proc.exitcode is None:
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _has_data(conn: multiprocessing.connection.Connection) -> bool:
    try:
        return conn.poll(0)
    except (OSError, EOFError):
        return False


def _planner_main(
    conn: multiprocessing.connection.Connection,
    batches: GlobalBatches,
    config: PlanConfig,
    rank: int | None,
    parent: int,
    beat_s: float,
    inherited: list[multiprocessing.connection.Connection],
) -> None:
    """The planner process: ``(step, cost model)`` in, ``("ok", step, step or rank part, digest)``
    or ``("error", step, exception, traceback)`` out, a heartbeat every ``beat_s``; ``None`` ends it."""
    for other in inherited:
        with contextlib.suppress(OSError):
            other.close()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler the parent installed is the parent's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; this process dies with it
    _die_with_parent(parent)
    lock = threading.Lock()
    threading.Thread(target=_beat, args=(conn, lock, beat_s, parent), daemon=True).start()
    length_list: list[int] | None = None
    while True:
        try:
            work = conn.recv()
        except (EOFError, OSError):
            return
        if work is None:
            return
        s, cost = work
        try:
            step_config = config if cost == config.cost else dataclasses.replace(config, cost=cost)
            if length_list is None and step_config.strategy != "balanced":
                length_list = batches.lengths.tolist()
            step = plan_step(batches, s, step_config, length_list)
            digest = step_digest(step)
            part = step if rank is None else RankStep.of(step, s, rank, digest, pack=True)
            reply: tuple = ("ok", s, part, digest)
        except BaseException as exc:  # every failure goes home, never swallowed
            reply = ("error", s, exc, traceback.format_exc())
        try:
            data = ForkingPickler.dumps(reply)
        except Exception:  # an exception that does not pickle
            data = ForkingPickler.dumps(("error", s, None, traceback.format_exc()))
        try:
            with lock:
                conn.send_bytes(data)
        except OSError:
            return
