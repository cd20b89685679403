"""The context-parallel attention engine that every sequence-split mode runs: one autograd.Function.

:class:`ContextParallelAttention` (through :func:`attention_forward` and
:func:`attention_backward`, which the traced op and the hybrids' passes run too) executes a
:class:`~ringpack.attention.schedule.Schedule`: the local causal call, then one group of non-causal
calls per remote step, merging partial outputs by log-sum-exp in float32 (float64 for float64
inputs). A :class:`~ringpack.attention.kv_transport.KVTransport`, built per pass by
:attr:`PassConfig.make_transport`, brings the remote K/V and takes their dK/dV home; which one is
the mode's (:mod:`ringpack.attention.transports`). The loops over steps, the merge and the gradient
bookkeeping exist once, here; transports only move bytes, and this module imports none of them.
See docs/attention.md, "Ring and all-gather" and "Memory".
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ringpack.attention.kernels import (
    accum_dtype,
    dense_attn_bwd_parts,
    dense_attn_fwd_parts,
    dense_backend,
    varlen_attn_bwd,
    varlen_attn_fwd,
)
from ringpack.attention.kv_transport import KVTransport, TransportFactory, pass_schedule
from ringpack.attention.merge import Rows, merge_partial
from ringpack.attention.schedule import DenseSegment, KernelCall, Schedule

__all__ = [
    "FORWARD_ONLY_PART_ROWS",
    "ContextParallelAttention",
    "PassConfig",
    "attention_backward",
    "attention_forward",
    "pack_kv",
]


def _put_rows(dst: Tensor, rows: Rows, src: Tensor, dim: int = 0) -> None:
    """``dst[rows] = src`` along ``dim`` (rows: index tensor, slice or None)."""
    if isinstance(rows, Tensor):
        dst.index_copy_(dim, rows, src.to(dst.dtype))
    elif rows is None:
        dst.copy_(src)
    else:
        (dst[rows] if dim == 0 else dst[:, rows]).copy_(src)


def _add_rows(dst: Tensor, rows: Rows, src: Tensor) -> None:
    """``dst[rows] += src`` along dim 0, rounded once to ``dst``'s dtype (a float ``src`` is not
    rounded before the sum)."""
    if not isinstance(rows, Tensor):
        (dst if rows is None else dst[rows]).add_(src)  # mixed dtypes: computed in the wider one
    elif src.dtype == dst.dtype or src.dtype.itemsize < dst.dtype.itemsize:
        dst.index_add_(0, rows, src.to(dst.dtype))
    else:
        dst.index_copy_(0, rows, dst.index_select(0, rows).to(src.dtype).add_(src).to(dst.dtype))


def _send_kv(k: Tensor, v: Tensor, schedule: Schedule, capacity: int | None) -> Tensor | tuple[Tensor, Tensor]:
    """What this rank sends: views of k and v when its sent rows are one range and the transport
    takes them as they are (no copy), else the packed buffer (:func:`pack_kv`)."""
    if capacity is None and schedule.send_range is not None:
        rows = schedule.send_rows
        return k[rows], v[rows]
    return pack_kv(k, v, schedule.send_index, capacity)


def pack_kv(k: Tensor, v: Tensor, index: Tensor, capacity: int | None = None) -> Tensor:
    """The compact send buffer ``[2, capacity, H_kv, D]``: rows ``index`` of k and v (zero padding after)."""
    n = index.numel()
    capacity = n if capacity is None else capacity
    buf = (torch.empty if capacity == n else torch.zeros)((2, capacity, *k.shape[1:]), dtype=k.dtype, device=k.device)
    torch.index_select(k, 0, index, out=buf[0, :n])
    torch.index_select(v, 0, index, out=buf[1, :n])
    return buf


@dataclass(frozen=True)
class PassConfig:
    """The constants of one engine pass (forward or backward) that its helpers share.

    Attributes:
        softmax_scale: the scaling of ``QK^T`` before the softmax.
        backend: a resolved kernel backend (:func:`~ringpack.attention.kernels.resolve_backend`).
        make_transport: builds the pass's K/V mover from its schedule; unused (may be None) when
            the schedule has no remote steps.
        part_rows: the forward without gradients: a non-causal dense segment's rows go in chunks
            of at most about that many (:data:`FORWARD_ONLY_PART_ROWS`, :func:`_row_chunks`);
            None: blocks run whole. The backward ignores it.
    """

    softmax_scale: float
    backend: str
    make_transport: TransportFactory | None = None
    part_rows: int | None = None

    def splits(self, call: KernelCall) -> bool:
        """Whether ``call`` runs split: it has dense segments and the backend has a dense kernel."""
        return bool(call.dense) and dense_backend(self.backend) is not None


def _take(x: Tensor, rows: Rows, dim: int = 0) -> Tensor:
    """Rows ``rows`` of ``x`` along ``dim``: a gather for an index, a view for a range (contiguous for the kernels)."""
    if rows is None:
        return x
    if isinstance(rows, Tensor):
        return x.index_select(dim, rows)
    return x[rows] if dim == 0 else x[:, rows].contiguous()


def _fwd_call(q: Tensor, k: Tensor, v: Tensor, call: KernelCall, config: PassConfig) -> tuple[Tensor, Tensor]:
    return varlen_attn_fwd(
        _take(q, call.rows), _take(k, call.keys), _take(v, call.keys), call.cu_seqlens_q, call.cu_seqlens_k,
        call.max_seqlen_q, call.max_seqlen_k, config.softmax_scale, call.causal, config.backend,
    )  # fmt: skip


def _bwd_call(dout, q, k, v, out, lse, call: KernelCall, config: PassConfig) -> tuple[Tensor, Tensor, Tensor]:
    idx, keys = call.rows, call.keys
    return varlen_attn_bwd(
        _take(dout, idx), _take(q, idx), _take(k, keys), _take(v, keys), _take(out, idx), _take(lse, idx, dim=1),
        call.cu_seqlens_q, call.cu_seqlens_k, call.max_seqlen_q, call.max_seqlen_k, config.softmax_scale,
        call.causal, config.backend,
    )  # fmt: skip


def _fwd_parts(
    q: Tensor, k: Tensor, v: Tensor, call: KernelCall, config: PassConfig
) -> Iterator[tuple[Rows, Tensor, Tensor, tuple | None]]:
    """One call's partial results as ``(local query rows, out, lse, second)``: one part, or with a
    hybrid backend one part per dense segment (largest first) and the varlen ``rest`` (disjoint rows). ``second``
    is ``None`` or a second ``(out, lse)`` of the same rows (a dense part whose key tail went
    through the varlen kernel), to be merged in the same pass. A generator: each kernel runs when
    its part is asked for, so a caller that folds a part in before asking for the next holds one
    part's tensors at a time (peak memory). A non-causal dense segment's rows go in chunks of
    ``config.part_rows`` (:func:`_row_chunks`; a causal one is never cut)."""
    if not config.splits(call):
        yield (call.rows, *_fwd_call(q, k, v, call, config), None)
        return
    # a helper builds each part, so this frame keeps no reference to the last one
    for segment in _largest_first(call.dense):
        for chunk in _row_chunks(segment, call.causal, config.part_rows):
            yield _dense_fwd_part(q, k, v, chunk, call.causal, config)
    for rest in call.rest:
        yield (rest.rows, *_fwd_call(q, k, v, rest, config), None)


#: Forward without gradients: the most query rows of one partial result of a remote dense block
#: (:func:`_row_chunks`; ``None``: blocks run whole). Each partial is a new tensor beside the rank's
#: output until it is merged, and a block whose keys are split between cuDNN and the flash key tail
#: returns two: whole, the partials of one 8K-row block take the forward to 1.44x single-GPU
#: attention plus two K/V buffers (16K-token mix, 8 K/V heads). Chunks cost speed (more, smaller
#: launches, each with its key tail and merge): on H200, chunks of at most 8192 rows make the mix's
#: forward 0.4-1.1% slower, of at most 4096 rows 5-10%. With gradients blocks run whole, as the
#: backward's peak is higher than the forward's anyway.
FORWARD_ONLY_PART_ROWS: int | None = 8192


def _row_chunks(segment: DenseSegment, causal: bool, part_rows: int | None) -> tuple[DenseSegment, ...]:
    """A non-causal dense segment as ``n = ceil(q_run / part_rows)`` row chunks of ``ceil(q_run / n)``
    padded rows each (the last one's padding: the local rows after it as views, or zeros past the
    end), or itself. Rows attend their keys independently, so the chunks' outputs are the segment's
    rows. The chunk shape is a function of the segment's, so shape buckets still bound the shapes.
    A causal square is never cut (its rows would need different keys)."""
    if part_rows is None or causal or segment.batch > 1 or segment.q_run <= part_rows:
        return (segment,)
    chunks = -(-segment.q_run // part_rows)
    run = -(-segment.q_run // chunks)
    return tuple(
        segment._replace(q_start=segment.q_start + start, q_len=min(run, segment.q_len - start), q_run=run)
        for start in range(0, segment.q_len, run)
    )


def _work(segment: DenseSegment) -> int:
    """Query x key rows of a dense segment (all of a batch's segments)."""
    return segment.batch * segment.q_len * segment.k_len


def _largest_first(dense: tuple[DenseSegment, ...]) -> list[DenseSegment]:
    """Dense segments, the most query x key rows first. The engine issues its first transfer once
    the first local kernel is queued (:func:`_after_first`): a long kernel there covers the host
    time of issuing it (about 0.5 ms on H200), which a short varlen run would leave idle."""
    return sorted(dense, key=lambda seg: -_work(seg))


def _padded(x: Tensor, start: int, n: int, run: int) -> Tensor:
    """Rows ``start:start+run`` of ``x`` for a dense kernel padded past its ``n`` real rows to a
    bucket shape (docs/attention.md, "Shape buckets"): a view where ``x`` has those rows (the extra rows are
    other tokens' data: finite, unseen by the real rows, their results dropped), else the real rows
    followed by zeros."""
    if start + run <= x.shape[0]:
        return x[start : start + run]
    return torch.cat((x[start : start + n], x.new_zeros((run - n, *x.shape[1:]))))


def _padded_lse(lse: Tensor, start: int, n: int, run: int) -> Tensor:
    """``lse [H, T]`` columns ``start:start+n`` followed by ``+inf`` for the ``run - n`` padding rows:
    a backward then gives them ``P = exp(s - lse) = 0``, so whatever their dO and O hold, they add
    nothing to dK/dV (and their dQ is dropped)."""
    cols = lse[:, start : start + n]
    return cols if run == n else torch.cat((cols, cols.new_full((cols.shape[0], run - n), float("inf"))), dim=1)


def _dense_inputs(q, k, v, segment: DenseSegment, causal: bool):
    """A dense segment's kernel inputs ``(q, k, v, dense keys)``: a causal square padded on both
    sides (its real rows never see the padding keys), a batch of equal causal squares as they are,
    or a full block with its rows padded and its keys exact, the dense kernel taking the first
    ``k_run`` (the rest: a key tail)."""
    q0, nq, k0, nk, q_run, k_run, batch = segment
    if batch > 1:
        return q[q0 : q0 + batch * nq], k[k0 : k0 + batch * nk], v[k0 : k0 + batch * nk], None
    if causal:
        return _padded(q, q0, nq, q_run), _padded(k, k0, nk, k_run), _padded(v, k0, nk, k_run), None
    return _padded(q, q0, nq, q_run), k[k0 : k0 + nk], v[k0 : k0 + nk], k_run


def _dense_fwd_part(q, k, v, segment: DenseSegment, causal: bool, config: PassConfig):
    n = segment.batch * segment.q_len  # the real rows (padding after them)
    qp, kp, vp, dense_keys = _dense_inputs(q, k, v, segment, causal)
    parts = dense_attn_fwd_parts(
        qp, kp, vp, config.softmax_scale, causal, config.backend, dense_keys=dense_keys, batch=segment.batch
    )
    first, *second = ((o[:n], lse[:, :n]) for o, lse in parts)
    return (_rows(segment.q_start, n, q.shape[0]), *first, second[0] if second else None)


def _bwd_parts(
    dout, q, k, v, out, lse, call: KernelCall, config: PassConfig
) -> Iterator[tuple[Rows, Tensor, Rows, Tensor, Tensor]]:
    """One call's gradients as ``(query rows, dq, key rows, dk, dv)``; key rows ``None``: the whole
    buffer. With a split, one part per dense segment (largest first), then the varlen ``rest`` (if any).
    A generator, like :func:`_fwd_parts`."""
    if not config.splits(call):
        yield (call.rows, *_bwd_call_parts(dout, q, k, v, out, lse, call, config))
        return
    # helpers build each part, so this frame keeps no reference to the last one
    for segment in _largest_first(call.dense):
        yield from _dense_bwd_parts(dout, q, k, v, out, lse, segment, call.causal, config)
    for rest in call.rest:
        yield (rest.rows, *_bwd_call_parts(dout, q, k, v, out, lse, rest, config))


def _dense_bwd_parts(
    dout, q, k, v, out, lse, segment: DenseSegment, causal: bool, config: PassConfig
) -> Iterator[tuple[Rows, Tensor, Rows, Tensor, Tensor]]:
    """A dense segment's gradients as :func:`_bwd_parts` yields them: one part, or with a key split
    the dense kernel's (its first ``k_run`` keys) and then the key tail's (the rest), each added
    on its own (:func:`~ringpack.attention.kernels.dense_attn_bwd_parts`)."""
    q0, k0, batch = segment.q_start, segment.k_start, segment.batch
    n, nk, run = batch * segment.q_len, batch * segment.k_len, batch * segment.q_run
    qp, kp, vp, dense_keys = _dense_inputs(q, k, v, segment, causal)
    dop, outp, lsep = _padded(dout, q0, n, run), _padded(out, q0, n, run), _padded_lse(lse, q0, n, run)
    for dq, dk, dv in dense_attn_bwd_parts(
        dop, qp, kp, vp, outp, lsep, config.softmax_scale, causal, config.backend, dense_keys=dense_keys, batch=batch
    ):
        keys = min(dk.shape[0], nk)  # this part's real key rows (a padded causal square's extra rows dropped)
        yield _rows(q0, n, q.shape[0]), dq[:n], _rows(k0, keys, k.shape[0]), dk[:keys], dv[:keys]
        k0, nk = k0 + keys, nk - keys
        del dq, dk, dv


def _rows(start: int, n: int, total: int) -> slice | None:
    """Rows ``start:start+n`` of ``total``: None when that is all of them (the caller then adopts
    the part instead of copying it into zeros, as for a lone batch of equal samples)."""
    return None if start == 0 and n == total else slice(start, start + n)


def _bwd_call_parts(
    dout, q, k, v, out, lse, call: KernelCall, config: PassConfig
) -> tuple[Tensor, slice | None, Tensor, Tensor]:
    dq, dk, dv = _bwd_call(dout, q, k, v, out, lse, call, config)
    return dq, call.keys, dk, dv


def _after_first(parts: Iterator, hook: Callable[[], None] | None) -> Iterator:
    """Yield ``parts``, calling ``hook`` once as soon as the first part's kernel is queued (or at
    the end if there is none). The engine issues its first transfer there: the GPU runs that
    kernel while the host spends its time issuing the transfer, and the remaining local kernels
    are queued after it, so the transfer starts early and overlaps them."""
    for part in parts:
        if hook is not None:
            hook()
            hook = None
        yield part
        del part  # not kept alive through the next part's kernel (peak memory)
    if hook is not None:
        hook()


def _local_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    call: KernelCall,
    out_dtype: torch.dtype,
    config: PassConfig,
    then=None,
    then_after_fold: bool = False,
) -> tuple[Tensor, Tensor]:
    """The local causal call: ``(out, lse)`` over all local rows (``out`` in ``out_dtype`` when split).
    ``then``: called once the first local kernel is queued (see :func:`_after_first`), or with
    ``then_after_fold`` once its part has been copied into ``out`` and dropped (a transfer whose
    buffers ``then`` allocates is then not held beside that part: the forward without gradients)."""
    parts = _fwd_parts(q, k, v, call, config)
    if not then_after_fold:
        parts, then = _after_first(parts, then), None
    if not config.splits(call):
        ((_, out, lse, _),) = parts
        if then is not None:
            then()
        return out, lse
    out = lse = None
    for rows, part_out, part_lse, second in parts:  # the parts tile the local rows (causal: no key split)
        assert second is None, "a causal dense part is never split by keys"
        if rows is None:  # one part over every row (a lone dense segment or batch): adopted, no copy
            if then is not None:
                then()
            return part_out, part_lse
        if out is None:
            out = q.new_empty(q.shape, dtype=out_dtype)
            lse = q.new_empty((q.shape[1], q.shape[0]), dtype=accum_dtype(q.dtype))
        _put_rows(out, rows, part_out)
        _put_rows(lse, rows, part_lse, dim=1)
        del part_out, part_lse  # before the next part's kernel allocates its output (peak memory)
        if then is not None:
            then()
            then = None
    if then is not None:
        then()
    return out, lse


