"""Carving: samples too big for any rank give their last pieces ranks of their own.

Why: a split sample sends the K/V of everything before its last piece to the ranks holding later
pieces, so that traffic is least when the last piece is as long as a rank holds. Before anything
else is placed, each sample that fits whole on no rank (most expensive first, while untouched ranks
last) puts its longest suffix an empty rank holds on the next empty rank. What is left of it, a
prefix that other ranks need the K/V of in any case, is then placed like a whole sample.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ringpack.planner.split.batch import PlacementTable, ProblemBatch
from ringpack.planner.split.pieces import piece_cost, suffix_start
from ringpack.planner.split.problem import Items, RankFill, SplitProblem

__all__ = ["Carving", "carve_last_pieces", "carve_batch"]


@dataclass(slots=True)
class Carving:
    """A micro-batch after carving: the ranks holding the carved last pieces, and what is left to place."""

    fill: RankFill
    items: Items


def carve_last_pieces(problem: SplitProblem, count: int) -> tuple[RankFill, list[tuple[int, int]]]:
    """Put the last pieces of the ``count`` samples that fit whole on no rank on ranks of their own.

    A sample fits whole on no rank when its cost is over ``problem.cap`` or its tokens over
    ``problem.tokens_per_rank``. The costliest ``min(count, cp)`` such samples, most expensive
    first, each put on the next empty rank their longest suffix that fits there. Returns the ranks
    and ``[(slot, start of its carved piece), ...]``.
    """
    cp, cap, tpr = problem.cp, problem.cap, problem.tokens_per_rank
    a, b, seg = problem.token, problem.pair, problem.segment
    lens, w = problem.lens, problem.costs
    fill = RankFill.empty(problem)
    cuts = []
    count = min(count, cp)
    for k in problem.order:
        if len(cuts) == count:
            break
        lk = lens[k]
        if w[k] <= cap and lk <= tpr:
            continue
        r = len(cuts)
        start = max(suffix_start(lk, cap, a, b, seg), lk - int(tpr))
        fill.shards[r].append((k, start, lk))
        fill.room[r] -= piece_cost(start, lk, a, b, seg)
        fill.token_room[r] -= lk - start
        cuts.append((k, start))
    return fill, cuts


def carve_batch(batch: ProblemBatch) -> tuple[list[Carving | None], PlacementTable]:
    """:func:`carve_last_pieces` in every micro-batch of ``batch`` with samples too big for any rank.

    Returns each micro-batch's :class:`Carving` (``None`` where no sample is too big) and the
    placement table of what best fit then places: the prefixes left of carved samples, priced and
    ordered among the whole samples, and nothing for samples carved whole.
    """
    problems, whole = batch.problems, batch.whole
    G = len(problems)
    gid, W, flat = whole.group, whole.costs, whole.tokens
    cap, tpr = batch.caps, batch.budgets
    too_big = np.bincount(gid, weights=(cap[gid] < W) | (flat > tpr[gid]), minlength=G).astype(np.int64)
    carvings: list[Carving | None] = [None] * G
    carved = np.flatnonzero(too_big).tolist()
    if not carved:
        return carvings, whole
    bounds = whole.starts.tolist()
    at, new_w, new_l = [], [], []  # flat index, cost and tokens of each carved sample's prefix
    prefixes = {}
    for g in carved:
        problem = problems[g]
        fill, cuts = carve_last_pieces(problem, int(too_big[g]))
        stops, costs = list(problem.lens), list(problem.costs)
        for k, start in cuts:
            stops[k] = start
            costs[k] = piece_cost(0, start, problem.token, problem.pair, problem.segment) if start else 0.0
            # what is left is placed in cost order; nothing left: after the micro-batch's items
            at.append(bounds[g] + k)
            new_w.append(costs[k] if start else -math.inf)
            new_l.append(start)
        prefixes[g] = (fill, stops, costs)
    W2, F2 = W.copy(), flat.copy()
    W2[at], F2[at] = new_w, new_l
    ordered = np.lexsort((batch.slot, -W2, gid))
    counts = whole.counts - np.bincount(gid[at], weights=F2[at] == 0, minlength=G).astype(np.int64)
    ord_slot = batch.slot[ordered].tolist()
    for g, (fill, stops, costs) in prefixes.items():
        carvings[g] = Carving(fill, Items(stops, costs, ord_slot[bounds[g] : bounds[g] + int(counts[g])]))
    return carvings, PlacementTable(W2, F2, ordered, gid, whole.starts, counts)
