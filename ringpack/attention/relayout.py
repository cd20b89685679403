"""Sequence-parallel rows to head-parallel whole samples and back: the all-to-all of Ulysses CP.

:func:`sequence_to_heads` turns this CP rank's tokens ``(T_local, C)`` (its pieces, in canonical
order) into block ``cp_rank`` of the channels of *every* token of the micro-batch, whole samples in
gathered order (:class:`~ringpack.attention.schedule.HeadLayout`); :func:`heads_to_sequence` is
its inverse. Both are differentiable (each one's backward is the other) and work for any plan:
uneven token counts per rank (one ``all_to_all_single`` with per-rank split sizes), idle ranks,
pieces anywhere. Sequence-mixing layers (convolutions, recurrences) then see each sample whole
and in order; head-parallel attention (:mod:`ringpack.attention.ulysses`) is built on the same
exchange. See docs/attention.md, "Head-parallel (Ulysses) attention" and "Sequence-mixing layers on
whole samples".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.checks import verify_schedule
from ringpack.attention.schedule import MAX_HEAD_PARALLEL_RANKS, HeadLayout, Schedule
from ringpack.errors import DataError

__all__ = [
    "all_to_all",
    "blocks_to_rows",
    "gathered_index",
    "head_layout",
    "heads_to_sequence",
    "rows_to_blocks",
    "sequence_to_heads",
    "to_gathered",
    "to_received",
]


def sequence_to_heads(x: Tensor, schedule: Schedule, group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's tokens to its channel block of every token of the micro-batch, whole samples in order.

    Collective over ``group``: every rank calls it with its own schedule of the same micro-batch.

    Args:
        x: ``(T_local, C)`` or ``(T_local, H, D)``: this rank's tokens in canonical order
            (``T_local == schedule.num_tokens``), any dtype, on the schedule's device.
        schedule: :func:`~ringpack.attention.compile_schedule`'s result for this rank.
        group: the CP process group (default: the world; unused when ``schedule.cp_size == 1``).

    Returns:
        ``(T_total, C / cp)`` or ``(T_total, H / cp, D)``: channels (heads)
        ``[cp_rank * C / cp, (cp_rank + 1) * C / cp)`` of every token of the micro-batch, samples
        in ``schedule.head_layout.samples`` order, each whole; sample ``b`` is rows
        ``cu_seqlens[b]:cu_seqlens[b + 1]`` of ``schedule.head_layout.cu_seqlens``.
        Differentiable; the backward is :func:`heads_to_sequence` of the gradient.

    Raises:
        DataError: ``x`` not a ``(T, C)`` or ``(T, H, D)`` tensor, ``C`` (``H``) not a multiple of
            the CP size (named), or a schedule without its head layout; with ``cp_size == 1``
            also a token count that does not fit the schedule.
        ScheduleMismatchError: on every rank, before the exchange, when the ranks hold schedules
            of different micro-batches, disagree on ``x``'s shape or dtype or on whether
            gradients are needed, or some rank's ``x`` does not fit its schedule.
    """
    layout = _checked(x, schedule, group, "x")
    if layout.cp_size == 1:
        return x
    return _SequenceToHeads.apply(x, layout, group)


def heads_to_sequence(y: Tensor, schedule: Schedule, group: dist.ProcessGroup | None = None) -> Tensor:
    """The inverse of :func:`sequence_to_heads`: this rank's channel block of every token back to its own tokens.

    Collective over ``group``, like :func:`sequence_to_heads`.

    Args:
        y: ``(T_total, C / cp)`` or ``(T_total, H / cp, D)``, rows in gathered order
            (``T_total = schedule.head_layout.num_tokens``), on the schedule's device.
        schedule: this rank's schedule of the micro-batch.
        group: the CP process group (default: the world; unused when ``schedule.cp_size == 1``).

    Returns:
        ``(T_local, C)`` or ``(T_local, H, D)``: every channel block of this rank's tokens, in
        canonical order. Differentiable; the backward is :func:`sequence_to_heads`.

    Raises:
        DataError, ScheduleMismatchError: as :func:`sequence_to_heads` (the row count checked is
            ``T_total``).
    """
    layout = _checked(y, schedule, group, "y")
    if layout.cp_size == 1:
        return y
    return _HeadsToSequence.apply(y, layout, group, schedule.num_tokens)


