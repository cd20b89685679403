"""Whole-sample placement: samples, most expensive first, each go whole to the rank with the smallest
cost room that still holds them (best fit).

Why best fit: ranks fill one at a time, so the room left is in few ranks, in large blocks, where
the samples that fit whole nowhere can then be cut into long pieces
(:mod:`~ringpack.planner.split.suffix_cuts`). A placement is refused if it would leave the rank
unable to reach its cost with the tokens it has left (no token costs more than the last one of the
longest sample), since cut pieces could not fill it then.

:func:`best_fit` places one micro-batch; :func:`best_fit_lockstep` places many at once with numpy
(one array operation per sample position instead of one loop per sample) and picks exactly the same
ranks, which the tests check.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Sequence

import numpy as np

from ringpack.planner.split.baselines import zigzag_even_chunks
from ringpack.planner.split.batch import PlacementTable, ProblemBatch
from ringpack.planner.split.pieces import piece_cost
from ringpack.planner.split.problem import Items, RankFill, Slice, SplitProblem

__all__ = ["best_fit", "best_fit_lockstep", "fill_from_lockstep"]


def best_fit(problem: SplitProblem, items: Items, fill: RankFill, zigzag_over: float = math.inf) -> list[int] | None:
    """Place ``items`` whole on ``fill``'s ranks by best fit, most expensive first; updates ``fill``.

    Items costing more than ``zigzag_over`` are first zigzagged over all ranks, token-even like
    :func:`~ringpack.planner.split.baselines.split_zigzag_even`: a sample much costlier than a rank
    sends nearly all its K/V whichever way it is cut, and its even spread leaves every rank the
    same room for the rest.

    Returns the slots that fit whole on no rank (to be cut), most expensive first; ``None`` when
    the zigzagged items alone overflow a rank's tokens.
    """
    order = items.order
    if zigzag_over < math.inf:
        order = _zigzag_costliest(problem, items, fill, zigzag_over)
        if order is None:
            return None
    if not order:
        return []
    lens = items.stops
    # The densest tokens (cost per token) are the last ones of the longest item.
    longest = max(lens) if len(order) == len(lens) else max([lens[k] for k in order])
    density = problem.token + problem.pair * longest + problem.segment
    return _place_best_fit(problem, items, order, fill, density)


def _zigzag_costliest(problem: SplitProblem, items: Items, fill: RankFill, zigzag_over: float) -> list[int] | None:
    """Zigzag the items costing more than ``zigzag_over`` over all ranks; the order of the others.

    ``None`` when the zigzagged items overflow a rank's tokens.
    """
    a, b, seg = problem.token, problem.pair, problem.segment
    room, troom, shards = fill.room, fill.token_room, fill.shards
    lens, w, order = items.stops, items.costs, items.order
    zig = [k for k in order if w[k] > zigzag_over]
    for k in zig:
        # most token room first is fewest tokens held first
        for r, start, stop in zigzag_even_chunks(lens[k], [-t for t in troom]):
            shards[r].append((k, start, stop))
            room[r] -= piece_cost(start, stop, a, b, seg)
            troom[r] -= stop - start
    if min(troom) < 0:
        return None
    if not zig:
        return order
    zig_set = set(zig)
    return [k for k in order if k not in zig_set]


def _place_best_fit(problem: SplitProblem, items: Items, order: list[int], fill: RankFill, density: float) -> list[int]:
    """The best-fit loop of :func:`best_fit`: each item of ``order`` to the rank with the smallest
    cost room that holds it (first rank on ties) and can still reach its cost with tokens costing
    at most ``density`` each. Returns the items placed nowhere.

    The ranks are kept in (room, rank) order and searched up from the first room >= the item's
    cost; ``rooms``/``rks`` hold that order (parallel lists: cheaper than a list of pairs).
    """
    cap, tokens_per_rank = problem.cap, problem.tokens_per_rank
    lens, w = items.stops, items.costs
    room, troom, shards = fill.room, fill.token_room, fill.shards
    cp = len(room)
    leftovers = []
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
    return leftovers


def best_fit_lockstep(
    batch: ProblemBatch, table: PlacementTable, start: Sequence[RankFill | None]
) -> list[tuple[list[float], list[int], list[int]]]:
    """:func:`best_fit` (no zigzag) of every micro-batch at once.

    ``table`` lists each micro-batch's items (every micro-batch holds at least one); ``start[g]``:
    the ranks to start micro-batch ``g`` from (its carving), ``None`` for empty ranks. Row ``g`` of
    the (micro-batch, rank) tables holds micro-batch ``g``'s cost and token rooms; step ``i`` offers
    every micro-batch its ``i``-th item and places it by best fit exactly as the per-micro-batch
    loop does: among the ranks whose room holds its cost, whose tokens hold it and that can still
    reach their cost with the tokens left, the smallest room, then the lowest rank.

    Returns, per micro-batch, the cost and token rooms left and the rank of each item in placement
    order (-1: fits whole nowhere, to be cut); :func:`fill_from_lockstep` turns that into ranks.
    """
    Wt, Lt, density = _item_tables(batch, table)
    R, TR = _room_tables(batch, start)
    G, cp = R.shape[0], R.shape[1] - 1
    Rf, TRf = R.reshape(-1), TR.reshape(-1)
    base = np.arange(G, dtype=np.int64) * (cp + 1)
    place = np.empty((len(Wt), G), dtype=np.int64)
    for i in range(len(Wt)):
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


def _item_tables(batch: ProblemBatch, table: PlacementTable) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(costs[width, G, 1], tokens[width, G, 1], density[G, 1])``: row ``i`` holds every micro-batch's
    ``i``-th item to place; each micro-batch's token density bound (its longest item's last token)."""
    G = len(batch.problems)
    first = batch.problems[0]
    a, b, seg = first.token, first.pair, first.segment
    gid, starts, counts = table.group, table.starts, table.counts
    w_ord, l_ord = table.costs[table.order], table.tokens[table.order]
    width = int((starts[1:] - starts[:-1]).max())
    pos = np.arange(len(gid), dtype=np.int64) - starts[gid]  # place in the micro-batch's order (gid is sorted)
    cap, tpr = batch.caps, batch.budgets
    # Items a rank cannot hold whole (cost over the room, tokens over the budget), skipped items
    # and padding cost +inf: their room left, room - inf, is negative everywhere.
    Wt = np.full((width, G), np.inf)
    Lt = np.zeros((width, G), dtype=np.int64)
    Wt[pos, gid] = np.where((w_ord <= cap[gid]) & (l_ord <= tpr[gid]) & (pos < counts[gid]), w_ord, np.inf)
    Lt[pos, gid] = l_ord
    density = (a + b * np.maximum.reduceat(l_ord, starts[:-1]) + seg)[:, None]
    return Wt[:, :, None], Lt[:, :, None], density


