"""The communication model: how long a micro-batch takes once K/V has to travel between CP ranks.

Small on purpose. Which pieces move and what a token weighs is :mod:`ringpack.traffic`'s; this
module turns those bytes into seconds, per layer:

* **ring** (the default runtime): ``C`` ring steps forward (K/V) and backward (K/V and dK/dV,
  twice the bytes), each step's transfer ``latency + B / bandwidth`` for the largest rank's buffer
  ``B``, overlapped with the rank's attention work spread evenly over the steps
  (``ATTN_FORWARD_SHARE`` of it forward); nothing moves when no rank needs another's K/V;
* **all-gather**: a K/V all-gather and a dK/dV reduce-scatter, ``(C-1) * (latency + B / bandwidth)``
  each, not overlapped.

Linear layers never overlap communication. Not modelled (the same for every strategy): the DP
gradient all-reduce, pipeline bubbles, kernel efficiency by segment length.

See docs/analysis.md, "The communication model".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ringpack.cost import PRESETS, CostModel
from ringpack.traffic import kv_bytes_per_token, needed_pieces

__all__ = ["CommModel", "LINKS", "ATTN_FORWARD_SHARE", "kv_cross_tokens", "microbatch_seconds"]

#: Forward share of attention FLOPs in fwd+bwd (backward ~2.5x forward, as in the cost model's 3.5).
ATTN_FORWARD_SHARE = 1.0 / 3.5

#: Named links: (bandwidth bytes/s per direction, latency s per message).
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": (300e9, 10e-6),  # NVLink 4 (H100/H200) point-to-point, achieved
    "ib": (45e9, 20e-6),  # one 400 Gb/s InfiniBand / RoCE NIC per GPU, achieved
    "pcie": (20e9, 15e-6),
}


@dataclass(frozen=True)
class CommModel:
    """Link bandwidth (bytes/s, one direction), per-message latency (s), and the attention mode."""

    bandwidth: float = LINKS["nvlink"][0]
    latency: float = LINKS["nvlink"][1]
    mode: str = "ring"
    kv_bytes_per_token_layer: float = 2 * 8 * 128 * 2  # llama3-8b, bf16
    layers: int = 32

    def __post_init__(self) -> None:
        if self.mode not in ("ring", "allgather"):
            raise ValueError(f"CommModel.mode must be 'ring' or 'allgather', got {self.mode!r}")
        if self.bandwidth <= 0 or self.latency < 0 or self.layers < 1 or self.kv_bytes_per_token_layer < 0:
            raise ValueError("CommModel needs bandwidth > 0, latency >= 0, layers >= 1, kv bytes >= 0")

    @classmethod
    def for_model(
        cls,
        model: CostModel,
        link: str = "nvlink",
        mode: str = "ring",
        dtype_bytes: int = 2,
        bandwidth: float | None = None,
        latency: float | None = None,
    ) -> CommModel:
        """K/V size from the cost model's preset shape (llama3-8b's when the model is not a preset)."""
        shape = PRESETS.get(model.name, PRESETS["llama3-8b"])
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; known: {', '.join(LINKS)}")
        bw, lat = LINKS[link]
        return cls(
            bandwidth=bw if bandwidth is None else bandwidth,
            latency=lat if latency is None else latency,
            mode=mode,
            kv_bytes_per_token_layer=kv_bytes_per_token(shape, dtype_bytes, layers=1),
            layers=shape.layers,
        )

    @property
    def kv_bytes_per_token(self) -> float:
        """K/V bytes of one token over all layers (what one forward moves per needed token)."""
        return self.kv_bytes_per_token_layer * self.layers

    def describe(self) -> str:
        return (
            f"{self.mode}, {self.bandwidth / 1e9:.0f} GB/s, {self.latency * 1e6:.0f} us latency, "
            f"{self.kv_bytes_per_token_layer:.0f} B of K/V per token per layer x {self.layers} layers"
        )


def kv_cross_tokens(arrays: Mapping[str, np.ndarray], shape: tuple[int, int, int] | None = None) -> np.ndarray:
    """Per piece row of a piece table: its tokens if some other CP rank of its micro-batch needs them, else 0.

    The rule and its vectorised implementation are the balancer's
    (:func:`ringpack.traffic.needed_pieces`); this only names the micro-batch of each row.
    """
    step, dp, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    if step.size == 0:
        return np.zeros(0, dtype=np.int64)
    if shape is None:
        shape = (int(step.max()) + 1, int(dp.max()) + 1, int(mb.max()) + 1)
    group = (step * shape[1] + dp) * shape[2] + mb
    start, stop = np.asarray(arrays["start"], dtype=np.int64), np.asarray(arrays["stop"], dtype=np.int64)
    need = needed_pieces(group, arrays["cp"], arrays["sample"], start, stop)
    return np.where(need > 0, stop - start, 0)


def microbatch_seconds(
    tokens: np.ndarray, pairs: np.ndarray, segments: np.ndarray, kv_cross: np.ndarray, model: CostModel, comm: CommModel
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds of each CP rank ``(..., C)`` and exposed communication seconds, per the module's model.

    Arrays have the CP rank as their last axis; ``kv_cross`` counts tokens (all layers' bytes are
    ``kv_cross * comm.kv_bytes_per_token``).
    """
    linear = model.seconds(model.cost(tokens, 0, segments))
    attn = model.seconds(model.cost(0, pairs, 0)) if model.pair else np.zeros(np.shape(pairs))
    cp = np.shape(tokens)[-1]
    largest = (np.asarray(kv_cross, dtype=np.float64) * comm.kv_bytes_per_token_layer).max(axis=-1, keepdims=True)
    moves = largest > 0
    if cp == 1 or not moves.any():
        return linear + attn, np.zeros_like(linear)
    L = comm.layers
    if comm.mode == "ring":
        total = np.zeros_like(attn)
        for share, factor in ((ATTN_FORWARD_SHARE, 1.0), (1.0 - ATTN_FORWARD_SHARE, 2.0)):
            a_step = attn * share / L / cp
            transfer = np.where(moves, comm.latency + factor * largest / comm.bandwidth, 0.0)
            total += L * (a_step + (cp - 1) * np.maximum(a_step, transfer))
        ring = total
    else:
        collective = np.where(moves, (cp - 1) * (comm.latency + largest / comm.bandwidth), 0.0)
        ring = attn + L * 2 * collective
    seconds = linear + ring
    return seconds, seconds - (linear + attn)
