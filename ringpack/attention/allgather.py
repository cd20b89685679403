"""All-gather context parallelism (the Llama 3 form) on the same schedule as the ring (DESIGN.md section 4).

Every rank gathers the compact K/V buffers of the whole CP group in one collective (started before
the local kernel so the two overlap), runs exactly the ring's per-step kernel calls against the
gathered buffers, and returns dK/dV to their owners with one reduce-scatter. Fewer, larger
messages than the ring and no dependency chain between steps; it holds all compact buffers at
once, which is cheap with GQA (only K/V heads travel) and at moderate lengths.

Collectives need equal sizes, so buffers are padded to the largest compact buffer of the group.
Only :class:`AllGatherTransport` lives here: the attention loop, the merge and the gradient
bookkeeping are the ring's (:mod:`ringpack.attention.ring`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.schedule import Schedule

__all__ = ["AllGatherTransport"]


class AllGatherTransport:
    """Implements :class:`~ringpack.attention.ring.KVTransport` with all-gather + reduce-scatter."""

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        c, r = schedule.cp_size, schedule.cp_rank
        self._group = group
        self._rank = r
        self._sizes = schedule.buffer_tokens
        self._capacity = max(self._sizes)
        self._origin = [(r - t) % c for t in schedule.distances]
        self._gathered: Tensor | None = None
        self._work = None
        self._grads: Tensor | None = None

    def begin(self, kv: Tensor, grad_dtype: torch.dtype | None = None) -> None:
        padded = kv
        if kv.shape[1] != self._capacity:
            padded = kv.new_zeros((2, self._capacity, *kv.shape[2:]))
            padded[:, : kv.shape[1]] = kv
        self._gathered = kv.new_empty((len(self._sizes), *padded.shape))
        self._work = dist.all_gather_into_tensor(self._gathered, padded, group=self._group, async_op=True)
        if grad_dtype is not None:
            self._grads = torch.zeros(self._gathered.shape, dtype=grad_dtype, device=kv.device)

    def buffer(self, i: int) -> Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        origin = self._origin[i]
        return self._gathered[origin, :, : self._sizes[origin]]

    def push_grad(self, i: int, dkv: Tensor | None) -> None:
        if dkv is not None:
            origin = self._origin[i]
            self._grads[origin, :, : self._sizes[origin]] += dkv

    def finish(self) -> Tensor | None:
        own = self._grads.new_empty(self._grads.shape[1:])
        dist.reduce_scatter_tensor(own, self._grads, op=dist.ReduceOp.SUM, group=self._group)
        n = self._sizes[self._rank]
        return own[:, :n] if n else None
