"""CP split strategies: cut one micro-batch's samples into pieces for C context-parallel ranks.

Every strategy takes the micro-batch's samples (in micro-batch order) with their lengths and
returns a :class:`~ringpack.balancer.plan.MicroBatch`. None needs any divisibility rule or padding:
a sample of any length >= 1 may be cut anywhere, and chunks that come out empty are simply absent.
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ringpack.balancer.plan import MicroBatch, Piece, microbatch_from_shards, new_rank_shard

if TYPE_CHECKING:
    from ringpack.balancer.cost import CostModel

__all__ = ["split_contiguous", "split_zigzag", "split_balanced", "split_zigzag_even", "CP_BALANCE_TOLERANCE", "RECOMMENDED_TOKEN_SLACK"]


def split_contiguous(samples: Sequence[int], lengths: Sequence[int], cp: int) -> MicroBatch:
    """The naive baseline: concatenate the samples and cut the sequence into ``cp`` equal token ranges.

    Rank ``r`` gets packed tokens ``[floor(r*T/cp), floor((r+1)*T/cp))``; ranks differ by at most
    one token, and a sample straddling a cut becomes one piece on each side.
    """
    sizes = np.array([int(lengths[s]) for s in samples], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    total = int(offsets[-1])
    cuts = (np.arange(cp + 1, dtype=np.int64) * total) // cp
    shards: list[list[Piece]] = []
    for r in range(cp):
        lo, hi = int(cuts[r]), int(cuts[r + 1])
        pieces = []
        first = int(np.searchsorted(offsets, lo, side="right")) - 1
        for k in range(max(first, 0), len(samples)):
            s_lo, s_hi = int(offsets[k]), int(offsets[k + 1])
            if s_lo >= hi:
                break
            start, stop = max(lo, s_lo) - s_lo, min(hi, s_hi) - s_lo
            if stop > start:
                pieces.append(Piece(int(samples[k]), start, stop))
        shards.append(pieces)
    return microbatch_from_shards(samples, shards, lengths)


def split_zigzag(samples: Sequence[int], lengths: Sequence[int], cp: int) -> MicroBatch:
    """Per-sample zigzag (Llama 3 / TransformerEngine style) without a divisibility rule.

    Each sample of length L is cut at ``floor(k*L/(2*cp))`` into 2*cp chunks; rank r takes chunks
    ``r`` and ``2*cp-1-r``, which pairs a cheap early chunk with an expensive late one. Chunks that
    are empty (L < 2*cp) are skipped.
    """
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    for sample in samples:
        length = int(lengths[sample])
        cuts = (np.arange(2 * cp + 1, dtype=np.int64) * length) // (2 * cp)
        for r in range(cp):
            for chunk in (r, 2 * cp - 1 - r):
                start, stop = int(cuts[chunk]), int(cuts[chunk + 1])
                if stop > start:
                    shards[r].append(Piece(int(sample), start, stop))
    return microbatch_from_shards(samples, shards, lengths)


# --------------------------------------------------------------------------------------- balanced

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


def _suffix_start(stop: int, room: float, a: float, b: float, seg: float) -> int:
    """Smallest ``start`` with ``cost([start, stop)) <= room`` (``stop`` when not one token fits).

    ``cost([s, e)) = a*(e-s) + b*(P(e)-P(s)) + seg`` with ``P(x) = x(x+1)/2`` (exact causal pairs).
    """
    # _piece_cost inlined (same operations in the same order, so the same floats): this runs once
    # per cut of every split sample
    if stop <= 0:
        return stop
    hb = b * 0.5
    pe = stop * (stop + 1)
    if a * 1 + hb * (pe - (stop - 1) * stop) + seg > room:
        return stop
    # b/2 (s^2 + s) + a s >= a*stop + b*P(stop) + seg - room  =: q
    q = a * stop + hb * stop * (stop + 1) + seg - room
    if q <= 0:
        return 0
    if b > 0:
        lin = a + 0.5 * b
        s = int(math.ceil((-lin + math.sqrt(lin * lin + 2.0 * b * q)) / b))
    else:
        s = int(math.ceil(q / a))
    s = min(max(s, 0), stop - 1)
    while s > 0 and a * (stop - s + 1) + hb * (pe - (s - 1) * s) + seg <= room:
        s -= 1
    while a * (stop - s) + hb * (pe - s * (s + 1)) + seg > room:
        s += 1
    return s


def split_balanced(
    samples: Sequence[int],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: "CostModel",
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
       longest; the balanced one sending less K/V is kept (:func:`_cut_choosing`).

    When tokens are tight (little free token room), step 2 can leave ranks that cannot be
    balanced; the split is then retried with the costliest samples zigzagged first, then with
    whole short samples around deficit-driven zigzag of the long ones (:func:`_hybrid_shards`),
    and :func:`split_zigzag_even` (every sample zigzagged, tokens even to one) is the last resort.
    The first candidate within ``2 * tolerance`` of the ideal wins, else the one with the lowest
    max rank cost (earlier candidates, which split less, win ties within ``tolerance``). The
    token room is never exceeded, so every micro-batch of at most ``cp * tokens_per_rank`` tokens
    gets a valid split.
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
    cost: "CostModel",
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
        flat = lengths[np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=N)].astype(np.int64, copy=False)
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
            _microbatch_from_slots(samples, [[(k, 0, l) for k, l in enumerate(lens)]], lengths, total)
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
    nbig = np.bincount(gid, weights=(W > cap_arr[gid]) | (flat > tpr_arr[gid]), minlength=G).astype(np.int64)
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
                costs[k] = _piece_cost(0, start, a, b, seg) if start else 0.0
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
        placed = _best_fit_lockstep(W2[ordered2], F2[ordered2], gid, starts, counts, init, caps, tprs, cp, a, b, seg)
    out = []
    for g, samples in enumerate(groups):
        # one group at a time from here on: its temporary pieces are freed before the next group's
        lens, cap, tpr = lens_of[g], caps[g], tprs[g]
        accept = ideals[g] * (1.0 + 2.0 * tolerance)
        stops, carving, carved[g] = items[g], carved[g], None  # (dropped: updated in place below)
        if placed is None:
            state = None if carving is None else carving[:3]
            shards, room, troom, leftovers = _best_fit(stops, item_w[g], item_order[g], cp, tpr, a, b, seg, cap, 1.0, state=state)
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
            _cut_suffixes(leftovers, stops, room, troom, shards, cp, a, b, seg)
            if cap - min(room) <= accept:
                out.append(_microbatch_from_slots(samples, shards, lengths, totals[g]))
                continue
            shards, room, troom, leftovers = _best_fit(lens, ws[g], orders[g], cp, tpr, a, b, seg, cap, 1.0)
        best = _cut_choosing(leftovers, lens, room, troom, shards, cp, a, b, seg, cap, accept)
        if best[0] > accept:
            best = _retry(best, lens, ws[g], orders[g], cp, tpr, a, b, seg, cap, ideals[g], accept, tolerance)
        out.append(_microbatch_from_slots(samples, best[1], lengths, totals[g]))
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
        start = max(_suffix_start(lk, cap, a, b, seg), lk - int(tpr))
        shards[r].append((k, start, lk))
        room[r] -= _piece_cost(start, lk, a, b, seg)
        troom[r] -= lk - start
        cuts.append((k, start))
    return (room, troom, shards, cuts) if cuts else None


def _cut_choosing(leftovers, lens, room, troom, shards, cp, a, b, seg, cap, accept):
    """Step 3 both ways (by density; longest last piece), the balanced one sending less K/V.

    Returns ``(max rank cost, shards, K/V tokens)``. Cutting by density keeps every rank able to
    reach its cost within its tokens; giving each split sample's last piece the rank where it is
    longest sends less K/V but can strand a rank with tokens too cheap to reach its cost. Both are
    tried from the same best fit (the second only when the rules pick different ranks), and the
    longest-last cut wins when it is balanced (within ``accept``) and sends fewer tokens.
    """
    if not leftovers:
        return cap - min(room), shards, 0
    kept = [len(shard) for shard in shards]
    room0, troom0 = list(room), list(troom)
    kv, differs = _cut_suffixes(leftovers, lens, room, troom, shards, cp, a, b, seg, probe=True)
    by_density = (cap - min(room), shards, kv)
    if not differs:
        return by_density
    added = [shard[n:] for shard, n in zip(shards, kept)]
    for shard, n in zip(shards, kept):
        del shard[n:]
    kv, _ = _cut_suffixes(leftovers, lens, room0, troom0, shards, cp, a, b, seg, longest_last=True)
    top = cap - min(room0)
    if top <= accept and (kv < by_density[2] or by_density[0] > accept):
        return top, shards, kv
    if by_density[0] <= accept or by_density[0] <= top:
        for shard, n, extra in zip(shards, kept, added):
            del shard[n:]
            shard.extend(extra)
        return by_density
    return top, shards, kv


def _retry(best, lens, w, order, cp, tpr, a, b, seg, cap, ideal, accept, tolerance):
    """The fallbacks of :func:`split_balanced` for a micro-batch the first pass leaves unbalanced.

    The first candidate within ``accept`` wins; without one, the lowest max rank cost (earlier
    candidates, which split less, win ties within ``tolerance``). Returns ``(max rank cost, shards)``.
    """
    best = best[:2]
    retries = (
        (_balanced_shards, (lens, w, order, cp, tpr, a, b, seg, cap, 1.0, 2.0 * ideal)),
        (_balanced_shards, (lens, w, order, cp, tpr, a, b, seg, cap, 1.0, ideal)),
        (_hybrid_shards, (lens, w, order, cp, tpr, a, b, seg, cap, 0.5)),
        (_hybrid_shards, (lens, w, order, cp, tpr, a, b, seg, cap, 0.1)),
        (_hybrid_shards, (lens, w, order, cp, tpr, a, b, seg, cap, 0.0)),
        (_zigzag_even_shards, (lens, cp, a, b, seg)),
    )
    for attempt, args in retries:
        shards, top = attempt(*args)
        if top <= accept or top < best[0] * (1.0 - tolerance):
            best = (top, shards)
        if top <= accept:
            break
    return best


def _best_fit_lockstep(w_ord, l_ord, gid, starts, counts, init, caps, tprs, cp, a, b, seg):
    """The best fit of :func:`_best_fit` (no zigzag) for every group at once.

    ``w_ord``/``l_ord``: the items' costs and tokens, group after group (``gid``, segments at
    ``starts``), each group's first ``counts[g]`` in the order to place (the rest are skipped);
    ``init[g]``: ``(room, troom)`` to start from (:func:`_carve`), ``None`` for empty ranks.
    Row ``g`` of the (group, rank) tables holds group ``g``'s cost and token rooms; step ``i``
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


