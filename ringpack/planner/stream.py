"""Steps of one epoch's plan, planned a few steps ahead of their consumer in a background thread.

:class:`StepStream` plans step ``s`` exactly as :func:`~ringpack.planner.epoch.make_plan` plans
``steps[s]`` (the same global batches, the same function), with the cost model in force at that
step, so a streamed epoch equals the whole-epoch plan step for step on every rank, with no
communication. Only a window of steps is kept: the one asked for last and up to ``lookahead``
after it; of every step planned besides, its micro-batches per DP rank and a digest stay (a few
bytes a step).

The thread is a daemon that sleeps while the window is full and ends when the epoch is planned,
when the stream is closed or no longer used, and at interpreter exit (joined there). An exception
raised while planning a step is kept with that step and raised again, the same object, in the
thread that asks for the step. A forked child plans in a thread of its own. The thread's work is
always the window's lowest step not planned yet, so no cost switch or jump leaves one unplanned.

See docs/data.md, "The sampler".
"""

from __future__ import annotations

import atexit
import bisect
import dataclasses
import hashlib
import os
import threading
import weakref
from typing import Any

import numpy as np

from ringpack.cost import CostModel
from ringpack.planner.epoch import GlobalBatches, global_batches, plan_step
from ringpack.shard_plan import PlanConfig, Step

__all__ = ["StepStream", "step_digest", "LOOKAHEAD_STEPS"]

#: Steps planned ahead of the one asked for last.
LOOKAHEAD_STEPS = 2
#: Seconds a waiting thread sleeps between checks (that the planner lives; that the stream is used).
_POLL_S = 0.5

_LIVE: weakref.WeakSet[StepStream] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """Stop every planning thread before the interpreter tears down the modules they use."""
    for stream in list(_LIVE):
        stream.close(join_s=5.0)


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


class StepStream:
    """The steps of one epoch, planned in order by a background thread, ``lookahead`` ahead of :meth:`get`.

    Args:
        lengths: the planner's input (one length per sample), as for ``make_plan``.
        config: the plan config of the epoch (its ``seed`` and ``epoch`` decide the global batches;
            its cost model is the one of step 0 unless ``costs`` says otherwise).
        costs: ``[(first step, cost model), ...]`` ascending: each model plans from its step on.
        lookahead: steps planned past the one asked for last (>= 0).
        batches: ``global_batches(lengths, config)`` when the caller has it already.

    Raises:
        PlanError: as :func:`~ringpack.planner.epoch.global_batches` (bad lengths, overflow, ...).
    """

    def __init__(
        self,
        lengths: Any,
        config: PlanConfig,
        costs: list[tuple[int, CostModel]] | None = None,
        lookahead: int = LOOKAHEAD_STEPS,
        batches: GlobalBatches | None = None,
    ) -> None:
        self.batches = global_batches(lengths, config) if batches is None else batches
        self.config = config
        self.num_steps = len(self.batches.windows)
        self._costs = _schedule(config.cost, costs or [])
        self._lookahead = max(0, int(lookahead))
        self._length_list: list[int] | None = None  # the documents' lengths as a list, made once
        self._cond = threading.Condition()
        self._steps: dict[int, Step] = {}  # the window's planned steps
        self.counts: dict[int, int] = {}  # micro-batches per DP rank of every step planned so far
        self.digests: dict[int, str] = {}  # step_digest of every step planned so far
        self._first = 0  # the step asked for last: the window is [first, first + lookahead]
        self._busy: int | None = None  # the step the thread is planning
        self._error: tuple[int, BaseException] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self.planned: list[int] = []  # every step the thread planned, in order (re-plans included)
        _LIVE.add(self)

    # ------------------------------------------------------------------ consumers
    def get(self, s: int) -> Step:
        """Step ``s``, waiting for the thread to plan it; the window then starts at ``s`` (the
        thread plans on from there: ask for steps in order). Raises what planning step ``s``
        raised (the same exception object), or ``IndexError``."""
        self._check_index(s)
        self._after_fork()
        with self._cond:
            self._move_window(s)
            return self._wait(s)

    def peek(self, s: int) -> Step:
        """Step ``s`` without moving the window: from the window or the thread, else planned here."""
        self._check_index(s)
        self._after_fork()
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
        """Stop the thread (it finishes the step it is planning) and wait up to ``join_s`` for it."""
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

    def _wait(self, s: int) -> Step:
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
        """In a forked child: a fresh lock and no thread (the parent's are not there)."""
        if os.getpid() != self._pid:
            self._pid = os.getpid()
            self._cond = threading.Condition()
            self._thread = None

    def _plan(self, s: int, cost: CostModel) -> Step:
        """Step ``s`` planned with ``cost`` (in any thread)."""
        config = self.config if cost == self.config.cost else dataclasses.replace(self.config, cost=cost)
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

    def _record(self, s: int, cost: CostModel, step: Step | None, digest: str, error: BaseException | None) -> None:
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
            self.counts[s] = len(step.microbatches[0])
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
    """The planning thread. It holds its stream weakly except while planning or briefly waiting,
    so a stream nobody uses any more is collected and the thread ends."""
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
            step = stream._plan(s, cost)
            digest = step_digest(step)
        except BaseException as exc:  # kept, and raised in the thread that asks for step s
            error = exc
        with stream._cond:
            stream._record(s, cost, step, digest, error)
        del stream, step
