"""Learn the cost model from the training run itself: time every micro-batch, fit, re-plan.

The planner balances a linear cost ``token * tokens + pair * pairs + segment * pieces`` per CP rank.
FLOP prices are wrong on real GPUs (attention runs at about half the FLOP rate of the linear
layers), and an offline calibration of kernels misses the rest of the training step (embedding,
norms, loss over the vocabulary, recompute under activation checkpointing). The run's own timings
have none of these gaps. :class:`CostLearner`:

1. times each micro-batch's forward + backward on every rank (:meth:`CostLearner.measure`: two
   CUDA events, no host synchronisation; events are read one step later, when they are done);
2. every ``refit_every`` steps gathers all ranks' timings (one small collective), fits the
   coefficients by non-negative least squares (:func:`fit_rank_times`), and broadcasts rank 0's
   answer so every rank holds bit-identical numbers;
3. when the new prices differ enough from the current ones, tells the sampler to plan with them
   from a step that no rank has handed to its loader yet (agreed by all-reduce), so every rank
   switches at the same step and plans stay identical everywhere.

CP ranks of a micro-batch that exchange K/V wait on each other every layer, so each of them
measures about the time of the slowest: such a micro-batch gives one observation, the slowest
rank's features against the longest time, the slowest rank being the one the current fit
predicts (iterated to a fixed point). Micro-batches whose samples all stay on one rank give one
observation per rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack._checks import is_finite, is_int, is_real
from ringpack.analysis.calibration.fit import fit_nnls
from ringpack.cost import CostModel, piece_pairs
from ringpack.errors import DataError, PlanError
from ringpack.shard_plan import MicroBatch

__all__ = [
    "CostLearner",
    "LearnerConfig",
    "FitResult",
    "fit_rank_times",
    "microbatch_features",
    "usable_rows",
]

log = logging.getLogger(__name__)

#: Columns of an observation row (float64): where it was measured, what the rank held, how long it took.
ROW = ("step", "dp", "microbatch", "cp", "tokens", "pairs", "pieces", "coupled", "seconds")
_FEATURES = slice(4, 7)
#: a fitted term below this share of every observation's time is set to exactly zero
NEGLIGIBLE = 1e-9
#: The shortest time an observation may report. A micro-batch's forward + backward never takes less
#: (CUDA events resolve about 0.5 us); a shorter time is a clock artefact, and dividing counts by it
#: in the relative fit would overflow.
MIN_SECONDS = 1e-9
#: The largest count (tokens, pairs, pieces) an observation may hold: what a plan's int64 can count.
MAX_COUNT = float(2**63)
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


@dataclass(frozen=True)
class FitResult:
    """A fitted model and how well it explains the observations it was fitted on.

    ``model`` is in seconds per token / pair / piece (``unit="s"``); ``overhead`` the fitted seconds
    per micro-batch and rank (equal on every rank, so the planner ignores it); ``rms_error`` and
    ``max_error`` are relative; ``used`` / ``dropped`` count observations kept and outliers;
    ``unusable`` counts rows left out before the fit (:func:`usable_rows`: a time or count that is
    not finite, not positive or out of range, or another rank of the same coupled micro-batch with
    one).
    """

    model: CostModel
    overhead: float
    rms_error: float
    max_error: float
    used: int
    dropped: int
    unusable: int = 0


def microbatch_features(mb: MicroBatch) -> tuple[np.ndarray, bool]:
    """``([cp, 3] float64 tokens/pairs/pieces of every CP rank, coupled)`` of one micro-batch.

    ``coupled``: some sample has pieces on two ranks, so the ranks exchange K/V and wait on each other.
    """
    feats = np.zeros((len(mb.shards), 3))
    owner: dict[int, int] = {}
    coupled = False
    for c, shard in enumerate(mb.shards):
        starts = np.fromiter((p.start for p in shard.pieces), dtype=np.int64, count=len(shard.pieces))
        stops = np.fromiter((p.stop for p in shard.pieces), dtype=np.int64, count=len(shard.pieces))
        feats[c] = (stops - starts).sum(), piece_pairs(starts, stops).sum(), len(shard.pieces)
        for p in shard.pieces:
            coupled |= owner.setdefault(p.sample, c) != c
    return feats, coupled


def usable_rows(rows: np.ndarray) -> np.ndarray:
    """Which observation rows a fit can use (``[n]`` bool).

    A usable row is finite everywhere; its ``step``, ``dp``, ``microbatch`` and ``cp`` are whole
    numbers in ``[0, MAX_COUNT)``, ``coupled`` is 0 or 1, its counts lie in ``[0, MAX_COUNT]`` and
    its time is at least :data:`MIN_SECONDS`. Anything else (a time of 0, a negative time from a
    clock that stepped back, NaN, infinity, a count that overflows the fit) is a bad observation.
    A finite time that is merely far off (a clock that jumped ahead) is usable: the fit's outlier
    guard drops it.

    Args:
        rows: ``[n, 9]`` float64 rows with the columns of :data:`ROW`.
    """
    rows = np.asarray(rows, dtype=np.float64).reshape(-1, len(ROW))
    keys, feats = rows[:, :4], rows[:, _FEATURES]
    return (
        np.isfinite(rows).all(axis=1)
        & ((keys >= 0) & (keys < MAX_COUNT) & (keys == np.floor(keys))).all(axis=1)
        & ((rows[:, 7] == 0) | (rows[:, 7] == 1))
        & ((feats >= 0) & (feats <= MAX_COUNT)).all(axis=1)
        & (rows[:, 8] >= MIN_SECONDS)
    )


def _without_microbatches(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """``[n]`` bool: rows that are not a coupled rank of one of the micro-batches ``keys`` (``[m, 3]``
    finite step, dp, micro-batch). A coupled micro-batch is one observation of all its ranks: without
    one rank's time, the others' cannot say which rank was slowest."""
    if not len(keys):
        return np.ones(len(rows), dtype=bool)
    keys = np.asarray(keys, dtype=np.float64).reshape(-1, 3)
    _, ids = np.unique(np.concatenate([keys, np.nan_to_num(rows[:, :3], nan=-1.0)]), axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    return ~(np.isin(ids[len(keys) :], ids[: len(keys)]) & (rows[:, 7] != 0))


def fit_rank_times(rows: np.ndarray, prior: CostModel, iterations: int = 6) -> FitResult | None:
    """Fit ``seconds ~ token*tokens + pair*pairs + segment*pieces + overhead`` to observation rows.

    Args:
        rows: ``[n, 9]`` float64 rows with the columns of :data:`ROW` (any order; every rank of a
            micro-batch present once). Rows :func:`usable_rows` refuses are left out, with every
            other rank of their micro-batch when it is coupled, and counted in ``unusable``.
        prior: the model in use; it picks the slowest rank of coupled micro-batches in the first
            iteration.
        iterations: fixed-point iterations over which rank of a coupled micro-batch is slowest.

    Returns:
        The fit, or ``None`` when there are fewer than five usable observations, or when the fit
        prices both tokens and pairs at zero.
        Deterministic: the same rows in any order give the same result.

    Raises:
        ValueError: ``rows`` is not an ``[n, 9]`` array of numbers.
    """
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim != 2 or rows.shape[1] != len(ROW):
        raise ValueError(f"fit_rank_times: rows must be [n, {len(ROW)}] ({', '.join(ROW)}), got {rows.shape}")
    ok = usable_rows(rows)
    ok &= _without_microbatches(rows, rows[~ok & np.isfinite(rows[:, :3]).all(axis=1), :3])
    unusable = int((~ok).sum())
    rows = rows[ok]
    rows = rows[np.lexsort(rows[:, ::-1].T)]  # canonical order: results do not depend on gather order
    model, overhead = prior, 0.0
    keep = np.ones(0, dtype=bool)
    for _ in range(iterations):
        feats, times = _observations(rows, model, overhead)
        if len(times) < 5:
            return None
        keep = _inliers(feats, times, model, overhead) if keep.size == len(times) else np.ones(len(times), bool)
        design = np.column_stack([feats[keep], np.ones(keep.sum())])
        coef = fit_nnls(design, times[keep])
        coef[(design * coef <= NEGLIGIBLE * times[keep, None]).all(axis=0)] = 0.0  # rounding residue, not a price
        if not np.isfinite(coef).all() or (coef[0] == 0 and coef[1] == 0):
            return None
        new = CostModel(token=float(coef[0]), pair=float(coef[1]), segment=float(coef[2]), unit="s", name="learned")
        settled = new == model and coef[3] == overhead
        model, overhead = new, float(coef[3])
        if settled:
            break
    feats, times = _observations(rows, model, overhead)
    keep = _inliers(feats, times, model, overhead)
    err = (model.cost(*feats[keep].T) + overhead) / times[keep] - 1
    model = dataclasses.replace(model, microbatch=overhead)
    return FitResult(
        model,
        overhead,
        float(np.sqrt(np.mean(err**2))),
        float(np.abs(err).max()),
        int(keep.sum()),
        int((~keep).sum()),
        unusable,
    )


def _observations(rows: np.ndarray, model: CostModel, overhead: float) -> tuple[np.ndarray, np.ndarray]:
    """Features and times to fit: every rank of an uncoupled micro-batch; the predicted slowest
    rank of a coupled one, against the longest time any of its ranks measured."""
    alone = rows[:, 7] == 0
    feats, times = [rows[alone, _FEATURES]], [rows[alone, 8]]
    coupled = rows[~alone]
    if len(coupled):
        keys = coupled[:, :3]
        starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
        predicted = model.cost(*coupled[:, _FEATURES].T) + overhead
        slowest = [s + int(np.argmax(predicted[s:e])) for s, e in zip(starts, np.r_[starts[1:], len(coupled)])]
        feats.append(coupled[slowest, _FEATURES])
        times.append(np.maximum.reduceat(coupled[:, 8], starts))
    return np.concatenate(feats), np.concatenate(times)


def _inliers(feats: np.ndarray, times: np.ndarray, model: CostModel, overhead: float) -> np.ndarray:
    """Observations whose relative residual is within 4 robust sigmas (at least 5%) of the median."""
    err = (model.cost(*feats.T) + overhead) / times - 1
    mad = 1.4826 * np.median(np.abs(err - np.median(err)))
    return np.abs(err - np.median(err)) <= max(4 * mad, 0.05)


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
    NaN, infinity, or counts no fit can hold (:func:`usable_rows`) is left out of every fit, counted
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
        return (self._step, self.sampler.dp_rank, int(index), self.cp_rank, *feats[self.cp_rank], float(coupled))

    def end_step(self) -> FitResult | None:
        """Close the optimizer step; every ``refit_every`` steps fit and maybe switch the sampler.

        Collective over ``group`` on the steps that fit (the same steps on every rank, whatever
        the timings). Returns the fit when one was made and accepted, else ``None``. Never raises
        for the timings it was given (bad ones are dropped and counted: class docstring).
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
        mine = (self._rows, self._void, self.sampler.planned_through())
        dist.all_gather_object(gathered, mine, group=self.group)
        rows = np.asarray([r for part, _, _ in gathered for r in part], dtype=np.float64).reshape(-1, len(ROW))
        void = np.asarray([k for _, part, _ in gathered for k in part], dtype=np.float64).reshape(-1, 3)
        planned = max(p for _, _, p in gathered)
        result = self._fit(rows[_without_microbatches(rows, void)])
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
        """:func:`fit_rank_times` of the gathered rows, or ``None`` (logged once) when numpy cannot fit them."""
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

        Rows holding a bad observation (:func:`usable_rows`) are dropped, counted in
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


