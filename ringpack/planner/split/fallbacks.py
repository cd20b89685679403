"""The balanced split's fallbacks for a micro-batch that best fit and suffix cuts leave unbalanced.

Why they exist: when tokens are tight (little free token room), best fit can leave ranks whose
free tokens are too cheap to reach their cost. :func:`retry_with_fallbacks` then tries splits that
cut more samples but balance more surely, in order: the costliest samples zigzagged before best fit
(:func:`_balanced_shards`), whole short samples around deficit-driven zigzag of the long ones
(:func:`_hybrid_shards`), and every sample zigzagged with tokens even to one
(:func:`~ringpack.planner.split.baselines.zigzag_even_shards`), which always fits.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringpack.planner.split.baselines import zigzag_even_shards
from ringpack.planner.split.batch import ProblemBatch
from ringpack.planner.split.best_fit import best_fit
from ringpack.planner.split.pieces import microbatch_from_slots
from ringpack.planner.split.problem import RankFill, Slice, SplitProblem
from ringpack.planner.split.suffix_cuts import cut_suffixes
from ringpack.shard_plan import MicroBatch

if TYPE_CHECKING:
    from ringpack.cost import CostModel

__all__ = ["retry_with_fallbacks", "split_spread"]

Shards = list[list[Slice]]


def retry_with_fallbacks(problem: SplitProblem, best: tuple[float, Shards]) -> tuple[float, Shards]:
    """The best of ``best`` (the first pass's ``(max rank cost, shards)``) and the fallbacks.

    The first candidate within ``problem.accept`` wins; without one, the lowest max rank cost
    (earlier candidates, which split less, win ties within ``problem.tolerance``). Returns
    ``(max rank cost, shards)``.
    """
    accept = problem.accept
    for shards, top in _candidates(problem):
        if top <= accept or top < best[0] * (1.0 - problem.tolerance):
            best = (top, shards)
        if top <= accept:
            break
    return best


def _candidates(problem: SplitProblem) -> Iterator[tuple[Shards, float]]:
    """The fallbacks in order, each computed only when asked for: ``(shards, largest rank cost)``.

    Best fit with a zigzag threshold no sample exceeds is the first pass's density cut, which
    lost already (the first pass always ends with best fit of the whole samples and both suffix
    cuts): such a candidate, or one zigzagging the same samples as the one before, is skipped.
    """
    zigzagged = 0
    for over in (2.0 * problem.ideal, problem.ideal):
        count = sum(1 for w in problem.costs if w > over)
        if count > zigzagged:
            yield _balanced_shards(problem, over)
        zigzagged = count
    for theta in (0.5, 0.1, 0.0):
        yield _hybrid_shards(problem, theta)
    yield zigzag_even_shards(problem.lens, problem.cp, problem.token, problem.pair, problem.segment)


def split_spread(
    samples: Sequence[int],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    over: float,
    tolerance: float,
) -> MicroBatch:
    """One micro-batch split with the samples costing more than ``over`` ranks' ideal zigzagged over
    every rank and the rest whole (:func:`_hybrid_shards`), whatever the balance.

    For CP groups of several nodes (:mod:`~ringpack.planner.pool`): a sample bigger than a node
    crosses nodes in any split, and its zigzag chunks give each rank its share of that sample's
    cost and tokens, so the other samples can stay whole and send no K/V between nodes.

    Args:
        samples: the micro-batch's sample ids, in micro-batch order.
        lengths: tokens of every sample, indexed by id (a sequence or a 1-D integer array).
        cp: CP ranks, >= 1.
        tokens_per_rank: token budget of every rank (never exceeded).
        cost: the cost model the ranks are balanced by.
        over: samples costing more than ``over`` times a rank's ideal cost are zigzagged (the
            costliest one at least, and any longer than ``tokens_per_rank``).
        tolerance: a rank's cost room over the ideal for the whole samples (the balanced split's
            :data:`~ringpack.planner.split.balanced.CP_BALANCE_TOLERANCE`).

    Returns:
        The micro-batch with one shard per CP rank.

    Raises:
        ValueError: the samples hold more than ``cp * tokens_per_rank`` tokens.
    """
    batch = ProblemBatch.build([samples], lengths, cp, tokens_per_rank, cost, tolerance, None)
    shards, _ = _hybrid_shards(batch.problems[0], over)
    return microbatch_from_slots(samples, shards, lengths, batch.totals[0])


def _balanced_shards(problem: SplitProblem, zigzag_over: float) -> tuple[Shards, float]:
    """Best fit with samples costing over ``zigzag_over`` zigzagged first, then suffix cuts by
    density; returns the shards and the largest rank cost."""
    fill = RankFill.empty(problem)
    leftovers = best_fit(problem, problem.whole_samples, fill, zigzag_over)
    if leftovers is None:
        return fill.shards, math.inf
    cut_suffixes(problem, fill, leftovers, problem.lens)
    return fill.shards, fill.max_cost()


@dataclass(slots=True)
class _Held:
    """What each rank holds in :func:`_hybrid_shards`: cost, tokens and pieces."""

    cost: list[float]
    tokens: list[int]
    shards: Shards


def _hybrid_shards(problem: SplitProblem, theta: float) -> tuple[Shards, float]:
    """Tight-budget split: samples costing over ``theta * ideal`` are zigzagged, the rest stay whole.

    Whole samples go, most expensive first, to the cheapest rank whose tokens stay under an even
    share (:func:`_place_short_whole`). Then every zigzagged sample gives each rank a front and a
    back chunk: the chunk *tokens* even out the ranks' token counts (never over the token room)
    and the split between front (cheap) and back (dense) tokens makes up each rank's cost deficit
    (:func:`_zigzag_long`). Returns the shards and the largest rank cost.
    """
    lens, w, order, cp = problem.lens, problem.costs, problem.order, problem.cp
    tpr, cap = problem.tokens_per_rank, problem.cap
    long = [k for k in order if w[k] > theta * problem.ideal or lens[k] > tpr or w[k] > cap]
    if not long:
        long = [order[0]]
    held = _Held([0.0] * cp, [0] * cp, [[] for _ in range(cp)])
    long += _place_short_whole(problem, set(long), held)
    _zigzag_long(problem, long, held)
    assert max(held.tokens) <= tpr
    return held.shards, max(held.cost)


def _place_short_whole(problem: SplitProblem, is_long: set[int], held: _Held) -> list[int]:
    """Samples not in ``is_long``, most expensive first, each whole to the cheapest rank (first on
    ties) that stays within the cost room and an even share of the tokens, else within the token
    room. Returns the samples no rank takes (to be zigzagged)."""
    lens, w, cp, cap = problem.lens, problem.costs, problem.cp, problem.cap
    even = -(-sum(lens) // cp)
    limits = (even,) if even >= problem.tokens_per_rank else (even, problem.tokens_per_rank)
    cost_r, tok_r = held.cost, held.tokens
    ranks = range(cp)
    unplaced = []
    for k in problem.order:
        if k in is_long:
            continue
        lk, wk = lens[k], w[k]
        best = -1
        for limit in limits:
            # the cheapest rank with the tokens (first on ties) is the one to take it, if any is:
            # a cheaper rank stays within the cost room whenever a dearer one does
            fits, cheapest = limit - lk, 0.0
            for r in ranks:
                if tok_r[r] <= fits and (best < 0 or cost_r[r] < cheapest):
                    best, cheapest = r, cost_r[r]
            if best >= 0 and cheapest + wk <= cap:
                break
            best = -1
        if best < 0:
            unplaced.append(k)
            continue
        held.shards[best].append((k, 0, lk))
        cost_r[best] += wk
        tok_r[best] += lk
    return unplaced


def _zigzag_long(problem: SplitProblem, long: list[int], held: _Held) -> None:
    """Zigzag the samples ``long`` over all ranks: their tokens even out the ranks' token counts,
    their costs go to the ranks in proportion to each one's deficit to the cost room."""
    lens, w, cp = problem.lens, problem.costs, problem.cp
    long_tokens = sum(lens[k] for k in long)
    long_cost = sum(w[k] for k in long)
    quota_left = _even_quotas(long_tokens, held.tokens, problem.tokens_per_rank)
    need = [max(0.0, problem.cap - c) for c in held.cost]
    need_total = sum(need) or 1.0
    target = [long_cost * x / need_total for x in need]  # each rank's cost from zigzagged samples
    tokens_left = long_tokens
    for idx, k in enumerate(long):
        length, wk = lens[k], w[k]
        # this sample's tokens per rank, proportional to what each rank still takes
        if idx == len(long) - 1:
            take = list(quota_left)
        else:
            raw = [length * q / tokens_left if tokens_left else 0.0 for q in quota_left]
            take = [min(int(x), q) for x, q in zip(raw, quota_left)]
            _round_up_largest_remainders(take, raw, length, quota_left, [0] * cp)
        for r in range(cp):
            quota_left[r] -= take[r]
        tokens_left -= length
        share = [wk * t / long_cost if long_cost else 0.0 for t in target]
        _deal_front_back(problem, k, take, share, held)


