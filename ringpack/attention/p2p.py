"""The targeted K/V exchange (``mode="p2p"``): every needed piece goes only to the ranks that need it.

Per engine pass a rank posts one ``batch_isend_irecv`` with its partners
(:class:`~ringpack.attention.exchange.TargetedExchange`), started once the local kernel is queued;
in backward the K/V travel again and each rank returns the dK/dV of what it received to the owners
in a second batch, which the owner sums. The bytes are the ``p2p`` traffic of
:func:`ringpack.traffic.kv_traffic`. Point-to-point rather than ``all_to_all_single``: host work
in the partners, not in the group size.

The engine runs :func:`targeted_schedule`; only :class:`TargetedTransport` and its factory live
here, the loop, merge and gradient bookkeeping are the engine's (:mod:`ringpack.attention.ring`).

See docs/attention.md, "Targeted exchange".
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.kernels import accum_dtype
from ringpack.attention.schedule import Schedule
from ringpack.attention.streams import issued_after, mark
from ringpack.errors import DataError

__all__ = ["TargetedTransport", "TargetedTransports", "targeted_schedule"]

# message tags: K, V (forward, and again in backward), then dK, dV
_KV_TAG, _GRAD_TAG = 0, 2

# global ranks of a group's ranks, looked up once per group (torch's lookup scans the group)
_GLOBAL_RANKS: dict[dist.ProcessGroup, list[int]] = {}


def _global_ranks(group: dist.ProcessGroup | None) -> list[int] | None:
    """The global rank of each rank of ``group``; None for the world (the identity)."""
    if group is None or group is dist.group.WORLD:
        return None
    ranks = _GLOBAL_RANKS.get(group)
    if ranks is None:
        ranks = _GLOBAL_RANKS[group] = dist.get_process_group_ranks(group)
    return ranks


def targeted_schedule(schedule: Schedule) -> Schedule:
    """``schedule`` with the steps of its targeted exchange: one per rank it receives from, or one
    without calls for a rank that only sends, or none (host work independent of the group size).

    Raises:
        DataError: a schedule without an exchange map (one not made by ``compile_schedule``).
    """
    exchange = schedule.exchange
    if exchange is None:
        raise DataError(
            f"cp rank {schedule.cp_rank}: mode='p2p' needs the schedule's exchange map; "
            "compile the schedule with compile_schedule(microbatch, cp_rank)"
        )
    view = copy.copy(schedule)  # a shallow copy (its group-check cache starts empty)
    object.__setattr__(view, "steps", exchange.steps)
    return view


def _post(ops: list[dist.P2POp], after, device: torch.device) -> list:
    """Issue ``ops`` as one batch (nothing if empty), waiting for ``after`` only (:mod:`streams`)."""
    if not ops:
        return []
    with issued_after(after, device):
        return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


class TargetedTransport:
    """Implements :class:`~ringpack.attention.ring.KVTransport` with one batched point-to-point
    exchange per pass and direction, over ``group`` (None: the world).

    ``schedule`` is the :func:`targeted_schedule` of the pass: step ``i`` reads the buffer of
    ``exchange.sources[i]``. dK/dV travel in the K/V dtype (each destination's return is rounded
    once); the owner sums them in float, or adopts a lone one that covers its buffer.
    """

    send_capacity = None

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        self._ex = ex = schedule.exchange
        ranks = _global_ranks(group)
        self._group = group
        self._sources = list(ex.sources) if ranks is None else [ranks[s] for s in ex.sources]
        self._dests = list(ex.dests) if ranks is None else [ranks[d] for d in ex.dests]
        self._own = schedule.buffer_tokens[schedule.cp_rank]
        self._works: list = []
        self._recv: list[Tensor | None] = []
        self._sent: list = []  # tensors in flight, alive until waited on
        self._grads: list[Sequence[Tensor]] = []

    def begin(self, kv: Tensor | Sequence[Tensor], grad_dtype: torch.dtype | None = None) -> None:
        k, v = kv[0], kv[1]
        self._shape, self._dtype, self._device = k.shape[1:], k.dtype, k.device
        ex = self._ex
        sends = []
        for rows, index in zip(ex.send_ranges, ex.send_index):
            if rows is not None:
                sends.append((k[rows[0] : rows[1]], v[rows[0] : rows[1]]))  # views
            else:
                sends.append((k.index_select(0, index), v.index_select(0, index)))
        self._recv = [self._empty(n, self._dtype) for n in ex.recv_tokens]
        self._first = (sends, mark(k))  # every buffer allocated before the mark (streams)

    def start(self) -> None:
        sends, after = self._first
        del self._first
        ops = self._ops(sends, self._dests, self._recv, self._sources, _KV_TAG)  # host work behind the local kernel
        self._works, self._sent = _post(ops, after, self._device), sends

    def _empty(self, tokens: int, dtype: torch.dtype) -> Tensor:
        return torch.empty((2, tokens, *self._shape), dtype=dtype, device=self._device)

    def _ops(self, send, to: list[int], recv, frm: list[int], tag: int) -> list[dist.P2POp]:
        """Sends of ``send[j]`` (a K and a V tensor) to ``to[j]`` and receives into ``recv[i]`` from ``frm[i]``."""
        ops = [
            dist.P2POp(dist.isend, t, peer, self._group, tag + j)
            for pair, peer in zip(send, to)
            for j, t in enumerate(pair)
        ]
        ops += [
            dist.P2POp(dist.irecv, t, peer, self._group, tag + j)
            for pair, peer in zip(recv, frm)
            for j, t in enumerate(pair)
        ]
        return ops

    def buffer(self, i: int) -> Tensor:
        if self._works or self._sent:
            _wait(self._works)
            self._works, self._sent = [], []  # the compute stream waited: sent rows may go
        if i >= len(self._recv):  # the step of a rank that only sends
            return self._empty(0, self._dtype)
        buf, self._recv[i] = self._recv[i], None  # held by the engine for this step only
        return buf

    def push_grad(self, i: int, dkv: Sequence[Tensor] | None) -> None:
        if i < len(self._sources):
            if dkv is None:  # no query used the buffer (never in practice): its owner still waits for a return
                dkv = self._empty(self._ex.recv_tokens[i], self._dtype).zero_()
            self._grads.append([g.to(self._dtype).contiguous() for g in dkv])
        if i + 1 < len(self._ex.steps):
            return
        # after the last step: every return to its owner, every destination's return to this rank
        self._recv = [self._empty(n, self._dtype) for n in self._ex.send_tokens]
        ops = self._ops(self._grads, self._sources, self._recv, self._dests, _GRAD_TAG)
        self._works, self._sent, self._grads = _post(ops, None, self._device), self._grads, []

    def finish(self) -> Tensor | None:
        _wait(self._works)
        self._works, self._sent = [], []
        returns, self._recv = self._recv, []
        if not self._own:
            return None
        ex = self._ex
        if len(returns) == 1 and ex.send_ranges[0] == (0, self._own):
            return returns[0]  # one destination read the whole buffer: its return is the sum
        own = torch.zeros((2, self._own, *self._shape), dtype=accum_dtype(self._dtype), device=self._device)
        for grads, rows, index in zip(returns, ex.send_ranges, ex.send_index):
            if rows is not None:
                own[:, rows[0] : rows[1]] += grads
            else:
                own.index_add_(1, index, grads.to(own.dtype))
        return own


class TargetedTransports:
    """The transport factory of ``mode="p2p"`` over ``group``: builds a :class:`TargetedTransport`
    per engine pass and gives the engine the pass's schedule (:func:`targeted_schedule`)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group

    def __call__(self, schedule: Schedule) -> TargetedTransport:
        return TargetedTransport(schedule, self.group)

    @staticmethod
    def pass_schedule(schedule: Schedule) -> Schedule:
        return targeted_schedule(schedule)
