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
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack.analysis.calibration.fit import fit_nnls
from ringpack.cost import CostModel, piece_pairs
from ringpack.shard_plan import MicroBatch

__all__ = ["CostLearner", "LearnerConfig", "FitResult", "fit_rank_times", "microbatch_features"]

#: Columns of an observation row (float64): where it was measured, what the rank held, how long it took.
ROW = ("step", "dp", "microbatch", "cp", "tokens", "pairs", "pieces", "coupled", "seconds")
_FEATURES = slice(4, 7)
#: a fitted term below this share of every observation's time is set to exactly zero
NEGLIGIBLE = 1e-9
_STATE_VERSION = 1


@dataclass(frozen=True)
class LearnerConfig:
    """When :class:`CostLearner` fits and when it switches the planner to a new model.

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
        for name in ("warmup_steps", "lead_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"LearnerConfig.{name} must be >= 0")
        for name in ("first_fit_after", "refit_every", "window_steps", "min_observations"):
            if getattr(self, name) < 1:
                raise ValueError(f"LearnerConfig.{name} must be >= 1")
        if not (self.max_error > 0 and self.min_change >= 0):
            raise ValueError("LearnerConfig: max_error must be > 0 and min_change >= 0")


@dataclass(frozen=True)
class FitResult:
    """A fitted model and how well it explains the observations it was fitted on.

    ``model`` is in seconds per token / pair / piece (``unit="s"``); ``overhead`` the fitted seconds
    per micro-batch and rank (equal on every rank, so the planner ignores it); ``rms_error`` and
    ``max_error`` are relative; ``used`` / ``dropped`` count observations kept and outliers.
    """

    model: CostModel
    overhead: float
    rms_error: float
    max_error: float
    used: int
    dropped: int


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


def fit_rank_times(rows: np.ndarray, prior: CostModel, iterations: int = 6) -> FitResult | None:
    """Fit ``seconds ~ token*tokens + pair*pairs + segment*pieces + overhead`` to observation rows.

    Args:
        rows: ``[n, 9]`` float64 rows with the columns of :data:`ROW` (any order; every rank of a
            micro-batch present once).
        prior: the model in use; it picks the slowest rank of coupled micro-batches in the first
            iteration.
        iterations: fixed-point iterations over which rank of a coupled micro-batch is slowest.

    Returns:
        The fit, or ``None`` when there are fewer than five observations, or when the fit prices
        both tokens and pairs at zero.
        Deterministic: the same rows in any order give the same result.
    """
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
        if coef[0] == 0 and coef[1] == 0:
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
        model, overhead, float(np.sqrt(np.mean(err**2))), float(np.abs(err).max()), int(keep.sum()), int((~keep).sum())
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

    Use on every rank::

        learner = CostLearner(sampler, cp_rank, device=device)
        for batch in loader:
            with learner.measure(batch):
                loss = compute_loss(batch); loss.backward()
            if batch["microbatch_index"] + 1 == batch["microbatches_in_step"]:
                optimizer.step(); optimizer.zero_grad()
                learner.end_step()            # collective every refit_every steps

    The sampler's ``state_dict`` records every switch, so a resumed run plans exactly as this one did.
    """

    def __init__(
        self,
        sampler: Any,
        cp_rank: int,
        group: Any = None,
        config: LearnerConfig | None = None,
        device: Any = None,
    ) -> None:
        self.sampler = sampler
        self.cp_rank = int(cp_rank)
        self.group = group
        self.config = config or LearnerConfig()
        self.history: list[FitResult] = []
        self._timer = _Timer(device)
        self._step = 0  # end_step() calls so far
        self._last_fit = 0
        self._open: list[tuple[tuple, Any, Any]] = []  # this step's (key+features, start, stop)
        self._unread: list[tuple[tuple, Any, Any]] = []  # the previous step's, read at the next end_step()
        self._rows: list[tuple[float, ...]] = []  # this rank's readable observations

    @property
    def model(self) -> CostModel:
        """The cost model the sampler plans with now."""
        return self.sampler.config.cost

    @contextlib.contextmanager
    def measure(self, batch: dict[str, Any]) -> Iterator[None]:
        """Time the forward + backward run inside the ``with`` block for ``batch`` (a collator output)."""
        start = self._timer.mark()
        yield
        stop = self._timer.mark()
        self._open.append((self._describe(batch), start, stop))

    def record(self, batch: dict[str, Any], seconds: float) -> None:
        """Add a micro-batch timed by the caller (instead of :meth:`measure`)."""
        self._open.append((self._describe(batch), None, float(seconds)))

    def _describe(self, batch: dict[str, Any]) -> tuple:
        feats, coupled = microbatch_features(batch["microbatch"])
        return (
            self._step,
            self.sampler.dp_rank,
            int(batch["microbatch_index"]),
            self.cp_rank,
            *feats[self.cp_rank],
            float(coupled),
        )

    def end_step(self) -> FitResult | None:
        """Close the optimizer step; every ``refit_every`` steps fit and maybe switch the sampler.

        Collective over ``group`` on the steps that fit (the same steps on every rank). Returns the
        fit when one was made and accepted, else ``None``.
        """
        for key, start, stop in self._unread:
            if key[0] >= self.config.warmup_steps:
                seconds = stop if start is None else self._timer.seconds(start, stop)
                self._rows.append((*key, seconds))
        self._unread, self._open = self._open, []
        self._step += 1
        readable = self._step - 1 - self.config.warmup_steps  # steps whose timings have been read
        if readable < self.config.first_fit_after:
            return None
        if self.history and self._step - self._last_fit < self.config.refit_every:
            return None
        self._last_fit = self._step
        return self._fit_and_switch()

    def _fit_and_switch(self) -> FitResult | None:
        import torch
        import torch.distributed as dist

        oldest = self._step - self.config.window_steps
        self._rows = [r for r in self._rows if r[0] >= oldest]
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, (self._rows, self.sampler.planned_through()), group=self.group)
        rows = np.asarray([r for part, _ in gathered for r in part], dtype=np.float64).reshape(-1, len(ROW))
        planned = max(p for _, p in gathered)
        result = fit_rank_times(rows, self.model) if len(rows) else None
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

    def state_dict(self) -> dict[str, Any]:
        """Plain-data (JSON-able) state from which a resumed run fits exactly as this one would.

        Holds this rank's observations, the step count and the accepted fits; the models in use are
        in the sampler's state. Timings not read yet (the last step's CUDA events) are read here,
        which waits for the GPU. Each rank's state is its own (its observations).
        """
        return {
            "version": _STATE_VERSION,
            "step": self._step,
            "last_fit": self._last_fit,
            "history": [list(_encode(result)) for result in self.history],
            "rows": [list(row) for row in self._rows],
            "unread": self._timed(self._unread),
            "open": self._timed(self._open),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (of this rank).

        Raises:
            ValueError: not a learner state of this version, or rows of the wrong width.
        """
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(f"not a CostLearner state (version {_STATE_VERSION}): {state!r:.200}")
        width = len(ROW)
        for name in ("rows", "unread", "open"):
            rows = state.get(name)
            if not isinstance(rows, list) or any(not isinstance(row, list) or len(row) != width for row in rows):
                raise ValueError(f"CostLearner state {name}: every row needs {width} values ({', '.join(ROW)})")
        self._step, self._last_fit = int(state["step"]), int(state["last_fit"])
        self.history = [_decode(values) for values in state["history"]]
        self._rows = [tuple(row) for row in state["rows"]]
        self._unread = [(tuple(row[:-1]), None, float(row[-1])) for row in state["unread"]]
        self._open = [(tuple(row[:-1]), None, float(row[-1])) for row in state["open"]]

    def _timed(self, marks: list[tuple[tuple, Any, Any]]) -> list[list[float]]:
        """Rows (:data:`ROW`) of timed micro-batches whose marks may still be unread."""
        return [[*key, stop if start is None else self._timer.seconds(start, stop)] for key, start, stop in marks]

    def _acceptable(self, result: FitResult) -> bool:
        """A fit the planner may switch to: enough observations, no :func:`fit_problem`, new prices."""
        cfg = self.config
        if result.used < cfg.min_observations or fit_problem(result, cfg.max_error):
            return False
        return price_change(self.model, result.model) > cfg.min_change


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
    if result is None:
        return [0.0] * 8
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
    ]


def _decode(values: Sequence[float]) -> FitResult | None:
    if not values[0]:
        return None
    _, token, pair, segment, overhead, rms, worst, counts = values
    model = CostModel(token=token, pair=pair, segment=segment, unit="s", name="learned", microbatch=overhead)
    return FitResult(model, overhead, rms, worst, int(counts % 1e6), int(counts // 1e6))