def head_layout(schedule: Schedule) -> HeadLayout:
    """``schedule.head_layout``.

    Raises:
        DataError: a schedule without one (not made by ``compile_schedule``).
    """
    if not isinstance(schedule, Schedule):
        raise DataError(f"schedule must be a Schedule (compile_schedule(microbatch, cp_rank)), got {type(schedule)}")
    if schedule.head_layout is None and schedule.cp_size > MAX_HEAD_PARALLEL_RANKS:
        raise DataError(
            f"cp rank {schedule.cp_rank}: head-parallel CP over {schedule.cp_size} ranks needs a query head per "
            f"rank, more than any model has (at most {MAX_HEAD_PARALLEL_RANKS} ranks); use mode='p2p' or 'ring'"
        )
    if schedule.head_layout is None:
        raise DataError(
            f"cp rank {schedule.cp_rank}: head-parallel CP needs the schedule's head layout; "
            "compile the schedule with compile_schedule(microbatch, cp_rank)"
        )
    return schedule.head_layout


def _checked(x: Tensor, schedule: Schedule, group: dist.ProcessGroup | None, name: str) -> HeadLayout:
    """The schedule's head layout, once ``x`` fits it and (``cp_size > 1``) the group agrees."""
    if not isinstance(x, Tensor):
        raise DataError(f"{name} must be a torch.Tensor (T, C) or (T, H, D), got {type(x).__name__}")
    layout = head_layout(schedule)
    problem = _shape_problem(x, schedule, name)
    if schedule.cp_size > 1:
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        group = group if group is not None else dist.group.WORLD
        verify_schedule(schedule, group, "ulysses", x, problem, needs_grad=needs_grad, inputs=name)
    if problem:
        raise DataError(problem)
    return layout


def _shape_problem(x: Tensor, schedule: Schedule, name: str) -> str | None:
    """Why ``x`` (``name``: "x" for this rank's rows, "y" for the gathered ones) cannot be relaid (None if it can)."""
    layout, cp = schedule.head_layout, schedule.cp_size
    rows = schedule.num_tokens if name == "x" else layout.num_tokens
    if x.dim() not in (2, 3):
        return f"{name} must be (tokens, channels) or (tokens, heads, head_dim), got shape {tuple(x.shape)}"
    what = "channels" if x.dim() == 2 else "heads"
    if name == "x" and x.shape[1] % cp:
        return f"{name} has {x.shape[1]} {what}, not a multiple of the CP size {cp}: each rank takes an equal block"
    if x.shape[0] != rows:
        where = "this rank's tokens" if name == "x" else "the micro-batch's tokens (the gathered layout)"
        return f"cp rank {schedule.cp_rank}: {name} has {x.shape[0]} rows but {where} number {rows}"
    if x.device != layout.device:
        return f"schedule is on {layout.device} but {name} is on {x.device}; call schedule.to(device) per micro-batch"
    return None


# ------------------------------------------------------------------------------------- the exchange


def gathered_index(layout: HeadLayout) -> Tensor | None:
    """int64 ``[T_total]`` on the layout's device: gathered row ``i`` is receive-order row ``index[i]``
    (None when the orders agree). Built from the layout's runs on the device, without a host sync."""
    if layout.in_order:
        return None
    source, length = layout.run_source, layout.run_length
    total = layout.num_tokens
    out_start = torch.cumsum(length, 0) - length
    shift = torch.repeat_interleave(source - out_start, length, output_size=total)
    return torch.arange(total, dtype=torch.int64, device=source.device) + shift


def to_gathered(received: Tensor, index: Tensor | None) -> Tensor:
    """Receive-order rows (or a column slice of them) in gathered order, contiguous."""
    return received.contiguous() if index is None else received.index_select(0, index)