def _deal_front_back(problem: SplitProblem, k: int, take: list[int], share: list[float], held: _Held) -> None:
    """Cut slot ``k`` into a front and a back chunk per rank: ``take[r]`` tokens on rank ``r``, as
    many of them dense back tokens as keep the chunks' cost within ``share[r]``; the chunks tile it."""
    a, b, seg = problem.token, problem.pair, problem.segment
    length = problem.lens[k]
    # outer chunks span the widest range of densities: ranks with extreme needs go first
    mean_density = problem.costs[k] / length
    ranks = [r for r in range(problem.cp) if take[r] > 0]
    ranks.sort(key=lambda r: (-abs(share[r] / take[r] - mean_density), r))
    lo, hi = 0, length
    for i, r in enumerate(ranks):
        t = take[r]
        if i == len(ranks) - 1:  # everything left (t == hi - lo)
            front, back = t, 0
            pieces = [(lo, hi)]
        else:
            back = _longest_back_chunk(problem, lo, hi, t, share[r])
            front = t - back
            pieces = [(lo, lo + front)] if front else []
            if back:
                pieces.append((hi - back, hi))
        for start, stop in pieces:
            held.shards[r].append((k, start, stop))
            # piece_cost inlined (the same operations in the same order, so the same floats)
            held.cost[r] += a * (stop - start) + b * 0.5 * (stop * (stop + 1) - start * (start + 1)) + seg
            held.tokens[r] += stop - start
        lo += front
        hi -= back
    assert lo == hi, "zigzag chunks must tile the sample"