def _microbatch_from_slots(
    samples: Sequence[int], shards: list[list[tuple[int, int, int]]], lengths: Sequence[int], total_tokens: int
) -> MicroBatch:
    """The MicroBatch of shards given as ``(slot, start, stop)`` triples (``slot``: position in ``samples``).

    Equal to ``microbatch_from_shards`` on the same pieces: with distinct samples, sorting the
    triples sorts by (slot, start), the canonical order, and ``loss_tokens`` is ``total_tokens``
    (the samples' summed lengths) minus one per sample. Samples listed twice (not a valid
    micro-batch, but callers may pass them) take the general path.
    """
    ids = tuple(map(int, samples))
    if len(set(ids)) != len(ids):
        return microbatch_from_shards(samples, [[Piece(ids[k], start, stop) for k, start, stop in shard] for shard in shards], lengths)
    for shard in shards:
        shard.sort()
    return MicroBatch(samples=ids, shards=tuple([new_rank_shard(shard, ids) for shard in shards]), loss_tokens=total_tokens - len(ids))


def split_zigzag_even(samples: Sequence[int], lengths: Sequence[int], cp: int) -> MicroBatch:
    """Zigzag whose per-rank token counts differ by at most one over the whole micro-batch.

    Each sample's ``L`` tokens are dealt as ``L // cp`` per rank plus one more to the ``L % cp``
    ranks holding the fewest tokens so far; rank ``r``'s share is a front chunk (the ``r``-th from
    the start) and a back chunk (the ``r``-th from the end), which pairs cheap early tokens with
    expensive late ones as zigzag does. Every rank ends with ``floor`` or ``ceil`` of
    ``total / cp`` tokens, so the split fits whenever the micro-batch does.
    """
    lens = [int(lengths[s]) for s in samples]
    shards, _ = _zigzag_even_shards(lens, cp, 1.0, 0.0, 0.0)
    return _microbatch_from_slots(samples, shards, lengths, sum(lens))


