"""The baseline CP splits, which ignore the cost model: contiguous token ranges, per-sample zigzag,
and zigzag with token counts even to one over the whole micro-batch.

``contiguous`` and ``zigzag`` are the splits the balanced one is measured against (and the
planner's other strategies); ``zigzag_even`` is zigzag's fallback when floor cuts overflow a tight
token budget and the balanced split's last resort, and its per-sample chunks
(:func:`zigzag_even_chunks`) also spread the costliest samples in the balanced split's best fit.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringpack.planner.split.pieces import microbatch_from_slots, piece_cost
from ringpack.planner.split.problem import Slice
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

__all__ = ["split_contiguous", "split_zigzag", "split_zigzag_even", "zigzag_even_shards", "zigzag_even_chunks"]


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


def split_zigzag_even(samples: Sequence[int], lengths: Sequence[int], cp: int) -> MicroBatch:
    """Zigzag whose per-rank token counts differ by at most one over the whole micro-batch.

    Each sample's ``L`` tokens are dealt as ``L // cp`` per rank plus one more to the ``L % cp``
    ranks holding the fewest tokens so far; rank ``r``'s share is a front chunk (the ``r``-th from
    the start) and a back chunk (the ``r``-th from the end), which pairs cheap early tokens with
    expensive late ones as zigzag does. Every rank ends with ``floor`` or ``ceil`` of
    ``total / cp`` tokens, so the split fits whenever the micro-batch does.
    """
    lens = [int(lengths[s]) for s in samples]
    shards, _ = zigzag_even_shards(lens, cp, 1.0, 0.0, 0.0)
    return microbatch_from_slots(samples, shards, lengths, sum(lens))


def zigzag_even_shards(lens: Sequence[int], cp: int, a: float, b: float, seg: float) -> tuple[list[list[Slice]], float]:
    """Shards of :func:`split_zigzag_even` of samples with lengths ``lens`` (``(slot, start, stop)``
    triples) and their largest cost with coefficients ``a`` per token, ``b`` per causal pair and
    ``seg`` per piece."""
    held = [0] * cp
    cost_r = [0.0] * cp
    shards: list[list[Slice]] = [[] for _ in range(cp)]
    for k, length in enumerate(lens):
        for r, start, stop in zigzag_even_chunks(length, held):
            shards[r].append((k, start, stop))
            cost_r[r] += piece_cost(start, stop, a, b, seg)
            held[r] += stop - start
    return shards, max(cost_r)


def zigzag_even_chunks(length: int, held: Sequence[int]) -> list[tuple[int, int, int]]:
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