def _local_backward(
    dout, q, k, v, out, lse, calls, config: PassConfig, grads: list | None = None, then=None
) -> list | None:
    """Fold the gradients of local ``calls`` into ``grads = [dq, dk, dv]`` (created by the first part).

    Local parts' query rows and key rows tile the local rows (causal squares and runs of them), so
    each element receives one local value. The first part is adopted where it covers every row (the
    common one-kernel case, or one dense batch, copies nothing) and copied into zeros elsewhere.
    ``then``: see :func:`_local_forward`.
    """
    # chain keeps no reference to a part it passed on (a generator's loop variable would, through the next kernel)
    parts = itertools.chain.from_iterable(_bwd_parts(dout, q, k, v, out, lse, call, config) for call in calls)
    for q_rows, dq_c, k_rows, dk_c, dv_c in _after_first(parts, then):
        if grads is None:
            grads = [
                dq_c if q_rows is None else torch.zeros_like(q),
                *((dk_c, dv_c) if k_rows is None else (torch.zeros_like(k), torch.zeros_like(v))),
            ]
            if q_rows is not None:
                _put_rows(grads[0], q_rows, dq_c)
            if k_rows is not None:
                _put_rows(grads[1], k_rows, dk_c)
                _put_rows(grads[2], k_rows, dv_c)
            del dq_c, dk_c, dv_c  # before the next part's kernel (peak memory)
            continue
        _add_rows(grads[0], q_rows, dq_c)
        _add_rows(grads[1], k_rows, dk_c)
        _add_rows(grads[2], k_rows, dv_c)
        del dq_c, dk_c, dv_c
    return grads