def _zigzag_even_shards(lens, cp, a, b, seg):
    """Shards of :func:`split_zigzag_even` (``(slot, start, stop)`` triples) and their largest cost."""
    held = [0] * cp
    cost_r = [0.0] * cp
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    for k, length in enumerate(lens):
        for r, start, stop in _zigzag_even_chunks(length, held):
            shards[r].append((k, start, stop))
            cost_r[r] += _piece_cost(start, stop, a, b, seg)
            held[r] += stop - start
    return shards, max(cost_r)


def _zigzag_even_chunks(length: int, held: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(rank, start, stop)`` chunks of one sample dealt token-evenly over ``len(held)`` ranks.

    Every rank gets ``length // cp`` tokens, one more for the ``length % cp`` ranks holding the
    fewest tokens so far (``held``; ties by rank); rank ``r``'s share is a front chunk (the
    ``r``-th from the start) and a back chunk (the ``r``-th from the end). Empty chunks are left out.
    """
    cp = len(held)
    base, extra = divmod(length, cp)
    quota = [base] * cp
    for r in sorted(range(cp), key=lambda q: (held[q], q))[:extra]:
        quota[r] += 1
    chunks = []
    lo, hi = 0, length
    for r in range(cp):
        front = quota[r] // 2
        back = quota[r] - front
        for start, stop in ((lo, lo + front), (hi - back, hi)):
            if stop > start:
                chunks.append((r, start, stop))
        lo += front
        hi -= back
    assert lo == hi
    return chunks


def _piece_cost(start: int, stop: int, a: float, b: float, seg: float) -> float:
    return a * (stop - start) + b * 0.5 * (stop * (stop + 1) - start * (start + 1)) + seg


def _water_level(total: int, held: list[int], limit: int) -> float:
    """The level L with ``sum(clip(L - h, 0, limit - h) for h in held) == total`` (exact, no search).

    Filling from the lowest rank up, the first ``k`` ranks (by tokens held) are under water at
    level ``(total + sum of their holdings) / k``; ``k`` grows while the next rank sits below it.
    Every rank shares ``limit``, so the level never passes it when ``total`` fits.
    """
    ordered = sorted(held)
    filled = 0.0
    level = float(ordered[0])
    for k, h in enumerate(ordered, start=1):
        if k > 1 and h >= level:
            break
        filled += h
        level = (total + filled) / k
    return min(level, float(limit))


def _even_quotas(total: int, held: list[int], limit: int) -> list[int]:
    """Split ``total`` tokens over ranks so held + quota is as even as possible, never over ``limit``."""
    cp = len(held)
    hi = _water_level(total, held, limit)
    raw = [min(max(hi - h, 0.0), float(limit - h)) for h in held]
    quota = [int(math.floor(x)) for x in raw]
    left = total - sum(quota)
    for r in sorted(range(cp), key=lambda q: (-(raw[q] - quota[q]), held[q], q)):
        if left <= 0:
            break
        if held[r] + quota[r] < limit:
            quota[r] += 1
            left -= 1
    r = 0
    while left > 0:  # only when rounding left someone without room: fill any room
        if held[r] + quota[r] < limit:
            quota[r] += 1
            left -= 1
        else:
            r += 1
    return quota


def _hybrid_shards(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, theta):
    """Tight-budget split: samples costing over ``theta * ideal`` are zigzagged, the rest stay whole.

    Whole samples go, most expensive first, to the cheapest rank whose tokens stay under an even
    share. Then every zigzagged sample gives each rank a front and a back chunk: the chunk
    *tokens* even out the ranks' token counts (never over ``tokens_per_rank``) and the split
    between front (cheap) and back (dense) tokens makes up each rank's cost deficit. Returns the
    shards and the largest rank cost.
    """
    ideal = sum(w) / cp
    total_tokens = sum(lens)
    even = -(-total_tokens // cp)
    long = [k for k in order if w[k] > theta * ideal or lens[k] > tokens_per_rank or w[k] > cap]
    if not long:
        long = [order[0]]
    is_long = set(long)
    cost_r = [0.0] * cp
    tok_r = [0] * cp
    shards: list[list[tuple[int, int, int]]] = [[] for _ in range(cp)]
    for k in order:
        if k in is_long:
            continue
        lk, wk = lens[k], w[k]
        best = -1
        for limit in (even, tokens_per_rank):
            for r in range(cp):
                if tok_r[r] + lk <= limit and cost_r[r] + wk <= cap and (best < 0 or cost_r[r] < cost_r[best]):
                    best = r
            if best >= 0:
                break
        if best < 0:
            long.append(k)
            is_long.add(k)
            continue
        shards[best].append((k, 0, lk))
        cost_r[best] += wk
        tok_r[best] += lk
    long_tokens = sum(lens[k] for k in long)
    long_cost = sum(w[k] for k in long)
    quota = _even_quotas(long_tokens, tok_r, tokens_per_rank)
    need = [max(0.0, cap - c) for c in cost_r]
    need_total = sum(need) or 1.0
    target = [long_cost * x / need_total for x in need]  # each rank's cost from zigzagged samples
    quota_left = list(quota)
    tokens_left = long_tokens
    for idx, k in enumerate(long):
        length, wk = lens[k], w[k]
        # this sample's tokens per rank, proportional to what each rank still takes
        if idx == len(long) - 1:
            take = list(quota_left)
        else:
            raw = [length * q / tokens_left if tokens_left else 0.0 for q in quota_left]
            take = [min(int(x), q) for x, q in zip(raw, quota_left)]
            left = length - sum(take)
            for r in sorted(range(cp), key=lambda q: (-(raw[q] - take[q]), q)):
                if left <= 0:
                    break
                if take[r] < quota_left[r]:
                    take[r] += 1
                    left -= 1
            r = 0
            while left > 0:
                if take[r] < quota_left[r]:
                    take[r] += 1
                    left -= 1
                else:
                    r += 1
        for r in range(cp):
            quota_left[r] -= take[r]
        tokens_left -= length
        share = [wk * t / long_cost if long_cost else 0.0 for t in target]
        # outer chunks span the widest range of densities: ranks with extreme needs go first
        mean_density = wk / length
        ranks = [r for r in range(cp) if take[r] > 0]
        ranks.sort(key=lambda r: (-abs(share[r] / take[r] - mean_density), r))
        lo, hi = 0, length
        for i, r in enumerate(ranks):
            t = take[r]
            if i == len(ranks) - 1:
                g = hi - lo - t  # everything left (t == hi - lo)
                f_, g = t, 0
                pieces = [(lo, hi)]
            else:
                # largest back chunk g with cost(front t-g) + cost(back g) <= share
                def cost_of(g: int) -> float:
                    f = t - g
                    c = 0.0
                    if f:
                        c += _piece_cost(lo, lo + f, a, b, seg)
                    if g:
                        c += _piece_cost(hi - g, hi, a, b, seg)
                    return c

                glo, ghi = 0, t
                while glo < ghi:
                    mid = (glo + ghi + 1) // 2
                    if cost_of(mid) <= share[r]:
                        glo = mid
                    else:
                        ghi = mid - 1
                g = glo
                f_ = t - g
                pieces = [(lo, lo + f_)] if f_ else []
                if g:
                    pieces.append((hi - g, hi))
            for start, stop in pieces:
                shards[r].append((k, start, stop))
                cost_r[r] += _piece_cost(start, stop, a, b, seg)
                tok_r[r] += stop - start
            lo += f_
            hi -= g
        assert lo == hi, "zigzag chunks must tile the sample"
    assert max(tok_r) <= tokens_per_rank
    return shards, max(cost_r)


def _best_fit(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over=math.inf, state=None):
    """Steps 1-2 of :func:`split_balanced`: ``(shards, room, troom, leftovers)``, ``leftovers`` the
    samples to cut (step 3), ``None`` when the zigzagged samples alone overflow a rank's tokens.

    ``order`` lists the samples' positions most expensive first; shards hold ``(slot, start, stop)``
    triples. Samples costing more than ``zigzag_over`` are zigzagged over all ranks first
    (token-even, like :func:`split_zigzag_even`): a sample much costlier than a rank sends nearly
    all its K/V whichever way it is cut, and its even spread leaves every rank the same room for
    the rest. ``state``: ``(room, troom, shards)`` to start from instead of empty ranks.
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
            for r, start, stop in _zigzag_even_chunks(lens[k], [-t for t in troom]):
                shards[r].append((k, start, stop))
                room[r] -= _piece_cost(start, stop, a, b, seg)
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
    density = (a + b * max([lens[k] for k in order] if zigzag_over < math.inf or state is not None else lens)) * density_factor + seg
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


