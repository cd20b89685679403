"""Packing + DP balance: samples of one global batch into ``dp x m`` micro-batch bins.

A bin is one micro-batch of one DP rank (``bin = dp_rank * m + index``), holding at most
``capacity = cp * tokens_per_rank`` tokens. A DP rank's load is the sum of its samples' weights;
with cost weights, ``sum / cp`` is what a perfectly balanced CP split costs.

* :func:`pack_greedy`: cost-descending, least-loaded DP rank that fits (LPT), O(n log dp);
* :func:`improve`: local search (moves and swaps off the slowest DP rank), vectorised;
* :func:`pack_first_fit`: the token-count baseline;
* :func:`fill_empty_bins`: no bin is left empty.

All are deterministic (ties broken by index). See docs/planner.md, "The stages".
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["PackingProblem", "pack_greedy", "pack_first_fit", "fill_empty_bins", "improve"]


@dataclass(frozen=True)
class PackingProblem:
    """The samples of one global batch and the ``dp x m`` bins they go into.

    Attributes:
        weights: ``float64[n]``, each sample's cost (what DP ranks are balanced by); or
            ``float64[n, K]``, its cost under each of ``K`` price scenarios, each column normalised
            to its own lower bound: a DP rank's height is then its largest load over the
            scenarios, and packing balances every scenario at once.
        tokens: ``int64[n]``, each sample's length.
        dp: DP ranks.
        m: micro-batches (bins) per DP rank.
        capacity: tokens one bin holds (``cp * tokens_per_rank``).
    """

    weights: np.ndarray
    tokens: np.ndarray
    dp: int
    m: int
    capacity: int

    @property
    def num_bins(self) -> int:
        """``dp * m``: the micro-batches of the step."""
        return self.dp * self.m

    @property
    def columns(self) -> np.ndarray:
        """``float64[n, K]``: the weights with one column per price scenario (``K = 1`` for one price)."""
        w = np.asarray(self.weights, dtype=np.float64)
        return w[:, None] if w.ndim == 1 else w

    def dp_loads(self, bins: np.ndarray) -> np.ndarray:
        """``float64[dp, K]`` (``[dp]`` for 1-D weights): each DP rank's summed weights under ``bins``."""
        if np.ndim(self.weights) == 1:
            return np.bincount(bins // self.m, weights=self.weights, minlength=self.dp)
        return np.stack([np.bincount(bins // self.m, weights=c, minlength=self.dp) for c in self.columns.T], axis=1)

    def heights(self, bins: np.ndarray) -> np.ndarray:
        """``float64[dp]``: each DP rank's load in its worst price scenario (its load for 1-D weights)."""
        loads = self.dp_loads(bins)
        return loads if loads.ndim == 1 else loads.max(axis=1)


def pack_greedy(problem: PackingProblem) -> np.ndarray | None:
    """LPT: items by weight descending, each to the least-loaded DP rank with a micro-batch that fits.

    Returns the bin of every item (``int64[n]``), or ``None`` when some item fits nowhere (the
    caller then tries more micro-batches). Inside a DP rank the micro-batch with the most free
    tokens is chosen, so a rank's first ``m`` items open its ``m`` micro-batches.
    """
    tokens, dp, m, capacity = problem.tokens, problem.dp, problem.m, problem.capacity
    columns = problem.columns
    n = len(columns)
    order = np.lexsort((np.arange(n), -columns.max(axis=1)))
    # each rank's load in every scenario, as Python floats (only with several price scenarios:
    # a few additions per sample, far cheaper than numpy calls on rows of two or three)
    scenario_loads = [[0.0] * columns.shape[1] for _ in range(dp)]
    # each rank's bins as a heap of (-free tokens, bin): the one with most room first, then the lowest
    rooms = [[(-capacity, b) for b in range(m)] for _ in range(dp)]
    # (load, rank) pairs are distinct (one per rank), so which rank is least loaded never depends
    # on the heap's internal layout: heapreplace is pop + push in one sift.
    heap = [(0.0, d) for d in range(dp)]
    # ranks without room for the sample at hand wait here, most free tokens first, with their
    # load; items come heaviest first, which is longest first for any cost model that grows with
    # length, so a rank parked here rarely has room again before it is the next to get it.
    parked: list[tuple[int, int, float]] = []
    bins = [0] * n
    rank_free = [capacity] * dp  # most free tokens of any bin of each rank (== -rooms[d][0][0])
    most_free = capacity  # an upper bound on max(rank_free), refreshed when a sample exceeds it
    heappop, heappush, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    one_price = columns.shape[1] == 1
    rows = [()] * n if one_price else columns[order].tolist()
    for i, t, wi, row in zip(order.tolist(), tokens[order].tolist(), columns[order, 0].tolist(), rows):
        if t > most_free:
            most_free = max(rank_free)  # rank_free only shrinks: fail fast once no bin fits
            if t > most_free:
                return None
        while parked and -parked[0][0] >= t:  # room again: back among the candidates
            _, d, load = heappop(parked)
            heappush(heap, (load, d))
        while heap and rank_free[heap[0][1]] < t:  # the least-loaded ranks without room wait
            load, d = heappop(heap)
            heappush(parked, (-rank_free[d], d, load))
        if not heap:  # no rank fits (most_free was a stale upper bound)
            return None
        load, d = heap[0]
        room = rooms[d]
        fj, best = room[0]  # the bin with most free tokens, first on ties
        heapreplace(room, (fj + t, best))
        bins[i] = d * m + best
        rank_free[d] = -room[0][0]
        if one_price:
            key = load + wi
        else:  # the rank's height: its load in its heaviest scenario
            scenario_loads[d] = loads_d = [x + y for x, y in zip(scenario_loads[d], row)]
            key = max(loads_d)
        heapreplace(heap, (key, d))
    return np.array(bins, dtype=np.int64)


def fill_empty_bins(problem: PackingProblem, bins: np.ndarray) -> np.ndarray:
    """Give every empty bin one sample, taken from bins holding two or more; returns new bins.

    Prefers a donor bin of the same DP rank (DP loads unchanged); otherwise takes the cheapest
    movable sample of the whole step. Needs ``len(bins) >= dp * m`` (the caller checks).
    """
    bins = bins.copy()
    m, nbins = problem.m, problem.num_bins
    counts = np.bincount(bins, minlength=nbins)
    empty = np.flatnonzero(counts == 0)
    if empty.size == 0:
        return bins
    assert len(bins) >= nbins, "fewer samples than micro-batches"
    w = problem.columns.sum(axis=1)
    for e in empty.tolist():
        d = e // m
        movable = counts[bins] >= 2
        same = movable & (bins // m == d)
        pool = same if same.any() else movable
        cand = np.flatnonzero(pool)  # ascending, so argmin's first minimum is the lowest index
        chosen = int(cand[np.argmin(w[cand])])  # cheapest, then lowest index
        counts[bins[chosen]] -= 1
        bins[chosen] = e
        counts[e] += 1
    return bins


class _LocalSearch:
    """The state :func:`improve` updates: every sample's bin, DP-rank loads per price scenario
    (``[dp, K]``), their heights (the worst scenario), bin tokens and counts."""

    def __init__(self, problem: PackingProblem, bins: np.ndarray) -> None:
        self.m, self.capacity = problem.m, problem.capacity
        self.bins = bins
        self.w = problem.columns
        self.t = problem.tokens.astype(np.int64)
        self.loads = np.stack([np.bincount(bins // self.m, weights=c, minlength=problem.dp) for c in self.w.T], axis=1)
        self.bin_tok = np.bincount(bins, weights=self.t, minlength=problem.num_bins).astype(np.int64)
        self.counts = np.bincount(bins, minlength=problem.num_bins)
        # improvements smaller than this are rounding, not progress
        self.tol = 1e-12 * max(float(self.loads.max()), 1.0)
        self._tables: dict[str, np.ndarray] = {}

    @property
    def heights(self) -> np.ndarray:
        """``float64[dp]``: each DP rank's load in its worst scenario."""
        return self.loads.max(axis=1)

    def best_move(self, h: int, A: np.ndarray, light: np.ndarray) -> tuple[float, int, int] | None:
        """The move of one sample ``A[k]`` of the heaviest rank ``h`` to the bin with most free
        tokens of a light rank that minimises the larger new height: ``(new max, sample, bin)``."""
        m, capacity, bins, w, t = self.m, self.capacity, self.bins, self.w, self.t
        top = float(self.loads[h].max())
        shed = (self.loads[h] - w[A]).max(axis=1)  # h's height without each sample
        best = None
        for d in light.tolist():
            d_bins = np.arange(d * m, (d + 1) * m)
            j = d_bins[np.argmax(capacity - self.bin_tok[d_bins])]
            ok = (self.counts[bins[A]] >= 2) & (self.bin_tok[j] + t[A] <= capacity)
            if not ok.any():
                continue
            new = np.maximum(shed, (self.loads[d] + w[A]).max(axis=1))
            new = np.where(ok, new, np.inf)
            k = int(np.argmin(new))
            if new[k] < top - self.tol and (best is None or new[k] < best[0]):
                best = (float(new[k]), int(A[k]), int(j))
        return best

    def best_swap(self, h: int, A: np.ndarray, B: np.ndarray) -> tuple[float, int, int] | None:
        """The swap of ``a`` in ``A`` (rank ``h``) and ``b`` in ``B`` (light ranks) that minimises
        the larger new height, if it lowers ``h``'s height: ``(new max, a, b)``."""
        bins, w, t, capacity, bin_tok = self.bins, self.w, self.t, self.capacity, self.bin_tok
        top = float(self.loads[h].max())
        shape = (A.size, B.size)
        wA, wB, other_loads = w[A], w[B], self.loads[bins[B] // self.m]
        # (a, b) tables, one price scenario at a time (2-D passes; a reduction over a short last
        # axis is far slower): the weight h sheds, h's new load and the other rank's, largest so far
        delta = self._table("delta", np.float64, shape)
        scratch = self._table("scratch", np.float64, shape)
        new = self._table("new", np.float64, shape)
        other = self._table("other", np.float64, shape)
        for k in range(w.shape[1]):
            np.subtract(wA[:, k : k + 1], wB[None, :, k], out=delta)
            np.subtract(self.loads[h, k], delta, out=new if k == 0 else scratch)
            if k:
                np.maximum(new, scratch, out=new)
            np.add(other_loads[None, :, k], delta, out=other if k == 0 else scratch)
            if k:
                np.maximum(other, scratch, out=other)
        np.maximum(new, other, out=new)
        # allowed: both bins stay within capacity (tokens that move: dt = t[a] - t[b])
        dt = np.subtract(t[A][:, None], t[B][None, :], out=self._table("dt", np.int64, shape))
        tokens = self._table("tokens", np.int64, shape)
        fits = self._table("fits", np.bool_, shape)
        ok = np.less_equal(
            np.add(bin_tok[bins[B]][None, :], dt, out=tokens), capacity, out=self._table("ok", np.bool_, shape)
        )
        ok &= np.less_equal(np.subtract(bin_tok[bins[A]][:, None], dt, out=tokens), capacity, out=fits)
        new[np.logical_not(ok, out=fits)] = np.inf
        flat = int(np.argmin(new))  # the smallest entry, the lowest index among equals
        ka, kb = divmod(flat, B.size)
        val = float(new[ka, kb])
        if not val < top - self.tol:
            return None
        return val, int(A[ka]), int(B[kb])

    def _table(self, name: str, dtype: type, shape: tuple[int, ...]) -> np.ndarray:
        """A reusable ``shape`` array for the swap search: its (sample, sample) tables are refilled
        every iteration, and fresh arrays that size cost more to page in than to compute."""
        size = int(np.prod(shape))
        buf = self._tables.get(name)
        if buf is None or buf.size < size:
            buf = self._tables[name] = np.empty(size, dtype=dtype)
        return buf[:size].reshape(shape)

    def move(self, a: int, dst: int) -> None:
        """Move sample ``a`` to bin ``dst``."""
        src, m, w, t = self.bins[a], self.m, self.w, self.t
        self.loads[src // m] -= w[a]
        self.loads[dst // m] += w[a]
        self.bin_tok[src] -= t[a]
        self.bin_tok[dst] += t[a]
        self.counts[src] -= 1
        self.counts[dst] += 1
        self.bins[a] = dst

    def swap(self, a: int, b: int) -> None:
        """Swap the bins of samples ``a`` and ``b``."""
        bins, m, w, t = self.bins, self.m, self.w, self.t
        ba, bb = bins[a], bins[b]
        delta = w[a] - w[b]
        self.loads[ba // m] -= delta
        self.loads[bb // m] += delta
        self.bin_tok[ba] += t[b] - t[a]
        self.bin_tok[bb] += t[a] - t[b]
        bins[a], bins[b] = bb, ba


def improve(
    problem: PackingProblem,
    bins: np.ndarray,
    lower_bound: float,
    max_iters: int = 200,
    neighbours: int = 8,
    stop_gap: float = 1e-4,
    min_progress: float = 0.0,
    patience: int = 8,
) -> np.ndarray:
    """Local search on the slowest DP rank: move one sample out, or swap two, while the max drops.

    A rank's height is its load (with several price scenarios: its load in the worst one). Each
    iteration looks at the highest DP rank ``h`` and the ``neighbours`` lowest ranks and picks the
    move or swap that minimises the larger of the two new heights (strictly below ``h``'s
    load; ties by index, a move before a swap). Token capacities hold and no bin is emptied. Stops
    within ``stop_gap`` (relative) of ``lower_bound``, when nothing improves, after ``max_iters``
    iterations, or, with ``min_progress > 0``, when ``patience`` iterations lowered the largest
    height by less than that fraction (a plateau of equally high ranks, lowered one at a time:
    with several price scenarios every rank is at the top in one of them). Iteration counts, never
    a clock, so the result is the same on every machine. Returns new bins.
    """
    bins = bins.copy()
    if problem.dp < 2 or len(bins) < 2:
        return bins
    state = _LocalSearch(problem, bins)
    tops: list[float] = []
    for _ in range(max_iters):
        heights = state.heights
        h = int(np.argmax(heights))
        if heights[h] <= lower_bound * (1 + stop_gap):
            break
        tops.append(float(heights[h]))
        if min_progress > 0 and len(tops) > patience and tops[-1] > tops[-1 - patience] * (1 - min_progress):
            break
        ranks = bins // problem.m
        light = np.argsort(heights, kind="stable")[:neighbours]
        light = light[light != h]
        A = np.flatnonzero(ranks == h)
        move = state.best_move(h, A, light) if A.size else None
        is_light = np.zeros(problem.dp, dtype=bool)
        is_light[light] = True
        B = np.flatnonzero(is_light[ranks])
        swap = state.best_swap(h, A, B) if A.size and B.size else None
        if swap is not None and (move is None or swap[0] < move[0]):
            state.swap(swap[1], swap[2])
        elif move is not None:
            state.move(move[1], move[2])
        else:
            break
    return bins


def pack_first_fit(
    tokens: np.ndarray,
    dp: int,
    m_min: int,
    m_fixed: int,
    capacity: int,
) -> tuple[np.ndarray | None, int]:
    """The common baseline: balanced by token count only.

    Samples in their (shuffled) order go to the first open micro-batch with room (first fit);
    the micro-batches are then dealt to DP ranks, largest first, to the rank with the fewest
    tokens that still has a free slot. When there are fewer than ``dp * m`` micro-batches, the
    fullest ones give up their last sample to new ones. Returns ``(bins, m)``, ``bins`` ``None``
    when ``m_fixed`` micro-batches per rank cannot hold the samples.
    """
    n = len(tokens)
    t_list = tokens.tolist()
    packs, free = _first_fit(t_list, capacity, dp * m_fixed if m_fixed else n)
    m = m_fixed if m_fixed else max(m_min, -(-len(packs) // dp))
    if len(packs) > dp * m or n < dp * m:  # too many packs, or too few samples to fill every slot
        return None, m
    while len(packs) < dp * m:  # split the pack with most samples (then most tokens)
        p = max(range(len(packs)), key=lambda q: (len(packs[q]), -free[q], -q))
        assert len(packs[p]) >= 2, "fewer samples than micro-batches"
        moved = packs[p].pop()
        free[p] += t_list[moved]
        packs.append([moved])
        free.append(capacity - t_list[moved])
    # deal packs to DP ranks: most tokens first, to the rank with fewest tokens and a free slot
    pack_tokens = [capacity - f for f in free]
    order = sorted(range(len(packs)), key=lambda q: (-pack_tokens[q], q))
    heap = [(0, d) for d in range(dp)]
    slots = [0] * dp
    bins = np.empty(n, dtype=np.int64)
    for q in order:
        load, d = heapq.heappop(heap)
        for i in packs[q]:
            bins[i] = d * m + slots[d]
        slots[d] += 1
        if slots[d] < m:
            heapq.heappush(heap, (load + pack_tokens[q], d))
    return bins, m


def _first_fit(t_list: list[int], capacity: int, limit: int) -> tuple[list[list[int]], list[int]]:
    """Samples in order to the first pack with room, a new pack when none has: ``(packs, free room)``.

    The first pack with room is found in ``O(log packs)`` through a max-tree of the packs' free
    room (leaves in pack order; a leaf without a pack holds -1). Stops once there are more than
    ``limit`` packs (the caller then has too many whatever the rest do).
    """
    packs: list[list[int]] = []
    free: list[int] = []
    size = 64
    tree = [-1] * (2 * size)
    for i, ti in enumerate(t_list):
        if tree[1] >= ti:
            node = 1
            while node < size:
                node *= 2
                if tree[node] < ti:
                    node += 1
            p = node - size
            packs[p].append(i)
            free[p] -= ti
        else:
            if len(packs) >= limit:
                packs.append([i])
                free.append(capacity - ti)
                break
            p = len(packs)
            packs.append([i])
            free.append(capacity - ti)
            if p == size:  # grow: the leaves double, the inner nodes are rebuilt
                size *= 2
                tree = [-1] * size + free + [-1] * (size - len(free))
                for node in range(size - 1, 0, -1):
                    tree[node] = max(tree[2 * node], tree[2 * node + 1])
                continue
            node = p + size
        tree[node] = free[p]
        node //= 2
        while node:
            top = max(tree[2 * node], tree[2 * node + 1])
            if tree[node] == top:
                break
            tree[node] = top
            node //= 2
    return packs, free
