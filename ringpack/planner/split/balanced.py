"""The cost-balanced CP split (``strategy="balanced"``): short samples stay whole, only samples
that must be split are split, and each rank's cost comes within a tolerance of the mean.

:func:`split_balanced` splits one micro-batch; :func:`split_balanced_many` splits many with the
same result, sharing the work (the planner's path). This module holds the tolerances, the flow of
one micro-batch and the carving of split samples' last pieces (step 2a); the other steps have
modules of their own: best fit (:mod:`~ringpack.planner.split.best_fit`), suffix cuts
(:mod:`~ringpack.planner.split.suffix_cuts`) and the fallbacks for tight token budgets
(:mod:`~ringpack.planner.split.fallbacks`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ringpack.planner.split.best_fit import best_fit, best_fit_lockstep
from ringpack.planner.split.fallbacks import retry_with_fallbacks
from ringpack.planner.split.pieces import microbatch_from_slots, piece_cost, suffix_start
from ringpack.planner.split.suffix_cuts import choose_suffix_cuts, cut_suffixes
from ringpack.shard_plan import MicroBatch

if TYPE_CHECKING:
    from ringpack.cost import CostModel

__all__ = [
    "split_balanced",
    "split_balanced_many",
    "CP_BALANCE_TOLERANCE",
    "RECOMMENDED_TOKEN_SLACK",
    "LOCKSTEP_MIN_GROUPS",
]


#: A rank may exceed the ideal cost ``sum(costs) / cp`` of its micro-batch by this fraction before
#: a sample that would otherwise stay whole is split instead. Splitting trades K/V traffic for
#: balance; 0.1% of imbalance is far below run-to-run noise and saves most splits.
CP_BALANCE_TOLERANCE = 1e-3


#: A ``token_slack`` that makes ``balanced`` robust to a mispriced cost model (opt-in through
#: ``PlanConfig.cp_token_slack``). Why: a rank's time is ``token*tokens + pair*pairs`` with
#: coefficients a FLOP model misprices by up to 2x (attention kernels run at about half the FLOP
#: rate of the linear layers; norms, activations and the loss are per-token work FLOPs ignore).
#: With tokens free, the split trades one rank's tokens for another's attention pairs at the
#: model's price; holding every rank within ``1 + slack`` of the mean tokens makes equal cost mean
#: (nearly) equal pairs too, balanced under *any* coefficients. The price, measured by
#: benchmarks/planner.py (BENCHMARKS.md): more samples cut, so more K/V crossing ranks (at CP=8,
#: 0.47-0.80 of zigzag's instead of 0.22-0.53, measured before last pieces were carved) and slower
#: planning. A calibrated profile
#: (``ringpack calibrate``) is the other cure.
RECOMMENDED_TOKEN_SLACK = 0.02


def split_balanced(
    samples: Sequence[int],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    tolerance: float = CP_BALANCE_TOLERANCE,
    token_slack: float | None = None,
) -> MicroBatch:
    """Cost-balanced CP split: short samples stay whole, only samples that must be split are split.

    1. Every CP rank gets a cost room of ``(1 + tolerance) * sum(sample costs) / cp`` and a token
       room of ``tokens_per_rank``, tightened to ``(1 + token_slack)`` times the mean tokens per
       rank when ``token_slack`` is given (see :data:`RECOMMENDED_TOKEN_SLACK`; ``None`` leaves
       tokens free for the cost model to trade).
    2. Samples that fit whole on no rank, most expensive first, each put their longest suffix an
       untouched rank holds on a rank of its own (:func:`_carve`): the K/V a split sample sends
       is everything before its last piece, least when that piece fills a rank. Then samples
       (and what is left of the carved ones), most expensive first, go *whole* to the rank with
       the smallest cost room that still holds them (best fit), so ranks fill one at a time and
       the room left is in few ranks, in large blocks. A placement is refused if it would leave a
       rank unable to reach its cost with the tokens it has left (no token costs more than the
       last one of the longest sample).
    3. Samples that fit whole nowhere are cut from the back: the densest remaining suffix goes to
       the rank needing the densest content (highest cost room per free token), as long a suffix
       as fits there, and so on. If carving left some rank unable to reach its cost (the tokens
       left for it too cheap), the micro-batch is planned again without step 2's carving, and
       step 3 is tried both by density and with each sample's last piece on the rank where it is
       longest; the balanced one sending less K/V is kept (:func:`choose_suffix_cuts`).

    When tokens are tight (little free token room), step 2 can leave ranks that cannot be
    balanced; the split is then retried with the costliest samples zigzagged first, then with
    whole short samples around deficit-driven zigzag of the long ones, and
    :func:`~ringpack.planner.split.baselines.split_zigzag_even` (every sample zigzagged, tokens
    even to one) is the last resort (:mod:`~ringpack.planner.split.fallbacks`). The first
    candidate within ``2 * tolerance`` of the ideal wins, else the one with the lowest max rank
    cost (earlier candidates, which split less, win ties within ``tolerance``). The token room is
    never exceeded, so every micro-batch of at most ``cp * tokens_per_rank`` tokens gets a valid
    split.
    """
    return split_balanced_many([samples], lengths, cp, tokens_per_rank, cost, tolerance, token_slack)[0]


#: From this many micro-batches on, :func:`split_balanced_many` runs the best-fit pass of all of
#: them in lockstep with numpy (one array operation per sample position instead of per sample).
LOCKSTEP_MIN_GROUPS = 8


def split_balanced_many(
    groups: Sequence[Sequence[int]],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    tolerance: float = CP_BALANCE_TOLERANCE,
    token_slack: float | None = None,
    lockstep: bool | None = None,
) -> list[MicroBatch]:
    """:func:`split_balanced` of every micro-batch in ``groups`` (lists of samples), in order.

    The result is the same as one :func:`split_balanced` call per group; only the work is shared.
    Sample costs and orders are computed for all groups at once, and the best-fit pass (step 2),
    which runs once per sample in each group, runs in lockstep over the groups: the ``i``-th
    costliest sample of every group is placed by one vectorised best fit over a (group, rank)
    table of rooms. ``lockstep=None`` does so from :data:`LOCKSTEP_MIN_GROUPS` groups on (the
    per-group loop is faster for a few); ``True``/``False`` force either path (the tests check
    that both give the same pieces). Cuts of samples that fit whole nowhere (step 3) and the
    retries of tight micro-batches run per group.
    """
    a, b, seg = float(cost.token), float(cost.pair), float(cost.segment)
    G = len(groups)
    if G == 0:
        return []
    sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=G)
    N = int(sizes.sum())
    starts = np.zeros(G + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    bounds = starts.tolist()
    if isinstance(lengths, np.ndarray):
        flat = lengths[np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=N)].astype(
            np.int64, copy=False
        )
        flat_list = flat.tolist()
        lens_of = [flat_list[bounds[g] : bounds[g + 1]] for g in range(G)]
    else:
        lens_of = [[int(lengths[x]) for x in samples] for samples in groups]
        flat = np.fromiter(itertools.chain.from_iterable(lens_of), dtype=np.int64, count=N)
    totals = [sum(l) for l in lens_of]
    for total in totals:
        if total > cp * tokens_per_rank:
            raise ValueError(f"micro-batch holds {total} tokens, more than cp*tokens_per_rank={cp * tokens_per_rank}")
    if cp == 1:
        return [
            microbatch_from_slots(samples, [[(k, 0, l) for k, l in enumerate(lens)]], lengths, total)
            for samples, lens, total in zip(groups, lens_of, totals)
        ]
    if token_slack is None:
        tprs = [int(tokens_per_rank)] * G
    else:
        tprs = [min(tokens_per_rank, math.ceil(total / cp * (1.0 + token_slack))) for total in totals]
    # the same operations, in the same order, as a*l + b*0.5*l*(l+1) + seg on Python numbers
    W = a * flat + b * 0.5 * flat * (flat + 1) + seg
    gid = np.repeat(np.arange(G, dtype=np.int64), sizes)
    slot = np.arange(N, dtype=np.int64) - starts[gid]
    # most expensive first, ties by position in the micro-batch
    ordered = np.lexsort((slot, -W, gid))
    w_all, ord_slot = W.tolist(), slot[ordered].tolist()
    ws = [w_all[bounds[g] : bounds[g + 1]] for g in range(G)]
    orders = [ord_slot[bounds[g] : bounds[g + 1]] for g in range(G)]
    ideals = [sum(w) / cp for w in ws]  # Python's left-to-right float sum, as in a per-group loop
    caps = [ideal * (1.0 + tolerance) for ideal in ideals]
    if lockstep is None:
        lockstep = G >= LOCKSTEP_MIN_GROUPS
    # Step 2a: samples too big for any rank give their last pieces ranks of their own (carve)
    cap_arr, tpr_arr = np.array(caps), np.array(tprs, dtype=np.int64)
    nbig = np.bincount(gid, weights=(cap_arr[gid] < W) | (flat > tpr_arr[gid]), minlength=G).astype(np.int64)
    big = np.flatnonzero(nbig)
    carved = [None] * G
    items, item_w, item_order = lens_of, ws, orders  # what the best fit places, per group
    W2, F2, ordered2, counts = W, flat, ordered, sizes
    if big.size:
        items, item_w, item_order = list(lens_of), list(ws), list(orders)
        at, new_w, new_l = [], [], []
        for g in big.tolist():
            carved[g] = _carve(lens_of[g], ws[g], orders[g], cp, tprs[g], a, b, seg, caps[g], int(nbig[g]))
            if carved[g] is None:
                continue
            stops, costs = items[g], item_w[g] = list(lens_of[g]), list(ws[g])
            for k, start in carved[g][3]:
                stops[k] = start
                costs[k] = piece_cost(0, start, a, b, seg) if start else 0.0
                # what is left is placed in cost order; nothing left: after the group's items
                at.append(bounds[g] + k)
                new_w.append(costs[k] if start else -math.inf)
                new_l.append(start)
        W2, F2 = W.copy(), flat.copy()
        W2[at], F2[at] = new_w, new_l
        ordered2 = np.lexsort((slot, -W2, gid))
        counts = sizes - np.bincount(gid[at], weights=F2[at] == 0, minlength=G).astype(np.int64)
        ord_slot2 = slot[ordered2].tolist()
        for g in big.tolist():
            if carved[g] is not None:
                item_order[g] = ord_slot2[bounds[g] : bounds[g] + int(counts[g])]
    placed = None
    if lockstep and int(sizes.min()) > 0:
        init = [None if c is None else c[:2] for c in carved]
        placed = best_fit_lockstep(W2[ordered2], F2[ordered2], gid, starts, counts, init, caps, tprs, cp, a, b, seg)
    out = []
    for g, samples in enumerate(groups):
        # one group at a time from here on: its temporary pieces are freed before the next group's
        lens, cap, tpr = lens_of[g], caps[g], tprs[g]
        accept = ideals[g] * (1.0 + 2.0 * tolerance)
        stops, carving, carved[g] = items[g], carved[g], None  # (dropped: updated in place below)
        if placed is None:
            state = None if carving is None else carving[:3]
            shards, room, troom, leftovers = best_fit(
                stops, item_w[g], item_order[g], cp, tpr, a, b, seg, cap, 1.0, state=state
            )
        else:
            room, troom, place = placed[g]
            placed[g] = None
            shards = [[] for _ in range(cp)] if carving is None else carving[2]
            leftovers = []
            for k, r in zip(item_order[g], place):
                if r >= 0:
                    shards[r].append((k, 0, stops[k]))
                else:
                    leftovers.append(k)
        if carving is not None:
            # step 3 by density; when that leaves a rank unbalanced (the tokens left for it too
            # cheap to reach its cost), the micro-batch is planned without carving
            cut_suffixes(leftovers, stops, room, troom, shards, cp, a, b, seg)
            if cap - min(room) <= accept:
                out.append(microbatch_from_slots(samples, shards, lengths, totals[g]))
                continue
            shards, room, troom, leftovers = best_fit(lens, ws[g], orders[g], cp, tpr, a, b, seg, cap, 1.0)
        best = choose_suffix_cuts(leftovers, lens, room, troom, shards, cp, a, b, seg, cap, accept)
        if best[0] > accept:
            best = retry_with_fallbacks(
                best, lens, ws[g], orders[g], cp, tpr, a, b, seg, cap, ideals[g], accept, tolerance
            )
        out.append(microbatch_from_slots(samples, best[1], lengths, totals[g]))
    return out


def _carve(lens, w, order, cp, tpr, a, b, seg, cap, count=-1):
    """Step 2a of :func:`split_balanced`: split samples' last pieces get ranks of their own.

    Samples that fit whole on no rank (cost over ``cap`` or tokens over ``tpr``), most expensive
    first, each put their longest suffix that an untouched rank holds on the next untouched rank,
    while untouched ranks last: the K/V a split sample sends is everything before its last piece,
    least when that piece fills a rank. What is left of them (a prefix, sent to the other ranks
    in any case) is placed like a whole sample. Returns ``None`` when no sample is carved, else
    ``(room, troom, shards, [(slot, start of its carved piece), ...])``. ``count``: how many
    samples are too big (the scan stops there), -1 if not known.
    """
    room = [cap] * cp
    troom = [int(tpr)] * cp
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    cuts = []
    count = cp if count < 0 else min(count, cp)
    for k in order:
        if len(cuts) == count:
            break
        lk = lens[k]
        if w[k] <= cap and lk <= tpr:
            continue
        r = len(cuts)
        start = max(suffix_start(lk, cap, a, b, seg), lk - int(tpr))
        shards[r].append((k, start, lk))
        room[r] -= piece_cost(start, lk, a, b, seg)
        troom[r] -= lk - start
        cuts.append((k, start))
    return (room, troom, shards, cuts) if cuts else None