def _room_tables(batch: ProblemBatch, start: Sequence[RankFill | None]) -> tuple[np.ndarray, np.ndarray]:
    """The (micro-batch, rank) cost and token rooms to start from.

    Column 0 is a rank that never fits (room -inf): the pick when no real rank does; real rank ``r``
    is column ``r + 1``, so ties still go to the lowest rank.
    """
    G, cp = len(batch.problems), batch.problems[0].cp
    R = np.empty((G, cp + 1))
    R[:, 0] = -np.inf
    R[:, 1:] = batch.caps[:, None]
    TR = np.zeros((G, cp + 1), dtype=np.int64)
    TR[:, 1:] = batch.budgets[:, None]
    for g, fill in enumerate(start):
        if fill is not None:
            R[g, 1:], TR[g, 1:] = fill.room, fill.token_room
    return R, TR


def fill_from_lockstep(
    problem: SplitProblem,
    items: Items,
    placed: tuple[list[float], list[int], list[int]],
    shards: list[list[Slice]],
) -> tuple[RankFill, list[int]]:
    """The ranks after one micro-batch's lockstep best fit, and the slots to cut.

    ``placed``: the micro-batch's entry of :func:`best_fit_lockstep`; ``shards``: the pieces its
    ranks held before (from carving), extended in place.
    """
    room, troom, place = placed
    stops = items.stops
    leftovers = []
    for k, r in zip(items.order, place):
        if r >= 0:
            shards[r].append((k, 0, stops[k]))
        else:
            leftovers.append(k)
    return RankFill(problem.cap, room, troom, shards), leftovers
