"""Compile one micro-batch's shard plan into the kernel calls and transfers of one CP rank.

A :class:`Schedule` is compiled once per micro-batch and CP rank on the host (a DataLoader worker
is the intended place), moved to the device once with :meth:`Schedule.to`, and reused by every
attention layer, forward and backward: the hot path does no host work besides launching kernels.

What a schedule promises: its local causal call and its remote steps' calls cover every (query,
key) pair of the per-sample causal mask of this rank's queries exactly once, as plain varlen calls;
a rank sends only the pieces another rank needs, in one compact buffer; distances nobody needs are
skipped by every rank alike. With :class:`DenseOptions` it also marks long segments for a hybrid
backend's dense kernel (:class:`DenseSegment`, padded to shape buckets) and keeps the rest as varlen
calls (:attr:`KernelCall.rest`). Its :class:`HeadLayout` describes the micro-batch gathered
whole on every rank, for head-parallel CP. Why that is exact, the dense split and shape buckets:
docs/attention.md, "The schedule" and "Kernel backends".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ringpack._checks import is_int
from ringpack.attention.exchange import (
    TargetedExchange,
    compile_exchange,
    exchange_ranges,
    sends_of_ranks,
)
from ringpack.attention.kernel_calls import (
    DEFAULT_DENSE_BUCKETS,
    DEFAULT_DENSE_THRESHOLD,
    DENSE_KEYWORDS,
    DenseOptions,
    DenseSegment,
    KernelCall,
    as_range,
    cu_seqlens,
    dense_bucket,
    dense_bucket_up,
    is_dense_segment,
    make_call,
    noncausal_calls,
)
from ringpack.attention.mode_choice import ModeChoice
from ringpack.errors import PlanError
from ringpack.modes import HYBRID_MODES
from ringpack.piece_table import PieceTable, piece_table
from ringpack.ranges import concat_ranges, cumsum0, prefix_rows, run_starts
from ringpack.shard_plan import ColumnShards, MicroBatch, Piece, RankShard
from ringpack.traffic import microbatch_over_budget

try:  # torch.compile passes a schedule to the engine's custom op as an opaque runtime input
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase as _ScheduleBase
except ImportError:  # older torch: compiled code calls the engine outside the graph
    register_opaque_type, _ScheduleBase = None, object

__all__ = [
    "DEFAULT_DENSE_BUCKETS",
    "DEFAULT_DENSE_THRESHOLD",
    "DENSE_KEYWORDS",
    "DenseOptions",
    "MAX_HEAD_PARALLEL_RANKS",
    "DenseSegment",
    "HeadLayout",
    "KernelCall",
    "NodeLayout",
    "RingStep",
    "Schedule",
    "ScheduleMismatchError",
    "ScheduleOptions",
    "compile_schedule",
    "dense_bucket",
    "dense_bucket_up",
    "is_dense_segment",
]


class ScheduleMismatchError(ValueError):
    """Ranks of one CP group hold schedules (or inputs) that do not belong together."""


@dataclass(frozen=True, kw_only=True)
class ScheduleOptions:
    """Everything :func:`compile_schedule` takes besides the micro-batch and the rank, as one value
    (what :class:`~ringpack.data.PackedCollator`, :class:`~ringpack.data.ShardReader` and
    ``RingpackConfig`` pass on). Its fields are :func:`compile_schedule`'s keywords.

    Raises:
        PlanError: a bad value; the message names the field.
    """

    dense_threshold: int | None = DEFAULT_DENSE_THRESHOLD
    """Segments of at least this many queries and keys (by area) go to a hybrid backend's dense kernel; None: none."""
    dense_buckets: int | None = DEFAULT_DENSE_BUCKETS
    """The dense parts' lengths per octave, a power of two; None keeps exact shapes (data whose lengths repeat)."""
    dense_batches: bool = True
    """Runs of equal short local segments go to the dense kernel as batched calls."""
    gpus_per_node: int | None = None
    """The targeted exchange over nodes of this many CP ranks (K/V cross nodes once); None: the plan's, else flat."""
    mode_choice: ModeChoice | None = None
    """How ``mode="auto"`` picks each micro-batch's mode (stored in ``Schedule.mode``); None: no pick."""
    hybrid_layout: bool = False
    """Also compile the hybrid modes' node layout (``Schedule.node_layout``, with a ``gpus_per_node``
    that divides the CP size): about one more compile of the whole micro-batch per rank, so only
    for ``"ulysses+p2p"`` / ``"ulysses+ring"`` (a ``mode_choice`` that picks one builds it anyway)."""
    max_partners: int = 0
    """The partner budget (the plan's ``max_partners``; 0: none): a micro-batch whose targeted exchange
    would give some rank more partners (:func:`~ringpack.traffic.over_partner_budget`) runs the ring
    under ``mode="p2p"`` (``Schedule.partner_fallback``) and compiles no exchange map."""

    def __post_init__(self) -> None:
        node = self.gpus_per_node
        if node is not None and not (is_int(node) and node >= 1):
            raise PlanError(f"gpus_per_node must be None or an integer >= 1, got {node!r}")
        if self.mode_choice is not None and not isinstance(self.mode_choice, ModeChoice):
            raise PlanError(f"mode_choice must be None or a ModeChoice, got {type(self.mode_choice).__name__}")
        if not (is_int(self.max_partners) and (self.max_partners == 0 or self.max_partners >= 2)):
            raise PlanError(f"max_partners must be 0 (no budget) or an integer >= 2, got {self.max_partners!r}")
        object.__setattr__(self, "max_partners", int(self.max_partners))
        if not isinstance(self.hybrid_layout, bool):
            raise PlanError(f"hybrid_layout must be True or False, got {self.hybrid_layout!r}")
        dense = DenseOptions(self.dense_threshold, self.dense_buckets, self.dense_batches)  # checks, names the field
        object.__setattr__(self, "dense_threshold", dense.threshold)
        object.__setattr__(self, "dense_buckets", dense.buckets)
        object.__setattr__(self, "dense_batches", dense.batches)
        object.__setattr__(self, "gpus_per_node", None if node is None else int(node))

    @property
    def dense(self) -> DenseOptions:
        """The dense split these options ask for."""
        return DenseOptions(self.dense_threshold, self.dense_buckets, self.dense_batches)

    def with_node_size(self, gpus_per_node: int | None, max_partners: int = 0) -> ScheduleOptions:
        """These options with the plan's node size ``gpus_per_node`` and partner budget ``max_partners``
        where they set none themselves."""
        out = self
        if gpus_per_node is not None and self.gpus_per_node is None:
            out = replace(out, gpus_per_node=gpus_per_node)
        if max_partners and not self.max_partners:
            out = replace(out, max_partners=max_partners)
        return out

    @classmethod
    def from_keywords(cls, options: Mapping[str, Any]) -> ScheduleOptions:
        """The options named by :func:`compile_schedule`'s keywords (``{"dense_buckets": None}``).

        Raises:
            PlanError: a key that is no field, or a bad value (named).
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names), key=str)
        if unknown:
            raise PlanError(f"unknown schedule option(s) {unknown}; choose from {names}")
        return cls(**options)


@dataclass(frozen=True)
class RingStep:
    """Remote work at ring distance ``distance``: this rank attends to the buffer of ``(rank - distance) mod C``.

    ``calls`` may be empty: the rank then only forwards the buffer. Every rank of the group has
    the same distances in the same order (they come from the whole micro-batch).
    """

    distance: int
    calls: tuple[KernelCall, ...]


class _AllToAllRuns:
    """What :class:`HeadLayout` and :class:`NodeLayout` share, the relayout's view of either: the
    all-to-all's ranks (``rank_tokens``) and the runs that put its receive order in gathered order."""

    rank_tokens: tuple[int, ...]
    run_source: Tensor

    @property
    def cp_size(self) -> int:
        """The ranks of the all-to-all."""
        return len(self.rank_tokens)

    @property
    def num_tokens(self) -> int:
        """The gathered rows each rank holds after the all-to-all."""
        return sum(self.rank_tokens)

    @property
    def in_order(self) -> bool:
        """Whether receive order already is gathered order (one run): the relayout then permutes nothing."""
        return self.run_source.numel() <= 1


