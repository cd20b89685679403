"""The communication model: how long a micro-batch takes once K/V (or heads) travel between CP ranks.

Which pieces move is :mod:`ringpack.traffic`'s; this module turns bytes into seconds, per layer, on
two link classes: within a node (``bandwidth``, ``latency``) and, with ``gpus_per_node``, across
nodes (``inter_bandwidth``, ``inter_latency``). Per mode: **ring**, ``C`` steps of the largest K/V
buffer over the slowest hop, overlapped with attention step by step; **all-gather**, a K/V
all-gather and a dK/dV reduce-scatter, not overlapped; **p2p**, the node-relayed targeted exchange
in two stages, overlapped with attention on the rank's own K/V; **ulysses**, each rank attends
``1 / C`` of the micro-batch's pairs whatever the split, behind four all-to-alls a layer
(:func:`head_parallel_bytes`), none overlapped; the hybrids **ulysses+p2p** / **ulysses+ring**, the
all-to-all within each node and the targeted exchange or the ring between nodes, each rank moving
its heads' share of its node's K/V (:func:`node_exchange_inputs`). Linear layers never overlap
communication; the DP all-reduce is not modelled (docs/analysis.md, "The communication model").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ringpack.cost import PRESETS, CostModel, piece_pairs
from ringpack.modes import HEAD_PARALLEL_MODES as TABLE_HEAD_PARALLEL
from ringpack.modes import MODE_TABLE, SEQUENCE_MODES, check_mode
from ringpack.modes import MODES as TABLE_MODES
from ringpack.traffic import (
    exchange_links,
    exchange_partners,
    exchange_tokens,
    kv_bytes_per_token,
    needed_pieces,
    partners_over_budget,
)

__all__ = [
    "ATTN_FORWARD_SHARE",
    "HEAD_PARALLEL_MODES",
    "LINKS",
    "MODES",
    "PARTNER_BUFFER_BYTES",
    "RELAYOUT_BANDWIDTH",
    "SEQUENCE_MODES",
    "CommModel",
    "ExchangeInputs",
    "ExchangeVolumes",
    "HeadParallelBytes",
    "exchange_inputs",
    "exchange_volumes",
    "fastest_modes",
    "head_parallel_bytes",
    "relayout_bytes",
    "kv_cross_tokens",
    "microbatch_seconds",
    "needs_piece_table",
    "microbatch_partners",
    "node_exchange_inputs",
    "partner_fallback",
    "rank_partners",
    "rank_seconds",
    "ring_fallback",
]

#: Forward share of attention FLOPs in fwd+bwd (backward ~2.5x forward, as in the cost model's 3.5).
ATTN_FORWARD_SHARE = 1.0 / 3.5
#: The modes the model times: every mode of the table (:mod:`ringpack.modes`).
MODES = TABLE_MODES
#: The head-parallel modes, each with the sequence mode it runs between nodes (``None``: the
#: all-to-all spans the CP group).
HEAD_PARALLEL_MODES: dict[str, str | None] = {name: MODE_TABLE[name].across_nodes for name in TABLE_HEAD_PARALLEL}

#: GPU memory NCCL keeps for each point-to-point partner of a rank: its connection buffers, about
#: 12 MiB per channel (``NCCL_BUFFSIZE``'s 4 MiB for the simple protocol plus the low-latency ones;
#: Megatron-LM measured 63 partners x 32 channels x 12 MiB = 23.6 GiB for an all-to-all over 64 ranks),
#: on 2 channels per partner (``NCCL_NCHANNELS_PER_NET_PEER``'s default). An estimate: set
#: ``CommModel.partner_buffer_bytes`` from your NCCL logs.
PARTNER_BUFFER_BYTES = 2 * 12 * 2**20
#: Device-memory bytes/s the head-parallel relayouts achieve: around every all-to-all a rank packs its
#: heads into per-rank blocks before it and puts the received rows in gathered order after it (and the
#: reverse on the way home), each a read and a write of the rows. Measured on one H100 (bf16, 32 query /
#: 8 K/V heads, head_dim 128, ``benchmarks/ulysses_rank.py``): about 120 ns per local token per layer,
#: forward and backward, for 240 KB moved, the stand-in all-to-all's copy included.
RELAYOUT_BANDWIDTH = 2.0e12
#: Named links: (bandwidth bytes/s per direction, latency s per message).
LINKS: dict[str, tuple[float, float]] = {
    "nvlink": (300e9, 10e-6),  # NVLink 4 (H100/H200) point-to-point, achieved
    "ib": (45e9, 20e-6),  # one 400 Gb/s InfiniBand / RoCE NIC per GPU, achieved
    "pcie": (20e9, 15e-6),
}


@dataclass(frozen=True)
class CommModel:
    """Links, the attention mode and the K/V size a token moves.

    Attributes:
        bandwidth, latency: the link between two ranks of one node (bytes/s one direction, s per
            message); every rank pair's link when ``gpus_per_node`` is ``None``.
        mode: one of :data:`MODES`.
        kv_bytes_per_token_layer, layers: K and V bytes of one token in one layer, and the layers.
        gpus_per_node: CP rank ``c`` of a micro-batch is on node ``c // gpus_per_node``; ``None``: flat.
        inter_bandwidth, inter_latency: the link between ranks of two nodes (with ``gpus_per_node``).
        heads, kv_heads: query and K/V heads of the model (what the head-parallel modes split).
        q_bytes_per_token_layer: bytes of one token's Q (and of its O) in one layer, all heads.
        partner_buffer_bytes: GPU memory NCCL holds for each rank this rank exchanges with point to
            point (:data:`PARTNER_BUFFER_BYTES`; read yours from ``NCCL_DEBUG=INFO``).
        relayout_bandwidth: device-memory bytes/s of the head-parallel modes' copies around each
            all-to-all (:data:`RELAYOUT_BANDWIDTH`; :func:`relayout_bytes`).
        max_partners: the plan's partner budget (``PlanConfig.max_partners``; 0: none): under
            ``"p2p"`` a micro-batch whose targeted exchange would give a rank more partners runs
            the ring, and is timed and counted as the ring (:func:`partner_fallback`).

    Raises:
        ValueError: an unknown mode, a bandwidth <= 0, a latency < 0, ``layers < 1``, negative K/V
            or Q bytes, heads < 1, or a ``gpus_per_node`` < 1.
    """

    bandwidth: float = LINKS["nvlink"][0]
    latency: float = LINKS["nvlink"][1]
    mode: str = "ring"
    kv_bytes_per_token_layer: float = 2 * 8 * 128 * 2  # llama3-8b, bf16
    layers: int = 32
    gpus_per_node: int | None = None
    inter_bandwidth: float = LINKS["ib"][0]
    inter_latency: float = LINKS["ib"][1]
    heads: int = 32  # llama3-8b
    kv_heads: int = 8
    q_bytes_per_token_layer: float = 32 * 128 * 2
    partner_buffer_bytes: float = PARTNER_BUFFER_BYTES
    relayout_bandwidth: float = RELAYOUT_BANDWIDTH
    max_partners: int = 0

    def __post_init__(self) -> None:
        check_mode(self.mode, MODES, what="CommModel.mode")
        if self.bandwidth <= 0 or self.latency < 0 or self.layers < 1 or self.kv_bytes_per_token_layer < 0:
            raise ValueError("CommModel needs bandwidth > 0, latency >= 0, layers >= 1, kv bytes >= 0")
        if not (self.heads >= 1 and self.kv_heads >= 1 and self.q_bytes_per_token_layer >= 0):
            raise ValueError("CommModel needs heads >= 1, kv_heads >= 1 and q bytes >= 0")
        if self.inter_bandwidth <= 0 or self.inter_latency < 0:
            raise ValueError("CommModel needs inter_bandwidth > 0 and inter_latency >= 0")
        if not self.relayout_bandwidth > 0:
            raise ValueError(f"CommModel needs relayout_bandwidth > 0, got {self.relayout_bandwidth!r}")
        if not (isinstance(self.max_partners, int) and self.max_partners >= 0):
            raise ValueError(f"CommModel.max_partners must be an integer >= 0, got {self.max_partners!r}")
        if self.gpus_per_node is not None and not (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1):
            raise ValueError(f"CommModel.gpus_per_node must be None or an integer >= 1, got {self.gpus_per_node!r}")

    @classmethod
    def for_model(
        cls,
        model: CostModel,
        link: str = "nvlink",
        mode: str = "ring",
        dtype_bytes: int = 2,
        bandwidth: float | None = None,
        latency: float | None = None,
        gpus_per_node: int | None = None,
        inter_link: str = "ib",
        inter_bandwidth: float | None = None,
        inter_latency: float | None = None,
    ) -> CommModel:
        """K/V size from the cost model's preset shape (llama3-8b's when the model is not a preset);
        ``link`` within a node, ``inter_link`` across nodes of ``gpus_per_node`` (each overridable)."""
        shape = PRESETS.get(model.name, PRESETS["llama3-8b"])
        for name in (link, inter_link):
            if name not in LINKS:
                raise ValueError(f"unknown link {name!r}; known: {', '.join(LINKS)}")
        bw, lat = LINKS[link]
        inter_bw, inter_lat = LINKS[inter_link]
        return cls(
            bandwidth=bw if bandwidth is None else bandwidth,
            latency=lat if latency is None else latency,
            mode=mode,
            kv_bytes_per_token_layer=kv_bytes_per_token(shape, dtype_bytes, layers=1),
            layers=shape.layers,
            gpus_per_node=gpus_per_node,
            inter_bandwidth=inter_bw if inter_bandwidth is None else inter_bandwidth,
            inter_latency=inter_lat if inter_latency is None else inter_latency,
            heads=shape.heads,
            kv_heads=shape.kv_heads,
            q_bytes_per_token_layer=shape.heads * shape.head_dim * dtype_bytes,
        )

    @property
    def kv_bytes_per_token(self) -> float:
        """K/V bytes of one token over all layers (what one forward moves per needed token)."""
        return self.kv_bytes_per_token_layer * self.layers

    def node_size(self, cp: int) -> int:
        """Ranks of a CP group of ``cp`` that share a node: ``min(cp, gpus_per_node)`` (``cp`` when flat)."""
        return cp if self.gpus_per_node is None else min(cp, self.gpus_per_node)

    def all_to_all_size(self, cp: int) -> int:
        """Ranks of one all-to-all of a head-parallel mode over a CP group of ``cp``: the group for
        ``"ulysses"``, a node for the hybrids; 0 for the sequence-split modes."""
        if self.mode not in HEAD_PARALLEL_MODES:
            return 0
        return cp if HEAD_PARALLEL_MODES[self.mode] is None else self.node_size(cp)

    def unfit_reason(self, cp: int) -> str:
        """Why this mode cannot run a CP group of ``cp`` ranks, in one clause, or ``""``: a
        head-parallel all-to-all needs the query heads to be a multiple of its ranks, and a hybrid
        whole nodes, more than one."""
        size = self.all_to_all_size(cp)
        if not size:
            return ""
        if HEAD_PARALLEL_MODES[self.mode] is not None:
            if self.gpus_per_node is None or cp <= self.gpus_per_node:
                return f"{self.mode} needs a CP group over several nodes (cp={cp} fits one)"
            if cp % self.gpus_per_node:
                return f"{self.mode} needs whole nodes: cp={cp} is not a multiple of {self.gpus_per_node}"
        if self.heads % size:
            return f"{self.mode} splits {self.heads} query heads over {size} ranks: not a multiple"
        return ""

    def to_dict(self) -> dict[str, float | int | str]:
        """The fields as a JSON-ready dict; the links between nodes only with ``gpus_per_node``, the
        heads only for a head-parallel mode."""
        out = dict(self.__dict__)
        if self.gpus_per_node is None:
            for name in ("gpus_per_node", "inter_bandwidth", "inter_latency"):
                del out[name]
        if self.mode not in HEAD_PARALLEL_MODES:
            for name in ("heads", "kv_heads", "q_bytes_per_token_layer", "relayout_bandwidth"):
                del out[name]
        elif self.relayout_bandwidth == RELAYOUT_BANDWIDTH:
            del out["relayout_bandwidth"]
        if self.partner_buffer_bytes == PARTNER_BUFFER_BYTES:
            del out["partner_buffer_bytes"]
        if not self.max_partners:
            del out["max_partners"]
        return out

    def describe(self) -> str:
        text = (
            f"{self.mode}, {self.bandwidth / 1e9:.0f} GB/s, {self.latency * 1e6:.0f} us latency, "
            f"{self.kv_bytes_per_token_layer:.0f} B of K/V per token per layer x {self.layers} layers"
        )
        if self.mode in HEAD_PARALLEL_MODES:
            text += f", {self.heads} query heads, {self.kv_heads} K/V heads, {self.q_bytes_per_token_layer:.0f} B of Q"
        if self.gpus_per_node is not None:
            text += (
                f"; across nodes of {self.gpus_per_node} GPUs {self.inter_bandwidth / 1e9:.0f} GB/s, "
                f"{self.inter_latency * 1e6:.0f} us"
            )
        return text


@dataclass(frozen=True)
class ExchangeVolumes:
    """What each CP rank moves in the targeted exchange and how much of its attention waits for it.

    Every array has the shape of the rank arrays it goes with (CP rank last); tokens of one layer's
    forward, as :func:`ringpack.traffic.exchange_tokens` counts them for the node-relayed exchange:

    * ``send_intra`` / ``recv_intra``: pieces sent to / received from ranks of the same node, directly;
    * ``send_inter`` / ``recv_inter``: pieces crossing nodes, once per receiving node (received by
      that node's proxy);
    * ``relay_send`` / ``relay_recv``: pieces a proxy forwards to / a rank gets from its node's proxy;
    * ``remote_intra_pairs`` / ``remote_inter_pairs``: the rank's causal pairs whose key is on another
      rank of its node / on another node (the rest run on its own K/V, during the exchange);
      :attr:`remote_pairs` is their sum.

    Flat (no ``gpus_per_node``): everything is ``_intra``, the relays and ``_inter`` arrays are 0.
    """

    send_intra: np.ndarray
    send_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    relay_send: np.ndarray
    relay_recv: np.ndarray
    remote_intra_pairs: np.ndarray
    remote_inter_pairs: np.ndarray

    @property
    def remote_pairs(self) -> np.ndarray:
        """The rank's causal pairs whose key is on another rank: ``remote_intra_pairs + remote_inter_pairs``."""
        return self.remote_intra_pairs + self.remote_inter_pairs

    @classmethod
    def concat(cls, parts: Sequence[ExchangeVolumes]) -> ExchangeVolumes:
        """The steps of several ``(S, D, M, C)`` volumes one after another, the micro-batch axis
        padded to the widest (as :func:`~ringpack.analysis.metrics.concat_metrics` pads the metrics)."""
        M = max(p.send_intra.shape[2] for p in parts)

        def stacked(name: str) -> np.ndarray:
            arrays = [getattr(p, name) for p in parts]
            return np.concatenate([np.pad(a, [(0, 0), (0, 0), (0, M - a.shape[2]), (0, 0)]) for a in arrays])

        return cls(**{f.name: stacked(f.name) for f in dataclasses.fields(cls)})


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


def exchange_volumes(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], gpus_per_node: int | None = None
) -> ExchangeVolumes:
    """The targeted exchange of every rank of a piece table, as ``(S, D, M, C)`` arrays (:class:`ExchangeVolumes`).

    Args:
        arrays: the plan's piece table (``Plan.piece_arrays`` columns).
        cp: CP ranks of a micro-batch (``C``).
        shape: ``(S, D, M)``, the grid of micro-batches.
        gpus_per_node: nodes of that many CP ranks, node-relayed (``None``: one node, every byte
            and pair ``_intra``).

    A piece's local pairs are its own causal pairs and those against the same sample's earlier
    pieces on the same rank; its remote pairs against earlier pieces on other ranks of its node are
    ``_intra``, the rest (earlier pieces on other nodes) ``_inter``.
    """
    step, dp, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    c, sample = np.asarray(arrays["cp"], dtype=np.int64), np.asarray(arrays["sample"], dtype=np.int64)
    start, stop = np.asarray(arrays["start"], dtype=np.int64), np.asarray(arrays["stop"], dtype=np.int64)
    S, D, M = shape
    cell = (step * D + dp) * M + mb
    moved = _moved_in_blocks(cell, c, sample, start, stop, S * D * M, cp, gpus_per_node)
    length = stop - start
    on_rank = _earlier_tokens(cell, sample, c, start, length)
    remote = piece_pairs(start, stop) - (length * (length + 1) // 2 + length * on_rank)
    if gpus_per_node is None:
        intra = remote
    else:
        intra = length * (_earlier_tokens(cell, sample, c // gpus_per_node, start, length) - on_rank)
    grid = (S, D, M, cp)

    def per_rank(values: np.ndarray) -> np.ndarray:
        out = np.zeros(S * D * M * cp, dtype=np.int64)
        np.add.at(out, cell * cp + c, values)
        return out.reshape(grid)

    names = ("send_intra", "send_inter", "recv_intra", "recv_inter", "relay_send", "relay_recv")
    return ExchangeVolumes(*(moved[k].reshape(grid) for k in names), per_rank(intra), per_rank(remote - intra))


#: Most (piece, receiving rank) pairs :func:`exchange_volumes` holds at once (memory in the pairs;
#: a zigzag over a large group needs every piece on almost every rank).
PAIR_BLOCK = 1 << 22


def _moved_in_blocks(cell, c, sample, start, stop, cells: int, cp: int, gpus_per_node: int | None) -> dict:
    """:func:`~ringpack.traffic.exchange_tokens` of the pieces, a block of micro-batches (``cell``) at
    a time, each block of at most :data:`PAIR_BLOCK` pairs (one micro-batch at least)."""
    names = ("send_intra", "send_inter", "recv_intra", "recv_inter", "relay_send", "relay_recv")
    out = {name: np.zeros((cells, cp), dtype=np.int64) for name in names}
    if not cell.size:
        return out
    if (np.diff(cell) < 0).any():  # the sums do not depend on the order
        order = np.argsort(cell, kind="stable")
        cell, c, sample, start, stop = (x[order] for x in (cell, c, sample, start, stop))
    pairs = np.cumsum(needed_pieces(cell, c, sample, start, stop))
    heads = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    ends = np.r_[heads[1:], cell.size]
    lo = 0
    while lo < heads.size:
        done = pairs[heads[lo] - 1] if heads[lo] else 0
        hi = max(lo + 1, int(np.searchsorted(pairs[ends - 1], done + PAIR_BLOCK, side="right")))
        a, b = heads[lo], ends[hi - 1]
        first = cell[a]
        block = cell[a:b] - first
        width = int(block[-1]) + 1
        got = exchange_tokens(block, c[a:b], sample[a:b], start[a:b], stop[a:b], width, cp, gpus_per_node)
        for name in names:
            out[name][first : first + width] = got[name]
        lo = hi
    return out


def _earlier_tokens(
    cell: np.ndarray, sample: np.ndarray, holder: np.ndarray, start: np.ndarray, length: np.ndarray
) -> np.ndarray:
    """Per piece: tokens of its sample's earlier pieces in its micro-batch ``cell`` held by the same
    ``holder`` (a CP rank, or a node), int64 ``[n]``."""
    order = np.lexsort((start, holder, sample, cell))
    run = np.ones(len(order), dtype=bool)
    if len(order):
        key = np.stack([cell[order], sample[order], holder[order]])
        run[1:] = (key[:, 1:] != key[:, :-1]).any(axis=0)
    before = np.cumsum(length[order]) - length[order]
    base = np.maximum.accumulate(np.where(run, before, 0))
    earlier = np.empty_like(length)
    earlier[order] = before - base
    return earlier


def microbatch_seconds(
    tokens: np.ndarray,
    pairs: np.ndarray,
    segments: np.ndarray,
    kv_cross: np.ndarray | None,
    model: CostModel,
    comm: CommModel,
    volumes: ExchangeVolumes | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Predicted seconds of each CP rank ``(..., C)`` and exposed communication seconds, per the module's model.

    Arrays have the CP rank as their last axis; ``kv_cross`` counts tokens (all layers' bytes are
    ``kv_cross * comm.kv_bytes_per_token``). ``volumes`` (:func:`exchange_volumes`) is what mode
    ``"p2p"`` times; ``"ring"`` and ``"allgather"`` time ``kv_cross``; ``"ulysses"`` neither. The
    hybrids take both at node granularity, as :func:`node_exchange_inputs` gives them
    (``kv_cross`` ``(..., C / gpus_per_node)`` for ``"ulysses+ring"``, node-level ``volumes`` for
    ``"ulysses+p2p"``). Exposed communication is what the step spends beyond the compute of its mode
    (under a head-parallel mode, a rank's attention is its all-to-all group's pairs over the group).

    Raises:
        ValueError: a mode without the inputs it times, a head-parallel mode that cannot run
            ``C`` ranks (:meth:`CommModel.unfit_reason`), or a mode of :data:`MODES` without a
            formula here.
    """
    linear = model.seconds(model.cost(tokens, 0, segments))
    if comm.mode in HEAD_PARALLEL_MODES:
        return _head_parallel_seconds(tokens, pairs, linear, kv_cross, model, comm, volumes)
    attn = _attention_seconds(model, pairs)
    seconds = linear + _exchange_attention(attn, pairs, kv_cross, volumes, comm)
    return seconds, seconds - (linear + attn)


def _attention_seconds(model: CostModel, pairs: np.ndarray) -> np.ndarray:
    return model.seconds(model.cost(0, pairs, 0)) if model.pair else np.zeros(np.shape(pairs))


def _exchange_attention(
    attn: np.ndarray, pairs: np.ndarray, kv_cross: np.ndarray | None, volumes: ExchangeVolumes | None, comm: CommModel
) -> np.ndarray:
    """Attention seconds of each rank ``(..., C)`` with a sequence-split mode's K/V exchange."""
    if comm.mode == "p2p":
        if volumes is None:
            raise ValueError("the p2p communication model needs the exchange volumes (exchange_volumes)")
        return _p2p_attention(attn, pairs, volumes, comm)
    if kv_cross is None:
        raise ValueError(f"the {comm.mode} communication model needs the K/V each rank sends (kv_cross)")
    cp = np.shape(attn)[-1]
    largest = (np.asarray(kv_cross, dtype=np.float64) * comm.kv_bytes_per_token_layer).max(axis=-1, keepdims=True)
    moves = largest > 0
    if cp == 1 or not moves.any():
        return attn
    L = comm.layers
    node = comm.node_size(cp)
    if comm.mode == "ring":
        # a ring over several nodes has a hop between nodes: every step waits for it
        bw, lat = (comm.bandwidth, comm.latency) if node == cp else (comm.inter_bandwidth, comm.inter_latency)
        total = np.zeros_like(attn)
        for share, factor in ((ATTN_FORWARD_SHARE, 1.0), (1.0 - ATTN_FORWARD_SHARE, 2.0)):
            a_step = attn * share / L / cp
            transfer = np.where(moves, lat + factor * largest / bw, 0.0)
            total += L * (a_step + (cp - 1) * np.maximum(a_step, transfer))
        return total
    if comm.mode != "allgather":  # a sequence mode of the table without a formula here
        raise ValueError(f"the communication model has no price for mode {comm.mode!r}")
    # the node's other ranks' buffers over the node's links, the other nodes' over the links between
    collective = (node - 1) * (comm.latency + largest / comm.bandwidth)
    if node < cp:
        collective = collective + (cp - node) * largest / comm.inter_bandwidth + (cp // node - 1) * comm.inter_latency
    return attn + L * 2 * np.where(moves, collective, 0.0)


@dataclass(frozen=True)
class HeadParallelBytes:
    """Bytes each rank sends and receives in one layer's forward all-to-alls of a head-parallel mode.

    Arrays of the tokens' shape (CP rank last). ``qkv_send`` / ``qkv_recv``: this rank's tokens'
    Q, K and V of the other ranks' heads out, the other tokens' Q, K and V of its heads in;
    ``o_send`` / ``o_recv``: the outputs home. The backward mirrors both (dO travels as O came back,
    dQ, dK, dV as Q, K, V went), so over forward and backward a rank sends what it receives.
    """

    qkv_send: np.ndarray
    qkv_recv: np.ndarray
    o_send: np.ndarray
    o_recv: np.ndarray

    @property
    def per_layer(self) -> np.ndarray:
        """Bytes a rank sends in one layer, forward and backward (the same it receives)."""
        return self.qkv_send + self.qkv_recv + self.o_send + self.o_recv


def head_parallel_bytes(tokens: np.ndarray, comm: CommModel, size: int) -> HeadParallelBytes:
    """The all-to-all bytes of every rank (:class:`HeadParallelBytes`) over groups of ``size``
    consecutive CP ranks (the last axis of ``tokens``, a multiple of ``size``).

    Each token moves ``(size - 1) / size`` of its Q, K and V (its rank keeps its own heads' share) and
    takes the same share of O home. K/V heads go replicated when ``size`` does not divide
    ``kv_heads``: ``lcm(kv_heads, size)`` heads' worth, as the runtime sends them.
    """
    t = np.asarray(tokens, dtype=np.float64)
    group = _group_sum(t, size)
    kv = _sent_kv_bytes(comm, size)
    q = comm.q_bytes_per_token_layer
    own, others = t * (size - 1) / size, (group - t) / size
    return HeadParallelBytes(own * (q + kv), others * (q + kv), others * q, own * q)


def relayout_bytes(tokens: np.ndarray, comm: CommModel, size: int) -> np.ndarray:
    """Device-memory bytes every rank's head-parallel relayouts read and write per micro-batch, all
    layers, forward and backward, over groups of ``size`` consecutive CP ranks (``tokens``' last axis).

    Per layer and pass, a rank packs its own rows' Q, K and V (K/V replicated as sent) into blocks and
    puts its heads' share of the group's rows in gathered order, then the reverse for O (dO, and dQ,
    dK, dV on the way back): each a read and a write, of ``tokens`` rows before and after the
    all-to-all and of ``group / size`` rows at the gathered side. The all-to-all itself is the link's.
    """
    t = np.asarray(tokens, dtype=np.float64)
    rows = t + _group_sum(t, size) / size
    q_and_o = 2 * comm.q_bytes_per_token_layer
    return comm.layers * 2 * 2 * rows * (q_and_o + _sent_kv_bytes(comm, size))


def _sent_kv_bytes(comm: CommModel, size: int) -> float:
    """K and V bytes of one token and layer as a head-parallel all-to-all over ``size`` ranks sends
    them: ``lcm(kv_heads, size)`` heads' worth, the runtime's replicas when ``size`` does not divide them."""
    return comm.kv_bytes_per_token_layer * math.lcm(comm.kv_heads, size) / comm.kv_heads


def _group_sum(x: np.ndarray, size: int) -> np.ndarray:
    """Each rank's value replaced by the sum over its group of ``size`` consecutive ranks (last axis)."""
    shape = np.shape(x)
    sums = np.asarray(x).reshape(*shape[:-1], shape[-1] // size, size).sum(axis=-1)
    return np.repeat(sums, size, axis=-1)


def _all_to_all_seconds(send: np.ndarray, recv: np.ndarray, size: int, comm: CommModel) -> np.ndarray:
    """One all-to-all over ``size`` consecutive ranks: each rank's larger direction over its links,
    the share bound for other nodes (spread evenly over the partners) on the links between them."""
    moved = np.maximum(send, recv)
    node = comm.node_size(size)
    if node == size:
        return np.where(moved > 0, comm.latency + moved / comm.bandwidth, 0.0)
    across = (size - node) / (size - 1)
    within = comm.latency + moved * (1.0 - across) / comm.bandwidth
    between = comm.inter_latency + moved * across / comm.inter_bandwidth
    return np.where(moved > 0, np.maximum(within, between), 0.0)


def _head_parallel_seconds(tokens, pairs, linear, kv_cross, model: CostModel, comm: CommModel, volumes):
    """:func:`microbatch_seconds` of a head-parallel mode (see the module docstring)."""
    cp = np.shape(tokens)[-1]
    unfit = comm.unfit_reason(cp)
    if unfit:
        raise ValueError(unfit)
    size = comm.all_to_all_size(cp)
    group_pairs = _group_sum(np.asarray(pairs, dtype=np.float64), size)
    attn = _attention_seconds(model, group_pairs / size)
    moved = head_parallel_bytes(tokens, comm, size)
    pair_of_all_to_alls = _all_to_all_seconds(moved.qkv_send, moved.qkv_recv, size, comm) + _all_to_all_seconds(
        moved.o_send, moved.o_recv, size, comm
    )
    heads_moved = comm.layers * 2 * pair_of_all_to_alls  # the backward mirrors the forward
    heads_moved = heads_moved + relayout_bytes(tokens, comm, size) / comm.relayout_bandwidth
    between = attn
    inner = HEAD_PARALLEL_MODES[comm.mode]
    if inner is not None:
        kv_share = _sent_kv_bytes(comm, size) / size
        nodes = dataclasses.replace(
            comm,
            mode=inner,
            bandwidth=comm.inter_bandwidth,
            latency=comm.inter_latency,
            gpus_per_node=None,
            kv_bytes_per_token_layer=kv_share,
        )
        per_node = _exchange_attention(attn[..., ::size], group_pairs[..., ::size], kv_cross, volumes, nodes)
        between = np.repeat(per_node, size, axis=-1)
    seconds = linear + between + heads_moved
    return seconds, seconds - (linear + attn)


def rank_seconds(
    arrays: Mapping[str, np.ndarray],
    cp: int,
    shape: tuple[int, int, int],
    model: CostModel,
    comm: CommModel,
    inputs: ExchangeInputs | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`microbatch_seconds` of every rank of a piece table under ``comm``'s mode: ``(seconds,
    exposed)``, each ``(S, D, M, C)``.

    Args:
        arrays: the piece table (``step``, ``dp``, ``microbatch``, ``cp``, ``sample``, ``start``,
            ``stop`` columns, as ``Plan.piece_arrays``).
        cp: CP ranks of a micro-batch (``C``).
        shape: ``(S, D, M)``, the grid of micro-batches.
        model, comm: the cost and communication models.
        inputs: the table's :func:`exchange_inputs` under ``comm``, when the caller has them
            (default: computed here).

    Raises:
        ValueError: as :func:`microbatch_seconds`.
    """
    S, D, M = shape
    step, dp, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    start, stop = np.asarray(arrays["start"], dtype=np.int64), np.asarray(arrays["stop"], dtype=np.int64)
    flat = ((step * D + dp) * M + mb) * cp + np.asarray(arrays["cp"], dtype=np.int64)

    def per_rank(values: np.ndarray) -> np.ndarray:
        out = np.zeros(S * D * M * cp, dtype=np.int64)
        np.add.at(out, flat, values)
        return out.reshape(S, D, M, cp)

    tokens, pairs, segments = per_rank(stop - start), per_rank(piece_pairs(start, stop)), per_rank(np.ones_like(start))
    inputs = exchange_inputs(arrays, cp, shape, comm) if inputs is None else inputs
    cross = inputs.kv_cross
    if comm.mode in ("ring", "allgather"):  # per rank, from the per-rank figures
        cross = per_rank(kv_cross_tokens(arrays, shape=shape))
    seconds, exposed = microbatch_seconds(tokens, pairs, segments, cross, model, comm, inputs.volumes)
    if inputs.fallback is None or not inputs.fallback.any():
        return seconds, exposed
    cross = per_rank(kv_cross_tokens(arrays, shape=shape))
    return ring_fallback(seconds, exposed, inputs.fallback, tokens, pairs, segments, cross, model, comm)


def ring_fallback(
    seconds: np.ndarray,
    exposed: np.ndarray,
    fallback: np.ndarray,
    tokens: np.ndarray,
    pairs: np.ndarray,
    segments: np.ndarray,
    kv_cross: np.ndarray,
    model: CostModel,
    comm: CommModel,
) -> tuple[np.ndarray, np.ndarray]:
    """``(seconds, exposed)`` of :func:`microbatch_seconds` with the micro-batches marked in
    ``fallback`` (bool ``(S, D, M)``, :func:`partner_fallback`) timed as the ring they run; the
    per-rank figures ``(S, D, M, C)`` (``kv_cross``: the tokens of each rank another rank needs)."""
    ring = dataclasses.replace(comm, mode="ring")
    ring_seconds, ring_exposed = microbatch_seconds(tokens, pairs, segments, kv_cross, model, ring)
    mark = np.asarray(fallback, dtype=bool)[..., None]
    return np.where(mark, ring_seconds, seconds), np.where(mark, ring_exposed, exposed)


def partner_fallback(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], comm: CommModel
) -> np.ndarray:
    """Which micro-batches of a piece table run the ring instead of ``comm``'s ``"p2p"``: those whose
    targeted exchange would give a rank more than ``comm.max_partners`` partners
    (:func:`~ringpack.traffic.over_partner_budget`, the runtime's rule), bool ``(S, D, M)``; all
    False under another mode or without a budget. Arguments as for :func:`rank_seconds`."""
    if comm.mode != "p2p" or not comm.max_partners or cp - 1 <= comm.max_partners:
        return np.zeros(shape, dtype=bool)
    return partners_over_budget(_p2p_partners(arrays, cp, shape, comm), comm.max_partners)


def _p2p_partners(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], comm: CommModel
) -> np.ndarray:
    """Each rank's targeted-exchange partners in each micro-batch, no budget: int64 ``(S, D, M, C)``."""
    S, D, M = shape
    cell, columns = _cells(arrays, shape)
    return exchange_partners(cell, *columns, S * D * M, cp, comm.gpus_per_node).reshape(S, D, M, cp)


def _cells(arrays: Mapping[str, np.ndarray], shape: tuple[int, int, int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each piece's micro-batch as one index ``(step * D + dp) * M + microbatch``, and its ``cp``,
    ``sample``, ``start`` and ``stop`` columns (int64)."""
    _, D, M = shape
    step, dp, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    return (step * D + dp) * M + mb, [np.asarray(arrays[k], dtype=np.int64) for k in ("cp", "sample", "start", "stop")]


def microbatch_partners(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], comm: CommModel
) -> np.ndarray:
    """How many other ranks each rank exchanges with in each micro-batch under ``comm``'s mode, int64
    ``(S, D, M, C)``: what the partner budget bounds under ``"p2p"`` (a micro-batch over it counts
    the ring's 2). The other modes as :func:`rank_partners` counts them, per micro-batch. Arguments
    as for :func:`rank_seconds`."""
    S, D, M = shape
    if comm.mode != "p2p":
        return np.broadcast_to(rank_partners(arrays, cp, shape, comm)[None, :, None, :], (S, D, M, cp)).copy()
    counts = _p2p_partners(arrays, cp, shape, comm)
    return np.where(partners_over_budget(counts, comm.max_partners)[..., None], min(2, cp - 1), counts)


def fastest_modes(
    arrays: Mapping[str, np.ndarray],
    cp: int,
    shape: tuple[int, int, int],
    model: CostModel,
    comm: CommModel,
    modes: Sequence[str] = MODES,
    fallback: np.ndarray | None = None,
) -> np.ndarray:
    """Per micro-batch of a piece table, the index into ``modes`` of the fastest (the slowest rank's
    predicted seconds; a tie to the earlier mode), int64 ``(S, D, M)``.

    Modes that cannot run a CP group of ``cp`` (:meth:`CommModel.unfit_reason`) are never picked.
    Deterministic: every rank computes the same answer from the same micro-batch. ``fallback``: the
    micro-batches over the partner budget, where already decided (:func:`exchange_inputs`).

    Raises:
        ValueError: an unknown mode, or no mode of ``modes`` that can run ``cp`` ranks.
    """
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"modes must be some of {MODES}, got {list(modes)!r}")
    times = np.full((len(modes), *shape), np.inf)
    unfit = []
    for i, mode in enumerate(modes):
        link = dataclasses.replace(comm, mode=mode)
        reason = link.unfit_reason(cp)
        if reason:
            unfit.append(reason)
        else:
            inputs = exchange_inputs(arrays, cp, shape, link, fallback) if mode == "p2p" else None
            times[i] = rank_seconds(arrays, cp, shape, model, link, inputs)[0].max(axis=-1)
    if len(unfit) == len(modes):
        raise ValueError(f"no mode of {list(modes)} can run a CP group of {cp}: " + "; ".join(unfit))
    return np.argmin(times, axis=0)


def needs_piece_table(comm: CommModel) -> bool:
    """Whether ``comm``'s mode is timed from a plan's piece table (:func:`exchange_inputs`), not
    from per-rank figures alone: the targeted exchange and the hybrids."""
    return comm.mode == "p2p" or HEAD_PARALLEL_MODES.get(comm.mode) is not None


@dataclass(frozen=True)
class ExchangeInputs:
    """What :func:`microbatch_seconds` needs from a piece table beyond the per-rank figures:
    ``kv_cross`` (``"ulysses+ring"``: per node, ``(S, D, M, nodes)``) and ``volumes`` (``"p2p"``:
    per rank; ``"ulysses+p2p"``: per node), either None where the mode does not read it. Under
    ``"p2p"`` also ``partners`` (each rank's partners per micro-batch, int64 ``(S, D, M, C)``, the
    ring's 2 where it runs the ring) and ``fallback`` (bool ``(S, D, M)``: the micro-batches over the
    partner budget, timed as the ring, :func:`partner_fallback`)."""

    kv_cross: np.ndarray | None = None
    volumes: ExchangeVolumes | None = None
    fallback: np.ndarray | None = None
    partners: np.ndarray | None = None

    @classmethod
    def concat(cls, parts: Sequence[ExchangeInputs]) -> ExchangeInputs:
        """The steps of several chunks' inputs one after another, the micro-batch axis padded to the
        widest (as :meth:`ExchangeVolumes.concat`)."""
        cross = [p.kv_cross for p in parts]
        volumes = [p.volumes for p in parts]
        joined = None
        if all(c is not None for c in cross) and cross:
            M = max(c.shape[2] for c in cross)
            joined = np.concatenate([np.pad(c, [(0, 0), (0, 0), (0, M - c.shape[2]), (0, 0)]) for c in cross])
        both = all(v is not None for v in volumes) and volumes
        M = max((p.partners.shape[2] for p in parts if p.partners is not None), default=0)

        def padded(name: str, fill) -> np.ndarray | None:
            arrays = [getattr(p, name) for p in parts]
            if not arrays or any(a is None for a in arrays):
                return None
            pad = [(0, 0), (0, 0)]
            return np.concatenate(
                [np.pad(a, [*pad, (0, M - a.shape[2])] + [(0, 0)] * (a.ndim - 3), constant_values=fill) for a in arrays]
            )

        return cls(
            joined,
            ExchangeVolumes.concat(volumes) if both else None,
            padded("fallback", False),
            padded("partners", 0),
        )


def exchange_inputs(
    arrays: Mapping[str, np.ndarray],
    cp: int,
    shape: tuple[int, int, int],
    comm: CommModel,
    fallback: np.ndarray | None = None,
) -> ExchangeInputs:
    """``comm``'s :class:`ExchangeInputs` of a piece table: the targeted exchange's volumes
    (:func:`exchange_volumes`) for ``"p2p"``, the node-level inputs (:func:`node_exchange_inputs`)
    for the hybrids, nothing for the other modes. Arguments as for :func:`rank_seconds`;
    ``fallback`` (bool ``(S, D, M)``): under ``"p2p"``, the micro-batches over the partner budget
    where the caller already knows them (the planner decided them), so the partners are not counted
    again and ``partners`` is left None; None: counted here."""
    if comm.mode == "p2p":
        partners = None
        if fallback is None:
            raw = _p2p_partners(arrays, cp, shape, comm)
            fallback = partners_over_budget(raw, comm.max_partners)
            partners = np.where(fallback[..., None], min(2, cp - 1), raw)
        volumes = exchange_volumes(arrays, cp, shape, comm.gpus_per_node)
        return ExchangeInputs(volumes=volumes, fallback=np.asarray(fallback, dtype=bool), partners=partners)
    return ExchangeInputs(*node_exchange_inputs(arrays, cp, shape, comm))


def rank_partners(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], comm: CommModel
) -> np.ndarray:
    """How many other ranks each rank exchanges with under ``comm``'s mode over all the micro-batches
    of a piece table, int64 ``(D, C)`` (DP rank, CP rank).

    NCCL keeps a rank's connection buffers to every rank it has exchanged with, so over a run a
    rank holds ``partners * comm.partner_buffer_bytes`` of them, the union over its
    micro-batches. ``"ring"`` and ``"allgather"``: the ring's 2 neighbours; ``"p2p"``: the targeted
    exchange's partners, relays included (:func:`ringpack.traffic.exchange_links`); ``"ulysses"``:
    the rest of the group; the hybrids: the rest of the node plus, between nodes, the ring's 2 or the
    node-level targeted exchange's partners. 0 on a CP group of one rank. Arguments as for
    :func:`rank_seconds`.
    """
    D = shape[1]
    if cp == 1:
        return np.zeros((D, cp), dtype=np.int64)
    size = comm.all_to_all_size(cp)
    between = HEAD_PARALLEL_MODES.get(comm.mode)
    if comm.mode in ("ring", "allgather"):
        return np.full((D, cp), min(2, cp - 1), dtype=np.int64)
    if comm.mode == "p2p":
        return _partners_over_steps(arrays, cp, shape, comm.gpus_per_node, partner_fallback(arrays, cp, shape, comm))
    if between is None:  # ulysses: every other rank of the group
        return np.full((D, cp), cp - 1, dtype=np.int64)
    nodes = cp // size
    if between == "ring":
        across = np.full((D, nodes), min(2, nodes - 1), dtype=np.int64)
    else:
        by_node = {**arrays, "cp": np.asarray(arrays["cp"], dtype=np.int64) // size}
        across = _partners_over_steps(by_node, nodes, shape, None)
    return size - 1 + np.repeat(across, size, axis=-1)


def _partners_over_steps(
    arrays: Mapping[str, np.ndarray],
    cp: int,
    shape: tuple[int, int, int],
    node: int | None,
    ring: np.ndarray | None = None,
):
    """:func:`~ringpack.traffic.exchange_links` of every micro-batch, the distinct partners of each
    ``(DP rank, CP rank)`` over all of them, int64 ``(D, C)``; the micro-batches marked in ``ring``
    (bool ``(S, D, M)``) count the ring's neighbours instead."""
    _, D, M = shape
    cell, columns = _cells(arrays, shape)
    if ring is not None and ring.any():
        keep = ~ring.reshape(-1)[cell]
        cell, columns = cell[keep], [c[keep] for c in columns]
    cell, rank, partner = exchange_links(cell, *columns, cp, node)
    links = (cell // M % D * cp + rank) * cp + partner
    if ring is not None and ring.any():
        dp = np.unique(np.flatnonzero(ring.reshape(-1)) // M % D)
        ranks = np.arange(cp, dtype=np.int64)
        rows = (dp[:, None] * cp + ranks) * cp
        links = np.concatenate([links, (rows + (ranks + 1) % cp).ravel(), (rows + (ranks - 1) % cp).ravel()])
    links = np.unique(links)
    return np.bincount(links // cp, minlength=D * cp).astype(np.int64).reshape(D, cp)


def node_exchange_inputs(
    arrays: Mapping[str, np.ndarray], cp: int, shape: tuple[int, int, int], comm: CommModel
) -> tuple[np.ndarray | None, ExchangeVolumes | None]:
    """A hybrid mode's exchange between nodes, for :func:`microbatch_seconds`: ``(kv_cross, volumes)``.

    Args:
        arrays: the plan's piece table (``Plan.piece_arrays`` columns).
        cp: CP ranks of a micro-batch, whole nodes of ``comm.gpus_per_node``.
        shape: ``(S, D, M)``, the grid of micro-batches.
        comm: the links and mode.

    Returns:
        For ``"ulysses+ring"``: the tokens each node's K/V another node needs, ``(S, D, M, nodes)``,
        and None; for ``"ulysses+p2p"``: None and the targeted exchange between nodes taken as ranks
        (flat, :func:`exchange_volumes`); ``(None, None)`` for every other mode.
    """
    inner = HEAD_PARALLEL_MODES.get(comm.mode)
    if inner is None or comm.unfit_reason(cp):
        return None, None
    node = comm.all_to_all_size(cp)
    nodes = cp // node
    by_node = {**arrays, "cp": np.asarray(arrays["cp"], dtype=np.int64) // node}
    if inner == "p2p":
        return None, exchange_volumes(by_node, nodes, shape, None)
    S, D, M = shape
    cell = (np.asarray(arrays["step"], dtype=np.int64) * D + np.asarray(arrays["dp"], dtype=np.int64)) * M
    cell = cell + np.asarray(arrays["microbatch"], dtype=np.int64)
    out = np.zeros(S * D * M * nodes, dtype=np.int64)
    np.add.at(out, cell * nodes + by_node["cp"], kv_cross_tokens(by_node, shape=shape))
    return out.reshape(S, D, M, nodes), None


def _p2p_attention(attn: np.ndarray, pairs: np.ndarray, volumes: ExchangeVolumes, comm: CommModel) -> np.ndarray:
    """Attention seconds with the staged targeted exchange, per layer and direction.

    Link times of a rank, each ``latency + max(sent, received) / bandwidth`` on its class (0 when
    it moves nothing): ``intra`` (direct, NVLink), ``inter`` (to and from proxies, IB), ``relay``
    (NVLink). Stage 1 (direct and IB sends at once) ends at ``s1 = max(intra, inter)``; stage 2
    (the relays) starts once the node's relaying ranks are through stage 1 (a relay waits for its
    proxy's copy): ``s2 = max(s1, s1 of the node's relaying ranks) + relay``. Attention on the
    rank's own K/V runs from the start, on keys of its node after ``s1``, on keys of other nodes
    after ``s2``: ``c1 = max(local, s1) + remote_intra``, ``c2 = max(c1, s2) + remote_inter``
    (``c1`` for a rank with no key on another node). Forward: ``c2``. Backward: K/V again the same
    way, then G1 (dK/dV back within the node: direct returns and the relays' grads to the proxy,
    one NVLink batch) and G2 (the proxies' summed grads back over IB, once the node's relaying
    ranks are through G1), both exposed: ``g1 = c2 + G1``, ``g2 = max(g1, g1 of the node's
    relaying ranks) + inter`` for a rank with IB traffic, ``g1`` otherwise.

    Assumed: a rank's two link classes run at once, a batch takes as long as its rank's larger
    direction, a rank waits on the other ranks only through its node's relays, and no part of the
    local backward overlaps G1 or G2 (conservative). Flat (no relays, nothing ``_inter``) this is
    the one-batch exchange: forward ``max(local, exchange) + remote``, backward ``max(local,
    exchange) + remote + exchange``.
    """
    L = comm.layers
    b = comm.kv_bytes_per_token_layer

    def link(tokens: np.ndarray, bandwidth: float, latency: float) -> np.ndarray:
        return np.where(tokens > 0, latency + tokens * b / bandwidth, 0.0)

    v = volumes
    t_intra = link(np.maximum(v.send_intra, v.recv_intra), comm.bandwidth, comm.latency)
    t_inter = link(np.maximum(v.send_inter, v.recv_inter), comm.inter_bandwidth, comm.inter_latency)
    t_relay = link(np.maximum(v.relay_send, v.relay_recv), comm.bandwidth, comm.latency)
    # dK/dV back within the node: to the direct senders and, from the relays' receivers, to the proxy
    t_g1 = link(np.maximum(v.recv_intra + v.relay_recv, v.send_intra + v.relay_send), comm.bandwidth, comm.latency)
    relaying = t_relay > 0
    node = comm.node_size(np.shape(attn)[-1])

    def after_relays(t: np.ndarray) -> np.ndarray:
        """``t``, or later: the latest ``t`` of the node's relaying ranks, for a rank that relays."""
        return np.where(relaying, np.maximum(t, _node_max(np.where(relaying, t, 0.0), node)), t)

    s1 = np.maximum(t_intra, t_inter)
    s2 = after_relays(s1) + t_relay
    pairs = np.asarray(pairs, dtype=np.float64)
    share_intra = np.divide(v.remote_intra_pairs, pairs, out=np.zeros_like(pairs), where=pairs > 0)
    share_inter = np.divide(v.remote_inter_pairs, pairs, out=np.zeros_like(pairs), where=pairs > 0)
    across = v.remote_inter_pairs > 0
    total = np.zeros_like(attn)
    for share, backward in ((ATTN_FORWARD_SHARE, False), (1.0 - ATTN_FORWARD_SHARE, True)):
        a = attn * share / L
        remote_intra, remote_inter = a * share_intra, a * share_inter
        c1 = np.maximum(a - remote_intra - remote_inter, s1) + remote_intra
        end = np.where(across, np.maximum(c1, s2) + remote_inter, c1)
        if backward:
            end = end + t_g1
            end = np.where(t_inter > 0, after_relays(end) + t_inter, end)
        total += L * end
    return total


def _node_max(x: np.ndarray, node: int) -> np.ndarray:
    """Each rank's value replaced by the largest of its node's ranks (CP rank last, nodes of ``node``)."""
    C = np.shape(x)[-1]
    starts = np.arange(0, C, node)
    return np.repeat(np.maximum.reduceat(x, starts, axis=-1), np.diff(np.append(starts, C)), axis=-1)