def _overlap_split(call: KernelCall | None, config: PassConfig) -> tuple[list[KernelCall], list[KernelCall]]:
    """The local backward as ``(before, after)`` the remote steps.

    The dK/dV of the last remote step travel home after its kernels; local work queued after them
    hides that transfer (and local work queued before the remote steps hides the first K/V
    transfer). With a hybrid backend's split the largest dense segment goes after and the rest
    before; a local call that is one kernel runs before, as the first transfer needs cover most.
    """
    if call is None:
        return [], []
    if not config.splits(call) or (not call.rest and len(call.dense) == 1):
        return [call], []
    big = max(range(len(call.dense)), key=lambda i: _work(call.dense[i]))
    others = call.dense[:big] + call.dense[big + 1 :]
    before = [replace(call, dense=others)] if others else list(call.rest)
    return before, [replace(call, dense=(call.dense[big],), rest=())]


def _one_local_part(call: KernelCall, config: PassConfig, rows: int) -> bool:
    """Whether the local call's result is one kernel's output, adopted as the rank's (no copy, so
    nothing to gain by allocating the first transfer's buffers after it)."""
    if not config.splits(call):
        return True
    return (
        not call.rest
        and len(call.dense) == 1
        and _rows(call.dense[0].q_start, call.dense[0].batch * call.dense[0].q_len, rows) is None
    )


