"""The targeted exchange map of one CP rank: which rows of its compact K/V buffer go to which rank,
which rows it receives, and its remote kernel calls on what it receives.

Rank ``r`` needs a prefix of rank ``s``'s pieces of each shared sample
(:func:`ringpack.traffic.needed_pieces`), hence one contiguous range of ``s``'s compact send
buffer; both sides derive every range from the micro-batch alone, so they agree on sizes and row
order without telling each other. The schedule compiles its remote calls a second time on the
received rows (zero-query segments shrink, empty ones go), so the engine runs the same kernels on
fewer rows. :func:`exchange_ranges` and :func:`compile_exchange` take time in the rank's pieces
and partners, not in the CP group size (:func:`neighbourhood`); they read the micro-batch's
:class:`~ringpack.piece_table.PieceTable`.

See docs/attention.md, "Targeted exchange".
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ringpack.ranges import concat_ranges, cumsum0, prefix_rows, run_starts
from ringpack.traffic import proxy_index

__all__ = [
    "ProxyJob",
    "TargetedExchange",
    "compile_exchange",
    "exchange_ranges",
    "neighbourhood",
    "sends_of_ranks",
]


@dataclass(frozen=True)
class ProxyJob:
    """This rank as the proxy of ``source`` (a rank of another node) for its node.

    It receives ``tokens`` rows of the source's compact buffer (every row a rank of this node
    needs, in buffer order; call that buffer ``U``), keeps ``own`` for itself and forwards the rest:
    ``own`` lists ``(u, count, offset)``, rows ``u:u+count`` of ``U`` into rows
    ``offset:offset+count`` of its own buffer of the source (its step ``own_index``, -1: none);
    ``forwards`` lists ``(dest, u, count, offset)``, rows ``u:u+count`` of ``U`` to rows
    ``offset:offset+count`` of node rank ``dest``'s buffer of the source. In backward it sums the
    returns of the same rows and sends ``U``'s dK/dV to the source.
    """

    source: int
    tokens: int
    own_index: int
    own: tuple[tuple[int, int, int], ...]
    forwards: tuple[tuple[int, int, int, int], ...]


@dataclass(frozen=True)
class TargetedExchange:
    """One CP rank's part of the targeted exchange (``mode="p2p"``) of one micro-batch.

    ``sources[i]`` (a CP rank) sends this rank ``recv_tokens[i]`` K/V rows, which the calls of
    ``steps[i]`` (a :class:`~ringpack.attention.schedule.RingStep`, ``distance = (rank - source) mod
    C``) read. ``dests[j]`` receives ``send_tokens[j]`` rows of this rank's compact send buffer:
    rows ``send_ranges[j] = (a, b)`` when they are one range, else ``send_index[j]`` (int64).
    A rank that only sends has one step without calls or source (distance 0), the one in which its
    sends complete; a rank with no partner has no step. Sources and destinations come in order of
    ring distance, each one's rows in buffer order.

    Node-relayed (``gpus_per_node`` set, the group over several nodes): sources on another node
    come after those of this rank's node, and their rows arrive ``via[i]``: the source itself
    (same node), this rank (it is the source's proxy for its node: a :class:`ProxyJob` of
    ``proxied``) or the node rank that is (``relay_in``: ``(i, via, offset, count)``, rows
    ``offset:offset+count`` of source ``i``'s buffer, in the second stage). A destination on another
    node is the proxy of that node (:func:`ringpack.traffic.proxy_index`) and gets every row any
    rank of its node needs.
    """

    sources: tuple[int, ...]
    recv_tokens: tuple[int, ...]
    steps: tuple[Any, ...]
    dests: tuple[int, ...]
    send_tokens: tuple[int, ...]
    send_ranges: tuple[tuple[int, int] | None, ...]
    send_index: tuple[Tensor | None, ...]
    via: tuple[int, ...] = ()
    proxied: tuple[ProxyJob, ...] = ()
    relay_in: tuple[tuple[int, int, int, int], ...] = ()
    gpus_per_node: int | None = None
    rank: int = -1

    @property
    def partner_ranks(self) -> frozenset[int]:
        """The other ranks this rank sends to or receives from (its point-to-point partners): the ranks
        its rows arrive from (a relayed source's proxy, not the source), its destinations and the
        ranks it relays to."""
        # a row arrives from its source when this rank is the source's proxy, else from ``via``
        arrive = {src if self.via_of(i) == self.rank else self.via_of(i) for i, src in enumerate(self.sources)}
        ranks = arrive | set(self.dests)
        ranks |= {f[0] for job in self.proxied for f in job.forwards}
        return frozenset(ranks - {self.rank})

    @property
    def partners(self) -> int:
        """How many :attr:`partner_ranks` this rank has."""
        return len(self.partner_ranks)

    def via_of(self, i: int) -> int:
        """The rank source ``i``'s rows arrive from (the source itself unless relayed)."""
        return self.via[i] if self.via else self.sources[i]

    @property
    def relayed(self) -> bool:
        """Whether the exchange has a second stage (some source's rows come through a proxy)."""
        return bool(self.proxied or self.relay_in)

    def map_tensors(self, fn: Callable[[Tensor], Tensor]) -> TargetedExchange:
        """A copy with ``fn`` applied to every tensor (send indices and the steps' calls)."""
        return replace(
            self,
            steps=tuple(replace(st, calls=tuple(c._map_tensors(fn) for c in st.calls)) for st in self.steps),
            send_index=tuple(None if t is None else fn(t) for t in self.send_index),
        )


def neighbourhood(table: Any, mine: np.ndarray) -> np.ndarray:
    """Rows of the piece table holding the samples of rows ``mine`` (any ranks' pieces): every
    piece of each, in (sample, start) order, through ``table.by_sample`` and
    ``table.sample_bounds``. Its size is those pieces plus their samples' pieces elsewhere."""
    if not mine.size:
        return np.zeros(0, dtype=np.int64)
    own = np.unique(table.slot[mine])
    lo = table.sample_bounds[own]
    return table.by_sample[concat_ranges(lo, table.sample_bounds[own + 1] - lo)]


def exchange_ranges(table: Any, mine: np.ndarray, cp_rank: int) -> tuple[np.ndarray, np.ndarray]:
    """The ranges rank ``cp_rank`` (its pieces: table rows ``mine``) receives and sends, read from
    its :func:`neighbourhood` only.

    Returns:
        ``(receives, sends)``, int64 ``[n, 3]`` arrays of ``(partner, lo, count)``: rows
        ``lo:lo+count`` of the holder's compact send buffer (the partner's for a receive, this
        rank's for a send), one per shared sample and partner, sorted by partner then ``lo``.
    """
    receives, sends = _ranges_of(table, mine, np.array([cp_rank], dtype=np.int64))
    return receives[:, 1:], sends[:, 1:]


def sends_of_ranks(table: Any, ranks: Sequence[int], to: tuple[int, int] | None = None) -> dict[int, np.ndarray]:
    """The sends of each of ``ranks`` (the second array of its :func:`exchange_ranges`), computed
    together in one pass over their joint neighbourhood; ``to=(lo, hi)`` keeps only the sends to
    ranks ``lo..hi-1`` (one node's), which bounds the work by the ranks' samples times those ranks
    rather than times every rank the samples span."""
    targets = np.unique(np.asarray(ranks, dtype=np.int64))
    lo, hi = np.searchsorted(table.rank, targets), np.searchsorted(table.rank, targets + 1)
    _, sends = _ranges_of(table, concat_ranges(lo, hi - lo), targets, to)
    bounds = np.append(np.searchsorted(sends[:, 0], targets), len(sends))
    return {int(r): sends[bounds[i] : bounds[i + 1], 1:] for i, r in enumerate(targets.tolist())}


def _ranges_of(
    table: Any, rows_of_targets: np.ndarray, targets: np.ndarray, partners: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(receives, sends)`` of every rank of ``targets`` (ascending; their pieces: table rows
    ``rows_of_targets``) with partners among ranks ``partners = (lo, hi)`` (``None``: any), int64
    ``[n, 4]`` arrays of ``(target, partner, lo, count)`` sorted by target, partner, then ``lo``.

    Every (sample, rank) group of a target is paired with each other group of its sample whose rank
    is a partner: the target receives the other group's pieces ending by its own last start, and
    sends its own pieces ending by the other's last start."""
    empty = np.zeros((0, 4), dtype=np.int64)
    rows = neighbourhood(table, rows_of_targets)
    if not rows.size:
        return empty, empty
    cols = ("rank", "slot", "start", "stop", "compact")
    rank, slot, start, stop, compact = (getattr(table, c)[rows] for c in cols)
    order, first, last = _sample_rank_groups(rank, slot)
    rank, slot, start, stop, compact = (x[order] for x in (rank, slot, start, stop, compact))
    group = np.repeat(np.arange(first.size), last - first + 1)
    g_slot, g_rank, g_last_start = slot[first], rank[first], start[last]
    pair_own, pair_other = _group_pairs(g_slot, g_rank, targets, partners or (0, table.cp_size))
    # receive: the other group's pieces ending by the target's last start; send: own pieces ending by theirs
    holder = np.concatenate((pair_other, pair_own))
    limit = np.concatenate((g_last_start[pair_own], g_last_start[pair_other]))
    count = prefix_rows(group, start, stop, first, holder, limit)
    lo = compact[first[holder]]
    target = np.tile(g_rank[pair_own], 2)
    partner = np.tile(g_rank[pair_other], 2)
    out = []
    for part in (slice(0, pair_own.size), slice(pair_own.size, None)):
        t, p, a, n = target[part], partner[part], lo[part], count[part]
        keep = n > 0
        t, p, a, n = t[keep], p[keep], a[keep], n[keep]
        by = np.lexsort((a, p, t))
        out.append(np.stack([t[by], p[by], a[by], n[by]], axis=1).reshape(-1, 4))
    return out[0], out[1]


def _group_pairs(
    g_slot: np.ndarray, g_rank: np.ndarray, targets: np.ndarray, partners: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """``(own, other)``: every pair of (sample, rank) groups of one sample (groups sorted by sample,
    then rank) where ``own``'s rank is a target and ``other``'s another rank in ``partners``."""
    width = max(int(g_rank.max()) + 1, partners[1])
    sample = np.cumsum(run_starts(g_slot)) - 1
    key = sample * width + g_rank  # ascending
    own = np.flatnonzero(np.isin(g_rank, targets))
    lo = np.searchsorted(key, sample[own] * width + partners[0])
    hi = np.searchsorted(key, sample[own] * width + partners[1])
    pair_own = np.repeat(own, hi - lo)
    pair_other = concat_ranges(lo, hi - lo)
    keep = pair_other != pair_own
    return pair_own[keep], pair_other[keep]


def _sample_rank_groups(rank: np.ndarray, slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces (non-empty, each rank's in canonical order) grouped by (sample, rank): ``order``
    sorts them so (stable: each group in start order), and group ``g`` is sorted rows
    ``first[g]..last[g]``."""
    width = int(rank.max()) + 1 if rank.size else 1
    order = np.argsort(slot * width + rank, kind="stable")  # one int64 key: faster than lexsort, as stable
    head = run_starts(slot[order]) | run_starts(rank[order])
    first = np.flatnonzero(head)
    return order, first, np.append(first[1:], order.size) - 1


def compile_exchange(
    receives: np.ndarray,
    sends: np.ndarray,
    cp_rank: int,
    cp: int,
    steps: Sequence[Any],
    gpus_per_node: int | None = None,
    sends_of: Callable[[int], np.ndarray] | None = None,
) -> TargetedExchange:
    """The :class:`TargetedExchange` of rank ``cp_rank`` of ``cp``.

    Args:
        receives, sends: the rank's :func:`exchange_ranges`.
        cp_rank: this rank.
        cp: the CP group size.
        steps: the rank's ring steps (ascending distance, calls on the host), their calls reading
            the rows received from the step's source (its ranges of ``receives``, concatenated)
            rather than its whole compact buffer.
        gpus_per_node: CP rank ``c`` is on node ``c // gpus_per_node``: pieces cross nodes once per
            node, through a proxy (:func:`ringpack.traffic.proxy_index`). ``None``: every piece
            straight to each rank that needs it.
        sends_of: with ``gpus_per_node``, the sends of any rank (its :func:`exchange_ranges`'
            second array), asked for the sources on other nodes only.

    Returns:
        The exchange map; its steps are those of ``steps`` with a source, in receive order.
    """
    node = (lambda r: 0) if gpus_per_node is None else (lambda r: r // gpus_per_node)
    mine = node(cp_rank)
    direct, proxied_by_me, relayed = [], [], []
    jobs, relay_in_of = [], {}
    for src, lo, count in _by_partner(receives, cp_rank, cp, sign=1):
        if node(src) == mine:
            direct.append((src, lo, count, src))
            continue
        receivers = _node_sends(sends_of(src), gpus_per_node, mine)
        proxy = _proxy(src, receivers)
        if proxy == cp_rank:
            proxied_by_me.append((src, lo, count, proxy))
            jobs.append((src, receivers))
        else:
            relayed.append((src, lo, count, proxy))
            relay_in_of[src] = _segments(receivers, cp_rank)
    sources, recv_tokens, own_steps, via = [], [], [], []
    for src, _, count, frm in direct + proxied_by_me + relayed:
        distance = (cp_rank - src) % cp
        i = bisect.bisect_left(steps, distance, key=lambda st: st.distance)
        assert i < len(steps) and steps[i].distance == distance, "every source has a ring step"
        sources.append(src)
        recv_tokens.append(int(count.sum()))
        own_steps.append(steps[i])
        via.append(frm)
    index_of = {src: i for i, src in enumerate(sources)}
    proxied = tuple(
        _proxy_job(src, receivers, cp_rank, index_of[src]) for src, receivers in sorted(jobs, key=lambda j: j[0])
    )
    # stage two's receives, per proxy in the order its forwards go: by source, then by row
    relay_in = tuple(
        sorted(
            ((index_of[src], frm, offset, n) for src, _, _, frm in relayed for _, offset, n in relay_in_of[src]),
            key=lambda m: (m[1], sources[m[0]], m[2]),
        )
    )
    dests, send_tokens, send_ranges, send_index = [], [], [], []
    for dst, lo, count in _send_groups(sends, cp_rank, cp, gpus_per_node, node):
        dests.append(dst)
        send_tokens.append(int(count.sum()))
        one = bool((lo[1:] == lo[:-1] + count[:-1]).all())
        send_ranges.append((int(lo[0]), int(lo[-1] + count[-1])) if one else None)
        send_index.append(None if one else torch.from_numpy(concat_ranges(lo, count)))
    if dests and not sources:  # sends complete in a step of its own
        own_steps.append(replace(steps[0], distance=0, calls=()))
    relays = bool(proxied or relay_in)
    return TargetedExchange(
        sources=tuple(sources),
        recv_tokens=tuple(recv_tokens),
        steps=tuple(own_steps),
        dests=tuple(dests),
        send_tokens=tuple(send_tokens),
        send_ranges=tuple(send_ranges),
        send_index=tuple(send_index),
        via=tuple(via) if relays else (),
        proxied=proxied,
        relay_in=relay_in,
        gpus_per_node=gpus_per_node,
        rank=cp_rank,
    )


def _node_sends(sends: np.ndarray, gpus_per_node: int, node: int) -> np.ndarray:
    """The rows of ``sends`` (``(dest, lo, count)``, sorted by dest then lo) to ranks of ``node``."""
    return sends[sends[:, 0] // gpus_per_node == node]


def _proxy(source: int, receivers: np.ndarray) -> int:
    """The proxy of ``source`` among the ranks of ``receivers`` (its sends to one node)."""
    ranks = np.unique(receivers[:, 0])
    return int(ranks[proxy_index(source, len(ranks))])


def _union(receivers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows any of ``receivers`` needs, as ascending disjoint ranges ``(lo, count)``."""
    lo, hi = receivers[:, 1], receivers[:, 1] + receivers[:, 2]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    reach = np.maximum.accumulate(hi)
    new = np.ones(len(lo), dtype=bool)
    new[1:] = lo[1:] > reach[:-1]
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(lo)) - 1
    return lo[starts], reach[ends] - lo[starts]


def _segments(receivers: np.ndarray, rank: int, position: Callable | None = None) -> list[tuple[int, int, int]]:
    """``(u, offset, count)`` runs of ``rank``'s rows (from ``receivers``, one node's sends of a
    source) within the node's union ``U`` and within ``rank``'s buffer, maximal runs contiguous in
    both. ``position``: the compressed index on ``U`` (:func:`_compressed` of :func:`_union`)."""
    position = position or _compressed(*_union(receivers))
    rows = receivers[receivers[:, 0] == rank]
    u = position(rows[:, 1])
    n = rows[:, 2]
    offset = cumsum0(n)[:-1]
    runs = []
    for a, o, c in zip(u.tolist(), offset.tolist(), n.tolist()):
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == o:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + c)
        elif c:
            runs.append((a, o, c))
    return runs


def _proxy_job(source: int, receivers: np.ndarray, rank: int, own_index: int) -> ProxyJob:
    """This rank's :class:`ProxyJob` for ``source`` (``receivers``: its sends to this rank's node)."""
    u_lo, u_count = _union(receivers)
    position = _compressed(u_lo, u_count)
    forwards = [
        (int(dest), u, n, offset)
        for dest in np.unique(receivers[:, 0]).tolist()
        if dest != rank
        for u, offset, n in _segments(receivers, dest, position)
    ]
    own = tuple((u, n, offset) for u, offset, n in _segments(receivers, rank, position))
    return ProxyJob(source, int(u_count.sum()), own_index, own, tuple(forwards))


def _send_groups(sends: np.ndarray, cp_rank: int, cp: int, gpus_per_node: int | None, node):
    """``(dest, lo, count)`` per destination of this rank's stage-one sends: each rank of its node
    that needs rows, and each other node's proxy with every row that node needs (ascending)."""
    out = []
    for dst, lo, count in _by_partner(sends, cp_rank, cp, sign=-1):
        if node(dst) == node(cp_rank):
            out.append((dst, lo, count))
    if gpus_per_node is None or not sends.size:
        return out
    for n in np.unique(sends[:, 0] // gpus_per_node).tolist():
        if n == node(cp_rank):
            continue
        receivers = _node_sends(sends, gpus_per_node, n)
        lo, count = _union(receivers)
        out.append((_proxy(cp_rank, receivers), lo, count))
    return out


def _by_partner(ranges: np.ndarray, cp_rank: int, cp: int, sign: int):
    """``(partner, lo, count)`` per partner of ``ranges`` (sorted by partner), in order of ring
    distance: ``(rank - partner) mod C`` for sources (``sign=1``), ``(partner - rank) mod C`` for
    destinations."""
    if not ranges.size:
        return []
    cuts = np.flatnonzero(ranges[1:, 0] != ranges[:-1, 0]) + 1
    groups = np.split(ranges, cuts)
    groups.sort(key=lambda g: (sign * (cp_rank - int(g[0, 0]))) % cp)
    return [(int(g[0, 0]), g[:, 1], g[:, 2]) for g in groups]


def _compressed(lo: np.ndarray, count: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The compressed index on the rows of ranges ``lo:lo+count`` (ascending, concatenated): how
    many of their rows come before full-buffer row ``x``."""
    cum = cumsum0(count)

    def received_before(x):
        x = np.asarray(x, dtype=np.int64)
        i = np.searchsorted(lo, x, side="right") - 1
        at = np.maximum(i, 0)
        return np.where(i < 0, 0, cum[at] + np.minimum(x - lo[at], count[at]))

    return received_before
