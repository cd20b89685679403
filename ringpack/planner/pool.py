"""CP groups that span nodes, up to the whole pool: a micro-batch split node by node (docs/planner.md, "Pool plans").

With ``PlanConfig.gpus_per_node = G`` a CP group of ``cp`` ranks is ``cp / G`` nodes, CP rank ``c``
on node ``c // G``. :func:`split_over_nodes` splits a micro-batch in two levels: its samples are
packed into the nodes by cost (:mod:`~ringpack.planner.packing`'s greedy and local search, each
node holding at most ``G * tokens_per_rank`` tokens), then each node's samples are split over its
ranks by the plan's strategy, so a split sample's pieces stay in one node. A sample bigger than a
node (by tokens, or by cost) enters the packing as ``k`` equal shares, ``k`` the fewest nodes it
needs, and the nodes its shares land on are split together (without the token guard), their ranks
arranged so that the other samples split there still lie in one node, and every sample on
consecutive nodes (ranks reordered, else the group split contiguously), and a group whose targeted
exchange would give a rank more partners than ``max_partners`` split contiguously (the partner
budget). Work grows with the samples and the nodes, never with their product or with ``cp`` squared.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ringpack.planner.packing import PackingProblem, improve, pack_greedy
from ringpack.planner.split.balanced import CP_BALANCE_TOLERANCE
from ringpack.planner.split.baselines import split_contiguous
from ringpack.planner.split.fallbacks import split_spread
from ringpack.planner.split.strategies import split_groups
from ringpack.shard_plan import MicroBatch, PlanConfig, RankShard
from ringpack.traffic import over_partner_budget, remember_over_budget

__all__ = ["split_over_nodes", "node_groups", "node_need", "arrange_nodes", "NODE_TOLERANCE", "TIGHT_FILL"]

#: A sample may cost this fraction more than a node's share of its micro-batch before it takes two
#: nodes (the CP split's own tolerance, :data:`~ringpack.planner.split.CP_BALANCE_TOLERANCE`).
NODE_TOLERANCE = 1e-3
#: The local search over nodes with a pair-price range stops on a plateau, as the DP packing does
#: (docs/planner.md, "The stages"): from this many shares on, the lightest 4 nodes are searched and
#: two iterations that lower the highest node by less than 0.01% end it.
PLATEAU_MIN_ITEMS = 512
PLATEAU = {"min_progress": 1e-4, "patience": 2, "neighbours": 4}

#: From this share of the nodes' tokens on, every node holds about the same tokens, so a sample
#: needs as many nodes as its cost beyond its tokens' price (its attention pairs) is over a node's
#: share of that cost: a node holding it cannot shed the short samples' tokens elsewhere.
TIGHT_FILL = 0.9
_EMPTY = RankShard()
#: ``(first node, nodes, slots)``: a node group of a micro-batch and the positions of its samples.
NodeGroup = tuple[int, int, np.ndarray]


def split_over_nodes(groups: Sequence[Sequence[int]], lengths: Sequence[int], config: PlanConfig) -> list[MicroBatch]:
    """Every micro-batch of ``groups`` split over the nodes of its CP group, then inside its node groups.

    Args:
        groups: the micro-batches' sample ids, each in micro-batch order.
        lengths: tokens of every sample, indexed by id (a sequence or a 1-D integer array).
        config: a plan config whose CP group spans nodes (``config.nodes_per_group > 1``).

    Returns:
        One :class:`MicroBatch` per group with ``config.cp`` rank shards: each node group's samples
        (in micro-batch order within it) and pieces at its ranks, groups in node order; ranks of a
        node that got no sample hold nothing.

    Raises:
        ValueError: a group holds more than ``cp * tokens_per_rank`` tokens, or ``config`` has no
            CP group over several nodes.
    """
    if config.nodes_per_group < 2:
        raise ValueError(
            f"split_over_nodes needs a CP group over several nodes, got cp={config.cp}, "
            f"gpus_per_node={config.gpus_per_node}"
        )
    with cycle_collection_paused():
        return _split_over_nodes(groups, lengths, config)


@contextmanager
def cycle_collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused for the block (where it runs; as it was after).

    A pool split builds a few objects per piece, tens of thousands per micro-batch, none in a
    reference cycle and all alive until the plan is dropped. Their numbers trigger the collector's
    full passes, which walk every object of the process (of a training process: the model's and
    the framework's too) and cost more than the split itself; nothing they could free is made here.
    Reference counting still frees everything as usual; only cycles made meanwhile by other
    threads wait for the next collection.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _split_over_nodes(groups: Sequence[Sequence[int]], lengths: Sequence[int], config: PlanConfig) -> list[MicroBatch]:
    G = config.gpus_per_node
    single, multi = [], []  # (micro-batch, first node, nodes, sample ids)
    for g, members in enumerate(groups):
        members = list(members)
        L = np.array([int(lengths[x]) for x in members], dtype=np.int64)
        if int(L.sum()) > config.group_capacity:
            raise ValueError(
                f"micro-batch holds {int(L.sum())} tokens, more than cp*tokens_per_rank={config.group_capacity}"
            )
        for first, count, slots in node_groups(L, config):
            (single if count == 1 else multi).append((g, first, count, [members[k] for k in slots.tolist()]))
    split = _split_parts(single, lengths, config, G, config.token_slack)
    over = [False] * len(groups)
    for part in multi:  # each at its own size; its ranks arranged so that small splits stay in a node
        mb = _on_consecutive_nodes(arrange_nodes(_split_group(part, lengths, config), G), part, lengths, G)
        mb, part_over = _within_partner_budget(mb, part, lengths, config)
        split.append(mb)
        over[part[0]] |= part_over
    placed: list[list[tuple[int, MicroBatch]]] = [[] for _ in groups]
    for (g, first, _, _), mb in zip(single + multi, split):
        placed[g].append((first, mb))
    out = []
    for g, parts in enumerate(placed):
        parts.sort(key=lambda item: item[0])
        shards = [_EMPTY] * config.cp
        samples: list[int] = []
        loss = 0
        for first, mb in parts:
            shards[first * G : first * G + len(mb.shards)] = mb.shards
            samples.extend(mb.samples)
            loss += mb.loss_tokens
        out.append(MicroBatch(samples=tuple(samples), shards=tuple(shards), loss_tokens=loss))
        if config.max_partners and config.max_partners >= G - 1:  # a one-node group is within any such budget
            remember_over_budget(out[-1], G, config.max_partners, over[g])
    return out


def _split_parts(
    parts: list, lengths: Sequence[int], config: PlanConfig, cp: int, token_slack: float | None
) -> list[MicroBatch]:
    """The node groups ``parts`` (all of ``cp`` ranks) split by the plan's strategy, in order."""
    ids = [ids for *_, ids in parts]
    return split_groups(ids, lengths, cp, config.tokens_per_rank, config.cost, config.strategy, token_slack)


