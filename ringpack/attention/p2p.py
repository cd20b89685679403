"""The targeted K/V exchange (``mode="p2p"``): every needed piece goes only to the ranks that need it.

Per engine pass a rank posts one ``batch_isend_irecv`` with its partners
(:class:`~ringpack.attention.exchange.TargetedExchange`), started once the local kernel is queued;
in backward the K/V travel again and each rank returns the dK/dV of what it received to the owners
in a second batch, which the owner sums. The bytes are the ``p2p`` traffic of
:func:`ringpack.traffic.kv_traffic`. Node-relayed (a schedule compiled with ``gpus_per_node``),
pieces cross nodes once per node through a proxy, in a second batch each way. Point-to-point
rather than ``all_to_all_single``: host work in the partners, not in the group size.

The engine runs :func:`targeted_schedule`; only :class:`TargetedTransport` and its factory live
here, the loop, merge and gradient bookkeeping are the engine's (:mod:`ringpack.attention.engine`).

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

# message tags (gloo matches them; NCCL matches each pair's messages in order): each stage's
# messages between a pair get tags base + 2k (K or dK) and base + 2k + 1 (V or dV), k counting up
_KV_TAG, _RELAY_TAG, _GRAD_TAG, _GRAD_RELAY_TAG = 0, 1 << 20, 2 << 20, 3 << 20

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


def _post(ops: list[dist.P2POp], after, device: torch.device, behind: Sequence = ()) -> list:
    """Issue ``ops`` as one batch (nothing if empty), waiting for ``after`` only (:mod:`streams`) and,
    on CUDA, for the works ``behind`` (the side stream waits for them, the compute stream does not)."""
    if not ops:
        return []
    with issued_after(after, device):
        for work in behind:
            work.wait()
        return dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


Message = tuple[int, Sequence[Tensor]]  # (CP rank, its K and V, or dK and dV)


class TargetedTransport:
    """Implements :class:`~ringpack.attention.kv_transport.KVTransport` with batched point-to-point
    exchanges over ``group`` (None: the world).

    ``schedule`` is the :func:`targeted_schedule` of the pass: step ``i`` reads the buffer of
    ``exchange.sources[i]``. Flat, there is one batch per pass and direction. Node-relayed
    (:class:`~ringpack.attention.exchange.TargetedExchange`), K/V go in two stages: first to the
    ranks of this node and to each other node's proxy, then from the proxies to the rest of their
    node; steps of this node's sources wait for the first stage only. The dK/dV go home the same
    way back: within nodes first (proxies sum what they forwarded), then from the proxies across
    nodes. dK/dV travel in the K/V dtype (each hop rounds once); the owner sums them in float, or
    adopts a lone one that covers its buffer.
    """

    send_capacity = None

    def __init__(self, schedule: Schedule, group: dist.ProcessGroup | None = None) -> None:
        self._ex = schedule.exchange
        self._ranks = _global_ranks(group)
        self._group = group
        self._own = schedule.buffer_tokens[schedule.cp_rank]
        self._stages: list[list] = []  # works of each K/V stage, until waited
        self._waited = 0  # K/V stages the compute stream has waited for
        self._recv: list[Tensor | None] = []
        self._jobs: list[Tensor] | None = None  # the proxied buffers (U) while stage two may read them
        self._sent: list = []  # tensors in flight, alive until waited on
        self._grads: list[Sequence[Tensor] | None] = []
        self._works: list = []

    # ---------------------------------------------------------------- K/V

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
        # a source this rank proxies arrives in its proxied buffer (``_own_rows``)
        self._recv = [
            self._empty(0 if ex.via_of(i) == ex.rank else n, self._dtype) for i, n in enumerate(ex.recv_tokens)
        ]
        self._jobs = [self._empty(job.tokens, self._dtype) for job in ex.proxied]
        self._grads = [None] * len(ex.sources)
        self._first = (sends, mark(k))  # every buffer allocated before the mark (streams)

    def start(self) -> None:
        sends, after = self._first
        del self._first
        ex = self._ex
        direct = [(s, self._recv[i]) for i, s in enumerate(ex.sources) if ex.via_of(i) == s]
        recvs = direct + [(job.source, buf) for job, buf in zip(ex.proxied, self._jobs)]
        ops = self._ops(list(zip(ex.dests, sends)), recvs, _KV_TAG)  # host work behind the local kernel
        self._stages = [_post(ops, after, self._device)]
        self._sent = [sends]
        self._waited = 0
        if ex.relayed:
            # the relays read what stage one brings the proxies: on NCCL the side stream waits for
            # it (the compute stream does not); gloo does not order batches, the host waits
            on_gpu = self._device.type == "cuda"
            if not on_gpu:
                self._wait_stages(1)
            behind = self._stages[0] if on_gpu else ()
            relays = [
                (dest, (buf[0][u : u + n], buf[1][u : u + n]))
                for job, buf in zip(ex.proxied, self._jobs)
                for dest, u, n, _ in job.forwards
            ]
            relayed = [(frm, self._rows(self._recv[i], o, n)) for i, frm, o, n in ex.relay_in]
            self._stages.append(_post(self._ops(relays, relayed, _RELAY_TAG), after, self._device, behind))

    def _empty(self, tokens: int, dtype: torch.dtype) -> Tensor:
        return torch.empty((2, tokens, *self._shape), dtype=dtype, device=self._device)

    @staticmethod
    def _rows(buf: Tensor | Sequence[Tensor], offset: int, n: int) -> tuple[Tensor, Tensor]:
        """Rows ``offset:offset+n`` of a K/V (or dK/dV) pair, as views."""
        return buf[0][offset : offset + n], buf[1][offset : offset + n]

    def _global_rank(self, rank: int) -> int:
        """The global rank of CP rank ``rank`` (what point-to-point operations name)."""
        return rank if self._ranks is None else self._ranks[rank]

    def _ops(self, sends: list[Message], recvs: list[Message], base: int) -> list[dist.P2POp]:
        """One batch's operations: each message's two tensors to (from) its CP rank, tagged by its
        place among the messages of that pair and direction."""
        ops = []
        for op, messages in ((dist.isend, sends), (dist.irecv, recvs)):
            count: dict[int, int] = {}
            for rank, pair in messages:
                k = count[rank] = count.get(rank, -1) + 1
                to = self._global_rank(rank)
                ops += [dist.P2POp(op, t, to, self._group, base + 2 * k + j) for j, t in enumerate(pair)]
        return ops

    def buffer(self, i: int) -> Tensor:
        ex = self._ex
        if i >= len(ex.sources):  # the step of a rank that only sends
            self._wait_stages(len(self._stages))
            return self._empty(0, self._dtype)
        via = ex.via_of(i)
        # the last step waits for every stage: a proxy's forwards complete within the pass
        last = i + 1 == len(ex.steps)
        self._wait_stages(len(self._stages) if last else 1 if via in (ex.sources[i], ex.rank) else 2)
        if via == ex.rank:  # this rank is the source's proxy: its rows are in the proxied buffer
            buf = self._own_rows(i)
        else:
            buf = self._recv[i]
        self._recv[i] = None  # held by the engine for this step only
        if (
            self._jobs is not None
            and self._waited == len(self._stages)
            and all(ex.via_of(j) != ex.rank or self._recv[j] is None for j in range(len(ex.sources)))
        ):
            self._jobs = None  # stage two has read them and every own part is taken
        return buf

    def _wait_stages(self, upto: int) -> None:
        """Make the compute stream wait for the first ``upto`` K/V stages."""
        while self._waited < min(upto, len(self._stages)):
            _wait(self._stages[self._waited])
            self._waited += 1
        if self._waited == len(self._stages):
            self._sent = []  # the compute stream waited: sent rows may go

    def _own_rows(self, i: int) -> Tensor:
        """This rank's buffer of source ``i``, which it proxies: its rows of the proxied buffer."""
        j = next(n for n, job in enumerate(self._ex.proxied) if job.own_index == i)
        job, whole = self._ex.proxied[j], self._jobs[j]
        if job.own == ((0, job.tokens, 0),):
            return whole
        buf = self._empty(self._ex.recv_tokens[i], self._dtype)
        for u, n, offset in job.own:
            buf[:, offset : offset + n] = whole[:, u : u + n]
        return buf

    # ---------------------------------------------------------------- dK/dV

    def push_grad(self, i: int, dkv: Sequence[Tensor] | None) -> None:
        ex = self._ex
        if i < len(ex.sources):
            if dkv is None:  # no query used the buffer (never in practice): its owner still waits for a return
                dkv = self._empty(ex.recv_tokens[i], self._dtype).zero_()
            self._grads[i] = [g.to(self._dtype).contiguous() for g in dkv]
        if i + 1 < len(ex.steps):
            return
        self._return_grads()

    def _return_grads(self) -> None:
        """After the last step: every return home. Within nodes first: to this node's owners, and to
        the proxies of relayed buffers; then each proxy's sums across nodes to their owners."""
        ex = self._ex
        near = [j for j, d in enumerate(ex.dests) if ex.gpus_per_node is None or self._same_node(d)]
        far = [j for j in range(len(ex.dests)) if j not in set(near)]
        self._recv = [self._empty(n, self._dtype) for n in ex.send_tokens]  # every destination's return
        works, forwarded = self._return_within_nodes(near)
        sent: list = [self._grads, forwarded]
        sums = []
        if ex.proxied:
            _wait(works)  # the node's returns are in: sum them
            sums = [self._proxy_sum(job, bufs) for job, bufs in zip(ex.proxied, forwarded)]
            works, sent = [], [sums]
        to_owners = [(job.source, g) for job, g in zip(ex.proxied, sums)]
        ops = self._ops(to_owners, [(ex.dests[j], self._recv[j]) for j in far], _GRAD_RELAY_TAG)
        self._works, self._sent = works + (_post(ops, None, self._device) if ops else []), sent
        self._grads = []

    def _return_within_nodes(self, near: list[int]) -> tuple[list, list[list[Tensor]]]:
        """Post the returns within this node (own sources' to them, relayed ones' to their proxies,
        and the receives of its node's destinations and of what it forwarded); the works and the
        buffers of the forwards' returns."""
        ex, grads = self._ex, self._grads
        home = [(s, grads[i]) for i, s in enumerate(ex.sources) if ex.via_of(i) == s]
        to_proxies = [(frm, self._rows(grads[i], o, n)) for i, frm, o, n in ex.relay_in]
        forwarded = [[self._empty(n, self._dtype) for _, _, n, _ in job.forwards] for job in ex.proxied]
        back = [(dest, buf) for job, bufs in zip(ex.proxied, forwarded) for (dest, *_), buf in zip(job.forwards, bufs)]
        ops = self._ops(home + to_proxies, [(ex.dests[j], self._recv[j]) for j in near] + back, _GRAD_TAG)
        return _post(ops, None, self._device), forwarded

    def _same_node(self, rank: int) -> bool:
        return rank // self._ex.gpus_per_node == self._ex.rank // self._ex.gpus_per_node

    def _proxy_sum(self, job, forwarded: list[Tensor]) -> Tensor:
        """The dK/dV of a proxied buffer: this rank's own rows plus what each forward returned, summed
        in float and rounded once to the K/V dtype for the trip home."""
        acc = torch.zeros((2, job.tokens, *self._shape), dtype=accum_dtype(self._dtype), device=self._device)
        if job.own_index >= 0:
            own = self._grads[job.own_index]
            for u, n, offset in job.own:
                acc[0, u : u + n] += own[0][offset : offset + n]
                acc[1, u : u + n] += own[1][offset : offset + n]
        for (_, u, n, _), grads in zip(job.forwards, forwarded):
            acc[:, u : u + n] += grads
        return acc.to(self._dtype)

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
