"""The kernel calls of a schedule: what one varlen launch computes (:class:`KernelCall`), the dense
split for hybrid backends (:class:`DenseOptions`, :class:`DenseSegment`, shape buckets), and how
calls are built from segment arrays, many at once.

A call pairs query segments of the rank's local rows with key segments of one buffer; the schedule
compiler (:mod:`ringpack.attention.schedule`) decides which segments, this module how they become
``cu_seqlens``, row indices and dense parts. See docs/attention.md, "The schedule" and "Kernel
backends".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from ringpack._checks import is_int
from ringpack.errors import PlanError
from ringpack.ranges import concat_ranges, cumsum0, run_starts

__all__ = [
    "DEFAULT_DENSE_BUCKETS",
    "DEFAULT_DENSE_THRESHOLD",
    "DENSE_KEYWORDS",
    "LOCAL_RUN_ROWS",
    "DenseOptions",
    "DenseSegment",
    "KernelCall",
    "as_range",
    "cu_seqlens",
    "dense_bucket",
    "dense_bucket_up",
    "is_dense_segment",
    "make_call",
    "noncausal_calls",
]

# Segments of at least this many queries and keys (by area, is_dense_segment) go to a hybrid backend's
# dense kernel. On a heavy-tailed mix at 64K tokens per GPU, 2048 ran 3-4% faster than 4096 for about
# 1.5x the distinct cuDNN shapes, and 1024 gained nothing more (BENCHMARKS.md).
DEFAULT_DENSE_THRESHOLD = 2048

# Dense lengths per octave (docs/attention.md, "Shape buckets"): a dense part is padded by under 1/32 of a side.
# 32 ran the heavy-tailed mix 3-7% faster than 16 for 1.7x the cuDNN shapes (BENCHMARKS.md).
DEFAULT_DENSE_BUCKETS = 32


@dataclass(frozen=True)
class DenseOptions:
    """How :func:`compile_schedule` marks work for a hybrid backend's dense kernel (other backends
    ignore the marks; docs/attention.md, "The dense split"). Its keywords are ``dense_<field>``
    (:data:`DENSE_KEYWORDS`, fields of :class:`ScheduleOptions`).

    Attributes:
        threshold: segments of at least this many queries and keys (by area,
            :func:`is_dense_segment`) are marked; ``None`` marks none (no split).
        buckets: the dense parts' lengths per octave, a power of two (docs/attention.md, "Shape
            buckets"); ``None`` keeps exact shapes.
        batches: runs of equal short local segments go to the dense kernel as batched calls.

    Raises:
        PlanError: a ``threshold`` that is not None or an integer >= 1, ``buckets`` that are not
            None or a power of two, ``batches`` that are not a bool; the message names the keyword.
    """

    threshold: int | None = DEFAULT_DENSE_THRESHOLD
    buckets: int | None = DEFAULT_DENSE_BUCKETS
    batches: bool = True

    def __post_init__(self) -> None:
        threshold, buckets, batches = self.threshold, self.buckets, self.batches
        if threshold is not None and (not is_int(threshold) or threshold < 1):
            raise PlanError(f"dense_threshold must be None or an integer >= 1, got {threshold!r}")
        if buckets is not None and (not is_int(buckets) or buckets < 1 or buckets & (buckets - 1)):
            raise PlanError(f"dense_buckets must be None or a power of two, got {buckets!r}")
        if not isinstance(batches, (bool, np.bool_)):
            raise PlanError(f"dense_batches must be True or False, got {batches!r}")
        object.__setattr__(self, "threshold", None if threshold is None else int(threshold))
        object.__setattr__(self, "buckets", None if buckets is None else int(buckets))
        object.__setattr__(self, "batches", bool(batches))


#: :func:`compile_schedule`'s keywords of the :class:`DenseOptions` fields.
DENSE_KEYWORDS = tuple(f"dense_{f.name}" for f in fields(DenseOptions))


class DenseSegment(NamedTuple):
    """A segment of a call that a hybrid backend's dense kernel runs (:class:`KernelCall`): local
    query rows ``q_start:q_start+q_len`` against buffer rows ``k_start:k_start+k_len``, with the
    call's ``causal``, run on ``q_run >= q_len`` query rows (padding to a bucket shape) and
    ``k_run`` keys (causal: ``k_run == q_run``, the padded square; otherwise ``k_run <= k_len``, the
    other keys going to the varlen kernel beside it). ``batch > 1``: that many equal causal
    segments one after another (``q_len`` rows each, unpadded), one batched call. Plain ints."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    q_run: int
    k_run: int
    batch: int = 1