def attention_forward(q: Tensor, k: Tensor, v: Tensor, schedule: Schedule, config: PassConfig) -> tuple[Tensor, Tensor]:
    """The engine's forward over this rank's ``q [T, H, D]``, ``k``/``v [T, H_kv, D]`` (contiguous,
    fitting ``schedule``, which the group agrees on: :func:`~ringpack.attention.checks.check_inputs`).

    Returns ``(out [T, H, D] in q's dtype, lse [H, T] in the accumulation dtype)``.

    With ``config.part_rows`` (the forward without gradients, whose peak is the whole pass's):
    remote dense blocks go in row chunks of at most that many rows (:data:`FORWARD_ONLY_PART_ROWS`),
    and where the local result is copied from several parts, the first transfer's buffers are
    allocated once the first part has been copied into the output, so they are not held beside it
    (the transfer then overlaps the other local kernels, not the first)."""
    schedule = pass_schedule(schedule, config.make_transport)
    acc = accum_dtype(q.dtype)
    if not schedule.steps:
        if schedule.local is None:
            return q.new_zeros(q.shape), q.new_zeros((q.shape[1], 0), dtype=acc)
        out, lse = _local_forward(q, k, v, schedule.local, q.dtype, config)
        return out, lse.to(acc)
    transport = config.make_transport(schedule)
    # With one remote step every row gets at most one remote part, so the running output stays in
    # q's dtype (merge_partial computes in float and rounds once); more steps accumulate in float.
    out_dtype = q.dtype if len(schedule.steps) == 1 else acc
    out, lse = _local_forward_then_send(q, k, v, schedule, transport, out_dtype, config)
    for i, step in enumerate(schedule.steps):
        buf = transport.buffer(i)
        _merge_remote_step(out, lse, q, buf, step.calls, config)
    return out.to(q.dtype), lse


