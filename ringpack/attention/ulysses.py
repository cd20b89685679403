"""Head-parallel (Ulysses) context-parallel attention: ``mode="ulysses"`` (and the hybrids' passes).

One all-to-all turns this rank's ``q``/``k``/``v`` rows into ``H / cp`` query heads (and the K/V
heads they read) of every token, whole samples in gathered order (:mod:`ringpack.attention.relayout`);
one causal varlen pass over whole samples runs them (no merges); one all-to-all takes the output
home; the backward mirrors it. GQA: when ``cp`` does not divide ``H_kv``, each K/V head is sent as
``r = cp / gcd(H_kv, cp)`` replicas, each to one rank, their dK/dV summed on the way home.

The hybrid modes (:mod:`ringpack.attention.hybrid`) run the same functions on a node's all-to-all
(:class:`~ringpack.attention.schedule.NodeLayout`) with the engine's pass over the node-level
schedule. Under ``torch.compile``, :func:`heads_forward_op` and :func:`heads_backward_op` run them
inside the traced engine op, which saves only this rank's own tensors.
See docs/attention.md, "Head-parallel (Ulysses) attention".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ringpack.attention.engine import PassConfig, attention_backward, attention_forward
from ringpack.attention.kernels import accum_dtype
from ringpack.attention.relayout import (
    blocks_to_rows,
    gathered_index,
    rows_to_blocks,
    to_gathered,
    to_received,
)
from ringpack.attention.schedule import HeadLayout, NodeLayout
from ringpack.errors import DataError

__all__ = ["HeadSplit", "UlyssesAttention", "heads_backward_op", "heads_forward_op"]

Layout = HeadLayout | NodeLayout  # the all-to-all of head-parallel CP: the whole group's, or the node's


@dataclass(frozen=True, kw_only=True)
class HeadSplit:
    """How ``heads`` query heads and ``kv_heads`` K/V heads split over the ``cp`` ranks of an all-to-all.

    ``mode`` (``"ulysses"``, or a hybrid mode, whose all-to-all spans a node) only words the error.

    Raises:
        DataError: ``heads`` not a multiple of ``cp`` (the message names both).
    """

    heads: int
    kv_heads: int
    cp: int
    mode: str = "ulysses"

    def __post_init__(self) -> None:
        if self.heads % self.cp:
            over = f"the CP size {self.cp}" if self.mode == "ulysses" else f"the {self.cp} GPUs of a node"
            raise DataError(
                f"mode={self.mode!r} splits the {self.heads} query heads over {over}: "
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


# ------------------------------------------------------------------------------- the all-to-alls


def _to_heads(parts: list[Tensor], layout: Layout, group, index: Tensor | None) -> list[Tensor]:
    """This rank's ``(T, cp * h_i, D)`` tensors (one dtype) to their ``(T_total, h_i, D)`` head
    blocks of every token, in gathered order: one all-to-all for all of them."""
    cp, local, dim = layout.cp_size, parts[0].shape[0], parts[0].shape[2]
    widths = [x.shape[1] // cp for x in parts]
    send = parts[0].new_empty((cp, local, sum(widths), dim))
    for (a, b), x in zip(_ranges(widths), parts):
        send[:, :, a:b].copy_(x.contiguous().view(local, cp, b - a, dim).transpose(0, 1))
    rows = blocks_to_rows(send, layout, group)
    del send
    return [to_gathered(rows[:, a:b], index) for a, b in _ranges(widths)]


def _to_sequence(parts: list[Tensor], layout: Layout, local: int, group, index: Tensor | None) -> list[Tensor]:
    """The inverse of :func:`_to_heads`: gathered ``(T_total, h_i, D)`` blocks home as ``(T, cp * h_i, D)``."""
    widths = [x.shape[1] for x in parts]
    rows = parts[0].new_empty((layout.num_tokens, sum(widths), parts[0].shape[2]))
    for (a, b), x in zip(_ranges(widths), parts):
        to_received(rows[:, a:b], x, index)
    blocks = rows_to_blocks(rows, layout, local, group)
    del rows
    cp = layout.cp_size
    return [blocks[:, :, a:b].transpose(0, 1).reshape(local, cp * (b - a), blocks.shape[3]) for a, b in _ranges(widths)]


def _ranges(widths: list[int]) -> list[tuple[int, int]]:
    """The column ranges of parts of ``widths`` packed side by side."""
    ends = list(itertools.accumulate(widths))
    return [(end - w, end) for w, end in zip(widths, ends)]


def _replicated(x: Tensor, split: HeadSplit) -> Tensor:
    return x.repeat_interleave(split.replicas, dim=1) if split.replicas > 1 else x


def _sum_replicas(grad: Tensor, split: HeadSplit) -> Tensor:
    """dK or dV of the replicated heads summed per K/V head (replicas are adjacent), in float, rounded once."""
    if split.replicas == 1:
        return grad
    local, _, dim = grad.shape
    replicas = grad.view(local, split.kv_heads, split.replicas, dim)
    return replicas.sum(2, dtype=accum_dtype(grad.dtype)).to(grad.dtype)


def _lse_to_sequence(lse: Tensor, layout: Layout, local: int, group, index: Tensor | None) -> Tensor:
    """The gathered ``lse [h, T_total]`` home as this rank's ``[cp * h, T]``."""
    (home,) = _to_sequence([lse.t().unsqueeze(-1)], layout, local, group, index)
    return home.squeeze(-1).t().contiguous()


