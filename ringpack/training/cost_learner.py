"""Learn the cost model from the training run itself: time every micro-batch, fit, re-plan (docs/training.md).

:class:`CostLearner` times each micro-batch's forward + backward on every rank (CUDA events, read a
step later, no host synchronisation); every ``refit_every`` steps it gathers all ranks' timings
(one small collective), fits the prices with :func:`~ringpack.cost_fit.fit_rank_times` and
broadcasts rank 0's answer, so every rank holds bit-identical numbers; when the prices move enough,
it tells the sampler to plan with them from a step no rank has handed out yet, so every rank
switches at the same step and plans stay identical everywhere.

It lives in the training layer, above the data loaders and below the integrations: it steers a
:class:`~ringpack.data.BalancedBatchSampler` (through its public methods) and runs
``torch.distributed`` collectives (torch is imported when it first times or fits), and the
integrations' checkpoints store its state. The fit itself is pure numpy, on the ground floor next to
the cost model (:mod:`ringpack.cost_fit`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack._checks import is_finite, is_int, is_real
from ringpack.cost import CostModel
from ringpack.cost_fit import (
    MIN_SECONDS,
    ROW,
    FitResult,
    fit_problem,
    fit_rank_times,
    microbatch_features,
    price_change,
    usable_rows,
    without_microbatches,
)
from ringpack.errors import DataError, PlanError
from ringpack.shard_plan import MicroBatch

__all__ = ["CostLearner", "LearnerConfig"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
_STATE_KEYS = ("version", "step", "last_fit", "history", "rows", "unread", "open")
_ENCODED = 9  # values of an encoded FitResult (_encode); states written before ``unusable`` hold 8


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """When :class:`CostLearner` fits and when it switches the planner to a new model (keyword-only).

    Attributes:
        warmup_steps: first steps whose timings are ignored (compilation, allocator growth).
        first_fit_after: steps of timings (after warm-up) before the first fit; until a fit is
            accepted, one is tried after every step.
        refit_every: steps between fits once one was accepted (each fit is one small collective on
            every rank).
        window_steps: fits use the timings of at most this many recent steps.
        min_observations: fewest observations (after outliers are dropped) a fit needs.
        max_error: a fit whose relative RMS error on its own observations exceeds this is rejected.
        min_change: the planner switches only when the token:pair price ratio or the per-piece
            price moves by more than this fraction (plans are not churned by noise).
        lead_steps: steps between the last step any rank has planned and the switch.

    Raises:
        PlanError: a count that is not a whole number (``>= 0`` for ``warmup_steps`` and
            ``lead_steps``, ``>= 1`` for the others), ``max_error`` not a finite number ``> 0`` or
            ``min_change`` not one ``>= 0``; the message names the field.
    """

    warmup_steps: int = 1
    first_fit_after: int = 3
    refit_every: int = 8
    window_steps: int = 64
    min_observations: int = 6
    max_error: float = 0.2
    min_change: float = 0.03
    lead_steps: int = 1

    def __post_init__(self) -> None:
        for name in (
            "warmup_steps",
            "lead_steps",
            "first_fit_after",
            "refit_every",
            "window_steps",
            "min_observations",
        ):
            value, low = getattr(self, name), 0 if name in ("warmup_steps", "lead_steps") else 1
            if not is_int(value) or not low <= value < 2**63:
                raise PlanError(f"LearnerConfig.{name} must be a whole number >= {low}, got {value!r}")
        for name, low in (("max_error", "> 0"), ("min_change", ">= 0")):
            value = getattr(self, name)
            if not is_finite(value) or value < 0 or (value == 0 and low == "> 0"):
                raise PlanError(f"LearnerConfig.{name} must be a finite number {low}, got {value!r}")


# ------------------------------------------------------------------------------------ the learner
class _Timer:
    """Start/stop marks of one micro-batch: CUDA events on a GPU (read later, no sync), else the host clock."""

    def __init__(self, device: Any) -> None:
        self._cuda = device is not None and getattr(device, "type", str(device)).startswith("cuda")

    def mark(self) -> Any:
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, stop: Any) -> float:
        if self._cuda:
            stop.synchronize()  # recorded a step ago: normally long complete
            return start.elapsed_time(stop) / 1e3
        return stop - start


class CostLearner:
    """Times every micro-batch of a training run and re-plans with the fitted cost model.

    Args:
        sampler: the :class:`~ringpack.data.BalancedBatchSampler` feeding this rank; it receives
            the fitted models (:meth:`~ringpack.data.BalancedBatchSampler.set_cost_model`).
        cp_rank: this rank's position in its CP group.
        group: the process group of *all* ranks that plan (DP x CP); default the world.
        config: when to fit and switch (:class:`LearnerConfig`).
        device: where the model runs; CUDA events time a CUDA device, the host clock anything else.

    Raises:
        TypeError: ``sampler`` is not a sampler or ``config`` not a :class:`LearnerConfig`.
        PlanError: ``cp_rank`` is not a whole number inside the sampler's CP size.

    Use on every rank::

        learner = CostLearner(sampler, cp_rank, device=device)
        for batch in loader:
            with learner.measure(batch):
                loss = compute_loss(batch); loss.backward()
            if batch["microbatch_index"] + 1 == batch["microbatches_in_step"]:
                optimizer.step(); optimizer.zero_grad()
                learner.end_step()            # collective every refit_every steps

    The sampler's ``state_dict`` records every switch, so a resumed run plans exactly as this one did.

    A bad observation never stops the run: a time of 0, a negative one (a clock that stepped back),
    NaN, infinity, or counts no fit can hold (:func:`~ringpack.cost_fit.usable_rows`) is left out of every fit, counted
    in :attr:`bad_observations` and logged once (a warning of this module's logger). When one rank
    of a coupled micro-batch has a bad time, the fits leave out the other ranks' times of it too.
    When numpy cannot fit the observations, the planner keeps its model (logged once). Every rank
    takes the same decisions: the fit sees every rank's observations (gathered) and every rank
    takes rank 0's result (broadcast).

    Attributes:
        history: the accepted fits, oldest first.
        bad_observations: this rank's bad observations so far (a resumed run keeps counting).
    """

    def __init__(
        self,
        sampler: Any,
        cp_rank: int,
        group: Any = None,
        config: LearnerConfig | None = None,
        device: Any = None,
    ) -> None:
        for needed in ("dp_rank", "config", "planned_through", "set_cost_model"):
            if not hasattr(sampler, needed):
                raise TypeError(
                    f"CostLearner: sampler must be a BalancedBatchSampler (it has no {needed}), "
                    f"got {type(sampler).__name__}"
                )
        cp = getattr(sampler.config, "cp", None)
        if not is_int(cp_rank) or cp_rank < 0 or (is_int(cp) and cp_rank >= cp):
            raise PlanError(
                f"CostLearner: cp_rank must be a whole number in [0, {cp}) (the sampler's CP size), got {cp_rank!r}"
            )
        if config is not None and not isinstance(config, LearnerConfig):
            raise TypeError(f"CostLearner: config must be a LearnerConfig, got {type(config).__name__}")
        self.sampler = sampler
        self.cp_rank = int(cp_rank)
        self.group = group
        self.config = config or LearnerConfig()
        self.history: list[FitResult] = []
        self.bad_observations = 0
        self._timer = _Timer(device)
        self._step = 0  # end_step() calls so far
        self._last_fit = 0
        self._open: list[tuple[tuple, Any, Any]] = []  # this step's (key+features, start, stop)
        self._unread: list[tuple[tuple, Any, Any]] = []  # the previous step's, read at the next end_step()
        self._rows: list[tuple[float, ...]] = []  # this rank's usable observations
        self._void: list[tuple[float, float, float]] = []  # (step, dp, micro-batch): coupled, a bad time here
        self._warned: set[str] = set()  # what has been logged once
        self._closing: tuple[int, int] | None = None  # (epoch, step) of the plan step of the latest batch

    @property
    def model(self) -> CostModel:
        """The cost model the sampler plans with now."""
        return self.sampler.config.cost

    @contextlib.contextmanager
    def measure(self, batch: dict[str, Any]) -> Iterator[None]:
        """Time the forward + backward run inside the ``with`` block for ``batch`` (a collator output).

        Raises:
            TypeError: ``batch`` is not a collator batch (:meth:`record`); raised before the block runs.
        """
        key = self._describe(batch)
        start = self._timer.mark()
        yield
        stop = self._timer.mark()
        self._open.append((key, start, stop))

    def record(self, batch: dict[str, Any], seconds: float) -> None:
        """Add a micro-batch timed by the caller (instead of :meth:`measure`).

        Args:
            batch: the collator's batch (``microbatch`` and ``microbatch_index`` are read).
            seconds: its forward + backward time, one number (Python, numpy or a one-element
                tensor). A bad time is no error: :meth:`end_step` leaves it out and counts it.

        Raises:
            TypeError: ``seconds`` is not one number (a string, ``None``, a bool, several values),
                or ``batch`` is not a collator batch.
        """
        if isinstance(seconds, (str, bytes, bool, np.bool_)):
            raise TypeError(f"CostLearner.record: seconds must be a number, got {type(seconds).__name__} {seconds!r}")
        try:
            value = float(seconds)
        except (TypeError, ValueError, RuntimeError):  # None, an array or tensor of several values
            raise TypeError(f"CostLearner.record: seconds must be one number, got {type(seconds).__name__}") from None
        self._open.append((self._describe(batch), None, value))

    def _describe(self, batch: dict[str, Any]) -> tuple:
        try:
            mb, index = batch["microbatch"], batch["microbatch_index"]
        except (TypeError, KeyError, IndexError):
            raise TypeError(
                "CostLearner: batch must be a collator batch with 'microbatch' and 'microbatch_index', "
                f"got {type(batch).__name__}"
            ) from None
        if not isinstance(mb, MicroBatch) or not is_int(index):
            raise TypeError(
                f"CostLearner: batch['microbatch'] must be a MicroBatch and batch['microbatch_index'] an integer, "
                f"got {type(mb).__name__} and {type(index).__name__}"
            )
        if self.cp_rank >= len(mb.shards):
            raise PlanError(f"CostLearner: cp_rank {self.cp_rank}, but the micro-batch has {len(mb.shards)} CP ranks")
        feats, coupled = microbatch_features(mb)
        epoch, step = (batch.get("epoch"), batch.get("step")) if hasattr(batch, "get") else (None, None)
        if is_int(epoch) and is_int(step):
            self._closing = (int(epoch), int(step))
        return (self._step, self.sampler.dp_rank, int(index), self.cp_rank, *feats[self.cp_rank], float(coupled))

    def end_step(self) -> FitResult | None:
        """Close the optimizer step; every ``refit_every`` steps fit and maybe switch the sampler.

        Collective over ``group`` on the steps that fit (the same steps on every rank, whatever
        the timings). Returns the fit when one was made and accepted, else ``None``. Never raises
        for the timings it was given (bad ones are dropped and counted: class docstring).

        Raises:
            PlanError: on every rank of the group, at a fit, when the ranks' latest batches (their
                ``epoch`` and ``step``, which collator batches carry) are of different plan steps:
                a rank called ``end_step`` more or fewer times than the others. The message names
                each rank's step.
        """
        read = [
            (*key, stop if start is None else self._timer.seconds(start, stop))
            for key, start, stop in self._unread
            if key[0] >= self.config.warmup_steps
        ]
        self._keep(read)
        self._unread, self._open = self._open, []
        self._step += 1
        readable = self._step - 1 - self.config.warmup_steps  # steps whose timings have been read
        if readable < self.config.first_fit_after:
            return None
        if self.history and self._step - self._last_fit < self.config.refit_every:
            return None
        self._last_fit = self._step
        return self._fit_and_switch()

    def _keep(self, rows: list[tuple[float, ...]]) -> None:
        """Add the usable ``rows`` to the observations; count, remember and log (once) the bad ones."""
        if not rows:
            return
        ok = usable_rows(np.asarray(rows, dtype=np.float64))
        self._rows += [tuple(map(float, row)) for row, good in zip(rows, ok) if good]
        bad = [row for row, good in zip(rows, ok) if not good]
        if bad:
            self._set_aside(bad)
            self._warn_once(
                "timing",
                f"CostLearner: left out a bad observation ({_describe_row(bad[0])}); {_USABLE}. Bad observations "
                "are left out of every fit and counted in CostLearner.bad_observations; this warning is not repeated",
            )

    def _set_aside(self, bad: Sequence[Sequence[float]]) -> None:
        """Count bad rows; remember coupled micro-batches that lost one rank's time (their other ranks go too)."""
        self.bad_observations += len(bad)
        self._void += [
            tuple(map(float, row[:3])) for row in bad if row[7] != 0 and all(math.isfinite(x) for x in row[:3])
        ]

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    def _fit_and_switch(self) -> FitResult | None:
        import torch
        import torch.distributed as dist

        oldest = self._step - self.config.window_steps
        self._rows = [r for r in self._rows if r[0] >= oldest]
        self._void = [k for k in self._void if k[0] >= oldest]
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        mine = (self._rows, self._void, self.sampler.planned_through(), self._closing)
        dist.all_gather_object(gathered, mine, group=self.group)
        _check_same_step([closing for *_, closing in gathered], self._step)
        rows = np.asarray([r for part, *_ in gathered for r in part], dtype=np.float64).reshape(-1, len(ROW))
        void = np.asarray([k for _, part, *_ in gathered for k in part], dtype=np.float64).reshape(-1, 3)
        planned = max(p for _, _, p, _ in gathered)
        result = self._fit(rows[without_microbatches(rows, void)])
        # a tensor where the group's backend can broadcast it (NCCL: the rank's current GPU)
        where = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        coef = torch.tensor(_encode(result), dtype=torch.float64, device=where)
        dist.broadcast(
            coef, src=dist.get_global_rank(self.group, 0) if self.group is not None else 0, group=self.group
        )  # bit-identical on every rank
        result = _decode(coef.tolist())
        if result is None or not self._acceptable(result):
            return None
        self.history.append(result)
        self.sampler.set_cost_model(result.model, after=planned, lead_steps=self.config.lead_steps)
        return result

    def _fit(self, rows: np.ndarray) -> FitResult | None:
        """The fit of the gathered rows; ``None`` (logged once) if numpy cannot fit them."""
        if not len(rows):
            return None
        try:
            return fit_rank_times(rows, self.model)
        except ValueError as exc:  # numpy's LinAlgError (a ValueError) on rows it cannot solve; a CostModel refused
            self._warn_once("fit", f"CostLearner: no fit could be made ({exc}); the planner keeps its cost model")
            return None

    def state_dict(self) -> dict[str, Any]:
        """Plain-data (JSON-able) state from which a resumed run fits exactly as this one would.

        Holds this rank's observations, the step count, the accepted fits and the bad observations
        counted; the models in use are in the sampler's state. Timings not read yet (the last
        step's CUDA events) are read here, which waits for the GPU. Each rank's state is its own
        (its observations).
        """
        return {
            "version": _STATE_VERSION,
            "step": self._step,
            "last_fit": self._last_fit,
            "history": [list(_encode(result)) for result in self.history],
            "rows": [list(row) for row in self._rows],
            "unread": self._timed(self._unread),
            "open": self._timed(self._open),
            "void": [list(key) for key in self._void],
            "bad_observations": self.bad_observations,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (of this rank).

        Rows holding a bad observation (:func:`~ringpack.cost_fit.usable_rows`) are dropped, counted in
        :attr:`bad_observations` and logged; nothing is installed unless the whole state is valid.

        Raises:
            DataError: not a learner state of this version, a key missing, or a value of the wrong
                kind (a step count that is not a whole number >= 0, a row of the wrong width or
                with a value that is not a number, a malformed fit); the message names the key.
        """
        if not isinstance(state, dict):
            raise DataError(f"not a CostLearner state (a dict from CostLearner.state_dict()): {type(state).__name__}")
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise DataError(f"CostLearner state lacks {', '.join(map(repr, missing))} (not a CostLearner state)")
        if state["version"] != _STATE_VERSION:
            raise DataError(
                f"CostLearner state version {state['version']!r}: this ringpack reads version {_STATE_VERSION}"
            )
        step, last_fit = _state_count(state, "step"), _state_count(state, "last_fit")
        if last_fit > step:
            raise DataError(f"CostLearner state last_fit: {last_fit} is after step {step}")
        bad_before = _state_count(state, "bad_observations", default=0)
        history = _state_history(state["history"])
        void = [tuple(key) for key in _state_rows(state, "void", ("step", "dp", "microbatch"), default=[])]
        lists = {name: _state_rows(state, name, ROW) for name in ("rows", "unread", "open")}
        for name in ("unread", "open"):  # warm-up timings are never read: not observations
            lists[name] = [row for row in lists[name] if not row[0] < self.config.warmup_steps]
        good = {name: usable_rows(np.asarray(rows, dtype=np.float64)) for name, rows in lists.items()}
        kept = {name: [row for row, ok in zip(rows, good[name]) if ok] for name, rows in lists.items()}
        bad = [row for name, rows in lists.items() for row, ok in zip(rows, good[name]) if not ok]
        self._step, self._last_fit, self.history = step, last_fit, history
        self.bad_observations, self._void = bad_before, void
        self._rows = kept["rows"]
        self._unread = [(row[:-1], None, row[-1]) for row in kept["unread"]]
        self._open = [(row[:-1], None, row[-1]) for row in kept["open"]]
        if bad:
            self._set_aside(bad)
            log.warning(
                "CostLearner state: dropped %d bad observation(s), counted in CostLearner.bad_observations "
                "(the first: %s); %s",
                len(bad),
                _describe_row(bad[0]),
                _USABLE,
            )

    def _timed(self, marks: list[tuple[tuple, Any, Any]]) -> list[list[float]]:
        """Rows (:data:`ROW`) of timed micro-batches whose marks may still be unread (warm-up ones are never read)."""
        return [
            [*key, stop if start is None else self._timer.seconds(start, stop)]
            for key, start, stop in marks
            if key[0] >= self.config.warmup_steps
        ]

    def _acceptable(self, result: FitResult) -> bool:
        """A fit the planner may switch to: enough observations, no :func:`fit_problem`, new prices."""
        cfg = self.config
        if result.used < cfg.min_observations or fit_problem(result, cfg.max_error):
            return False
        return price_change(self.model, result.model) > cfg.min_change


#: what a usable observation is (:func:`~ringpack.cost_fit.usable_rows`), for the log
_USABLE = f"a time must be a finite number of seconds >= {MIN_SECONDS:g}, and counts finite numbers in [0, 2**63]"


def _check_same_step(closing: Sequence[tuple[int, int] | None], learner_step: int) -> None:
    """Raise :class:`PlanError` (the same on every rank) unless every rank's latest batch is of one plan step.

    ``closing[r]``: rank ``r``'s (epoch, step), or None for a rank whose batches carry no step.
    """
    ranks: dict[tuple[int, int], list[int]] = {}
    for rank, at in enumerate(closing):
        if at is not None:
            ranks.setdefault(tuple(at), []).append(rank)
    if len(ranks) <= 1:
        return
    where = "; ".join(f"step {step} of epoch {epoch} on rank(s) {who}" for (epoch, step), who in sorted(ranks.items()))
    raise PlanError(
        f"CostLearner.end_step: the ranks end different training steps at the learner's step {learner_step} "
        f"({where}): call end_step exactly once per optimizer step on every rank, after the step's last micro-batch"
    )


def _describe_row(row: Sequence[float]) -> str:
    """One observation row in words, for the log."""
    named = dict(zip(ROW, row))
    return (
        f"step {named['step']:g}, DP rank {named['dp']:g}, micro-batch {named['microbatch']:g}, "
        f"CP rank {named['cp']:g}: "
        f"{named['seconds']!r} s for {named['tokens']:g} tokens, {named['pairs']:g} pairs, {named['pieces']:g} pieces"
    )


def _state_count(state: dict[str, Any], key: str, default: int | None = None) -> int:
    """``state[key]``, a whole number >= 0 (``default`` when absent and one is given)."""
    value = state.get(key, default)
    if not is_int(value) or value < 0:
        raise DataError(f"CostLearner state {key}: {value!r} is not a count (a whole number >= 0)")
    return int(value)


def _state_rows(
    state: dict[str, Any], key: str, columns: Sequence[str], default: list | None = None
) -> list[tuple[float, ...]]:
    """``state[key]``: a list of rows of ``len(columns)`` numbers (as float tuples; values unchecked)."""
    rows = state.get(key, default)
    width = len(columns)
    if not isinstance(rows, list) or any(not isinstance(row, (list, tuple)) or len(row) != width for row in rows):
        raise DataError(f"CostLearner state {key}: every row needs {width} values ({', '.join(columns)})")
    for i, row in enumerate(rows):
        for name, value in zip(columns, row):
            if not is_real(value):
                raise DataError(f"CostLearner state {key}[{i}] {name}: {value!r} is not a number")
    return [tuple(map(float, row)) for row in rows]


def _state_history(history: Any) -> list[FitResult]:
    """The accepted fits of a state (each as :func:`_encode` writes it; states of an earlier ringpack hold 8 values)."""
    if not isinstance(history, list):
        raise DataError(f"CostLearner state history: a list of fits, got {type(history).__name__}")
    out = []
    for i, values in enumerate(history):
        if (
            not isinstance(values, (list, tuple))
            or len(values) not in (_ENCODED - 1, _ENCODED)
            or not all(is_finite(v) and v >= 0 for v in values)
            or values[0] != 1
        ):
            raise DataError(f"CostLearner state history[{i}]: not a fit ({_ENCODED} finite numbers >= 0, the first 1)")
        try:
            out.append(_decode(list(values)))
        except ValueError as exc:  # a CostModel the fit could not have made
            raise DataError(f"CostLearner state history[{i}]: {exc}") from None
    return out


def _encode(result: FitResult | None) -> Sequence[float]:
    """A fit as :data:`_ENCODED` floats (broadcast as one tensor, stored in the state's history); ``None``: zeros."""
    if result is None:
        return [0.0] * _ENCODED
    m = result.model
    return [
        1.0,
        m.token,
        m.pair,
        m.segment,
        result.overhead,
        result.rms_error,
        result.max_error,
        result.used + 1e6 * result.dropped,
        result.unusable,
    ]


def _decode(values: Sequence[float]) -> FitResult | None:
    if not values[0]:
        return None
    _, token, pair, segment, overhead, rms, worst, counts, *unusable = values
    model = CostModel(token=token, pair=pair, segment=segment, unit="s", name="learned", microbatch=overhead)
    return FitResult(model, overhead, rms, worst, int(counts % 1e6), int(counts // 1e6), int(sum(unusable)))
