"""The ring transport (``mode="ring"``): K/V around the CP group point to point, double-buffered.

:class:`RingTransport` implements :class:`~ringpack.attention.kv_transport.KVTransport`: at each
remote step this rank holds the buffer of the rank ``t`` before it and passes it on while the
engine (:mod:`ringpack.attention.engine`) runs that step's kernels; distances nobody needs are
jumped over, and in backward the buffer's dK/dV accumulate on the way round and return home. It
moves bytes only. The engine's and the transport protocol's names are also importable from here,
their former home. See docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.engine import (
    FORWARD_ONLY_PART_ROWS,
    ContextParallelAttention,
    PassConfig,
    attention_backward,
    attention_forward,
    pack_kv,
)
from ringpack.attention.kv_transport import KVTransport, TransportFactory, pass_schedule
from ringpack.attention.schedule import Schedule
from ringpack.attention.streams import issued_after, mark

__all__ = [
    "FORWARD_ONLY_PART_ROWS",
    "ContextParallelAttention",
    "KVTransport",
    "PassConfig",
    "RingTransport",
    "TransportFactory",
    "attention_backward",
    "attention_forward",
    "pack_kv",
    "pass_schedule",
]


class _P2P:
    """Point-to-point exchange with partners named by their offset in the CP group (group ranks -> global ranks)."""

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None) -> None:
        c, r = schedule.cp_size, schedule.cp_rank
        self._global = [
            dist.get_global_rank(group, (r + d) % c) if group is not None else (r + d) % c for d in range(c)
        ]
        self._group = group

    def exchange(self, send: Sequence[Tensor], to: int, recv: Sequence[Tensor], frm: int, tag: int, after=None) -> list:
        """Post the sends (to offset ``to``) and the receives (from offset ``frm``), in order, as one
        batch; empty tensors are skipped (both sides know every size, so they skip alike).
        ``after``: an event the transfer waits for instead of the whole current stream."""
        ops = [
            dist.P2POp(dist.isend, t, self._global[to], self._group, 2 * tag + j)
            for j, t in enumerate(send)
            if t.numel()
        ]
        ops += [
            dist.P2POp(dist.irecv, t, self._global[frm], self._group, 2 * tag + j)
            for j, t in enumerate(recv)
            if t.numel()
        ]
        if not ops:
            return []
        with issued_after(after, ops[0].tensor.device):
            return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class RingTransport:
    """K/V around the ring, double-buffered; hops jump over distances that nobody needs.

    At remote step ``i`` (distance ``t_i``) this rank holds the buffer of rank ``r - t_i``. Moving to
    step ``i+1`` every rank passes what it holds ``t_{i+1} - t_i`` ranks forward, so bytes per step
    match a plain ring while skipped distances cost nothing.
    """

    send_capacity = None

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        self._p2p = _P2P(schedule, group)
        c, r = schedule.cp_size, schedule.cp_rank
        dists = schedule.distances
        self._hops = np.diff((0, *dists)).tolist()
        self._home = c - dists[-1] if dists else 0
        # tokens held at remote step i (index i+1; index 0 is this rank's own buffer)
        self._held = [schedule.buffer_tokens[(r - t) % c] for t in (0, *dists)]
        self._kv_pending: tuple[list, Tensor, Tensor] | None = None  # (works, received, sent)
        self._grad_pending: tuple[list, Tensor, Tensor | None] | None = None

    def begin(self, kv: Tensor | Sequence[Tensor], grad_dtype: torch.dtype | None = None) -> None:
        self._shape, self._dtype, self._device = kv[0].shape[1:], kv[0].dtype, kv[0].device
        self._grad_dtype = grad_dtype
        self._first = (kv, self._empty(self._held[1], self._dtype), mark(kv[0]))

    def start(self) -> None:
        send, recv, packed = self._first
        del self._first
        self._launch_kv(0, send, recv, packed)

    def _empty(self, tokens: int, dtype: torch.dtype | None) -> Tensor:
        return torch.empty((2, tokens, *self._shape), dtype=dtype, device=self._device)

    def _launch_kv(self, i: int, send: Tensor | Sequence[Tensor], recv: Tensor | None = None, after=None) -> None:
        hop = self._hops[i]
        recv = self._empty(self._held[i + 1], self._dtype) if recv is None else recv
        works = self._p2p.exchange(tuple(send), hop, tuple(recv), -hop, tag=2 * i, after=after)
        self._kv_pending = (works, recv, send)  # keep the send buffer alive until the transfer is waited on

    def buffer(self, i: int) -> Tensor:
        works, kv, _ = self._kv_pending
        _wait(works)
        self._kv_pending = None  # the compute stream waited: the sent buffer may go
        if i + 1 < len(self._hops):
            self._launch_kv(i + 1, kv)  # in flight while the caller runs step i's kernels
        return kv

    def push_grad(self, i: int, dkv: Sequence[Tensor] | None) -> None:
        held = self._held[i + 1]
        incoming = None
        if i > 0:  # the sum of the ranks that held this buffer before
            works, incoming, _ = self._grad_pending
            _wait(works)
        if dkv is None:  # no query of this rank used the buffer: pass the sum on unchanged
            dkv = incoming if incoming is not None else self._empty(held, self._grad_dtype).zero_()
        elif held and incoming is not None:
            for grad, more in zip(dkv, incoming):
                grad.add_(more)
        last = i + 1 == len(self._hops)
        to = self._home if last else self._hops[i + 1]
        recv_tokens = self._held[0] if last else self._held[i + 2]
        recv = self._empty(recv_tokens, self._grad_dtype)
        works = self._p2p.exchange(tuple(dkv), to, tuple(recv), -to, tag=2 * i + 1)
        self._grad_pending = (works, recv, dkv)

    def finish(self) -> Tensor | None:
        works, own, _ = self._grad_pending
        _wait(works)
        return own if own.numel() else None
