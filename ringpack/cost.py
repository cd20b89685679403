"""The cost model shared by every strategy, the reports and the simulator (docs/cost-model.md).

A rank's work for one micro-batch costs ``token * tokens + pair * attention_pairs + segment *
segments``. ``attention_pairs`` is the *exact* number of (query, key) pairs the rank computes under
the causal document mask: a query at position ``q`` of its sample attends keys ``0..q`` of that
sample wherever they live, so a piece ``[start, stop)`` contributes
``sum_{q=start}^{stop-1} (q + 1) = (stop*(stop+1) - start*(start+1)) / 2`` pairs. That closed form
is why the model is exact *and* vectorised: no loop over tokens or pairs, ever.

Default coefficients are FLOPs of one forward+backward pass derived from a model shape; a
calibrated profile (seconds measured on a GPU) can replace them without touching any caller.
Integer solvers get costs through :func:`scale_to_int`, one place, so every solver rounds alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from numbers import Real
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._checks import is_finite
from ringpack.errors import PlanError

__all__ = [
    "ModelShape",
    "CostModel",
    "MAX_PRICE",
    "MAX_SAMPLE_TOKENS",
    "POOR_FIT_ERROR",
    "PRESETS",
    "piece_pairs",
    "rank_costs",
    "scale_to_int",
]

#: The most tokens of one sample, and of one CP group's micro-batch. A sample of ``L`` tokens has
#: ``L * (L + 1) / 2`` causal pairs, under ``2**61`` here, so pair counts and every per-rank or
#: per-micro-batch sum of them stay exact in int64. Sample lengths (:func:`ringpack.lengths.check_lengths`)
#: and plan configs (``cp * tokens_per_rank``) above it are refused, from the Python API, plan
#: files and the command line alike.
MAX_SAMPLE_TOKENS = 2**31
#: The largest price (``token``, ``pair``, ``segment``, ``microbatch``) a :class:`CostModel` takes, in
#: any unit; ``flops_per_second`` must be at least its inverse. The planner multiplies prices by pair
#: counts (under ``2**61`` a sample, about ``1e30`` summed over any plan), squares coefficients and
#: sums and compares costs in float64: below this bound all of it stays finite (``1e130``, squared
#: ``1e260``, under float64's ``1.8e308``). Real prices are far below it: a trillion-weight model
#: costs about ``6e12`` FLOPs a token.
MAX_PRICE = 1e100
#: A profile whose largest held-out error is above this is a poor fit: :meth:`CostModel.load` warns.
POOR_FIT_ERROR = 0.20

logger = logging.getLogger(__name__)
_warned_profiles: set[str] = set()


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a transformer that decide its FLOPs per token and per attention pair."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 0
    head_dim: int = 0  # 0 means hidden // heads

    def __post_init__(self) -> None:
        for field in ("hidden", "layers", "heads", "kv_heads", "ffn"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelShape {self.name!r}: {field} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"ModelShape {self.name!r}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(f"ModelShape {self.name!r}: hidden not divisible by heads; give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)

    @property
    def params_per_layer(self) -> int:
        """Weights of one decoder layer: q, k, v, o projections and a gated (SwiGLU) MLP."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.ffn
        return q_and_o + k_and_v + mlp

    @property
    def params(self) -> int:
        """All weights, embedding and (untied) output head included."""
        return self.layers * self.params_per_layer + 2 * self.vocab * self.hidden


PRESETS: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        ModelShape("llama3-8b", hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256),
        # Llama-3.2-1B's layers with a 32K vocabulary: the end-to-end training benchmark's model
        ModelShape("llama-1b", hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=32000),
        ModelShape("tiny", hidden=256, layers=4, heads=4, kv_heads=2, ffn=688, vocab=32000),
    )
}