@dataclass(frozen=True)
class HeadLayout(_AllToAllRuns):
    """Where every token of a micro-batch lands in the head-parallel (gathered) layout.

    Under head-parallel (Ulysses) CP an all-to-all sends each rank's tokens, cut into ``cp`` blocks
    of channels (heads), so that rank ``j`` holds block ``j`` of every token of the micro-batch.
    They arrive rank by rank (rank 0's tokens in its canonical order, then rank 1's, ...); the
    *gathered* order is the micro-batch's samples in their listed order, each whole. The layout is
    a function of the micro-batch alone (the same on every rank) and is kept as runs of rows
    (``O(pieces)``): :mod:`ringpack.attention.relayout` builds the token index on the device.

    Attributes:
        rank_tokens: every CP rank's token count; the all-to-all receives ``rank_tokens[s]`` rows
            from rank ``s`` (rank-major receive order) and sends each rank this rank's own count.
        samples: the sample ids in gathered order (the micro-batch's listed order).
        cu_seqlens: int32 ``[len(samples) + 1]``, the samples' boundaries in gathered order.
        max_seqlen: the longest sample's length (a Python int).
        run_source: int64 ``[R]``, the receive-order row where each run of rows starts; runs are
            listed in gathered order and are maximal (consecutive in both orders merged).
        run_length: int64 ``[R]``, each run's row count.
        attention: the one-rank :class:`~ringpack.attention.schedule.Schedule` of the gathered
            micro-batch: one causal segment per sample (with the dense split of the schedule's
            options, for hybrid backends), which the head-parallel attention runs.
    """

    rank_tokens: tuple[int, ...]
    samples: tuple[int, ...]
    cu_seqlens: Tensor
    max_seqlen: int
    run_source: Tensor
    run_length: Tensor
    attention: Schedule

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> HeadLayout:
        """A copy with ``fn`` applied to every tensor (its own and its attention schedule's)."""
        return replace(
            self,
            cu_seqlens=fn(self.cu_seqlens),
            run_source=fn(self.run_source),
            run_length=fn(self.run_length),
            attention=self.attention._map_tensors(fn),
        )

    def __repr__(self) -> str:
        return (
            f"HeadLayout(tokens={self.num_tokens} over {self.cp_size} ranks, samples={len(self.samples)}, "
            f"max_seqlen={self.max_seqlen}, runs={self.run_source.numel()})"
        )