def _balanced_shards(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over=math.inf):
    """One pass of :func:`split_balanced` (cuts by density); returns the shards and the largest rank cost."""
    shards, room, troom, leftovers = _best_fit(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over)
    if leftovers is None:
        return shards, math.inf
    _cut_suffixes(leftovers, lens, room, troom, shards, cp, a, b, seg)
    return shards, cap - min(room)


def _cut_suffixes(leftovers, lens, room, troom, shards, cp, a, b, seg, longest_last=False, probe=False):
    """Step 3 of :func:`split_balanced`: cut the samples that fit whole nowhere from the back.

    Each suffix goes to the rank needing the densest content (highest cost room per free token),
    as long a suffix as fits there. With ``longest_last`` a sample's first suffix (its last piece)
    goes instead to the rank where it can be longest (:func:`_longest_suffix_rank`): the K/V a
    split sample sends is everything before its last piece. Updates ``room``, ``troom`` and
    ``shards`` (``(slot, start, stop)`` triples) in place. Returns the tokens of the new pieces
    other ranks need (the K/V sent) and, with ``probe``, whether some last piece went to another
    rank than the longest-last rule picks (else both rules give the same cuts).
    """
    kv = 0
    differs = False
    for k in leftovers:
        stop = lens[k]
        last_rank = -1
        used = -1  # the first rank given a piece of this sample (a later piece than any to come)
        several = False  # whether two ranks hold later pieces
        needed = False
        while stop > 0:
            r = _longest_suffix_rank(stop, room, troom, cp, a, b, seg) if longest_last and last_rank < 0 else -1
            if r < 0:  # (also when no rank holds a token of the suffix by cost: rounding remnants)
                # the densest remaining tokens (this suffix) go to the rank that needs the densest
                # content to reach its cost: the highest cost room per free token
                r, best_need = -1, -math.inf
                for q in range(cp):
                    tq = troom[q]
                    if tq > 0:
                        need = room[q] / tq
                        if need > best_need:
                            r, best_need = q, need
                if probe and last_rank < 0 and not differs:
                    longest = _longest_suffix_rank(stop, room, troom, cp, a, b, seg)
                    differs = longest >= 0 and longest != r
            assert r >= 0, "token rooms exhausted although the micro-batch fits"
            start = _suffix_start(stop, room[r], a, b, seg)
            if start == stop:  # no cost room left anywhere: rounding remnant, place by tokens
                start = 0
            start = max(start, stop - troom[r])
            piece_cost = _piece_cost(start, stop, a, b, seg)
            if r == last_rank:  # adjacent to this sample's previous piece on the same rank: merge
                old = shards[r].pop()
                shards[r].append((k, start, old[2]))
                piece_cost -= seg
            else:
                shards[r].append((k, start, stop))
                # needed iff another rank holds a later piece of this sample
                needed = several or (used >= 0 and used != r)
                if used < 0:
                    used = r
                elif used != r:
                    several = True
            if needed:
                kv += stop - start
            room[r] -= piece_cost
            troom[r] -= stop - start
            last_rank = r
            stop = start
    return kv, differs


def _longest_suffix_rank(stop, room, troom, cp, a, b, seg) -> int:
    """The rank where the suffix ending at ``stop`` can be longest (cost room, then free tokens).

    The suffix a room holds grows with the room, so the roomiest rank wins unless its free tokens
    cut the suffix short; only then are all ranks compared (first rank on ties). -1: no rank
    holds a token of it.
    """
    r = max(range(cp), key=room.__getitem__)
    tr = troom[r]
    if tr > 0 and tr >= stop - _suffix_start(stop, room[r], a, b, seg):
        return r
    r, best = -1, 0
    for q in range(cp):
        tq = troom[q]
        if tq > 0:
            length = stop - max(_suffix_start(stop, room[q], a, b, seg), stop - tq)
            if length > best:
                r, best = q, length
    return r