@dataclass(frozen=True)
class CostModel:
    """Linear cost of a rank's work: ``token*tokens + pair*pairs + segment*segments``.

    Attributes:
        token: cost of one token (everything but attention: linear layers, norms, the head).
        pair: cost of one causal (query, key) attention pair (:func:`piece_pairs` counts them).
        segment: fixed cost of one piece (a varlen segment: launch tiles, merges).
        unit: what one cost unit is: ``"flop"`` for shape-derived models, ``"s"`` for a
            calibrated profile; reports print it.
        name: the model preset it was derived from (the communication model looks the K/V shape
            up by it), or ``"custom"``.
        flops_per_second: achieved forward+backward throughput; :meth:`seconds` divides FLOP
            costs by it (unused when ``unit == "s"``).
        microbatch: fixed cost of one micro-batch on every rank that runs it, whatever it holds
            (kernel launches, the loss's setup). It is equal on every CP rank of a micro-batch, so
            splits ignore it, and so do plan costs, bounds and reports (rank costs); packing
            charges it when it weighs one more micro-batch per DP rank, and
            :func:`ringpack.calibration.step.predicted_busy` adds it once per micro-batch
            to predict a training loop's busy time. Measured profiles fit it; FLOP models leave it 0.
        fit_quality: how well a calibrated profile predicted held-out timings, as ``ringpack
            calibrate`` writes it (``None`` for models that were not measured): ``scope``,
            ``device`` (``"cpu"`` for a dry run), ``held_out_max_error`` and
            ``held_out_mean_error`` (relative), ``held_out_shards``. It describes the prices
            without changing them: equality, hashing and :meth:`to_dict` (so plan hashes) leave
            it out; :meth:`save` and :meth:`load` keep it, and :meth:`load` warns on a poor fit
            (:meth:`fit_problem`).

    Raises:
        ValueError: a coefficient that is not a number in ``[0, MAX_PRICE]`` (:data:`MAX_PRICE`:
            larger ones overflow the planner's float64 arithmetic), ``token`` and ``pair`` both
            zero, ``flops_per_second`` not a finite number of at least ``1 / MAX_PRICE``, an unknown unit, or a
            ``fit_quality`` that is not a mapping of its fields (the field is named).
    """

    token: float
    pair: float
    segment: float = 0.0
    unit: str = "flop"
    name: str = "custom"
    flops_per_second: float = 4.0e14  # achieved fwd+bwd throughput used to predict times
    microbatch: float = 0.0
    fit_quality: Mapping[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        for field in ("token", "pair", "segment", "flops_per_second", "microbatch"):
            value = getattr(self, field)
            if not is_finite(value) or value < 0:
                raise ValueError(f"CostModel {self.name!r}: {field} must be a finite number >= 0, got {value!r}")
        for field in ("token", "pair", "segment", "microbatch"):
            value = getattr(self, field)
            if value > MAX_PRICE:
                raise ValueError(
                    f"CostModel {self.name!r}: {field} {value!r} is above {MAX_PRICE:g}, the largest price whose costs "
                    "stay finite in float64 (no real model is near: check the profile's unit and values)"
                )
        if self.flops_per_second == 0:
            raise ValueError(f"CostModel {self.name!r}: flops_per_second must be > 0")
        if self.flops_per_second < 1 / MAX_PRICE:
            raise ValueError(
                f"CostModel {self.name!r}: flops_per_second {self.flops_per_second!r} is below {1 / MAX_PRICE:g}, "
                "whose predicted seconds would overflow float64"
            )
        if self.token == 0 and self.pair == 0:
            raise ValueError(f"CostModel {self.name!r}: token and pair coefficients are both zero")
        if self.unit not in ("flop", "s"):
            raise ValueError(f"CostModel {self.name!r}: unit must be 'flop' or 's', got {self.unit!r}")
        if self.fit_quality is not None:
            _check_fit_quality(self.fit_quality, self.name)

    def fit_problem(self) -> str | None:
        """Why this profile's prices should not be trusted, or ``None``: it was timed on a CPU (a
        dry run), or its largest held-out error is above :data:`POOR_FIT_ERROR`. Models without
        ``fit_quality`` have none."""
        quality = self.fit_quality or {}
        problems = []
        if quality.get("device") == "cpu":
            problems.append("it was timed on a CPU (a dry run), so its prices are not a GPU's")
        worst = quality.get("held_out_max_error")
        if worst is not None and math.isfinite(worst) and worst > POOR_FIT_ERROR:
            problems.append(f"its held-out timings were off by up to {worst:.0%} (over {POOR_FIT_ERROR:.0%})")
        return "; ".join(problems) or None

    @classmethod
    def from_shape(cls, shape: ModelShape, flops_per_second: float = 4.0e14) -> CostModel:
        """FLOPs of one forward+backward: 6 per weight per token; 4*d*H per pair forward, x3.5."""
        if not isinstance(shape, ModelShape):
            raise PlanError(f"shape must be a ModelShape, got {type(shape).__name__}")
        token = 6.0 * shape.params
        pair = 4.0 * shape.head_dim * shape.heads * 3.5 * shape.layers
        return cls(token=token, pair=pair, unit="flop", name=shape.name, flops_per_second=flops_per_second)

    @classmethod
    def preset(cls, name: str) -> CostModel:
        """The FLOP model (:meth:`from_shape`) of a named :data:`PRESETS` shape; ``ValueError`` if unknown."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return cls.from_shape(PRESETS[name])

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a profile written by :meth:`save` (plain JSON of the fields).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: not UTF-8 JSON, or not a valid profile (:meth:`from_dict`); the message
                names the file.
        """
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            model = cls.from_dict(data)
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ValueError(f"cost profile {path}: {exc}") from exc
        problem = model.fit_problem()
        if problem and str(path) not in _warned_profiles:  # once per file and process
            _warned_profiles.add(str(path))
            logger.warning(
                "cost profile %s: %s; plans balanced by it may be unbalanced on the training GPU "
                "(calibrate there: ringpack calibrate --scope step)",
                path,
                problem,
            )
        return model

    def save(self, path: str | Path) -> None:
        """Write the fields as JSON to ``path`` (what :meth:`load` and ``--cost-profile`` read), with
        ``fit_quality`` when set."""
        data = self.to_dict()
        if self.fit_quality is not None:
            data["fit_quality"] = dict(self.fit_quality)
        Path(path).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")

    def to_dict(self) -> dict[str, Any]:
        """The prices as a JSON-ready dict (what plan hashes cover): ``microbatch`` only when set, so
        hashes of plans without it ignore it; never ``fit_quality``, which does not change a price."""
        out = asdict(self)
        del out["fit_quality"]
        if not out["microbatch"]:
            del out["microbatch"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostModel:
        """The model of :meth:`to_dict`'s fields; ``token`` and ``pair`` are required.

        Raises:
            ValueError: not a mapping, a missing or unknown field (named), or an invalid value.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a cost model must be a JSON object of its fields, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cost model fields {unknown} (known: {sorted(known)})")
        missing = [name for name in ("token", "pair") if name not in data]
        if missing:
            raise ValueError(f"cost model lacks fields {missing}")
        for name in ("unit", "name"):
            if name in data and not isinstance(data[name], str):
                raise ValueError(f"cost model field {name!r} must be a string, got {data[name]!r}")
        return cls(**data)

    def cost(self, tokens: Any, pairs: Any, segments: Any = 0) -> np.ndarray:
        """Cost of ranks in this model's unit.

        Args:
            tokens, pairs, segments: integer arrays (or scalars) of one common broadcast shape.

        Returns:
            float64 array of that shape: ``token*tokens + pair*pairs + segment*segments``.
        """
        return (
            self.token * np.asarray(tokens, dtype=np.float64)
            + self.pair * np.asarray(pairs, dtype=np.float64)
            + self.segment * np.asarray(segments, dtype=np.float64)
        )

    def sample_cost(self, lengths: Any) -> np.ndarray:
        """Cost of whole samples processed on one rank (what packing balances)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return self.cost(lengths, piece_pairs(np.zeros_like(lengths), lengths), np.ones_like(lengths))

    def seconds(self, cost: Any) -> np.ndarray:
        """Predicted seconds for a cost (identity for calibrated profiles)."""
        cost = np.asarray(cost, dtype=np.float64)
        return cost if self.unit == "s" else cost / self.flops_per_second


def _check_fit_quality(quality: Any, name: str) -> None:
    """Refuse a ``fit_quality`` that is not a mapping, or whose checked fields have the wrong type."""
    if not isinstance(quality, Mapping):
        raise ValueError(f"CostModel {name!r}: fit_quality must be a mapping of its fields, got {quality!r}")
    for key in ("held_out_max_error", "held_out_mean_error"):
        value = quality.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, Real)):
            raise ValueError(f"CostModel {name!r}: fit_quality {key} must be a number, got {value!r}")
    device = quality.get("device")
    if device is not None and not isinstance(device, str):
        raise ValueError(f"CostModel {name!r}: fit_quality device must be a string, got {device!r}")