def _lse_to_heads(lse: Tensor, layout: Layout, group, index: Tensor | None) -> Tensor:
    """This rank's ``lse [cp * h, T]`` as the gathered ``[h, T_total]`` (:func:`_lse_to_heads` inverted)."""
    (heads,) = _to_heads([lse.t().contiguous().unsqueeze(-1)], layout, group, index)
    return heads.squeeze(-1).t().contiguous()


# ------------------------------------------------------------------------------- the passes


def _forward(q, k, v, layout: Layout, split: HeadSplit, group, config: PassConfig):
    """``(out [T, H, D], (qg, kg, vg, out_g, lse_g, index))``: the heads' pass over gathered rows."""
    index = gathered_index(layout)
    qg, kg, vg = _to_heads([q, _replicated(k, split), _replicated(v, split)], layout, group, index)
    out_g, lse = attention_forward(qg, kg, vg, layout.attention, config)
    (out,) = _to_sequence([out_g], layout, q.shape[0], group, index)
    return out, (qg, kg, vg, out_g, lse, index)


def _backward(dout_g, qg, kg, vg, out_g, lse, index, layout: Layout, split: HeadSplit, group, local: int, config):
    """This rank's ``(dq, dk, dv)`` from the gathered pass's tensors and ``dout_g``."""
    dq_g, dk_g, dv_g = attention_backward(dout_g, qg, kg, vg, out_g, lse, layout.attention, config)
    del dout_g
    dq, dk, dv = _to_sequence([dq_g, dk_g, dv_g], layout, local, group, index)
    return dq, _sum_replicas(dk, split), _sum_replicas(dv, split)


class UlyssesAttention(torch.autograd.Function):
    """Exact causal per-sample attention by head-parallel CP (forward and backward); see the module docstring.

    ``layout``: the all-to-all (the group's :class:`HeadLayout`, or a node's :class:`NodeLayout`
    for the hybrid modes), ``group`` its process group, ``config`` the pass over the gathered
    rows (with a transport between nodes for the hybrid). Saves the gathered ``q``/``k``/``v``,
    ``out`` and ``lse`` (``H / cp`` heads of every token of the layout) for the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout: Layout, split: HeadSplit, group, config: PassConfig):
        out, saved = _forward(q, k, v, layout, split, group, config)
        ctx.save_for_backward(*saved[:5])
        ctx.index, ctx.layout, ctx.split, ctx.group, ctx.config, ctx.local = (
            saved[5],
            layout,
            split,
            group,
            config,
            q.shape[0],
        )
        return out

    @staticmethod
    def backward(ctx, dout):
        qg, kg, vg, out_g, lse = ctx.saved_tensors
        (dout_g,) = _to_heads([dout.contiguous()], ctx.layout, ctx.group, ctx.index)
        grads = _backward(
            dout_g, qg, kg, vg, out_g, lse, ctx.index, ctx.layout, ctx.split, ctx.group, ctx.local, ctx.config
        )
        return *grads, None, None, None, None


def heads_forward_op(q, k, v, layout: Layout, split: HeadSplit, group, config: PassConfig) -> tuple[Tensor, Tensor]:
    """The traced engine op's forward (``torch.compile``): ``(out [T, H, D], lse [H, T])``, both of
    this rank's tokens. ``lse`` travels home (``1 / D`` of ``out``'s bytes) so the op's saved
    tensors are its own inputs and outputs, whose shapes the graph knows."""
    out, (*_, lse, index) = _forward(q, k, v, layout, split, group, config)
    return out, _lse_to_sequence(lse, layout, q.shape[0], group, index)


def heads_backward_op(dout, q, k, v, out, lse, layout: Layout, split: HeadSplit, group, config: PassConfig):
    """The traced engine op's backward: ``q``, ``k``, ``v``, ``out`` and ``dout`` go to heads again
    in one all-to-all (``lse`` in a second), then the backward of :class:`UlyssesAttention`."""
    index = gathered_index(layout)
    parts = [q, _replicated(k, split), _replicated(v, split), out, dout]
    qg, kg, vg, out_g, dout_g = _to_heads(parts, layout, group, index)
    lse_g = _lse_to_heads(lse, layout, group, index)
    return _backward(dout_g, qg, kg, vg, out_g, lse_g, index, layout, split, group, q.shape[0], config)
