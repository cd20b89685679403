"""The balanced split's fallbacks for a micro-batch its first pass leaves unbalanced.

Why they exist: when tokens are tight (little free token room), best fit can leave ranks whose
free tokens are too cheap to reach their cost. :func:`retry_with_fallbacks` then tries splits that
cut more samples but balance more surely, in order: the costliest samples zigzagged first
(:func:`_balanced_shards`), whole short samples around deficit-driven zigzag of the long ones
(:func:`_hybrid_shards`), and every sample zigzagged with tokens even to one
(:func:`~ringpack.planner.split.baselines.zigzag_even_shards`), which always fits.
"""

from __future__ import annotations

import math

from ringpack.planner.split.baselines import zigzag_even_shards
from ringpack.planner.split.best_fit import best_fit
from ringpack.planner.split.pieces import piece_cost
from ringpack.planner.split.suffix_cuts import cut_suffixes

__all__ = ["retry_with_fallbacks"]


def retry_with_fallbacks(best, lens, w, order, cp, tpr, a, b, seg, cap, ideal, accept, tolerance):
    """The fallbacks of :func:`~ringpack.planner.split.balanced.split_balanced` for a micro-batch the first
    pass leaves unbalanced.

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
        (zigzag_even_shards, (lens, cp, a, b, seg)),
    )
    for attempt, args in retries:
        shards, top = attempt(*args)
        if top <= accept or top < best[0] * (1.0 - tolerance):
            best = (top, shards)
        if top <= accept:
            break
    return best


def _balanced_shards(lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over=math.inf):
    """One pass of :func:`~ringpack.planner.split.balanced.split_balanced` (cuts by density); returns the
    shards and the largest rank cost."""
    shards, room, troom, leftovers = best_fit(
        lens, w, order, cp, tokens_per_rank, a, b, seg, cap, density_factor, zigzag_over
    )
    if leftovers is None:
        return shards, math.inf
    cut_suffixes(leftovers, lens, room, troom, shards, cp, a, b, seg)
    return shards, cap - min(room)


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
                        c += piece_cost(lo, lo + f, a, b, seg)
                    if g:
                        c += piece_cost(hi - g, hi, a, b, seg)
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
                cost_r[r] += piece_cost(start, stop, a, b, seg)
                tok_r[r] += stop - start
            lo += f_
            hi -= g
        assert lo == hi, "zigzag chunks must tile the sample"
    assert max(tok_r) <= tokens_per_rank
    return shards, max(cost_r)


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