def _split_group(part: tuple, lengths: Sequence[int], config: PlanConfig) -> MicroBatch:
    """A group of several nodes split over all its ranks: ``balanced`` zigzags the samples costing
    more than a node's share of the group (those that cross nodes in any split) and keeps the rest
    whole (:func:`~ringpack.planner.split.fallbacks.split_spread`); the other strategies as they are,
    without the token guard.

    Why not the balanced split itself: near a full token budget its cost balance needs ranks with
    few dense tokens that the others cannot make up, so it falls back to zigzagging every sample of
    the group over all its ranks (:mod:`~ringpack.planner.split.fallbacks`): short samples then send
    their K/V between nodes, and the ranks' attention waits on it. The big samples' zigzag chunks
    give every rank its share of their cost and tokens, and the whole samples even out the rest.
    A rank is still held to ``tokens_per_rank``.
    """
    cp = part[2] * config.gpus_per_node
    if config.strategy == "balanced":
        return split_spread(
            part[3], lengths, cp, config.tokens_per_rank, config.cost, config.gpus_per_node, CP_BALANCE_TOLERANCE
        )
    return _split_parts([part], lengths, config, cp, None)[0]


def _on_consecutive_nodes(mb: MicroBatch, part: tuple, lengths: Sequence[int], gpus_per_node: int) -> MicroBatch:
    """``mb`` (the split of the node group ``part``) with every sample on consecutive nodes.

    The group's split may leave a sample's pieces on nodes with a gap between them (a zigzagged
    sample gets no tokens on a rank that whole samples fill, near a full budget or with few tokens
    per rank). Its ranks are then reordered, those of the samples over the most ranks first
    (:func:`_interval_order`); where gaps remain, the group is split contiguously (every sample on
    consecutive ranks). ``mb`` itself when no sample has a gap.
    """
    if not _scattered(mb, gpus_per_node):
        return mb
    reordered = MicroBatch(
        samples=mb.samples, shards=tuple(mb.shards[r] for r in _interval_order(mb)), loss_tokens=mb.loss_tokens
    )
    if not _scattered(reordered, gpus_per_node):
        return reordered
    return split_contiguous(part[3], lengths, len(mb.shards))


