"""Head-parallel (Ulysses) context-parallel attention: ``mode="ulysses"``.

One all-to-all turns this rank's ``q``/``k``/``v`` rows into ``H / cp`` query heads (and the K/V
heads they read) of every token of the micro-batch, whole samples in gathered order
(:mod:`ringpack.attention.relayout`); one causal varlen pass over whole samples runs them (the
engine's local step on the layout's one-rank schedule: one kernel call, or a hybrid backend's dense
split, no merges); one all-to-all takes the output home. The backward mirrors it: ``dout`` to
heads, the kernels' backward, ``dq``/``dk``/``dv`` home in one all-to-all. Exact for any plan.

GQA: rank ``j`` takes query heads ``[j H/cp, (j+1) H/cp)``. When ``cp`` divides ``H_kv`` it takes
K/V heads ``[j H_kv/cp, (j+1) H_kv/cp)``; otherwise each K/V head is sent as ``r = cp / gcd(H_kv,
cp)`` replicas (``H_kv * r = lcm(H_kv, cp)`` heads, ``H_kv / gcd(H_kv, cp)`` per rank, each replica
to one rank only), the fewest that give every rank one uniform group size; the replicas' dK/dV are
summed on the way home. See docs/attention.md, "Head-parallel (Ulysses) attention".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.kernels import accum_dtype
from ringpack.attention.relayout import (
    blocks_to_rows,
    gathered_index,
    head_layout,
    rows_to_blocks,
    to_gathered,
    to_received,
)
from ringpack.attention.ring import PassConfig, attention_backward, attention_forward
from ringpack.attention.schedule import HeadLayout, Schedule
from ringpack.errors import DataError

__all__ = ["HeadSplit", "UlyssesAttention", "ulysses_attention"]


@dataclass(frozen=True, kw_only=True)
class HeadSplit:
    """How ``heads`` query heads and ``kv_heads`` K/V heads split over ``cp`` ranks.

    Raises:
        DataError: ``heads`` not a multiple of ``cp`` (the message names both).
    """

    heads: int
    kv_heads: int
    cp: int

    def __post_init__(self) -> None:
        if self.heads % self.cp:
            raise DataError(
                f"mode='ulysses' splits the {self.heads} query heads over the CP size {self.cp}: "
                "the heads must be a multiple of it (use mode='ring', 'allgather' or 'p2p')"
            )

    @property
    def replicas(self) -> int:
        """Copies of each K/V head sent (1: no replication)."""
        return self.cp // math.gcd(self.kv_heads, self.cp)

    @property
    def rank_heads(self) -> int:
        return self.heads // self.cp

    @property
    def rank_kv_heads(self) -> int:
        return self.kv_heads * self.replicas // self.cp


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, schedule: Schedule, group: dist.ProcessGroup | None, scale: float, backend: str
) -> Tensor:
    """Head-parallel causal per-sample attention of this rank's tokens (what ``ring_attention(mode="ulysses")`` runs).

    Args:
        q: ``(T, H, D)``, k/v: ``(T, H_kv, D)``, contiguous, fitting ``schedule`` (checked by the caller,
            with the group).
        schedule: this rank's schedule; its head layout drives the all-to-all.
        group: the CP group (None: the world; unused for CP=1).
        scale: the softmax scale; backend: a resolved backend.

    Returns:
        ``out (T, H, D)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
        DataError: ``H`` not a multiple of the CP size, or a schedule without its head layout.
    """
    layout = head_layout(schedule)
    split = HeadSplit(heads=q.shape[1], kv_heads=k.shape[1], cp=layout.cp_size)
    return UlyssesAttention.apply(q, k, v, layout, split, group, PassConfig(scale, backend))


def _blocks(x: Tensor, cp: int) -> Tensor:
    """``(T, cp * h, D)`` as ``(cp, T, h, D)`` (a view: block ``j`` goes to rank ``j``)."""
    return x.view(x.shape[0], cp, x.shape[1] // cp, x.shape[2]).transpose(0, 1)


def _home(blocks: Tensor) -> Tensor:
    """``(cp, T, h, D)`` blocks back from every rank as ``(T, cp * h, D)``."""
    cp, local, h, dim = blocks.shape
    return blocks.transpose(0, 1).reshape(local, cp * h, dim)


class UlyssesAttention(torch.autograd.Function):
    """Exact causal per-sample attention by head-parallel CP (forward and backward); see the module docstring.

    Saves the gathered ``q``/``k``/``v``, ``out`` and ``lse`` (``H / cp`` heads of every token) for
    the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout: HeadLayout, split: HeadSplit, group, config: PassConfig):
        cp, local, dim = layout.cp_size, q.shape[0], q.shape[2]
        hq, hkv = split.rank_heads, split.rank_kv_heads
        if split.replicas > 1:
            k, v = (x.repeat_interleave(split.replicas, dim=1) for x in (k, v))
        send = q.new_empty((cp, local, hq + 2 * hkv, dim))
        send[:, :, :hq].copy_(_blocks(q, cp))
        send[:, :, hq : hq + hkv].copy_(_blocks(k, cp))
        send[:, :, hq + hkv :].copy_(_blocks(v, cp))
        rows = blocks_to_rows(send, layout, group)
        del send
        index = gathered_index(layout)
        qg, kg, vg = (to_gathered(rows[:, a:b], index) for a, b in _parts(hq, hkv))
        del rows
        out_g, lse = attention_forward(qg, kg, vg, layout.attention, config)
        ctx.save_for_backward(qg, kg, vg, out_g, lse, index)
        ctx.layout, ctx.split, ctx.group, ctx.config, ctx.local = layout, split, group, config, local
        return _home(rows_to_blocks(_received(out_g, index), layout, local, group))

    @staticmethod
    def backward(ctx, dout):
        qg, kg, vg, out_g, lse, index = ctx.saved_tensors
        layout, split, group, local = ctx.layout, ctx.split, ctx.group, ctx.local
        cp, hq, hkv = layout.cp_size, split.rank_heads, split.rank_kv_heads
        dout_g = to_gathered(blocks_to_rows(_blocks(dout.contiguous(), cp).contiguous(), layout, group), index)
        dq_g, dk_g, dv_g = attention_backward(dout_g, qg, kg, vg, out_g, lse, layout.attention, ctx.config)
        del dout_g
        rows = dq_g.new_empty((layout.num_tokens, hq + 2 * hkv, qg.shape[2]))
        for (a, b), grad in zip(_parts(hq, hkv), (dq_g, dk_g, dv_g)):
            to_received(rows[:, a:b], grad, index)
        del dq_g, dk_g, dv_g
        blocks = rows_to_blocks(rows, layout, local, group)
        dq, dk, dv = (_home(blocks[:, :, a:b]) for a, b in _parts(hq, hkv))
        if split.replicas > 1:  # replicas of one K/V head are adjacent: sum them in float, round once
            dk, dv = (_sum_replicas(x, split) for x in (dk, dv))
        return dq, dk, dv, None, None, None, None


def _parts(hq: int, hkv: int) -> tuple[tuple[int, int], ...]:
    """The head ranges of q, k and v in one packed row of the exchange."""
    return (0, hq), (hq, hq + hkv), (hq + hkv, hq + 2 * hkv)


def _received(y: Tensor, index: Tensor | None) -> Tensor:
    """Gathered-order rows in receive order (``y`` itself when the orders agree)."""
    if index is None:
        return y
    rows = y.new_empty(y.shape)
    to_received(rows, y, index)
    return rows


def _sum_replicas(grad: Tensor, split: HeadSplit) -> Tensor:
    local, _, dim = grad.shape
    replicas = grad.view(local, split.kv_heads, split.replicas, dim)
    return replicas.sum(2, dtype=accum_dtype(grad.dtype)).to(grad.dtype)
