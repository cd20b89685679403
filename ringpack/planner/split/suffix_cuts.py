"""Suffix cuts: the samples that fit whole on no rank are cut into pieces from the back.

Why from the back: a split sample sends the K/V of everything before its last piece to the ranks
holding later pieces, so its last piece should be long, and the last tokens are the densest (each
attends to all before it), which is what a rank with much cost room and few free tokens needs.
:func:`cut_suffixes` cuts by one rule; :func:`choose_suffix_cuts` tries both rules and keeps the
balanced cut that sends less K/V.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import math

from ringpack.planner.split.pieces import suffix_start
from ringpack.planner.split.problem import RankFill, Slice, SplitProblem

__all__ = ["cut_suffixes", "choose_suffix_cuts"]


def cut_suffixes(
    problem: SplitProblem,
    fill: RankFill,
    leftovers: list[int],
    stops: list[int],
    longest_last: bool = False,
    probe: bool = False,
) -> tuple[int, bool]:
    """Cut tokens ``[0, stops[k])`` of every slot ``k`` of ``leftovers`` from the back onto ``fill``'s ranks.

    Each suffix goes to the rank needing the densest content (highest cost room per free token),
    as long a suffix as fits there. With ``longest_last`` a sample's first suffix (its last piece)
    goes instead to the rank where it can be longest (:func:`_longest_suffix_rank`): the K/V a
    split sample sends is everything before its last piece. Updates ``fill`` in place. Returns the
    tokens of the new pieces other ranks need (the K/V sent) and, with ``probe``, whether some last
    piece went to another rank than the longest-last rule picks (else both rules give the same cuts).
    """
    a, b, seg = problem.token, problem.pair, problem.segment
    room, troom, shards = fill.room, fill.token_room, fill.shards
    kv = 0
    differs = False
    for k in leftovers:
        stop = stops[k]
        last_rank = -1
        used = -1  # the first rank given a piece of this sample (a later piece than any to come)
        several = False  # whether two ranks hold later pieces
        needed = False
        while stop > 0:
            r = _longest_suffix_rank(problem, fill, stop) if longest_last and last_rank < 0 else -1
            if r < 0:  # (also when no rank holds a token of the suffix by cost: rounding remnants)
                # the densest remaining tokens (this suffix) go to the rank that needs the densest
                # content to reach its cost: the highest cost room per free token
                r, best_need = -1, -math.inf
                for q, (rq, tq) in enumerate(zip(room, troom)):
                    if tq > 0:
                        need = rq / tq
                        if need > best_need:
                            r, best_need = q, need
                if probe and last_rank < 0 and not differs:
                    longest = _longest_suffix_rank(problem, fill, stop)
                    differs = longest >= 0 and longest != r
            assert r >= 0, "token rooms exhausted although the micro-batch fits"
            start = suffix_start(stop, room[r], a, b, seg)
            if start == stop:  # no cost room left anywhere: rounding remnant, place by tokens
                start = 0
            if start < stop - troom[r]:  # no more tokens than the rank has room for
                start = stop - troom[r]
            # piece_cost inlined (the same operations in the same order, so the same floats)
            added_cost = a * (stop - start) + b * 0.5 * (stop * (stop + 1) - start * (start + 1)) + seg
            if r == last_rank:  # adjacent to this sample's previous piece on the same rank: merge
                old = shards[r].pop()
                shards[r].append((k, start, old[2]))
                added_cost -= seg
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
            room[r] -= added_cost
            troom[r] -= stop - start
            last_rank = r
            stop = start
    return kv, differs


def _longest_suffix_rank(problem: SplitProblem, fill: RankFill, stop: int) -> int:
    """The rank where the suffix ending at ``stop`` can be longest (cost room, then free tokens).

    The suffix a room holds grows with the room, so the roomiest rank wins unless its free tokens
    cut the suffix short; only then are all ranks compared (first rank on ties). -1: no rank
    holds a token of it.
    """
    cp, a, b, seg = problem.cp, problem.token, problem.pair, problem.segment
    room, troom = fill.room, fill.token_room
    r = max(range(cp), key=room.__getitem__)
    tr = troom[r]
    if tr > 0 and tr >= stop - suffix_start(stop, room[r], a, b, seg):
        return r
    r, best = -1, 0
    for q in range(cp):
        tq = troom[q]
        if tq > 0:
            length = stop - max(suffix_start(stop, room[q], a, b, seg), stop - tq)
            if length > best:
                r, best = q, length
    return r


def choose_suffix_cuts(problem: SplitProblem, fill: RankFill, leftovers: list[int]) -> tuple[float, list[list[Slice]]]:
    """Cut the whole samples ``leftovers`` both ways (by density; longest last piece), the balanced
    cut sending less K/V.

    Returns ``(max rank cost, shards)``; ``fill``'s shards are the chosen ones, its rooms those of
    the density cut. Cutting by density keeps every rank able to reach its cost within its tokens;
    giving each split sample's last piece the rank where it is longest sends less K/V but can
    strand a rank with tokens too cheap to reach its cost. Both are tried from the same best fit
    (the second only when the rules pick different ranks), and the longest-last cut wins when it
    is balanced (within ``problem.accept``) and sends fewer tokens.
    """
    if not leftovers:
        return fill.max_cost(), fill.shards
    accept, lens, shards = problem.accept, problem.lens, fill.shards
    kept = [len(shard) for shard in shards]
    room, token_room = list(fill.room), list(fill.token_room)
    kv_density, differs = cut_suffixes(problem, fill, leftovers, lens, probe=True)
    top_density = fill.max_cost()
    if not differs:
        return top_density, shards
    by_length = RankFill(fill.cap, room, token_room, shards)
    added = [shard[n:] for shard, n in zip(shards, kept)]
    for shard, n in zip(shards, kept):
        del shard[n:]
    kv, _ = cut_suffixes(problem, by_length, leftovers, lens, longest_last=True)
    top = by_length.max_cost()
    if top <= accept and (kv < kv_density or top_density > accept):
        return top, shards
    if top_density <= accept or top_density <= top:
        for shard, n, extra in zip(shards, kept, added):
            del shard[n:]
            shard.extend(extra)
        return top_density, shards
    return top, shards