#: what a usable observation is (:func:`usable_rows`), for the log
_USABLE = f"a time must be a finite number of seconds >= {MIN_SECONDS:g}, and counts finite numbers in [0, 2**63]"


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


def fit_problem(result: FitResult, max_error: float) -> str | None:
    """Why the planner must not use ``result`` (one line), or ``None`` when it may.

    A zero token or pair price means the observations could not tell the two apart (every rank
    held the same tokens and pairs, as zigzag splits make them): such a fit explains the timings
    but would price any other plan wrongly. A relative RMS error above ``max_error`` explains too
    little.
    """
    m = result.model
    if m.token <= 0 or m.pair <= 0:
        return f"the fit prices {'tokens' if m.token <= 0 else 'attention pairs'} at zero"
    if result.rms_error > max_error:
        return f"the fit's error is {result.rms_error:.0%} RMS (at most {max_error:.0%})"
    return None


def price_change(old: CostModel, new: CostModel) -> float:
    """How far ``new``'s relative prices (pair and piece, per token) move from ``old``'s (a fraction)."""

    def ratios(m: CostModel) -> np.ndarray:
        return np.array([m.pair, m.segment]) / m.token  # inf (or nan) for a free token: any change is total

    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        a, b = ratios(old), ratios(new)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        change = np.where(same, 0.0, np.abs(b - a) / np.maximum(a, 1e-300))
    return float(np.nan_to_num(change, nan=np.inf).max())


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
