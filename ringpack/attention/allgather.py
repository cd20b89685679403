"""All-gather context parallelism (the Llama 3 form) on the same schedule as the ring.

:class:`AllGatherTransport` gathers the compact K/V buffers of the whole CP group in one collective
(started before the local kernel, so the two overlap; buffers padded to the group's largest, as
collectives need equal sizes) and returns dK/dV to their owners with one reduce-scatter. The kernel
calls, the merge and the gradient bookkeeping are the engine's (:mod:`ringpack.attention.engine`). See
docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.schedule import Schedule
from ringpack.attention.streams import issued_after, mark

__all__ = ["AllGatherTransport", "all_gather_flat", "reduce_scatter_flat"]

# torch >= 2.13 renamed the tensor collectives (the old names warn); older releases only have the old ones
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None, async_op: bool = False):
    """All-gather concatenating along dim 0: ``out`` is ``[world * inp.shape[0], ...]`` (a form every backend takes)."""
    return _all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter_flat(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    """Sum-reduce ``inp [world * out.shape[0], ...]`` and keep this rank's slice of dim 0 in ``out``."""
    _reduce_scatter_single(out, inp, op=dist.ReduceOp.SUM, group=group)


class AllGatherTransport:
    """Implements :class:`~ringpack.attention.kv_transport.KVTransport` with all-gather + reduce-scatter."""

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        c, r = schedule.cp_size, schedule.cp_rank
        self._group = group
        self._rank = r
        self._sizes = schedule.buffer_tokens
        self._capacity = max(self._sizes)
        self.send_capacity = self._capacity  # every rank's buffer is padded to the largest (one collective)
        self._origin = [(r - t) % c for t in schedule.distances]
        self._gathered: Tensor | None = None
        self._work = None
        self._send: Tensor | None = None  # this rank's buffer, alive until the gather is waited on
        self._grads: Tensor | None = None

    def begin(self, kv: Tensor, grad_dtype: torch.dtype | None = None) -> None:
        padded = kv
        if kv.shape[1] != self._capacity:  # the engine packs to send_capacity; this is for other callers
            padded = kv.new_zeros((2, self._capacity, *kv.shape[2:]))
            padded[:, : kv.shape[1]] = kv
        world = len(self._sizes)
        flat = kv.new_empty((world * 2, *padded.shape[1:]))
        self._gathered = flat.view(world, *padded.shape)
        self._first = (padded, flat, mark(padded))
        if grad_dtype is not None:
            self._grads = torch.zeros(self._gathered.shape, dtype=grad_dtype, device=kv.device)

    def start(self) -> None:
        self._send, flat, packed = self._first
        del self._first
        with issued_after(packed, flat.device):
            self._work = all_gather_flat(flat, self._send, self._group, async_op=True)

    def buffer(self, i: int) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = self._send = None
        origin = self._origin[i]
        return self._gathered[origin, :, : self._sizes[origin]]

    def push_grad(self, i: int, dkv: Sequence[Tensor] | None) -> None:
        if dkv is not None:
            origin = self._origin[i]
            for j, grad in enumerate(dkv):
                self._grads[origin, j, : self._sizes[origin]] += grad

    def finish(self) -> Tensor | None:
        own = self._grads.new_empty(self._grads.shape[1:])
        reduce_scatter_flat(own, self._grads.flatten(0, 1), self._group)
        n = self._sizes[self._rank]
        return own[:, :n] if n else None