def piece_pairs(start: Any, stop: Any) -> np.ndarray:
    """Exact causal (query, key) pairs of pieces ``[start, stop)``: queries attend keys ``0..q``.

    Args:
        start, stop: integer arrays (or scalars) of one broadcast shape, ``0 <= start <= stop``.

    Returns:
        int64 array of that shape, ``(stop*(stop+1) - start*(start+1)) / 2``: exact.

    Raises:
        PlanError: a ``stop`` above :data:`MAX_SAMPLE_TOKENS`, whose pairs int64 would not hold.
    """
    start = np.asarray(start, dtype=np.int64)
    stop = np.asarray(stop, dtype=np.int64)
    if stop.size and int(stop.max()) > MAX_SAMPLE_TOKENS:
        raise PlanError(
            f"a piece ends at token {int(stop.max()):,}, beyond the {MAX_SAMPLE_TOKENS:,} tokens of the longest sample "
            "whose causal pairs are counted exactly"
        )
    return (stop * (stop + 1) - start * (start + 1)) // 2


def rank_costs(shards: Iterable[Any], model: CostModel) -> np.ndarray:
    """Cost of every rank shard of a micro-batch (one entry per CP rank)."""
    tokens, pairs, segments = [], [], []
    for shard in shards:
        starts, stops = _bounds(shard.pieces)
        tokens.append(int((stops - starts).sum()))
        pairs.append(int(piece_pairs(starts, stops).sum()))
        segments.append(len(starts))
    return model.cost(tokens, pairs, segments)


def scale_to_int(costs: Any, max_value: int = 2**40) -> tuple[np.ndarray, float]:
    """Integer costs for solvers: ``ceil(cost / scale)`` with the largest at most ``max_value``.

    Returns ``(ints, scale)`` so callers can map solver objectives back (``ints * scale``).
    Rounding up keeps every item's integer cost an upper bound of its true cost.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.size and costs.min() < 0:
        raise ValueError("costs must be non-negative")
    top = float(costs.max()) if costs.size else 0.0
    scale = top / max_value if top > 0 else 1.0
    return np.ceil(costs / scale).astype(np.int64), scale


def _bounds(pieces: Iterable[Any]) -> tuple[np.ndarray, np.ndarray]:
    pieces = list(pieces)
    starts = np.fromiter((p.start for p in pieces), dtype=np.int64, count=len(pieces))
    stops = np.fromiter((p.stop for p in pieces), dtype=np.int64, count=len(pieces))
    return starts, stops
