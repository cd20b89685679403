"""Step 2 of the balanced split: place samples whole, most expensive first, each on the rank with
the smallest cost room that still holds it (best fit).

Why best fit: ranks fill one at a time, so the room left is in few ranks, in large blocks, where
step 3 (:mod:`~ringpack.planner.split.suffix_cuts`) can give the samples that fit whole nowhere
long pieces. :func:`best_fit` places one micro-batch; :func:`best_fit_lockstep` places many at
once with numpy (one array operation per sample position instead of one loop per sample) and must
pick exactly the same ranks, which the tests check.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np

from ringpack.planner.split.baselines import zigzag_even_chunks
from ringpack.planner.split.pieces import piece_cost

__all__ = ["best_fit", "best_fit_lockstep"]


def best_fit(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over=math.inf, state=None):
    """Steps 1-2 of :func:`~ringpack.planner.split.balanced.split_balanced`:
    ``(shards, room, troom, leftovers)``, ``leftovers`` the samples to cut (step 3), ``None`` when
    the zigzagged samples alone overflow a rank's tokens.

    ``order`` lists the samples' positions most expensive first; shards hold ``(slot, start, stop)``
    triples. Samples costing more than ``zigzag_over`` are zigzagged over all ranks first
    (token-even, like :func:`~ringpack.planner.split.baselines.split_zigzag_even`): a sample much
    costlier than a rank sends nearly all its K/V whichever way it is cut, and its even spread
    leaves every rank the same room for the rest. ``state``: ``(room, troom, shards)`` to start
    from instead of empty ranks.
    """
    if state is None:
        room = [cap] * cp
        troom = [int(tokens_per_rank)] * cp
        shards: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    else:
        room, troom, shards = state
    if zigzag_over < math.inf:
        zig = [k for k in order if w[k] > zigzag_over]
        for k in zig:
            # most token room first is fewest tokens held first
            for r, start, stop in zigzag_even_chunks(lens[k], [-t for t in troom]):
                shards[r].append((k, start, stop))
                room[r] -= piece_cost(start, stop, a, b, seg)
                troom[r] -= stop - start
        if min(troom) < 0:
            return shards, room, troom, None
        if zig:
            zig_set = set(zig)
            order = [k for k in order if k not in zig_set]
    if not order:
        return shards, room, troom, []
    # The densest tokens (cost per token) are the last ones of the longest sample; ``density_factor``
    # below 1 assumes less dense content will be left to fill the ranks.
    density = (
        a + b * max([lens[k] for k in order] if zigzag_over < math.inf or state is not None else lens)
    ) * density_factor + seg
    leftovers = []
    # Best fit: the rank with the smallest cost room that holds the sample (first rank on ties),
    # found by walking the ranks in (room, rank) order up from the first room >= the sample's cost.
    # ``rooms``/``rks`` hold that order (parallel lists: cheaper than a list of pairs).
    rks = sorted(range(cp), key=lambda r: (room[r], r))
    rooms = [room[r] for r in rks]
    last = cp - 1
    for k in order:
        wk = w[k]
        lk = lens[k]
        if wk > cap or lk > tokens_per_rank:
            leftovers.append(k)
            continue
        j = bisect_left(rooms, wk)
        while j < cp:
            r = rks[j]
            tr = troom[r] - lk
            if tr >= 0 and rooms[j] - wk <= tr * density:
                break
            j += 1
        else:
            leftovers.append(k)
            continue
        rr = rooms[j] - wk
        del rooms[j]
        del rks[j]
        i = bisect_left(rooms, rr)
        while i < last and rooms[i] == rr and rks[i] < r:
            i += 1
        rooms.insert(i, rr)
        rks.insert(i, r)
        room[r] = rr
        troom[r] = tr
        shards[r].append((k, 0, lk))
    return shards, room, troom, leftovers


def best_fit_lockstep(w_ord, l_ord, gid, starts, counts, init, caps, tprs, cp, a, b, seg):
    """The best fit of :func:`best_fit` (no zigzag) for every group at once.

    ``w_ord``/``l_ord``: the items' costs and tokens, group after group (``gid``, segments at
    ``starts``), each group's first ``counts[g]`` in the order to place (the rest are skipped);
    ``init[g]``: ``(room, troom)`` to start from (:func:`~ringpack.planner.split.balanced._carve`),
    ``None`` for empty ranks. Row ``g`` of the (group, rank) tables holds group ``g``'s cost and token rooms; step ``i``
    offers every group its ``i``-th item and places it by best fit, exactly as the per-group loop
    does: among the ranks whose room holds its cost, whose tokens hold it and that can still
    reach their cost with the tokens left, the smallest room, then the lowest rank. Returns, per
    group, the rooms and token rooms left and the rank of each item (-1: fits whole nowhere,
    to be cut).
    """
    G = len(caps)
    width = int((starts[1:] - starts[:-1]).max())
    pos = np.arange(len(gid), dtype=np.int64) - starts[gid]  # place in the group's order (gid is sorted)
    cap = np.array(caps, dtype=np.float64)
    tpr = np.array(tprs, dtype=np.int64)
    # Items a rank cannot hold whole (cost over the room, tokens over the budget), skipped items
    # and padding cost +inf: their room left, room - inf, is negative everywhere.
    Wt = np.full((width, G), np.inf)
    Lt = np.zeros((width, G), dtype=np.int64)
    Wt[pos, gid] = np.where((w_ord <= cap[gid]) & (l_ord <= tpr[gid]) & (pos < counts[gid]), w_ord, np.inf)
    Lt[pos, gid] = l_ord
    Wt, Lt = Wt[:, :, None], Lt[:, :, None]
    # the densest tokens are the last ones of the longest item (density_factor 1)
    density = ((a + b * np.maximum.reduceat(l_ord, starts[:-1])) * 1.0 + seg)[:, None]
    # Column 0 is a rank that never fits (room -inf): the pick when no real rank does; real rank r
    # is column r + 1, so ties still go to the lowest rank.
    R = np.empty((G, cp + 1))
    R[:, 0] = -np.inf
    R[:, 1:] = cap[:, None]
    TR = np.zeros((G, cp + 1), dtype=np.int64)
    TR[:, 1:] = tpr[:, None]
    for g, state in enumerate(init):
        if state is not None:
            R[g, 1:], TR[g, 1:] = state
    Rf, TRf = R.reshape(-1), TR.reshape(-1)
    base = np.arange(G, dtype=np.int64) * (cp + 1)
    place = np.empty((width, G), dtype=np.int64)
    for i in range(width):
        left = R - Wt[i]  # the room each rank would keep
        tr = TR - Lt[i]
        # left >= 0 is room >= cost (exact in floating point); with density > 0 it also rules
        # out tr < 0, as left <= tr * density < 0 then fails
        fits = (left >= 0) & (left <= tr * density)
        best = np.where(fits, R, np.inf).argmin(axis=1)  # smallest room, then lowest rank
        place[i] = best
        at = base + best
        Rf[at] = left.reshape(-1)[at]
        TRf[at] = tr.reshape(-1)[at]
    return list(zip(R[:, 1:].tolist(), TR[:, 1:].tolist(), (place.T - 1).tolist()))