def to_received(out: Tensor, gathered: Tensor, index: Tensor | None) -> None:
    """Write gathered-order rows into ``out`` (receive order; may be a column slice of a buffer)."""
    if index is None:
        out.copy_(gathered)
    else:
        out.index_copy_(0, index, gathered)


def blocks_to_rows(blocks: Tensor, layout: HeadLayout, group: dist.ProcessGroup | None) -> Tensor:
    """One all-to-all: this rank's ``(cp, T_local, ...)`` blocks (block ``j`` to rank ``j``) to the
    ``(T_total, ...)`` rows every rank sent this one, in receive order (rank by rank)."""
    cp, local = layout.cp_size, blocks.shape[1]
    if cp == 1:
        return blocks.reshape(local, *blocks.shape[2:])
    out = blocks.new_empty((layout.num_tokens, *blocks.shape[2:]))
    send = blocks.reshape(cp * local, *blocks.shape[2:])
    all_to_all(out, send, list(layout.rank_tokens), [local] * cp, group)
    return out


def rows_to_blocks(rows: Tensor, layout: HeadLayout, local: int, group: dist.ProcessGroup | None) -> Tensor:
    """The inverse of :func:`blocks_to_rows`: receive-order ``(T_total, ...)`` rows home, as this
    rank's ``(cp, T_local, ...)`` blocks (block ``j`` from rank ``j``)."""
    cp = layout.cp_size
    if cp == 1:
        return rows.reshape(1, local, *rows.shape[1:])
    out = rows.new_empty((cp * local, *rows.shape[1:]))
    all_to_all(out, rows.contiguous(), [local] * cp, list(layout.rank_tokens), group)
    return out.view(cp, local, *rows.shape[1:])


def all_to_all(out: Tensor, send: Tensor, out_splits: list[int], in_splits: list[int], group) -> None:
    """``dist.all_to_all_single(out, send, out_splits, in_splits, group=group)``, or, where ``group``
    brings its own exchange (an object with ``exchange_rows(out, send, out_splits, in_splits)``:
    every rank of a group emulated in one process, as the one-GPU tests do), that exchange: the
    relayout's only communication, pluggable so that tests run the real code path for every rank."""
    exchange = getattr(group, "exchange_rows", None)
    if exchange is not None:
        exchange(out, send, out_splits, in_splits)
    else:
        dist.all_to_all_single(out, send, out_splits, in_splits, group=group)


def _to_heads(x: Tensor, layout: HeadLayout, group: dist.ProcessGroup | None) -> Tensor:
    """``(T_local, C, ...)`` to ``(T_total, C / cp, ...)`` in gathered order (no autograd)."""
    cp, local = layout.cp_size, x.shape[0]
    blocks = x.reshape(local, cp, x.shape[1] // cp, *x.shape[2:]).transpose(0, 1).contiguous()
    return to_gathered(blocks_to_rows(blocks, layout, group), gathered_index(layout))


def _to_sequence(y: Tensor, layout: HeadLayout, local: int, group: dist.ProcessGroup | None) -> Tensor:
    """``(T_total, c, ...)`` in gathered order to ``(T_local, cp * c, ...)`` (no autograd)."""
    index = gathered_index(layout)
    rows = y.new_empty(y.shape)
    to_received(rows, y, index)
    blocks = rows_to_blocks(rows, layout, local, group)
    return blocks.transpose(0, 1).reshape(local, layout.cp_size * y.shape[1], *y.shape[2:])


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, layout: HeadLayout, group):
        ctx.layout, ctx.group, ctx.local = layout, group, x.shape[0]
        return _to_heads(x, layout, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _to_sequence(grad, ctx.layout, ctx.local, ctx.group), None, None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, layout: HeadLayout, group, local: int):
        ctx.layout, ctx.group = layout, group
        return _to_sequence(y, layout, local, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _to_heads(grad, ctx.layout, ctx.group), None, None, None