@dataclass(frozen=True)
class NodeLayout(_AllToAllRuns):
    """The two levels of hybrid head-parallel CP (``mode="ulysses+p2p"`` / ``"ulysses+ring"``) for one rank.

    The CP group's ranks form nodes of ``gpus_per_node`` consecutive ranks (rank ``c`` on node
    ``c // gpus_per_node``, local index ``c % gpus_per_node``). An all-to-all inside the node gives
    each of its ranks block ``local index`` of the heads of every token of the node, in *node
    order*: the node's pieces sorted by (sample in the micro-batch's listed order, start), pieces
    that continue each other merged: the node's *rank shard* of the node-level micro-batch (one
    rank shard per node). The ranks with one local index, one per node, then run the engine over
    that node-level micro-batch (``attention``, compiled for ``cp_size`` = the number of nodes).

    It has the all-to-all interface of :class:`HeadLayout` (``rank_tokens``, ``run_source``,
    ``run_length``, ``attention``, ``cp_size``, ``num_tokens``, ``in_order``), over the node's ranks,
    so the relayout and the head-parallel engine run on either.

    Attributes:
        gpus_per_node: the node size (CP ranks per node).
        node: this rank's node.
        rank_tokens: the token count of each rank of the node; the in-node all-to-all receives
            ``rank_tokens[s]`` rows from node rank ``s``.
        run_source: int64 ``[R]``, the receive-order row where each run of node-order rows starts.
        run_length: int64 ``[R]``, each run's row count.
        attention: the node-level :class:`Schedule` of this node (``cp_rank`` = ``node``), with its
            targeted exchange map; its ``num_tokens`` is the node's token count.
    """

    gpus_per_node: int
    node: int
    rank_tokens: tuple[int, ...]
    run_source: Tensor
    run_length: Tensor
    attention: Schedule

    @property
    def nodes(self) -> int:
        return self.attention.cp_size

    @property
    def device(self) -> torch.device:
        return self.run_source.device

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> NodeLayout:
        return replace(
            self,
            run_source=fn(self.run_source),
            run_length=fn(self.run_length),
            attention=self.attention._map_tensors(fn),
        )

    def __repr__(self) -> str:
        return (
            f"NodeLayout(node {self.node} of {self.nodes}, gpus_per_node={self.gpus_per_node}, "
            f"node_tokens={self.num_tokens}, runs={self.run_source.numel()})"
        )


