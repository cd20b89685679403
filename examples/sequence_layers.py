"""Sequence-mixing layers of hybrid models on whole samples under any ringpack plan.

Recurrent and convolutional layers (Gated DeltaNet, Mamba, short convolutions) must see each
sample whole and in order, which no sequence split gives them. Between
``ringpack.attention.sequence_to_heads`` and ``heads_to_sequence`` every CP rank holds a block of
the channels of every token of the micro-batch, samples whole, at the rows
``schedule.head_layout.cu_seqlens`` gives; a layer that mixes tokens within a sample and channels
not at all then runs exactly as on one device. Two such layers, written for packed samples:

* :func:`causal_depthwise_conv`: ``out[t, c] = sum_i weight[i, c] * x[t - i, c]`` over the earlier
  tokens of the same sample (a depthwise causal convolution);
* :func:`decayed_cumsum`: ``h[t, c] = decay[c] * h[t - 1, c] + x[t, c]``, restarting at each sample
  (a linear recurrence: a cumulative decayed sum per channel).

:func:`whole_sample_layer` wraps either one for CP. docs/attention.md quotes this file;
tests/attention/test_sequence_layers.py checks it against single-device per-sample computation,
forward and backward, on 2 to 8 gloo processes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention import Schedule, heads_to_sequence, sequence_to_heads


def position_in_sample(cu_seqlens: Tensor, num_tokens: int) -> Tensor:
    """int64 ``[T]``: each packed row's position within its sample (``cu_seqlens``: int ``[S + 1]``)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    starts = cu_seqlens[:-1].long().repeat_interleave(lengths, output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts


def causal_depthwise_conv(x: Tensor, weight: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``(T, C)`` packed samples -> ``(T, C)``: ``out[t] = sum_i weight[i] * x[t - i]`` within each sample.

    ``weight``: ``(K, C)``, tap ``i`` multiplying the token ``i`` places back.
    """
    position = position_in_sample(cu_seqlens, x.shape[0])
    out = x * weight[0]
    for i in range(1, weight.shape[0]):
        earlier = torch.cat((x.new_zeros((i, x.shape[1])), x[:-i])) if i < x.shape[0] else torch.zeros_like(x)
        out = out + torch.where((position >= i)[:, None], earlier, 0.0) * weight[i]
    return out


def decayed_cumsum(x: Tensor, decay: Tensor, cu_seqlens: Tensor) -> Tensor:
    """``(T, C)`` packed samples -> ``(T, C)``: ``h[t] = decay * h[t - 1] + x[t]``, ``h = 0`` before each sample.

    ``decay``: ``(C,)``. One step per position runs every sample at once (a real model uses a
    fused scan kernel; the arithmetic is the same).
    """
    starts, lengths = cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    state = x.new_zeros((starts.numel(), x.shape[1]))
    rows, values = [], []
    for t in range(int(lengths.max()) if lengths.numel() else 0):
        live = lengths > t
        state = decay * state[live] + x[starts[live] + t]
        starts, lengths = starts[live], lengths[live]
        rows.append(starts + t)
        values.append(state)
    if not rows:
        return torch.zeros_like(x)
    order = torch.argsort(torch.cat(rows))  # every row appears once: back to packed order
    return torch.cat(values)[order]


def whole_sample_layer(
    layer: Callable[[Tensor, Tensor, Tensor], Tensor],
    x: Tensor,
    param: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Run a channel-wise sequence layer on this CP rank's tokens ``x (T_local, C)`` exactly.

    ``param``'s last dim is the ``C`` channels (e.g. ``weight (K, C)``, ``decay (C,)``); each rank
    applies the layer to its ``C / cp`` channels of every sample, whole, and the result comes home.
    """
    layout = schedule.head_layout
    x_heads = sequence_to_heads(x, schedule, group)  # (T_total, C / cp), whole samples in order
    width = x_heads.shape[1]
    block = param[..., schedule.cp_rank * width : (schedule.cp_rank + 1) * width]
    y_heads = layer(x_heads, block, layout.cu_seqlens)
    return heads_to_sequence(y_heads, schedule, group)  # (T_local, C)