def _local_forward_then_send(
    q, k, v, schedule: Schedule, transport: KVTransport, out_dtype, config: PassConfig
) -> tuple[Tensor, Tensor]:
    """The local result (``out`` in ``out_dtype``, ``lse`` in the accumulation dtype), with the first
    transfer started beside it: issued once the first local kernel is queued, waiting for the
    packing only. Without gradients (``config.part_rows``), where the local result is copied from
    several parts, its buffers are allocated (and it is issued) once the first part is folded in,
    so they are not held beside it. A rank without tokens starts the transfer and returns zeros."""
    acc = accum_dtype(q.dtype)

    def begin() -> None:
        transport.begin(_send_kv(k, v, schedule, transport.send_capacity))

    if schedule.local is None:  # a rank without tokens still forwards buffers
        begin()
        transport.start()
        return q.new_zeros(q.shape, dtype=out_dtype), q.new_zeros((q.shape[1], 0), dtype=acc)
    lean = config.part_rows is not None and not _one_local_part(schedule.local, config, q.shape[0])
    if not lean:
        begin()
    then = (lambda: (begin(), transport.start())) if lean else transport.start
    out, lse = _local_forward(q, k, v, schedule.local, out_dtype, config, then=then, then_after_fold=lean)
    return out.to(out_dtype), lse.to(acc)