def _within_partner_budget(
    mb: MicroBatch, part: tuple, lengths: Sequence[int], config: PlanConfig
) -> tuple[MicroBatch, bool]:
    """``mb`` (the split of the node group ``part``), or the group split contiguously (its samples in
    order, each on the fewest consecutive ranks its tokens need) where ``mb``'s targeted exchange
    gives a rank more partners than ``config.max_partners`` and the contiguous split's does not: the
    partner budget's tighter split, for less balance (:mod:`ringpack.planner.partners`); and whether
    the split returned is still over the budget.

    A group's partners are its own: its samples' pieces, their receivers and the proxies among them
    all lie on its nodes. They are counted at the group's place in the whole micro-batch (the
    proxies depend on the ranks' numbers), so the whole micro-batch is over the budget exactly
    where one of its groups is, when a one-node group cannot be."""
    cp = len(mb.shards)
    if not config.max_partners or cp - 1 <= config.max_partners or not _over_budget(mb, part, config):
        return mb, False
    tight = split_contiguous(part[3], lengths, cp)
    return (mb, True) if _over_budget(tight, part, config) else (tight, False)


def _over_budget(mb: MicroBatch, part: tuple, config: PlanConfig) -> bool:
    """Whether ``mb``'s targeted exchange (nodes of ``config.gpus_per_node``), placed on the nodes of
    the node group ``part`` in the plan's CP group, gives a rank more than ``config.max_partners`` partners."""
    rank, sample, start, stop = mb.piece_columns
    group = np.zeros(len(rank), dtype=np.int64)
    first = part[1] * config.gpus_per_node
    return bool(
        over_partner_budget(
            group, rank + first, sample, start, stop, 1, config.cp, config.gpus_per_node, config.max_partners
        )[0]
    )


def _scattered(mb: MicroBatch, gpus_per_node: int) -> bool:
    """Whether a sample of ``mb`` has pieces on nodes with a node between them that holds none of
    it (CP rank ``c`` on node ``c // gpus_per_node``)."""
    held = _held_ranks(mb, gpus_per_node)
    if not held.head.size:
        return False
    node = held.rank // gpus_per_node  # ascending within each sample
    new_node = np.r_[True, node[1:] != node[:-1]]
    new_node[held.head] = True
    nodes = np.add.reduceat(new_node.astype(np.int64), held.head)
    return bool((held.last_node() - held.first_node() + 1 != nodes).any())


def _interval_order(mb: MicroBatch) -> list[int]:
    """The ranks of ``mb`` ordered by which samples split over several ranks they hold: the samples
    over the most ranks decide first, a rank holding one coming before a rank without it, so each
    of a nested family of such samples lies on a prefix of the ranks of the samples above it."""
    ranks_of: dict[int, set[int]] = {}
    for r, shard in enumerate(mb.shards):
        for p in shard.pieces:
            ranks_of.setdefault(p.sample, set()).add(r)
    spans = sorted((held for held in ranks_of.values() if len(held) > 1), key=lambda held: (-len(held), min(held)))
    return sorted(range(len(mb.shards)), key=lambda r: (tuple(r not in held for held in spans), r))