def _longest_back_chunk(problem: SplitProblem, lo: int, hi: int, t: int, share: float) -> int:
    """The largest ``g <= t`` with ``cost([lo, lo + t - g)) + cost([hi - g, hi)) <= share`` (0 if none).

    The answer of a binary search over ``g`` (midpoints rounded up). Between the ends the cost is
    linear in ``g`` (each step trades the front's last token for a denser back token), so where
    that slope stands far above rounding the search runs on the crossing point found directly
    (a few cost evaluations instead of one per halving); otherwise on the costs themselves.
    """
    a, b, seg = problem.token, problem.pair, problem.segment
    # piece_cost inlined (the same operations in the same order, so the same floats)
    lo1, hi1 = lo * (lo + 1), hi * (hi + 1)

    def cost(g: int) -> float:
        f = t - g
        c = 0.0
        if f:
            e = lo + f
            c += a * f + b * 0.5 * (e * (e + 1) - lo1) + seg
        if g:
            s = hi - g
            c += a * g + b * 0.5 * (hi1 - s * (s + 1)) + seg
        return c

    inner = -1  # the largest g in [1, t) with cost(g) <= share (0: none), when the slope is safe
    slope = b * (hi - lo - t)  # each inner step: the front's last token out, a denser back token in
    if t >= 3:
        c1 = a * t + 2 * seg + b * 0.5 * ((lo + t - 1) * (lo + t) - lo1) + b * hi  # cost(1), about
        if slope > 1e-9 * abs(c1):
            if share < c1:
                g = 0
            elif share - c1 < slope * t:
                g = min(1 + math.floor((share - c1) / slope), t - 1)
            else:  # beyond the inner costs (also an infinite share)
                g = t - 1
            # the estimate, checked on the costs as the search computes them
            while g >= 1 and cost(g) > share:
                g -= 1
            while g + 1 <= t - 1 and cost(g + 1) <= share:
                g += 1
            inner = g
    if inner >= 0:
        whole_back = cost(t) <= share
        if not whole_back:  # monotone over [1, t]: the search ends at the crossing
            return inner
        if inner == t - 1:
            return t
    glo, ghi = 0, t  # the search itself (the costs do not rise steadily here)
    while glo < ghi:
        g = (glo + ghi + 1) // 2
        if (g <= inner) if (inner >= 0 and g < t) else (cost(g) <= share):
            glo = g
        else:
            ghi = g - 1
    return glo


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
    hi = _water_level(total, held, limit)
    raw = [min(max(hi - h, 0.0), float(limit - h)) for h in held]
    quota = [int(math.floor(x)) for x in raw]
    return _round_up_largest_remainders(quota, raw, total, [limit - h for h in held], held)


def _round_up_largest_remainders(
    base: list[int], raw: list[float], total: int, room: list[int], ties: Sequence[int]
) -> list[int]:
    """Round the shares ``raw`` (rounded down in ``base``) up until they sum to ``total``, in place.

    One more goes to each entry in order of largest remainder ``raw - base`` (then smallest
    ``ties``, then index) while ``base[r] < room[r]``; should rounding leave some short, they go
    to the first entries with room. Returns ``base``.
    """
    left = total - sum(base)
    for r in sorted(range(len(base)), key=lambda q: (-(raw[q] - base[q]), ties[q], q)):
        if left <= 0:
            break
        if base[r] < room[r]:
            base[r] += 1
            left -= 1
    r = 0
    while left > 0:
        if base[r] < room[r]:
            base[r] += 1
            left -= 1
        else:
            r += 1
    return base