def _merge_remote_step(out: Tensor, lse: Tensor, q: Tensor, buf: Tensor, calls, config: PassConfig) -> None:
    """Fold one remote step's partial results (its ``calls`` against the received ``buf``) into ``out``/``lse``."""
    for call in calls:
        for rows, part_out, part_lse, second in _fwd_parts(q, buf[0], buf[1], call, config):
            merge_partial(out, lse, part_out, part_lse, rows, part2=second)
            del part_out, part_lse, second


def attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, schedule: Schedule, config: PassConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """The engine's backward: ``(dq, dk, dv)`` in the dtypes of q, k, v, given a contiguous ``dout``
    and the final ``out`` and ``lse`` of :func:`attention_forward`."""
    schedule = pass_schedule(schedule, config.make_transport)
    if not schedule.steps:
        if schedule.local is None:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        return tuple(_local_backward(dout, q, k, v, out, lse, [schedule.local], config))
    # With one remote step, a query row gets at most one remote dQ part and a sent key row its
    # dK/dV from one rank: the kernels' outputs are already rounded to q's dtype, so keeping dQ and
    # the dK/dV in transit in that dtype and summing each element once (in float, rounded once)
    # equals a float accumulator rounded at the end, with half the bytes on the wire and no
    # T x H x D float buffer. (A rank whose step has several calls, nested levels of one sample,
    # sums their dK/dV in float and rounds that sum once for the trip. With shape buckets, a long
    # block's key tail is a second kernel over its rows: their dQ takes a second term, one more
    # rounding.) More steps accumulate, and pass around, float sums.
    one_step = len(schedule.steps) == 1
    grad_dtype = q.dtype if one_step else lse.dtype
    transport = config.make_transport(schedule)
    transport.begin(_send_kv(k, v, schedule, transport.send_capacity), grad_dtype=grad_dtype)
    before, after = _overlap_split(schedule.local, config)
    grads = _local_backward(dout, q, k, v, out, lse, before, config, then=transport.start)
    if grads is None:  # a rank without tokens
        grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    if not one_step:
        grads[0] = grads[0].to(lse.dtype)
    for i, step in enumerate(schedule.steps):
        buf = transport.buffer(i)
        dkv = _remote_step_backward(grads[0], dout, q, buf, out, lse, step.calls, grad_dtype, config)
        del buf  # the received K/V are not needed any more (peak memory)
        transport.push_grad(i, None if dkv is None else [g.to(grad_dtype) for g in dkv])
        del dkv
    grads = _local_backward(dout, q, k, v, out, lse, after, config, grads)  # hides the dK/dV transfer home
    home = transport.finish()
    dq, dk, dv = grads
    del grads
    dq = dq.to(q.dtype)  # no copy when it already is
    if home is not None:  # only the rows this rank sent, each summed once and rounded once
        rows = schedule.send_rows
        _add_rows(dk, rows, home[0])
        _add_rows(dv, rows, home[1])
    return dq, dk, dv


