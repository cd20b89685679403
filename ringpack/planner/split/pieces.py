"""What the CP split modules share: the cost of one piece of a sample, its inverse, and the
:class:`~ringpack.shard_plan.MicroBatch` of shards given as ``(slot, start, stop)`` triples.

Why these forms: the splits run their inner loops on positions in the micro-batch (slots) and on
the cost model's coefficients as plain floats (``a`` per token, ``b`` per causal pair, ``seg`` per
piece), which is cheaper than building :class:`~ringpack.shard_plan.Piece` objects and calling
the cost model; the pieces become a MicroBatch once, at the end. :func:`suffix_start` repeats
:func:`piece_cost`'s arithmetic operation for operation (the same floats), so a suffix it finds
within a room stays within it when :func:`piece_cost` prices it: change the two together.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards, new_rank_shard

__all__ = ["piece_cost", "suffix_start", "microbatch_from_slots"]


def piece_cost(start: int, stop: int, a: float, b: float, seg: float) -> float:
    """Cost of tokens ``[start, stop)`` of one sample as one piece: ``a`` per token, ``b`` per causal
    query-key pair (``P(stop) - P(start)`` with ``P(x) = x(x+1)/2``) and ``seg`` for the piece."""
    return a * (stop - start) + b * 0.5 * (stop * (stop + 1) - start * (start + 1)) + seg


def suffix_start(stop: int, room: float, a: float, b: float, seg: float) -> int:
    """Smallest ``start`` with ``cost([start, stop)) <= room`` (``stop`` when not one token fits).

    ``cost([s, e)) = a*(e-s) + b*(P(e)-P(s)) + seg`` with ``P(x) = x(x+1)/2`` (exact causal pairs).
    """
    # piece_cost inlined (same operations in the same order, so the same floats): this runs once
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
    # the positive root of b/2 s^2 + lin s = q, lin = a + b/2, as 2q / (lin + sqrt(lin^2 + 2bq)): no
    # cancellation, and hypot and the split square root keep every intermediate finite whatever the
    # prices (a square of a price above 1e154 would overflow); with b = 0 it is q / a
    lin = a + hb
    s = math.ceil(2.0 * q / (lin + math.hypot(lin, math.sqrt(2.0 * b) * math.sqrt(q))))
    # clamp to [0, stop - 1] (comparisons: cheaper than min/max calls in this hot function)
    if s < 0:
        s = 0
    elif s >= stop:
        s = stop - 1
    while s > 0 and a * (stop - s + 1) + hb * (pe - (s - 1) * s) + seg <= room:
        s -= 1
    while a * (stop - s) + hb * (pe - s * (s + 1)) + seg > room:
        s += 1
    return s


def microbatch_from_slots(
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
        return microbatch_from_shards(
            samples, [[Piece(ids[k], start, stop) for k, start, stop in shard] for shard in shards], lengths
        )
    for shard in shards:
        shard.sort()
    return MicroBatch(
        samples=ids, shards=tuple([new_rank_shard(shard, ids) for shard in shards]), loss_tokens=total_tokens - len(ids)
    )
