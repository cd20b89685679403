"""The context-parallel engine as one custom op, for code that ``torch.compile`` traces.

While traced, :func:`~ringpack.attention.ring_attention` calls ``torch.ops.ringpack.ring_attention``
(gradient: ``ring_attention_bwd``) instead of the autograd function: a graph cannot hold the
engine's transfers and host reads. The op's inputs are ``q``, ``k``, ``v``, the schedule (an opaque
*reference* object the graph never reads, so a new micro-batch's schedule reuses the graph) and
constants (CP group name, mode, scale, backend). Both ops run the engine functions eager code runs,
and check the inputs and the group's agreement when they run. The head-parallel modes run the
same way; their op returns ``lse`` of this rank's tokens, and its backward sends ``q``, ``k``,
``v``, ``out`` and ``dout`` to heads again (the graph saves only the op's own tensors), where
eager code keeps the gathered tensors instead (:mod:`ringpack.attention.ulysses`). Where torch has no opaque objects
(:data:`~ringpack.attention.schedule.OPAQUE_SCHEDULE` is False) the engine runs outside the graph:
one graph break per call. See docs/integrations.md, "torch.compile".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.checks import check_inputs
from ringpack.attention.dispatch import mode_backward, mode_forward, run_mode
from ringpack.attention.kernels import accum_dtype
from ringpack.attention.mode_choice import resolve_mode
from ringpack.attention.schedule import OPAQUE_SCHEDULE, Schedule

__all__ = ["ring_attention_op"]


def ring_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    softmax_scale: float,
    backend: str,
    part_rows: int | None,
    needs_grad: bool,
) -> Tensor:
    """:func:`~ringpack.attention.ring_attention` for traced code, after its argument handling.

    Args:
        q, k, v: contiguous ``(T, H, D)`` and ``(T, H_kv, D)`` tensors.
        schedule, mode, backend: as in ``ring_attention`` (``backend`` already resolved).
        group: the CP process group (None: the world).
        softmax_scale: the resolved scale.
        part_rows: the forward's row chunking (None with gradients).
        needs_grad: whether the caller's output requires grad (the group checks that all ranks agree).

    Returns:
        ``out``: ``(T, H, D)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
        ValueError, ScheduleMismatchError: as ``ring_attention``, when the op runs.
    """
    if not OPAQUE_SCHEDULE:
        return _outside_graph(q, k, v, schedule, group, mode, softmax_scale, backend, part_rows, needs_grad)
    out, _ = _forward_op(q, k, v, schedule, _group_name(group), mode, softmax_scale, backend, part_rows, needs_grad)
    return out


def _group_name(group: dist.ProcessGroup | None) -> str:
    """A constant that names the group in the graph ("": the world)."""
    return "" if group is None else group.group_name


def _group(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.compiler.disable
def _outside_graph(q, k, v, schedule, group, mode, softmax_scale, backend, part_rows, needs_grad) -> Tensor:
    mode = resolve_mode(mode, schedule)
    check_inputs(q, k, v, schedule, group, mode, needs_grad=needs_grad)
    return run_mode(q, k, v, schedule, group, mode, softmax_scale, backend, part_rows)


def ring_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group_name: str,
    mode: str,
    softmax_scale: float,
    backend: str,
    part_rows: int | None,
    needs_grad: bool,
) -> tuple[Tensor, Tensor]:
    """The op's implementation: check, then the engine's forward; ``(out [T, H, D], lse [H, T])``."""
    group = _group(group_name)
    mode = resolve_mode(mode, schedule)
    check_inputs(q, k, v, schedule, group, mode, needs_grad=needs_grad)
    out, lse = mode_forward(q, k, v, schedule, group, mode, softmax_scale, backend, part_rows)
    return out.contiguous(), lse.contiguous()  # the strides the fake implementation promises


def ring_attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    schedule: Schedule,
    group_name: str,
    mode: str,
    softmax_scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradient op's implementation: the engine's backward; ``(dq, dk, dv)`` like q, k, v."""
    group = _group(group_name)
    mode = resolve_mode(mode, schedule)
    grads = mode_backward(dout.contiguous(), q, k, v, out, lse, schedule, group, mode, softmax_scale, backend)
    return tuple(g.contiguous() for g in grads)


def _forward_fake(q, k, v, schedule, group_name, mode, softmax_scale, backend, part_rows, needs_grad):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=accum_dtype(q.dtype))


def _backward_fake(dout, q, k, v, out, lse, schedule, group_name, mode, softmax_scale, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, schedule, group_name, mode, softmax_scale, backend, _, _ = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (schedule, group_name, mode, softmax_scale, backend)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None, None


if OPAQUE_SCHEDULE:
    _forward_op = torch.library.custom_op("ringpack::ring_attention", ring_attention_forward, mutates_args=())
    _forward_op.register_fake(_forward_fake)
    _backward_op = torch.library.custom_op("ringpack::ring_attention_bwd", ring_attention_backward, mutates_args=())
    _backward_op.register_fake(_backward_fake)
    _forward_op.register_autograd(_backward, setup_context=_setup_context)