def _remote_step_backward(
    dq: Tensor, dout, q, buf: Tensor, out, lse, calls, grad_dtype, config: PassConfig
) -> list[Tensor] | None:
    """Add one remote step's dQ into ``dq`` and return the received buffer's dK/dV (``None``: no
    query of this rank used it). One call sums in ``grad_dtype``; several calls (levels) may share
    key rows, so they sum in float."""
    dkv = None
    sum_dtype = grad_dtype if len(calls) <= 1 else lse.dtype
    for call in calls:
        for q_rows, dq_c, k_rows, dk_c, dv_c in _bwd_parts(dout, q, buf[0], buf[1], out, lse, call, config):
            _add_rows(dq, q_rows, dq_c)
            if dkv is None and k_rows is None and dk_c.dtype == sum_dtype:
                dkv = [dk_c, dv_c]  # a part over the whole buffer (zeros where it has no queries) is the sum so far
                continue
            if dkv is None:
                dkv = [torch.zeros(buf.shape[1:], dtype=sum_dtype, device=buf.device) for _ in range(2)]
            rows = slice(None) if k_rows is None else k_rows
            dkv[0][rows] += dk_c
            dkv[1][rows] += dv_c
            del dq_c, dk_c, dv_c
    return dkv


class ContextParallelAttention(torch.autograd.Function):
    """Exact causal per-sample attention over a CP group for one rank's tokens (forward and backward).

    Inputs are this rank's ``q [T, H, D]``, ``k``/``v [T, H_kv, D]``; ``make_transport`` builds the
    K/V mover (the mode's transport) for one pass; ``part_rows`` (optional): see
    :func:`attention_forward` (:func:`~ringpack.attention.ring_attention` passes
    :data:`FORWARD_ONLY_PART_ROWS` when no gradient is needed). Only ``out`` is returned; ``lse`` is
    kept for the backward. Call through :func:`ringpack.attention.ring_attention`, which validates
    inputs and checks that the group agrees on the schedule first.
    """

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        schedule: Schedule,
        make_transport: TransportFactory,
        softmax_scale: float,
        backend: str,
        part_rows: int | None = None,
    ):
        config = PassConfig(softmax_scale, backend, make_transport, part_rows)
        out, lse = attention_forward(q, k, v, schedule, config)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.schedule, ctx.config = schedule, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(dout.contiguous(), q, k, v, out, lse, ctx.schedule, ctx.config)
        return dq, dk, dv, None, None, None, None, None