# ------------------------------------------------------------------------------ samples to nodes
def node_groups(lengths: np.ndarray, config: PlanConfig) -> list[NodeGroup]:
    """The node groups of one micro-batch whose samples have ``lengths``: ``(first node, nodes, slots)``.

    Each sample needs ``k`` nodes (:func:`node_need`) and enters the packing as ``k`` shares of
    ``1/k`` of its cost and ``ceil(tokens / k)`` tokens; greedy packing by cost (by tokens if that
    places no answer) and the local search put the shares on nodes, and nodes holding shares of one
    sample join one group. Where no packing fits, every node is one group.

    Args:
        lengths: int64 ``[n]``, the micro-batch's samples in micro-batch order (their positions are
            the slots returned).
        config: the plan config (``gpus_per_node``, ``cp``, ``tokens_per_rank``, ``cost``, the price range).

    Returns:
        The groups in node order, each ``(first node, nodes, int64 slots in micro-batch order)``,
        the largest first; nodes that hold no sample are in none. Deterministic: ties go to the
        lower node.
    """
    nodes = config.nodes_per_group
    L = np.asarray(lengths, dtype=np.int64)
    node_tokens = config.gpus_per_node * config.tokens_per_rank
    priced = _priced_costs(L, config)
    k = node_need(L, config)
    owner = np.repeat(np.arange(len(L), dtype=np.int64), k)
    tokens = (-(-L // k))[owner]
    weights, bound = _share_weights(priced, k, owner, nodes)
    problem = PackingProblem(weights, tokens, nodes, 1, node_tokens)
    bins = pack_greedy(problem)
    if bins is None:  # cost order strands a share: token order (worst fit by tokens) places more
        bins = pack_greedy(PackingProblem(tokens.astype(np.float64), tokens, nodes, 1, node_tokens))
    if bins is None:
        return [(0, nodes, np.arange(len(L), dtype=np.int64))]
    plateau = PLATEAU if np.ndim(weights) == 2 and len(tokens) >= PLATEAU_MIN_ITEMS else {}
    bins = improve(problem, bins, bound, **plateau)
    return _groups_of(bins, owner, k, nodes)


def node_need(lengths: np.ndarray, config: PlanConfig) -> np.ndarray:
    """``int64[n]``: the nodes each sample of one micro-batch needs, from 1 to all of the group's.

    ``k = max(ceil(tokens / node tokens), ceil(cost / node share))``, with a node's tokens
    ``gpus_per_node * tokens_per_rank`` and its share the micro-batch's cost over the nodes times
    ``1 + NODE_TOLERANCE``, at each end of the plan's pair-price range (a dense sample's part of
    the cost grows with the price). With the nodes' tokens at least :data:`TIGHT_FILL` full, also
    ``ceil(cost beyond its tokens' price / a node's share of that cost)``: every node then holds
    about the mean tokens, so only the rest of the cost can differ between nodes.
    """
    nodes = config.nodes_per_group
    L = np.asarray(lengths, dtype=np.int64)
    node_tokens = config.gpus_per_node * config.tokens_per_rank
    priced = _priced_costs(L, config)
    node_share = priced.sum(axis=0) / nodes * (1.0 + NODE_TOLERANCE)
    k = np.maximum(-(-L // node_tokens), np.ceil(priced / node_share).max(axis=1))
    if float(L.sum()) / (nodes * node_tokens) >= TIGHT_FILL:  # every node holds about its share of the tokens
        beyond = node_share - config.cost.token * float(L.sum()) / nodes  # a node's share of the rest
        if (beyond > 0).all():
            k = np.maximum(k, np.ceil((priced - config.cost.token * L[:, None]) / beyond).max(axis=1))
    return np.clip(k, 1, nodes).astype(np.int64)


def _priced_costs(L: np.ndarray, config: PlanConfig) -> np.ndarray:
    """``float64[n, P]``: each sample's cost at the model's prices (``P = 1``) or, over a pair-price
    range, at its two ends (a node's load over the mean load is a ratio of two lines in the price,
    largest at an end)."""
    cost = config.cost
    low, high = config.price_range
    base = cost.sample_cost(L)
    if (low, high) == (1.0, 1.0) or cost.pair == 0:
        return base[:, None]
    pairs = (L * (L + 1) // 2).astype(np.float64)
    return np.column_stack([base + cost.pair * (f - 1.0) * pairs for f in (low, high)])


def _share_weights(priced: np.ndarray, k: np.ndarray, owner: np.ndarray, nodes: int) -> tuple[np.ndarray, float]:
    """The shares' weights for the packing, and the height no packing can beat.

    One price: cost units, the bound the larger of a node's mean and the largest share. A price
    range: one column per end, each share's cost there over the nodes' mean cost there, so a node's
    height is its worst load relative to the mean.
    """
    if priced.shape[1] == 1:
        w = (priced[:, 0] / k)[owner]
        return w, max(float(w.sum()) / nodes, float(w.max()))
    w = (priced / k[:, None])[owner] / (priced.sum(axis=0) / nodes)
    return w, max(1.0, float(w.max()))


def _groups_of(bins: np.ndarray, owner: np.ndarray, k: np.ndarray, nodes: int) -> list[NodeGroup]:
    """Node groups from the node of every share: nodes holding shares of one sample are joined."""
    spread = np.unique(owner[k[owner] > 1]).tolist()
    held = (np.unique(bins[owner == sample]).tolist() for sample in spread)
    roots = np.array(_joined(nodes, held), dtype=np.int64)
    sample_root = np.full(len(k), -1, dtype=np.int64)
    sample_root[owner] = roots[bins]  # a sample's shares all have one root now
    used = np.unique(sample_root)
    sizes = np.bincount(roots, minlength=nodes)[used]
    order = np.lexsort((used, -sizes))  # largest group first, then by its lowest node
    groups, first = [], 0
    for g in order.tolist():
        groups.append((first, int(sizes[g]), np.flatnonzero(sample_root == used[g])))
        first += int(sizes[g])
    return groups


def _joined(n: int, links: Iterable[Sequence[int]]) -> list[int]:
    """Each of items ``0..n-1``'s component, named by its lowest item, once the items of every list
    in ``links`` are joined (union-find with path halving)."""
    parent = list(range(n))

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for items in links:
        for other in items[1:]:
            a, b = root(items[0]), root(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return [root(x) for x in range(n)]


# -------------------------------------------------------------------------- ranks to nodes
def arrange_nodes(mb: MicroBatch, gpus_per_node: int) -> MicroBatch:
    """``mb`` (a group of whole nodes) with its rank shards reordered so that split samples cross nodes least.

    A group's ranks are interchangeable (a shard costs the same on any of them), so the order is
    free. Ranks linked by samples split over at most ``gpus_per_node`` ranks form components, each
    kept inside one node where it fits (first fit, in order); the components come in the order of
    the pieces of the samples split over more ranks than a node holds, earliest tokens first, so
    those samples' consecutive pieces share nodes. The arrangement is kept when fewer split samples
    cross nodes than in the split's own order. Costs and pieces are unchanged.
    """
    G, cp = gpus_per_node, len(mb.shards)
    held = _held_ranks(mb, G)
    if not (held.first_node() != held.last_node()).any():  # no split sample crosses nodes: nothing to gain
        return mb
    wide = held.ranks > G  # samples over more ranks than a node holds
    small = (held.ranks > 1) & ~wide
    links = np.repeat(small, held.ranks)
    roots = _components(cp, np.repeat(held.rank[held.head], held.ranks)[links], held.rank[links]).tolist()
    # ranks in order: the wide samples' ranks by their piece's start (samples as they first appear), then every rank
    rows = np.repeat(wide, held.ranks)
    by = np.lexsort((held.rank[rows], held.first_start[rows], np.repeat(held.appears, held.ranks)[rows]))
    sequence = held.rank[rows][by].tolist() + list(range(cp))
    members: dict[int, list[int]] = {}
    for r in range(cp):
        members.setdefault(roots[r], []).append(r)
    room = [G] * (cp // G)
    slots: list[list[int]] = [[] for _ in room]
    done = set()
    for r in sequence:
        c = roots[r]
        if c in done:
            continue
        done.add(c)
        component = members[c]
        node = next((n for n, free in enumerate(room) if free >= len(component)), None)
        if node is None:  # larger than any node's room: its ranks fill the nodes in order
            for q in component:
                n = next(n for n, free in enumerate(room) if free)
                slots[n].append(q)
                room[n] -= 1
            continue
        slots[node].extend(component)
        room[node] -= len(component)
    order = [r for node in slots for r in node]
    position = np.empty(cp, dtype=np.int64)
    position[order] = np.arange(cp)
    planned = int((held.first_node() != held.last_node()).sum())  # split samples over several nodes
    arranged = held.node_spread(position)
    if arranged >= planned:
        return mb
    return MicroBatch(samples=mb.samples, shards=tuple(mb.shards[r] for r in order), loss_tokens=mb.loss_tokens)


@dataclass(frozen=True)
class _HeldRanks:
    """The (sample, rank) pairs of a micro-batch's pieces, by sample then rank: ``rank[i]`` holds
    pieces of sample ``sample[i]``, the first starting at ``first_start[i]``; sample ``k`` (in id
    order) has rows ``head[k]:head[k] + ranks[k]`` and first appears at piece ``appears[k]`` of
    the rank-major piece order."""

    sample: np.ndarray
    rank: np.ndarray
    first_start: np.ndarray
    head: np.ndarray
    ranks: np.ndarray
    appears: np.ndarray
    gpus_per_node: int

    def first_node(self, position: np.ndarray | None = None) -> np.ndarray:
        return self._nodes(position, np.minimum)

    def last_node(self, position: np.ndarray | None = None) -> np.ndarray:
        return self._nodes(position, np.maximum)

    def _nodes(self, position, reduce) -> np.ndarray:
        at = self.rank if position is None else position[self.rank]
        return reduce.reduceat(at // self.gpus_per_node, self.head) if self.head.size else self.head

    def node_spread(self, position: np.ndarray) -> int:
        """How many samples lie on several nodes once rank ``r`` moves to ``position[r]``."""
        return int((self.first_node(position) != self.last_node(position)).sum())


def _held_ranks(mb: MicroBatch, gpus_per_node: int) -> _HeldRanks:
    rank, sample, start, _ = mb.piece_columns
    order = np.argsort(sample * max(len(mb.shards), 1) + rank, kind="stable")
    s, r = sample[order], rank[order]
    pair = np.flatnonzero(np.r_[True, (s[1:] != s[:-1]) | (r[1:] != r[:-1])]) if s.size else order
    head = np.flatnonzero(np.r_[True, s[pair][1:] != s[pair][:-1]]) if pair.size else pair
    ranks = np.diff(np.append(head, pair.size))
    first_start = np.minimum.reduceat(start[order], pair) if pair.size else pair
    appears = np.minimum.reduceat(order, pair[head]) if head.size else head
    return _HeldRanks(s[pair], r[pair], first_start, head, ranks, appears, gpus_per_node)


def _components(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each of items ``0..n-1``'s component, named by its lowest item, once ``a[i]`` and ``b[i]``
    are joined for every ``i``: labels lowered along the links and followed to their own labels
    until nothing changes."""
    label = np.arange(n, dtype=np.int64)
    while True:
        low = np.minimum(label[a], label[b])
        new = label.copy()
        np.minimum.at(new, a, low)
        np.minimum.at(new, b, low)
        new = new[new]
        while not np.array_equal(new, new[new]):
            new = new[new]
        if np.array_equal(new, label):
            return label
        label = new
