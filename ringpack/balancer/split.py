"""CP split strategies: cut one micro-batch's samples into pieces for C context-parallel ranks.

Every strategy takes the micro-batch's samples (in micro-batch order) with their lengths and
returns a :class:`~ringpack.balancer.plan.MicroBatch`. None needs any divisibility rule or padding:
a sample of any length >= 1 may be cut anywhere, and chunks that come out empty are simply absent.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ringpack.balancer.plan import MicroBatch, Piece, microbatch_from_shards

__all__ = ["split_contiguous", "split_zigzag"]


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