@dataclass(frozen=True)
class Schedule(_ScheduleBase):
    """Everything one CP rank needs to run attention for one micro-batch; plain tensors and ints.

    ``num_tokens`` is the rank's local token count ``T``. ``send_index`` (int64 ``[n]``) picks the
    local rows of its compact send buffer (``send_range = (a, b)`` when they are one range).
    ``buffer_tokens[s]`` is the size of rank ``s``'s compact buffer: every rank knows every size,
    so receive buffers are allocated exactly and empty transfers are skipped on both sides.
    ``local`` is the local causal call (``None`` for a rank without tokens) and ``steps`` the remote
    steps, in the same order on every rank. ``fingerprint`` is a 64-bit hash of the micro-batch's
    piece table, identical on every rank that compiled the same micro-batch; the runtime compares
    it across the group once per schedule (``verified`` caches that check and is never pickled).
    ``exchange`` is the rank's targeted exchange map (``mode="p2p"``,
    :class:`~ringpack.attention.exchange.TargetedExchange`): its partners, the rows it sends each,
    and its sources' steps on the rows it receives; ``gpus_per_node`` the node size it was compiled
    for (None: a flat exchange), which the group check compares.
    ``head_layout`` is the micro-batch's head-parallel layout (``mode="ulysses"`` and
    :func:`~ringpack.attention.sequence_to_heads`;
    :class:`~ringpack.attention.schedule.HeadLayout`): every rank's token count, the gathered
    samples' ``cu_seqlens`` and order. ``node_layout`` (schedules compiled with a ``gpus_per_node``
    that divides the CP size and ``hybrid_layout``) drives the hybrid modes ``"ulysses+p2p"`` and
    ``"ulysses+ring"`` (:class:`NodeLayout`). ``mode`` is the mode ``mode="auto"`` runs, picked at compile time by the
    options' :class:`~ringpack.attention.mode_choice.ModeChoice` (None without one).
    ``max_partners`` is the partner budget it was compiled for (0: none); ``partner_fallback`` marks
    a micro-batch whose targeted exchange would exceed it: ``mode="p2p"`` then runs the ring, every
    rank alike, and the schedule holds no exchange map.

    For ``torch.compile`` a schedule is an opaque *reference* object (where torch supports them):
    the graph takes it as a runtime input of one engine op and never reads its fields, so a new
    micro-batch's schedule reuses the compiled graph instead of specialising it on the schedule's
    integers.
    """

    cp_rank: int
    cp_size: int
    num_tokens: int
    fingerprint: int
    buffer_tokens: tuple[int, ...]
    send_index: Tensor
    local: KernelCall | None
    steps: tuple[RingStep, ...]
    send_range: tuple[int, int] | None = None
    exchange: TargetedExchange | None = field(default=None, compare=False, repr=False)
    gpus_per_node: int | None = None
    head_layout: HeadLayout | None = field(default=None, compare=False, repr=False)
    node_layout: NodeLayout | None = field(default=None, compare=False, repr=False)
    mode: str | None = None
    max_partners: int = 0
    partner_fallback: bool = False
    verified: set = field(default_factory=set, compare=False, repr=False)

    @property
    def send_rows(self) -> Tensor | slice:
        """The local rows this rank sends: a slice when they are one range (views), else ``send_index``."""
        return slice(*self.send_range) if self.send_range is not None else self.send_index

    @property
    def distances(self) -> tuple[int, ...]:
        return tuple(step.distance for step in self.steps)

    def source(self, step: RingStep) -> int:
        """The rank whose buffer this rank attends to at ``step``."""
        return (self.cp_rank - step.distance) % self.cp_size

    @property
    def device(self) -> torch.device:
        return self.send_index.device

    @property
    def num_kernel_calls(self) -> int:
        return (self.local is not None) + sum(len(step.calls) for step in self.steps)

    def __repr__(self) -> str:
        sends = "none" if not self.send_index.numel() else f"{self.send_index.numel()} rows"
        distances = ", ".join(map(str, self.distances[:6])) + (", ..." if len(self.steps) > 6 else "")
        return (
            f"Schedule(cp_rank={self.cp_rank} of {self.cp_size}, tokens={self.num_tokens}, sends={sends}, "
            f"buffer_tokens={sum(self.buffer_tokens)} over {len(self.buffer_tokens)} ranks, "
            f"ring_steps={len(self.steps)} (distances {distances or '-'}), kernel_calls={self.num_kernel_calls}, "
            f"fingerprint={self.fingerprint & 0xFFFFFFFFFFFFFFFF:016x}, device={self.device})"
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Schedule:
        """A copy with every tensor on ``device``: one transfer per micro-batch, then every layer reuses it.

        Args:
            device: the device of the ``q``/``k``/``v`` it will run on (:func:`ring_attention`
                raises ``ValueError`` on a mismatch).
            non_blocking: asynchronous host-to-device copies; they overlap host work only from
                page-locked memory (:meth:`pin_memory`).

        Returns:
            A new :class:`Schedule` with its index tensors on ``device`` (ints and tuples shared);
            its run-time check cache starts empty, so its first use checks the group again.
        """
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Schedule:
        """A page-locked copy (``DataLoader(pin_memory=True)`` calls it): ``to(cuda, non_blocking=True)`` is async."""
        return self._map_tensors(Tensor.pin_memory)

    def _map_tensors(self, fn: Callable[[Tensor], Tensor]) -> Schedule:
        return replace(
            self,
            send_index=fn(self.send_index),
            local=None if self.local is None else self.local._map_tensors(fn),
            steps=tuple(replace(st, calls=tuple(c._map_tensors(fn) for c in st.calls)) for st in self.steps),
            exchange=None if self.exchange is None else self.exchange.map_tensors(fn),
            head_layout=None if self.head_layout is None else self.head_layout.map_tensors(fn),
            node_layout=None if self.node_layout is None else self.node_layout.map_tensors(fn),
            verified=set(),
        )

    def __getstate__(self) -> dict:  # pickle (DataLoader worker -> main process) without the run-time cache
        state = dict(self.__dict__)
        state["verified"] = set()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _register_opaque(cls: type) -> bool:
    """Register ``cls`` as an opaque reference type for custom ops; False where this torch has none."""
    if register_opaque_type is None:
        return False
    try:
        register_opaque_type(cls, typ="reference")
    except (TypeError, ValueError):  # an earlier form of the API
        return False
    return True


#: Whether compiled code can pass a :class:`Schedule` to a custom op (torch's opaque reference types).
OPAQUE_SCHEDULE = _register_opaque(Schedule)


# ------------------------------------------------------------------------------------ compilation


def compile_schedule(
    microbatch: MicroBatch,
    cp_rank: int,
    dense_threshold: int | None = DEFAULT_DENSE_THRESHOLD,
    dense_buckets: int | None = DEFAULT_DENSE_BUCKETS,
    dense_batches: bool = True,
    gpus_per_node: int | None = None,
    mode_choice: ModeChoice | None = None,
    hybrid_layout: bool = False,
    max_partners: int = 0,
    *,
    options: ScheduleOptions | None = None,
) -> Schedule:
    """Compile ``microbatch`` into the attention schedule of CP rank ``cp_rank``.

    Works for any valid micro-batch: any number of pieces per sample and rank, uneven or length-1
    pieces, ranks with no tokens, any CP size. The dense options only change which kernel computes
    what, so ranks may differ in them.

    Args:
        microbatch: the CP group's micro-batch; ``microbatch.shards[r]`` lists rank ``r``'s pieces in
            canonical order. Every rank of the group must compile the same micro-batch (checked at
            run time through :attr:`Schedule.fingerprint`).
        cp_rank: this rank's index in the CP group, ``0 <= cp_rank < len(microbatch.shards)``.
        dense_threshold: segments of at least this many queries and keys (by area, see
            :func:`is_dense_segment`) are marked for a hybrid backend's dense kernel; ``None`` marks
            none.
        dense_buckets: the dense parts' lengths per octave, a power of two (docs/attention.md,
            "Shape buckets"); ``None`` keeps exact shapes.
        dense_batches: give runs of equal short local segments to the dense kernel as batched calls.
        gpus_per_node: the targeted exchange (``mode="p2p"``) over nodes of this many CP ranks
            (rank ``c`` on node ``c // gpus_per_node``, the group's ranks node by node): K/V cross
            nodes once per node and are relayed within it (docs/attention.md, "Targeted
            exchange"). ``None``: every piece straight to each rank that needs it. Every rank of
            the group must give the same value (checked at run time).
        mode_choice: how ``mode="auto"`` picks this micro-batch's mode
            (:class:`~ringpack.attention.ModeChoice`), stored in ``Schedule.mode``; None: no pick.
            Every rank of the group must give the same (the group check compares the modes run).
        hybrid_layout: also compile the hybrid modes' :class:`NodeLayout` when ``gpus_per_node``
            divides the CP size (a node-level schedule of ``cp / gpus_per_node`` ranks: about one
            more compile of the whole micro-batch, which on a pool of a thousand ranks costs 20x
            the rank's own schedule); a ``mode_choice`` that picks a hybrid builds it anyway.
        max_partners: the partner budget (the plan's ``max_partners``; 0: none). When the
            micro-batch's targeted exchange would give some rank more partners
            (:func:`~ringpack.traffic.microbatch_over_budget`: the whole micro-batch's rule, so every
            rank decides alike; decided once per micro-batch, by the planner where it planned it,
            else on first use), the schedule is marked ``partner_fallback``: ``mode="p2p"`` runs
            the ring on it, and no exchange map is compiled. Every rank must give the same value
            (checked at run time).
        options: all of the above as one :class:`ScheduleOptions` (then leave the keywords out).

    Returns:
        The :class:`Schedule` of CPU tensors (int64 row indices, int32 ``cu_seqlens``); move it with
        :meth:`Schedule.to`. ``schedule.num_tokens`` is the rank's token count ``T``, the first
        dim of the ``q``/``k``/``v`` it runs on.

    Raises:
        PlanError: (a ``ValueError``) a ``microbatch`` that is not a :class:`MicroBatch`, a
            ``cp_rank`` that is not an integer in range, a bad ``dense_threshold``,
            ``dense_buckets``, ``dense_batches``, ``gpus_per_node`` or ``mode_choice``, no mode of the
            ``mode_choice`` that can run the group, ``options`` that are not
            :class:`ScheduleOptions` or given with those keywords, or pieces that do not tile their samples:
            empty, starting below 0, out of canonical order, overlapping, leaving a gap (tokens in
            no piece), of a sample the micro-batch does not list, or a listed sample in no piece.
            Each message names the argument, or the CP rank, sample and piece.
    """
    _check_microbatch(microbatch)
    cp = len(microbatch.shards)
    if not is_int(cp_rank) or not 0 <= cp_rank < cp:
        raise PlanError(f"cp_rank must be an integer in [0, {cp}) (the micro-batch's rank shards), got {cp_rank!r}")
    cp_rank = int(cp_rank)
    keywords = {"dense_threshold": dense_threshold, "dense_buckets": dense_buckets, "dense_batches": dense_batches}
    given = {"gpus_per_node": gpus_per_node, "mode_choice": mode_choice, "hybrid_layout": hybrid_layout}
    given["max_partners"] = max_partners
    options = _options_of(options, {**keywords, **given})
    dense, gpus_per_node = options.dense, options.gpus_per_node
    table = piece_table(microbatch)
    fingerprint = microbatch.fingerprint
    mine = table.rows_of(cp_rank)
    num_tokens = int((table.stop[mine] - table.start[mine]).sum())
    mine_needed = mine[table.needed[mine]]
    send_index = concat_ranges(table.offset[mine_needed], table.stop[mine_needed] - table.start[mine_needed])
    receives, sends = exchange_ranges(table, mine, cp_rank)  # from this rank's samples only
    fallback = microbatch_over_budget(microbatch, gpus_per_node, options.max_partners)
    on_buffer, on_received = _remote_calls(table, mine, receives, num_tokens, dense, received=not fallback)
    sources = [(t, (cp_rank - t) % cp) for t in table.distances]
    steps = tuple(RingStep(distance=t, calls=on_buffer.get(src, ())) for t, src in sources)
    received_steps = tuple(RingStep(distance=t, calls=on_received.get(src, ())) for t, src in sources)
    mode = None
    if options.mode_choice is not None:
        mode = options.mode_choice.pick(microbatch, gpus_per_node, options.max_partners)
    hybrid = options.hybrid_layout or mode in HYBRID_MODES
    return Schedule(
        cp_rank=cp_rank,
        cp_size=cp,
        num_tokens=num_tokens,
        fingerprint=fingerprint,
        buffer_tokens=table.buffer_tokens,
        send_index=torch.from_numpy(send_index),
        send_range=as_range(send_index),
        local=_local_call(table, mine, dense) if num_tokens else None,
        steps=steps,
        exchange=None if fallback else _exchange(table, cp_rank, receives, sends, received_steps, gpus_per_node),
        gpus_per_node=None if gpus_per_node is None else int(gpus_per_node),
        head_layout=_head_layout(table, microbatch.samples, fingerprint, dense)
        if cp <= MAX_HEAD_PARALLEL_RANKS
        else None,
        node_layout=_node_layout(table, microbatch, cp_rank, gpus_per_node, dense) if hybrid else None,
        mode=mode,
        max_partners=options.max_partners,
        partner_fallback=fallback,
    )


def _exchange(
    table: PieceTable,
    cp_rank: int,
    receives: np.ndarray,
    sends: np.ndarray,
    steps: tuple[RingStep, ...],
    gpus_per_node: int | None,
) -> TargetedExchange:
    """The rank's :func:`compile_exchange`; its node's relay needs the sends of its sources on other
    nodes to this node, computed in one pass."""
    gpus = None if gpus_per_node is None else int(gpus_per_node)
    sends_of: dict[int, np.ndarray] = {}  # asked for only with a node size
    if gpus is not None and receives.size:
        node, sources = cp_rank // gpus, np.unique(receives[:, 0])
        far = sources[sources // gpus != node]
        sends_of = sends_of_ranks(table, far, to=(node * gpus, (node + 1) * gpus))
    return compile_exchange(
        receives, sends, cp_rank, table.cp_size, steps, gpus_per_node=gpus, sends_of=sends_of.__getitem__
    )


def _node_layout(
    table: PieceTable, microbatch: MicroBatch, cp_rank: int, gpus_per_node: int | None, dense: DenseOptions
) -> NodeLayout | None:
    """This rank's :class:`NodeLayout` (None without a ``gpus_per_node`` that divides the CP size)."""
    cp = table.cp_size
    if gpus_per_node is None or cp % gpus_per_node:
        return None
    g = int(gpus_per_node)
    node = cp_rank // g
    length = table.stop - table.start
    rank_tokens = np.bincount(table.rank, weights=length, minlength=cp).astype(np.int64)[node * g : (node + 1) * g]
    lo, hi = np.searchsorted(table.rank, (node * g, (node + 1) * g))
    rows = np.arange(lo, hi)
    node_order = np.lexsort((table.start[rows], table.slot[rows]))
    run_source, run_length = _gathered_runs(
        table.rank[rows] - node * g, table.offset[rows], length[rows], node_order, rank_tokens
    )
    return NodeLayout(
        gpus_per_node=g,
        node=node,
        rank_tokens=tuple(int(n) for n in rank_tokens),
        run_source=torch.from_numpy(run_source),
        run_length=torch.from_numpy(run_length),
        attention=compile_schedule(
            _node_microbatch(table, microbatch, g),
            node,
            dense_threshold=dense.threshold,
            dense_buckets=dense.buckets,
            dense_batches=dense.batches,
        ),
    )


def _node_microbatch(table: PieceTable, microbatch: MicroBatch, gpus_per_node: int) -> MicroBatch:
    """The node-level micro-batch: one rank shard per node, its ranks' pieces in canonical order
    (by sample slot, then start), pieces that continue each other merged."""
    node = table.rank // gpus_per_node
    order = np.lexsort((table.start, table.slot, node))
    node, slot, start, stop = node[order], table.slot[order], table.start[order], table.stop[order]
    joins = (node[1:] == node[:-1]) & (slot[1:] == slot[:-1]) & (start[1:] == stop[:-1])
    heads = np.flatnonzero(np.r_[True, ~joins]) if order.size else order
    tails = np.r_[heads[1:], order.size] - 1
    shards: list[list[Piece]] = [[] for _ in range(table.cp_size // gpus_per_node)]
    samples = microbatch.samples
    for n, k, a, b in zip(node[heads].tolist(), slot[heads].tolist(), start[heads].tolist(), stop[tails].tolist()):
        shards[n].append(Piece(samples[k], a, b))
    return MicroBatch(
        samples=tuple(samples), shards=tuple(RankShard(tuple(p)) for p in shards), loss_tokens=microbatch.loss_tokens
    )


#: The largest CP group whose schedules carry a head layout: head-parallel CP splits the query
#: heads over the group's ranks, so it needs at least one head per rank, and no model has more than
#: this many. The layout costs time linear in the whole micro-batch's tokens, which a pool of
#: thousands of ranks (ring or targeted exchange only) should not pay on every compile.
MAX_HEAD_PARALLEL_RANKS = 256


def _options_of(options: Any, keywords: dict[str, Any]) -> ScheduleOptions:
    """``options``, or the :class:`ScheduleOptions` of :func:`compile_schedule`'s keywords when it is None."""
    if options is None:
        return ScheduleOptions(**keywords)
    if not isinstance(options, ScheduleOptions):
        raise PlanError(f"options must be a ScheduleOptions, got {type(options).__name__}")
    given = [name for name, value in keywords.items() if value != getattr(_DEFAULT_OPTIONS, name)]
    if given:
        raise PlanError(f"compile_schedule: pass options= or the keywords {given}, not both")
    return options


_DEFAULT_OPTIONS = ScheduleOptions()


def _head_layout(table: PieceTable, samples: Sequence[int], fingerprint: int, dense: DenseOptions) -> HeadLayout:
    """The micro-batch's head-parallel layout: receive-order runs, whole samples' bounds, and the
    one-rank schedule of the gathered micro-batch (one causal segment per sample)."""
    length = table.stop - table.start
    rank_tokens = np.bincount(table.rank, weights=length, minlength=table.cp_size).astype(np.int64)
    run_source, run_length = _gathered_runs(table.rank, table.offset, length, table.by_sample, rank_tokens)
    sample_len = np.bincount(table.slot, weights=length, minlength=len(samples)).astype(np.int64)
    total = int(sample_len.sum())
    starts = np.cumsum(sample_len) - sample_len
    attention = Schedule(
        cp_rank=0,
        cp_size=1,
        num_tokens=total,
        fingerprint=fingerprint,
        buffer_tokens=(0,),
        send_index=torch.zeros(0, dtype=torch.int64),
        local=make_call(sample_len, sample_len, starts, True, total, dense) if total else None,
        steps=(),
    )
    return HeadLayout(
        rank_tokens=tuple(int(n) for n in rank_tokens),
        samples=tuple(int(s) for s in samples),
        cu_seqlens=cu_seqlens(sample_len),
        max_seqlen=int(sample_len.max()) if sample_len.size else 0,
        run_source=torch.from_numpy(run_source),
        run_length=torch.from_numpy(run_length),
        attention=attention,
    )


def _gathered_runs(
    rank: np.ndarray, offset: np.ndarray, length: np.ndarray, by_sample: np.ndarray, rank_tokens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The receive-order runs of the gathered layout, in gathered order: ``(run_source, run_length)``.

    Args:
        rank, offset, length: every piece's CP rank, first row in its rank's local buffer and
            token count (int64 ``[P]``).
        by_sample: the pieces in gathered order (by sample slot, then start).
        rank_tokens: every rank's token count (int64 ``[C]``).

    Returns:
        Two int64 arrays: where each run starts in receive order, and its length; adjacent pieces
        that are also adjacent in receive order form one run.
    """
    rank_start = np.cumsum(rank_tokens) - rank_tokens
    source = (rank_start[rank] + offset)[by_sample]
    size = length[by_sample]
    if source.size == 0:
        return source, size
    joins = source[1:] == source[:-1] + size[:-1]
    heads = np.flatnonzero(np.r_[True, ~joins])
    run_length = np.add.reduceat(size, heads)
    return source[heads], run_length


def _local_call(table: PieceTable, mine: np.ndarray, dense: DenseOptions) -> KernelCall:
    """One causal segment per run of same-sample local pieces (exact: docs/attention.md, "The schedule")."""
    slot, length = table.slot[mine], table.stop[mine] - table.start[mine]
    run_id = np.cumsum(np.r_[True, slot[1:] != slot[:-1]]) - 1
    run_len = np.bincount(run_id, weights=length).astype(np.int64)
    return make_call(run_len, run_len, np.cumsum(run_len) - run_len, True, int(run_len.sum()), dense)


def _remote_calls(
    table: PieceTable, mine: np.ndarray, receives: np.ndarray, num_tokens: int, dense: DenseOptions, received: bool
) -> tuple[dict[int, tuple[KernelCall, ...]], dict[int, tuple[KernelCall, ...]]]:
    """The non-causal calls of this rank's queries (table rows ``mine``) against the keys of each of
    its sources (the partners of ``receives``, its :func:`exchange_ranges`), all sources in one
    vectorised pass, usually one call per source.

    Returns:
        ``(on_buffer, on_received)``, each source rank -> its calls. ``on_buffer``: keys read from the
        source's whole compact send buffer (ring steps). ``on_received``: from the rows received
        from it, its ranges of ``receives`` concatenated (the targeted exchange); empty unless
        ``received``.
    """
    if not mine.size or not receives.size:
        return {}, {}
    src, level, q_lo, q_hi, k_lo, k_hi = _key_groups(table, mine, np.unique(receives[:, 0]))
    if not src.size:
        return {}, {}
    head = run_starts(src) | run_starts(level)  # one call per (source, level)
    call_of_group, call_src = np.cumsum(head) - 1, src[head]
    buffer_len = np.asarray(table.buffer_tokens, dtype=np.int64)[call_src]
    on_buffer = noncausal_calls(call_of_group, q_lo, q_hi, k_lo, k_hi, buffer_len, num_tokens, dense)
    on_received = []
    if received:
        r_lo, r_hi = (_received_before(receives, src, k) for k in (k_lo, k_hi))
        assert (r_hi - r_lo == k_hi - k_lo).all(), "a call reads only received rows"
        cum, partner = cumsum0(receives[:, 2]), receives[:, 0]
        r_len = cum[np.searchsorted(partner, call_src + 1)] - cum[np.searchsorted(partner, call_src)]
        on_received = noncausal_calls(call_of_group, q_lo, q_hi, r_lo, r_hi, r_len, num_tokens, dense)
    return _calls_by_source(call_src, on_buffer), _calls_by_source(call_src, on_received)


def _calls_by_source(call_src: np.ndarray, calls: list[KernelCall]) -> dict[int, tuple[KernelCall, ...]]:
    """``calls`` (each of source ``call_src[i]``, sources ascending) grouped by source; none: empty."""
    if not calls:
        return {}
    bounds = np.flatnonzero(run_starts(call_src)).tolist() + [call_src.size]
    return {int(call_src[a]): tuple(calls[a:b]) for a, b in zip(bounds, bounds[1:])}


def _key_groups(table: PieceTable, mine: np.ndarray, sources: np.ndarray) -> tuple[np.ndarray, ...]:
    """The query-key groups of this rank's remote calls: each maximal run of its consecutive pieces
    (table rows ``mine``) of one sample that needs the same key prefix on one source, the key
    prefix being the source's needed pieces of that sample ending by the run's pieces' start.

    Args:
        sources: the source ranks, ascending.

    Returns:
        ``(source, level, q_lo, q_hi, k_lo, k_hi)``, int64 ``[G]``: the group's source, its level
        (its rank among its sample's groups on that source: nested prefixes cannot share a call),
        local query rows ``q_lo:q_hi`` and key rows ``k_lo:k_hi`` of the source's compact buffer;
        sorted by source, level, then query rows.
    """
    lo, hi = np.searchsorted(table.rank, sources), np.searchsorted(table.rank, sources + 1)
    rows, src = concat_ranges(lo, hi - lo), np.repeat(sources, hi - lo)
    my_slot = table.slot[mine]
    keep = table.needed[rows] & np.isin(table.slot[rows], my_slot)
    rows, src = rows[keep], src[keep]
    if not rows.size:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(6))
    # the source's needed pieces of one sample form a group; each local piece asks each source's group
    head = run_starts(src) | run_starts(table.slot[rows])
    first = np.flatnonzero(head)
    n_slots = table.sample_bounds.size  # more than any slot
    group_key = src[first] * n_slots + table.slot[rows[first]]
    ask_src, ask_piece = np.repeat(sources, mine.size), np.tile(np.arange(mine.size), sources.size)
    wanted = ask_src * n_slots + my_slot[ask_piece]
    group = np.minimum(np.searchsorted(group_key, wanted), first.size - 1)
    found = group_key[group] == wanted
    ask_src, ask_piece, group = ask_src[found], ask_piece[found], group[found]
    count = prefix_rows(
        np.cumsum(head) - 1, table.start[rows], table.stop[rows], first, group, table.start[mine][ask_piece]
    )
    has = count > 0
    ask_src, ask_piece, count = ask_src[has], ask_piece[has], count[has]
    k_lo = table.compact[rows[first[group[has]]]]
    k_hi = k_lo + count
    # merge consecutive local pieces of one sample that need the same keys of one source
    slot = my_slot[ask_piece]
    same = (np.diff(ask_src) == 0) & (np.diff(ask_piece) == 1) & (np.diff(slot) == 0)
    same &= (np.diff(k_lo) == 0) & (np.diff(k_hi) == 0)
    heads = np.flatnonzero(np.r_[True, ~same])
    tails = np.r_[heads[1:], ask_piece.size] - 1
    q_lo = table.offset[mine[ask_piece[heads]]]
    ends = mine[ask_piece[tails]]
    q_hi = table.offset[ends] + table.stop[ends] - table.start[ends]
    src, slot, k_lo, k_hi = ask_src[heads], slot[heads], k_lo[heads], k_hi[heads]
    index = np.arange(heads.size)
    new_sample = run_starts(src) | run_starts(slot)
    level = index - np.maximum.accumulate(np.where(new_sample, index, 0))
    order = np.lexsort((level, src))
    return src[order], level[order], q_lo[order], q_hi[order], k_lo[order], k_hi[order]


def _received_before(receives: np.ndarray, source: np.ndarray, row: np.ndarray) -> np.ndarray:
    """How many of the rows rank ``source[i]`` sends this rank (its ranges of ``receives``: ``(partner,
    lo, count)`` sorted by partner then ``lo``) come before row ``row[i]`` of its compact buffer."""
    partner, lo, count = receives[:, 0], receives[:, 1], receives[:, 2]
    width = int(max((lo + count).max(), row.max())) + 1  # buffers are int32-indexed: no overflow
    at = np.searchsorted(partner * width + lo, source * width + row, side="right") - 1
    inside = np.maximum(at, 0)
    cum = cumsum0(count)
    before = cum[inside] - cum[np.searchsorted(partner, source)] + np.minimum(row - lo[inside], count[inside])
    return np.where((at >= 0) & (partner[inside] == source), before, 0)


# ---------------------------------------------------------------------------------------- helpers


def _check_microbatch(microbatch: MicroBatch) -> None:
    """Raise :class:`PlanError` unless ``microbatch`` is a MicroBatch of rank shards and integer samples
    (types checked once per distinct type, not per item)."""
    if not isinstance(microbatch, MicroBatch):
        raise PlanError(f"microbatch must be a ringpack MicroBatch, got {type(microbatch).__name__}")
    shards = microbatch.shards
    if isinstance(shards, ColumnShards):
        pass  # RankShards by construction, built only where read
    elif not isinstance(shards, Sequence) or not all(issubclass(t, RankShard) for t in set(map(type, shards))):
        raise PlanError("microbatch.shards must be a sequence of RankShard, one per CP rank")
    samples = microbatch.samples
    if not isinstance(samples, Sequence) or not all(map(_is_int_type, set(map(type, samples)))):
        raise PlanError(f"microbatch.samples must be a sequence of sample indices, got {samples!r:.100}")


def _is_int_type(kind: type) -> bool:
    """Whether values of type ``kind`` are integers to :func:`~ringpack._checks.is_int` (bools are not)."""
    return issubclass(kind, (int, np.integer)) and not issubclass(kind, (bool, np.bool_))
