"""Which K/V pieces cross CP ranks, and how many bytes: one implementation for the runtime, the planner,
benchmarks and reports (docs/planner.md, "CP split strategies").

A query at position ``q`` of a sample attends the keys ``0..q`` of that sample wherever they live,
so a piece ``[start, stop)`` of sample ``X`` held by CP rank ``r`` is **needed** by rank ``r' != r``
iff ``r'`` holds a piece of ``X`` with ``start' >= stop`` (:func:`needed_pieces`). The runtime sends
exactly the needed pieces, compacted into one buffer per rank; :func:`kv_traffic` and
:func:`plan_kv_traffic` count their bytes (:class:`KVTraffic`), forward pass only, with
:func:`kv_bytes_per_token` giving what one token's K and V weigh (``bytes_per_token=1`` counts tokens).
:func:`receivers` lists the ranks needing each piece, and :func:`exchange_tokens` what every rank
sends and receives in the targeted exchange, within its node and across nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ringpack.cost import ModelShape
    from ringpack.shard_plan import MicroBatch, Plan

__all__ = [
    "KVTraffic",
    "kv_bytes_per_token",
    "needed_pieces",
    "receivers",
    "exchange_links",
    "exchange_partners",
    "partner_budget_problem",
    "over_partner_budget",
    "microbatch_over_budget",
    "remember_over_budget",
    "remembered_over_budget",
    "partners_over_budget",
    "exchange_tokens",
    "proxy_index",
    "relay_proxies",
    "kv_traffic",
    "plan_kv_traffic",
]


@dataclass(frozen=True)
class KVTraffic:
    """Bytes of K/V crossing the CP ranks of a micro-batch (``tokens * bytes_per_token``), forward pass only.

    Attributes:
        unique: tokens of pieces some other rank needs, each counted once (the compacted buffers).
        p2p: each needed piece counted once per rank that needs it (point-to-point sends).
        ring: what a ring relays: every rank's compacted buffer through all ``cp - 1`` other ranks,
            ``(cp - 1) * unique``. The backward sends K/V again plus dK/dV (about twice the forward).
        p2p_inter: what the node-relayed targeted exchange sends between nodes (CP rank ``c`` on
            node ``c // gpus_per_node``): each needed piece once per other node that needs it
            (:func:`exchange_tokens`); 0 when no ``gpus_per_node`` is given.
    """

    unique: int
    p2p: int
    ring: int
    p2p_inter: int = 0


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, layers: int | None = None) -> int:
    """Bytes of K and V of one token over ``layers`` layers (default: all of ``shape``'s) of one forward."""
    layers = shape.layers if layers is None else layers
    return 2 * shape.kv_heads * shape.head_dim * dtype_bytes * layers


def needed_pieces(
    group: np.ndarray, cp: np.ndarray, sample: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> np.ndarray:
    """For every piece, how many *other* CP ranks of its micro-batch need it (0: it stays local).

    Vectorised over any number of micro-batches. Every argument is an integer array of shape
    ``[n]``, one entry per piece: ``group`` its micro-batch (any integers), ``cp`` its CP rank,
    ``sample`` its sample (any integers), ``start``/``stop`` its tokens.

    Returns:
        int64 ``[n]``; ``needed > 0`` marks the pieces of the compacted send buffers.
    """
    if len(start) == 0:
        return np.zeros(0, dtype=np.int64)
    found = _holders(group, cp, sample, start, stop)
    return found.hi - found.lo - found.own


@dataclass(frozen=True)
class _Holders:
    """Per piece, the ranks holding a later part of its sample: ``ranks[lo[i]:hi[i]]`` hold a piece of
    piece ``i``'s sample (in its micro-batch) starting at or after ``stop[i]``; ``own[i]`` is 1 when
    piece ``i``'s own rank is one of them, else 0."""

    lo: np.ndarray
    hi: np.ndarray
    own: np.ndarray
    ranks: np.ndarray


def _holders(group, cp, sample, start, stop) -> _Holders:
    """:class:`_Holders` of every piece (arguments as for :func:`needed_pieces`, at least one piece)."""
    group = np.asarray(group, dtype=np.int64)
    cp = np.asarray(cp, dtype=np.int64)
    sample = np.asarray(sample, dtype=np.int64)
    start = np.asarray(start, dtype=np.int64)
    stop = np.asarray(stop, dtype=np.int64)
    # dense id of (group, sample) and of (group, sample, rank)
    gx = _pair_ids(group, sample)[1]
    uniq, gxr = _pair_ids(gx, cp)
    # latest start of each (group, sample, rank)
    rank_max = np.full(uniq.shape[1], -1, dtype=np.int64)
    np.maximum.at(rank_max, gxr, start)
    owner_gx = uniq[0]
    # for each piece: the ranks r' of the same (group, sample) with rank_max >= stop, its own included
    span = int(max(stop.max(), rank_max.max())) + 2
    composite = owner_gx * span + rank_max
    order = np.argsort(composite, kind="stable")
    composite = composite[order]
    hi = np.searchsorted(composite, gx * span + span - 1, side="right")
    lo = np.searchsorted(composite, gx * span + stop, side="left")
    own = (rank_max[gxr] >= stop).astype(np.int64)
    return _Holders(lo, hi, own, uniq[1][order])


def _pair_ids(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(np.stack([a, b]), axis=1, return_inverse=True)`` of two int64 arrays (the distinct
    pairs ``[2, U]`` in lexicographic order, and each pair's index among them), through one int64
    key per pair where the ranges allow (a sort of integers, not of pairs)."""
    if not len(a):
        return np.zeros((2, 0), dtype=np.int64), np.zeros(0, dtype=np.int64)
    a_lo, b_lo = int(a.min()), int(b.min())
    width = int(b.max()) - b_lo + 1
    if (int(a.max()) - a_lo + 1) * width >= 2**62:
        uniq, inverse = np.unique(np.stack([a, b]), axis=1, return_inverse=True)
        return uniq, inverse.reshape(-1)
    keys, inverse = np.unique((a - a_lo) * width + (b - b_lo), return_inverse=True)
    return np.stack([keys // width + a_lo, keys % width + b_lo]), inverse.reshape(-1)


def receivers(
    group: np.ndarray, cp: np.ndarray, sample: np.ndarray, start: np.ndarray, stop: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every (piece, rank that needs it) pair of the targeted exchange: what :func:`needed_pieces` counts.

    Args:
        group, cp, sample, start, stop: as for :func:`needed_pieces`, one entry per piece.

    Returns:
        ``(piece, rank)``, int64 ``[K]`` with ``K = needed_pieces(...).sum()``: piece ``piece[j]``
        (its index in the arguments) goes to CP rank ``rank[j]`` of its micro-batch; grouped by
        piece, in piece order.
    """
    if len(start) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    found = _holders(group, cp, sample, start, stop)
    count = found.hi - found.lo
    piece = np.repeat(np.arange(len(count), dtype=np.int64), count)
    first = np.cumsum(count) - count  # where each piece's run starts among the pairs
    rank = found.ranks[np.arange(len(piece), dtype=np.int64) - np.repeat(first - found.lo, count)]
    other = rank != np.asarray(cp, dtype=np.int64)[piece]
    return piece[other], rank[other]


def proxy_index(source, count):
    """The node-relayed exchange's one routing rule: of the ``count`` ranks of one node (ascending)
    that need pieces of CP rank ``source`` on another node, the one at index ``source % count``
    receives them over the link between nodes and relays them within its node.

    Consecutive sources pick different ranks, so the K/V a node takes in spread over its links.
    Works on ints and on integer arrays alike; the runtime (:mod:`ringpack.attention.exchange`)
    and the communication model (:func:`exchange_tokens`) both route by it.
    """
    return source % count


def exchange_tokens(
    group: np.ndarray,
    cp: np.ndarray,
    sample: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    num_groups: int,
    cp_size: int,
    gpus_per_node: int | None = None,
) -> dict[str, np.ndarray]:
    """What every rank sends and receives in the targeted exchange, in tokens, within and across nodes.

    Without ``gpus_per_node`` every needed piece goes straight to each rank that needs it. With it
    the exchange is node-relayed, as the runtime runs it: a piece goes straight to the ranks of its
    own node that need it, and once to each other node that needs it, to the rank
    :func:`proxy_index` picks among that node's ranks needing its source's pieces, which forwards
    it to the node's other ranks needing it.

    Args:
        group: int64 ``[n]``, each piece's micro-batch, in ``[0, num_groups)``.
        cp, sample, start, stop: as for :func:`needed_pieces`.
        num_groups: micro-batches.
        cp_size: CP ranks of a micro-batch.
        gpus_per_node: CP rank ``c`` is on node ``c // gpus_per_node``; ``None``: all on one node.

    Returns:
        int64 ``[num_groups, cp_size]`` arrays: ``send_intra`` / ``recv_intra`` (pieces sent to /
        received from ranks of the same node, first-hand), ``send_inter`` / ``recv_inter`` (pieces
        crossing nodes, once per receiving node; received by the proxies) and ``relay_send`` /
        ``relay_recv`` (pieces a proxy forwards within its node). Without ``gpus_per_node`` only the
        ``_intra`` arrays are non-zero.
    """
    piece, to = receivers(group, cp, sample, start, stop)
    g = np.asarray(group, dtype=np.int64)[piece]
    frm = np.asarray(cp, dtype=np.int64)[piece]
    tokens = (np.asarray(stop, dtype=np.int64) - np.asarray(start, dtype=np.int64))[piece]
    size = num_groups * cp_size

    def per_rank(rank: np.ndarray, mask: np.ndarray) -> np.ndarray:
        summed = np.bincount(g[mask] * cp_size + rank[mask], weights=tokens[mask], minlength=size)
        return summed.astype(np.int64).reshape(num_groups, cp_size)

    if gpus_per_node is None:
        everything = np.ones(len(piece), dtype=bool)
        nothing = np.zeros((num_groups, cp_size), dtype=np.int64)
        out = {"send_intra": per_rank(frm, everything), "recv_intra": per_rank(to, everything)}
        return out | {k: nothing.copy() for k in ("send_inter", "recv_inter", "relay_send", "relay_recv")}
    direct = frm // gpus_per_node == to // gpus_per_node
    out = {"send_intra": per_rank(frm, direct), "recv_intra": per_rank(to, direct)}
    proxy = relay_proxies(g, frm, to, cp_size, gpus_per_node)
    # one copy of a piece per receiving node: its (piece, node) pairs' first, sent to the proxy
    node_key = piece * (cp_size // gpus_per_node + 1) + to // gpus_per_node
    first = np.zeros(len(piece), dtype=bool)
    first[np.unique(node_key, return_index=True)[1]] = True
    crossing = ~direct & first
    relayed = ~direct & (to != proxy)
    out["send_inter"], out["recv_inter"] = per_rank(frm, crossing), per_rank(proxy, crossing)
    out["relay_send"], out["relay_recv"] = per_rank(proxy, relayed), per_rank(to, relayed)
    return out


def relay_proxies(
    group: np.ndarray, source: np.ndarray, dest: np.ndarray, cp_size: int, gpus_per_node: int
) -> np.ndarray:
    """For every (micro-batch, source rank, receiving rank) pair: the rank of the receiver's node that
    takes the source's pieces for it (:func:`proxy_index` among the node's receivers of that source;
    the receiver itself when it is on the source's node). Arrays ``[K]``, any order, pairs may repeat."""
    node = dest // gpus_per_node
    key = (group * cp_size + source) * cp_size + dest
    uniq, back = np.unique(key, return_inverse=True)
    u_group_src, u_dest = uniq // cp_size, uniq % cp_size
    u_node = u_dest // gpus_per_node
    # receivers of one (micro-batch, source, node) are consecutive in ``uniq``, ascending
    head = np.ones(len(uniq), dtype=bool)
    head[1:] = (u_group_src[1:] != u_group_src[:-1]) | (u_node[1:] != u_node[:-1])
    first = np.flatnonzero(head)
    count = np.diff(np.append(first, len(uniq)))
    which = np.cumsum(head) - 1
    chosen = u_dest[first + proxy_index(u_group_src[first] % cp_size, count)]
    proxy = chosen[which][back.reshape(-1)]
    same = source // gpus_per_node == node
    return np.where(same, dest, proxy)


def exchange_links(
    group: np.ndarray,
    cp: np.ndarray,
    sample: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    cp_size: int,
    gpus_per_node: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every point-to-point link of the targeted exchange, once from each end: ``(group, rank, partner)``,
    int64 ``[K]``, unique triples, sorted.

    A rank's partners are the ranks it sends to or receives from: the source and each receiver
    directly within a node (or flat); across nodes the source and the receiving node's proxy
    (:func:`relay_proxies`), and the proxy and each other receiver of its node. Arguments as for
    :func:`exchange_tokens`.
    """
    piece, to = receivers(group, cp, sample, start, stop)
    g = np.asarray(group, dtype=np.int64)[piece]
    frm = np.asarray(cp, dtype=np.int64)[piece]
    if gpus_per_node is None:
        a, b, gg = frm, to, g
    else:
        proxy = relay_proxies(g, frm, to, cp_size, gpus_per_node)
        hop = to != proxy  # relayed: the proxy forwards to the receiver
        a, b, gg = np.concatenate([frm, proxy[hop]]), np.concatenate([proxy, to[hop]]), np.concatenate([g, g[hop]])
    ends = np.sort(np.concatenate([(gg * cp_size + a) * cp_size + b, (gg * cp_size + b) * cp_size + a]))
    ends = ends[np.r_[True, ends[1:] != ends[:-1]]] if len(ends) else ends  # unique, by a sort (faster than hashing)
    return ends // (cp_size * cp_size), ends // cp_size % cp_size, ends % cp_size


def exchange_partners(
    group: np.ndarray,
    cp: np.ndarray,
    sample: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    num_groups: int,
    cp_size: int,
    gpus_per_node: int | None = None,
) -> np.ndarray:
    """How many other ranks each rank exchanges with in the targeted exchange (relays included), as
    the runtime's ``TargetedExchange.partners`` counts them: int64 ``[num_groups, cp_size]``
    (:func:`exchange_links` counted per rank; arguments as for :func:`exchange_tokens`)."""
    g, rank, _ = exchange_links(group, cp, sample, start, stop, cp_size, gpus_per_node)
    counts = np.bincount(g * cp_size + rank, minlength=num_groups * cp_size)
    return counts.astype(np.int64).reshape(num_groups, cp_size)


def over_partner_budget(
    group: np.ndarray,
    cp: np.ndarray,
    sample: np.ndarray,
    start: np.ndarray,
    stop: np.ndarray,
    num_groups: int,
    cp_size: int,
    gpus_per_node: int | None,
    max_partners: int,
) -> np.ndarray:
    """The partner budget's one rule: which micro-batches' targeted exchange would give some rank more
    than ``max_partners`` partners (:func:`exchange_partners`, relays included). Those run the ring
    instead (2 partners a rank), under ``mode="p2p"`` in the runtime and in the communication model.

    Args:
        group, cp, sample, start, stop, num_groups, cp_size, gpus_per_node: as for :func:`exchange_partners`.
        max_partners: the budget; 0: none (nothing is over).

    Returns:
        bool ``[num_groups]``. All False without pieces, without a budget or when ``cp_size - 1 <=
        max_partners`` (no rank can have more partners than the group's other ranks).
    """
    over = np.zeros(num_groups, dtype=bool)
    if not max_partners or cp_size - 1 <= max_partners or not len(start):
        return over
    group = np.asarray(group, dtype=np.int64)
    cp, sample = np.asarray(cp, dtype=np.int64), np.asarray(sample, dtype=np.int64)
    # only micro-batches whose cheap bound exceeds the budget are counted exactly
    unsure = _partner_bound(group, cp, sample, num_groups, cp_size, gpus_per_node).max(axis=1) > max_partners
    if not unsure.any():
        return over
    keep = unsure[group]
    _, dense = np.unique(group[keep], return_inverse=True)
    columns = (cp[keep], sample[keep], np.asarray(start)[keep], np.asarray(stop)[keep])
    partners = exchange_partners(dense.reshape(-1), *columns, int(unsure.sum()), cp_size, gpus_per_node)
    over[np.flatnonzero(unsure)] = partners_over_budget(partners, max_partners)
    return over


def _partner_bound(
    group: np.ndarray, cp: np.ndarray, sample: np.ndarray, num_groups: int, cp_size: int, gpus_per_node: int | None
) -> np.ndarray:
    """An upper bound of :func:`exchange_partners`, int64 ``[num_groups, cp_size]``, from the pieces'
    holders alone: a rank's partners hold a sample it holds (every direct link, every source and
    proxy across nodes shares a sample with it), besides the ranks of its node it relays to or
    through; so at most the other holders of its samples, summed, plus ``gpus_per_node - 1``."""
    gs = _pair_ids(group, sample)[1]  # (micro-batch, sample)
    held, where = np.unique(gs * cp_size + cp, return_index=True)  # each (micro-batch, sample, rank) once
    holders = np.bincount(held // cp_size, minlength=int(gs.max()) + 1)
    cell = group[where] * cp_size + held % cp_size
    bound = np.bincount(cell, weights=holders[held // cp_size] - 1, minlength=num_groups * cp_size)
    relays = 0 if gpus_per_node is None else min(gpus_per_node, cp_size) - 1
    return bound.astype(np.int64).reshape(num_groups, cp_size) + relays


#: Where a micro-batch object keeps the partner-budget outcomes already decided for it, by
#: ``(gpus_per_node, max_partners)``: the planner decides them once (in its own process), they travel
#: with the micro-batch, and compiling a rank's schedule then reads one instead of counting every
#: rank's partners again.
OVER_BUDGET_SLOT = "_over_partner_budget"


def microbatch_over_budget(mb: Any, gpus_per_node: int | None, max_partners: int) -> bool:
    """:func:`over_partner_budget` of one micro-batch (a :class:`~ringpack.shard_plan.MicroBatch`),
    remembered on it (:data:`OVER_BUDGET_SLOT`): counted from its pieces the first time only."""
    cp = len(mb.shards)
    if not max_partners or cp - 1 <= max_partners:
        return False
    known = remembered_over_budget(mb, gpus_per_node, max_partners)
    if known is not None:
        return known
    rank, sample, start, stop = mb.piece_columns
    group = np.zeros(len(rank), dtype=np.int64)
    over = bool(over_partner_budget(group, rank, sample, start, stop, 1, cp, gpus_per_node, max_partners)[0])
    remember_over_budget(mb, gpus_per_node, max_partners, over)
    return over


def remembered_over_budget(mb: Any, gpus_per_node: int | None, max_partners: int) -> bool | None:
    """The outcome :func:`remember_over_budget` kept on ``mb`` for this budget and node size; None: none kept."""
    return mb.__dict__.get(OVER_BUDGET_SLOT, {}).get((gpus_per_node, int(max_partners)))


def remember_over_budget(mb: Any, gpus_per_node: int | None, max_partners: int, over: bool) -> None:
    """Keep on ``mb`` whether its targeted exchange is over the budget ``max_partners`` over nodes of
    ``gpus_per_node`` ranks (what :func:`microbatch_over_budget` then returns)."""
    memo = mb.__dict__.setdefault(OVER_BUDGET_SLOT, {})
    memo[(gpus_per_node, int(max_partners))] = bool(over)


def partners_over_budget(partners: np.ndarray, max_partners: int) -> np.ndarray:
    """:func:`over_partner_budget` from the counts: ``partners`` int ``[..., cp_size]``
    (:func:`exchange_partners`), bool ``[...]``."""
    partners = np.asarray(partners)
    if not max_partners or partners.shape[-1] - 1 <= max_partners:
        return np.zeros(partners.shape[:-1], dtype=bool)
    return partners.max(axis=-1) > max_partners


def partner_budget_problem(rank: int, partners: int, max_partners: int) -> str | None:
    """Why CP rank ``rank`` exchanging with ``partners`` other ranks breaks the budget ``max_partners``
    (0: none), in one line; None when it does not."""
    if not max_partners or partners <= max_partners:
        return None
    return (
        f"CP rank {rank} exchanges with {partners} partners, over max_partners={max_partners}: a micro-batch "
        "over the budget runs the ring (compile its schedule with ScheduleOptions(max_partners=...))"
    )


def _traffic_arrays(group, cp_rank, sample, start, stop, cp: int, bytes_per_token: int, num_groups: int):
    need = needed_pieces(group, cp_rank, sample, start, stop)
    tokens = np.asarray(stop, dtype=np.int64) - np.asarray(start, dtype=np.int64)
    unique = np.bincount(group, weights=tokens * (need > 0), minlength=num_groups).astype(np.int64) * bytes_per_token
    p2p = np.bincount(group, weights=tokens * need, minlength=num_groups).astype(np.int64) * bytes_per_token
    return unique, p2p, unique * (cp - 1)


def _inter_bytes(group, cp_rank, sample, start, stop, cp: int, bytes_per_token: int, num_groups: int, node: int):
    """Per micro-batch: the bytes the node-relayed exchange sends between nodes (nodes of ``node`` ranks)."""
    sent = exchange_tokens(group, cp_rank, sample, start, stop, num_groups, cp, node)["send_inter"]
    return sent.sum(axis=1) * bytes_per_token


def kv_traffic(mb: MicroBatch, bytes_per_token: int = 1, gpus_per_node: int | None = None) -> KVTraffic:
    """K/V bytes crossing the CP ranks of one micro-batch (with ``gpus_per_node``, also those crossing nodes)."""
    rows = [(c, p.sample, p.start, p.stop) for c, shard in enumerate(mb.shards) for p in shard.pieces]
    if not rows:
        return KVTraffic(0, 0, 0)
    arr = np.array(rows, dtype=np.int64)
    group = np.zeros(len(arr), dtype=np.int64)
    cols = (group, arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], len(mb.shards), bytes_per_token, 1)
    u, p, r = _traffic_arrays(*cols)
    inter = 0 if gpus_per_node is None else int(_inter_bytes(*cols, gpus_per_node)[0])
    return KVTraffic(int(u[0]), int(p[0]), int(r[0]), inter)


def plan_kv_traffic(plan: Plan, bytes_per_token: int = 1) -> dict[str, np.ndarray]:
    """Per micro-batch K/V traffic of a whole plan, vectorised over its piece table.

    Returns int64 arrays, one row per micro-batch in plan order: ``step``, ``dp``, ``microbatch``,
    ``unique``, ``p2p``, ``ring``, and for a plan with ``gpus_per_node`` also ``p2p_inter`` (the
    part of ``p2p`` crossing nodes). Per-step totals: ``np.bincount(out["step"], out["ring"])``.
    """
    a = plan.piece_arrays
    keys = np.stack([a["step"], a["dp"], a["microbatch"]])
    uniq, group = np.unique(keys, axis=1, return_inverse=True)
    group = group.reshape(-1)
    cols = (group, a["cp"], a["sample"], a["start"], a["stop"], plan.config.cp, bytes_per_token, uniq.shape[1])
    u, p, r = _traffic_arrays(*cols)
    out = {"step": uniq[0], "dp": uniq[1], "microbatch": uniq[2], "unique": u, "p2p": p, "ring": r}
    if plan.config.gpus_per_node is not None:
        out["p2p_inter"] = _inter_bytes(*cols, plan.config.gpus_per_node)
    return out