@dataclass(frozen=True)
class KernelCall:
    """One varlen kernel launch of a ring step.

    Segment ``b`` pairs query rows ``q[rows][cu_seqlens_q[b]:cu_seqlens_q[b+1]]`` with rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of the key/value buffer (int32 ``cu_seqlens``).
    ``q_index`` (int64) selects the local query rows; ``None`` means all local rows in order, unless
    ``q_range = (a, b)`` says they are the contiguous rows ``a:b``, which the engine reads as views
    instead of gathering (:attr:`rows` gives either form). ``k_range = (a, b)``: the call reads
    only key/value rows ``a:b`` of its buffer and its ``cu_seqlens_k`` count from ``a`` (a local
    rest call); ``None``: the whole buffer. ``max_seqlen_*`` are Python ints, so launching needs no
    host synchronisation.

    The dense split (:class:`DenseOptions`), used only by hybrid backends: ``dense`` lists the long
    segments (and batches of equal short ones) as :class:`DenseSegment`; ``rest`` is the call
    without them, as varlen calls (empty if nothing is left). Empty ``dense``: no split.
    """

    q_index: Tensor | None
    cu_seqlens_q: Tensor
    cu_seqlens_k: Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    dense: tuple[DenseSegment, ...] = ()
    rest: tuple[KernelCall, ...] = ()
    q_range: tuple[int, int] | None = None
    k_range: tuple[int, int] | None = None

    @property
    def rows(self) -> Tensor | slice | None:
        """The local query rows: an index tensor, a slice (one range: views, no gathers), or None (all rows)."""
        return slice(*self.q_range) if self.q_range is not None else self.q_index

    @property
    def keys(self) -> slice | None:
        """The key/value rows of the buffer the call reads: a slice, or None (all of them)."""
        return slice(*self.k_range) if self.k_range is not None else None

    def __repr__(self) -> str:
        if self.q_range is not None:
            rows = f"{self.q_range[0]}:{self.q_range[1]}"
        else:
            rows = "all" if self.q_index is None else f"{self.q_index.numel()} gathered"
        keys = "all" if self.k_range is None else f"{self.k_range[0]}:{self.k_range[1]}"
        return (
            f"KernelCall(segments={self.cu_seqlens_q.numel() - 1}, q_rows={rows}, k_rows={keys}, "
            f"max_seqlen_q={self.max_seqlen_q}, max_seqlen_k={self.max_seqlen_k}, causal={self.causal}, "
            f"dense={len(self.dense)}, rest={len(self.rest)})"
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KernelCall:
        return self._map_tensors(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> KernelCall:
        return self._map_tensors(Tensor.pin_memory)

    def _map_tensors(self, fn: Callable[[Tensor], Tensor]) -> KernelCall:
        """A copy with ``fn`` applied to every tensor (its own and its ``rest`` calls')."""
        return replace(
            self,
            q_index=None if self.q_index is None else fn(self.q_index),
            cu_seqlens_q=fn(self.cu_seqlens_q),
            cu_seqlens_k=fn(self.cu_seqlens_k),
            rest=tuple(r._map_tensors(fn) for r in self.rest),
        )


def noncausal_calls(
    call_of_group, q_lo, q_hi, k_lo, k_hi, buffer_len, num_tokens: int, dense: DenseOptions
) -> list[KernelCall]:
    """One non-causal call per call id (``call_of_group``: ascending from 0, every id used) of its
    groups: query rows ``[q_lo, q_hi)`` gathered x keys ``[k_lo, k_hi)`` (ascending within a call) of
    a buffer of ``buffer_len[call]`` rows; key gaps become zero-query segments."""
    groups, calls = q_lo.size, buffer_len.size
    first = np.flatnonzero(run_starts(call_of_group))
    last = np.r_[first[1:], groups] - 1
    # call c's segments: the key gap before each group, the group; after its last group, the keys left
    at = 2 * np.arange(groups) + call_of_group + 1
    tail = 2 * (last + 1) + np.arange(calls)
    seg_q, seg_k, seg_q_start = (np.zeros(2 * groups + calls, dtype=np.int64) for _ in range(3))
    seg_q[at], seg_q_start[at], seg_k[at] = q_hi - q_lo, q_lo, k_hi - k_lo
    seg_k[at - 1] = k_lo - np.where(run_starts(call_of_group), 0, np.r_[0, k_hi[:-1]])
    seg_k[tail] = buffer_len - k_hi[last]
    seg_call = np.repeat(np.arange(calls), 2 * (last - first + 1) + 1)
    keep = (seg_q > 0) | (seg_k > 0)
    return _make_calls(seg_q[keep], seg_k[keep], seg_q_start[keep], seg_call[keep], False, num_tokens, dense)


def as_range(index: np.ndarray) -> tuple[int, int] | None:
    """``(a, b)`` if ``index`` is exactly ``a, a+1, ..., b-1`` (non-empty), else None."""
    if index.size == 0 or int(index[-1]) - int(index[0]) + 1 != index.size or not bool((np.diff(index) == 1).all()):
        return None
    return int(index[0]), int(index[-1]) + 1


def _query_rows(seg_q_start, seg_q, num_tokens: int) -> dict:
    """A call's ``q_index``/``q_range``: neither for all local rows in order, a range when contiguous, else an index."""
    one = np.zeros(len(seg_q), dtype=np.int64)
    return _query_rows_of_calls(seg_q_start, seg_q, one, np.array([0, len(seg_q)]), num_tokens)[0]


def _query_rows_of_calls(seg_q_start, seg_q, seg_call, bounds, num_tokens: int) -> list[dict]:
    """:func:`_query_rows` of each call (its segments ``bounds[c]:bounds[c + 1]``, ``seg_call`` their calls)."""
    q_index = concat_ranges(seg_q_start, seg_q)
    ends = cumsum0(np.bincount(seg_call, weights=seg_q, minlength=bounds.size - 1).astype(np.int64))
    breaks = cumsum0(np.diff(q_index) != 1)  # breaks[i]: steps other than +1 among rows 0..i
    out = []
    for a, b in zip(ends[:-1].tolist(), ends[1:].tolist()):
        if b > a and breaks[b - 1] == breaks[a]:
            out.append(
                dict(q_index=None)
                if b - a == num_tokens
                else dict(q_index=None, q_range=(int(q_index[a]), int(q_index[b - 1]) + 1))
            )
        else:
            out.append(dict(q_index=torch.from_numpy(q_index[a:b].copy())))
    return out


def is_dense_segment(len_q, len_k, dense_threshold: int):
    """Which segments a hybrid backend's dense kernel takes: at least ``dense_threshold**2`` query-key
    products and both sides at least ``dense_threshold // 4`` (a long causal segment: length >= the
    threshold; a remote full block such as 8K queries x 4K keys qualifies too). Vectorised over arrays."""
    len_q, len_k = np.asarray(len_q, dtype=np.int64), np.asarray(len_k, dtype=np.int64)
    side = max(dense_threshold // 4, 1)
    return (len_q * len_k >= dense_threshold * dense_threshold) & (len_q >= side) & (len_k >= side)


def dense_bucket(length, buckets: int | None):
    """The dense part of a side of ``length``: the largest ``m * 2**e <= length`` with
    ``buckets <= m < 2 * buckets`` (``buckets`` lengths per octave; lengths below ``buckets`` stay
    as they are); ``buckets=None``: ``length`` itself. Vectorised over arrays."""
    length = np.asarray(length, dtype=np.int64)
    if buckets is None:
        return length
    step = _bucket_step(length, buckets)
    return length // step * step


def dense_bucket_up(length, buckets: int | None):
    """The smallest bucket length at least ``length`` (the next one after :func:`dense_bucket`'s
    unless ``length`` is one): the padded side of a dense part. Vectorised over arrays."""
    length = np.asarray(length, dtype=np.int64)
    if buckets is None:
        return length
    step = _bucket_step(length, buckets)
    return -(-length // step) * step  # (2**(e+1) itself when rounding up leaves the octave: a bucket too)


def _bucket_step(length: np.ndarray, buckets: int) -> np.ndarray:
    """The spacing of the bucket lengths in ``length``'s octave: ``2**e`` / ``buckets``, at least 1."""
    octave = np.frexp(np.maximum(length, 1).astype(np.float64))[1] - 1  # floor(log2 length), exact below 2**53
    return np.left_shift(1, np.maximum(octave - (int(buckets).bit_length() - 1), 0))


def make_call(seg_q, seg_k, seg_q_start, causal: bool, num_tokens: int, dense: DenseOptions) -> KernelCall:
    """The call of segments ``seg_q[b]`` queries (local rows ``seg_q_start[b]`` on) x ``seg_k[b]`` keys,
    plus its dense split (none when ``dense.threshold`` is None)."""
    one = np.zeros(len(seg_q), dtype=np.int64)
    return _make_calls(seg_q, seg_k, seg_q_start, one, causal, num_tokens, dense)[0]


def _make_calls(
    seg_q, seg_k, seg_q_start, seg_call, causal: bool, num_tokens: int, dense: DenseOptions
) -> list[KernelCall]:
    """:func:`make_call` of many calls at once: segment ``b`` belongs to call ``seg_call[b]``
    (ascending from 0, every call with at least one segment)."""
    bounds = np.r_[np.flatnonzero(run_starts(seg_call)), seg_call.size]
    cu_q, cu_k = _cu_of_calls(seg_q, seg_call, bounds), _cu_of_calls(seg_k, seg_call, bounds)
    max_q, max_k = np.maximum.reduceat(seg_q, bounds[:-1]).tolist(), np.maximum.reduceat(seg_k, bounds[:-1]).tolist()
    rows = _query_rows_of_calls(seg_q_start, seg_q, seg_call, bounds, num_tokens)
    calls = [
        KernelCall(
            cu_seqlens_q=torch.from_numpy(cu_q[a + c : b + c + 1].copy()),
            cu_seqlens_k=torch.from_numpy(cu_k[a + c : b + c + 1].copy()),
            max_seqlen_q=max_q[c],
            max_seqlen_k=max_k[c],
            causal=causal,
            **rows[c],
        )
        for c, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist()))
    ]
    if dense.threshold is None:
        return calls
    long = is_dense_segment(seg_q, seg_k, dense.threshold)
    split = np.ones(len(calls), dtype=bool) if causal and dense.batches else np.add.reduceat(long, bounds[:-1]) > 0
    for c in np.flatnonzero(split).tolist():
        part = slice(int(bounds[c]), int(bounds[c + 1]))
        calls[c] = _dense_split(calls[c], seg_q[part], seg_k[part], seg_q_start[part], long[part].copy(), dense)
    return calls


def _dense_split(call: KernelCall, seg_q, seg_k, seg_q_start, long, dense: DenseOptions) -> KernelCall:
    """``call`` (segments ``seg_q``, ``seg_k``, ``seg_q_start``) with its dense parts: the ``long``
    segments, and (causal) batches of equal short ones; unchanged when it has neither."""
    causal = call.causal
    batches = _equal_batches(seg_q, ~long, dense.threshold) if causal and dense.batches else []
    if not long.any() and not batches:
        return call
    dense_parts = _dense_segments(seg_q, seg_k, seg_q_start, long, causal, dense.buckets)
    for first, count in batches:  # equal-length short segments, one batched dense call per power-of-two group
        a, n = int(seg_q_start[first]), int(seg_q[first])
        dense_parts += (DenseSegment(a, n, a, n, n, n, count),)
        long[first : first + count] = True
    assert not causal or all(d.q_len == d.k_len and d.q_start == d.k_start for d in dense_parts), (
        "dense causal parts are diagonal squares"
    )
    return replace(call, dense=dense_parts, rest=_rest_calls(call, seg_q, seg_q_start, long))


def _dense_segments(seg_q, seg_k, seg_q_start, long, causal: bool, buckets: int | None) -> tuple[DenseSegment, ...]:
    """The ``long`` segments as :class:`DenseSegment`: every query row, padded up to a bucket; the
    keys of a causal square padded the same way, those of a full block cut down to a bucket."""
    seg_k_start = np.cumsum(seg_k) - seg_k
    q_run = dense_bucket_up(seg_q, buckets)
    k_run = q_run if causal else dense_bucket(seg_k, buckets)
    return tuple(
        DenseSegment(int(a), int(n), int(b), int(m), int(qr), int(kr))
        for a, n, b, m, qr, kr in zip(
            seg_q_start[long], seg_q[long], seg_k_start[long], seg_k[long], q_run[long], k_run[long]
        )
    )


def _rest_calls(call: KernelCall, seg_q, seg_q_start, long) -> tuple[KernelCall, ...]:
    """What the dense kernel leaves of ``call`` (segments ``long`` taken), as varlen calls. Local
    (causal): the runs of rows between dense parts, rows and keys read as views. Remote: one call
    with the same key segments, the long ones without queries (their dK/dV rows come out zero)."""
    rest_q = np.where(long, 0, seg_q)
    if not rest_q.any():
        return ()
    if call.causal:
        return _local_runs(seg_q, seg_q_start, long)
    return (
        KernelCall(
            **_query_rows(seg_q_start, rest_q, -1),
            cu_seqlens_q=cu_seqlens(rest_q),
            cu_seqlens_k=call.cu_seqlens_k,
            max_seqlen_q=int(rest_q.max()),
            max_seqlen_k=call.max_seqlen_k,
            causal=False,
        ),
    )


def _equal_batches(seg_len: np.ndarray, eligible: np.ndarray, threshold: int) -> list[tuple[int, int]]:
    """``(first segment, count)`` of the batched dense calls of a causal call: maximal runs of
    consecutive ``eligible`` segments of one length ``L >= threshold // 16`` holding at least
    ``threshold`` rows, cut into power-of-two groups (bounded graph shapes ``(2**i, L)``; a group
    of one stays in the varlen runs). In memory such a run is a ``[count, L, H, D]`` batch, which
    cuDNN takes as a view, 1.5-1.7x faster than flash varlen on H200 for ``L`` of 256-4096
    (``benchmarks/probes/cudnn_batched.py``)."""
    idx = np.flatnonzero(eligible & (seg_len >= max(threshold // 16, 1)))
    if idx.size < 2:
        return []
    breaks = np.flatnonzero((np.diff(idx) != 1) | (seg_len[idx[1:]] != seg_len[idx[:-1]])) + 1
    out = []
    for run in np.split(idx, breaks):
        count, first = run.size, int(run[0])
        if count < 2 or count * int(seg_len[first]) < threshold:
            continue
        for bit in reversed(range(count.bit_length())):
            if count >> bit & 1 and bit:
                out.append((first, 1 << bit))
            first += (count >> bit & 1) << bit
    return out


#: The most rows one varlen call of the local step's short segments takes (longer runs are cut at
#: segment boundaries). Each call's output (and dQ/dK/dV) is a new tensor that the engine copies
#: into the rank's result, so it is held beside the full result: uncut, a 40K-row run on a 64K-token
#: rank puts the forward's peak at 1.4x single-GPU attention. At this size a call still fills the
#: GPU (64 row blocks per head) and the extra launches are a few per layer.
LOCAL_RUN_ROWS = 8192


def _local_runs(
    seg_len: np.ndarray, seg_start: np.ndarray, long: np.ndarray, max_rows: int | None = None
) -> tuple[KernelCall, ...]:
    """What the dense parts leave of the local causal call (queries = keys = local rows, in order):
    one call per run of short segments between long ones, cut at segment boundaries into calls of
    at most ``max_rows`` rows (a longer segment alone); each reads its range as views."""
    todo = np.flatnonzero(~long & (seg_len > 0))
    runs = np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1) if todo.size else []
    cap = LOCAL_RUN_ROWS if max_rows is None else max_rows
    runs = [piece for run in runs for piece in _cut_run(run, seg_len[run], cap)]
    calls = []
    for run in runs:
        lengths = seg_len[run]
        a, b = int(seg_start[run[0]]), int(seg_start[run[-1]] + seg_len[run[-1]])
        calls.append(
            KernelCall(
                q_index=None,
                cu_seqlens_q=cu_seqlens(lengths),
                cu_seqlens_k=cu_seqlens(lengths),
                max_seqlen_q=int(lengths.max()),
                max_seqlen_k=int(lengths.max()),
                causal=True,
                q_range=(a, b),
                k_range=(a, b),
            )
        )
    return tuple(calls)


def _cut_run(run: np.ndarray, lengths: np.ndarray, max_rows: int) -> list[np.ndarray]:
    """``run`` (segment ids with ``lengths``) cut greedily into consecutive groups of at most
    ``max_rows`` rows (a segment longer than that forms a group of its own)."""
    groups, first, rows = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        if rows and rows + n > max_rows:
            groups.append(run[first:i])
            first, rows = i, 0
        rows += n
    groups.append(run[first:])
    return groups


def cu_seqlens(lengths: np.ndarray) -> Tensor:
    """int32 ``[n + 1]``: ``0`` then the running sums of ``lengths``."""
    return torch.from_numpy(cumsum0(np.asarray(lengths)).astype(np.int32))


def _cu_of_calls(lengths: np.ndarray, seg_call: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """The int32 ``cu_seqlens`` of every call at once: call ``c``'s (its segments
    ``bounds[c]:bounds[c + 1]``) are entries ``bounds[c] + c`` to ``bounds[c + 1] + c`` inclusive."""
    running = np.cumsum(lengths)
    before = cumsum0(lengths)[bounds[:-1]]  # running sum ahead of each call's first segment
    out = np.zeros(lengths.size + bounds.size - 1, dtype=np.int32)
    out[np.arange(lengths.size) + seg_call + 1] = running - before[seg_call]
    return out
