"""Each mode of the table (:mod:`ringpack.modes`) to the runtime that runs it, in one place.

A sequence-split mode runs the engine (:mod:`ringpack.attention.engine`) with its transport
(:mod:`ringpack.attention.transports`); a head-parallel mode runs the head-parallel engine
(:mod:`ringpack.attention.ulysses`), over the whole group or, for a hybrid, within each node with
its row's sequence mode between nodes (:mod:`ringpack.attention.hybrid`). :func:`run_mode` is the
eager autograd path; :func:`mode_forward` and :func:`mode_backward` are the traced op's halves
(:mod:`ringpack.attention.traced`). A new mode needs nothing here. See docs/attention.md, "Modes".
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from ringpack.attention.engine import ContextParallelAttention, PassConfig, attention_backward, attention_forward
from ringpack.attention.hybrid import head_parallel_attention, head_parallel_parts
from ringpack.attention.schedule import Schedule
from ringpack.attention.transports import transport_factory
from ringpack.attention.ulysses import heads_backward_op, heads_forward_op
from ringpack.modes import MODE_TABLE

__all__ = ["mode_backward", "mode_forward", "run_mode"]


def run_mode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    scale: float,
    backend: str,
    part_rows: int | None = None,
) -> Tensor:
    """Causal per-sample attention of this rank's tokens under ``mode``, differentiable (autograd).

    Args:
        q: ``(T, H, D)``; k, v: ``(T, H_kv, D)``; contiguous, fitting ``schedule`` and agreed on by
            the group (:func:`~ringpack.attention.checks.check_inputs`).
        schedule: this rank's schedule; group: the CP group (None: the world).
        mode: a name of :data:`~ringpack.modes.MODES`.
        scale, backend: the softmax scale and a resolved backend.
        part_rows: the forward's row chunks without gradients (:func:`~ringpack.attention.engine.attention_forward`).

    Returns:
        ``out (T, H, D)`` in ``q``'s dtype.

    Raises:
        DataError: a head-parallel mode's constraints (:func:`~ringpack.attention.hybrid.head_parallel_parts`).
    """
    if MODE_TABLE[mode].head_parallel:
        return head_parallel_attention(q, k, v, schedule, group, mode, scale, backend, part_rows)
    return ContextParallelAttention.apply(q, k, v, schedule, transport_factory(mode, group), scale, backend, part_rows)


def mode_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    scale: float,
    backend: str,
    part_rows: int | None,
) -> tuple[Tensor, Tensor]:
    """The forward of :func:`run_mode` without autograd: ``(out [T, H, D] in q's dtype, lse [H, T]
    in the accumulation dtype)``, both of this rank's tokens (arguments and raises as :func:`run_mode`)."""
    if MODE_TABLE[mode].head_parallel:
        parts = head_parallel_parts(q, k, schedule, group, mode, scale, backend, part_rows)
        return heads_forward_op(q, k, v, *parts)
    config = PassConfig(scale, backend, transport_factory(mode, group), part_rows)
    return attention_forward(q, k, v, schedule, config)


def mode_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward of :func:`mode_forward`: ``(dq, dk, dv)`` in the dtypes of q, k, v, given a
    contiguous ``dout`` and the forward's ``out`` and ``lse``."""
    if MODE_TABLE[mode].head_parallel:
        parts = head_parallel_parts(q, k, schedule, group, mode, scale, backend)
        return heads_backward_op(dout, q, k, v, out, lse, *parts)
    config = PassConfig(scale, backend, transport_factory(mode, group))
    return attention_backward(dout, q, k, v, out, lse, schedule, config)
