"""The piece table of a micro-batch: its pieces as checked int64 columns, with what every rank's
schedule reads of the whole micro-batch (buffer offsets, which pieces other ranks need, the ring
distances in use).

:func:`piece_table` builds it once per micro-batch object and keeps it there. A planner process
builds it for each micro-batch it sends (:class:`~ringpack.planner.stream.PackedMicroBatch`), so a
loader that compiles one rank's schedule of a micro-batch spanning thousands of ranks reads it
instead of passing over every piece: its work follows the rank's own pieces and partners.

See docs/attention.md, "The schedule".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ringpack._checks import is_int
from ringpack.errors import PlanError
from ringpack.ranges import concat_ranges, run_starts
from ringpack.shard_plan import MicroBatch, Piece

__all__ = ["PieceTable", "piece_table", "remember_piece_table", "ring_distances"]

#: Where :func:`piece_table` keeps a micro-batch's table (not a field: equality, hash, repr and
#: pickles of the micro-batch ignore it).
TABLE_SLOT = "_piece_table"


def piece_table(mb: MicroBatch) -> PieceTable:
    """The checked :class:`PieceTable` of ``mb``, built on first use and kept on the object.

    Raises:
        PlanError: as :meth:`PieceTable.from_microbatch`.
    """
    table = vars(mb).get(TABLE_SLOT)
    if table is None:
        table = vars(mb)[TABLE_SLOT] = PieceTable.from_microbatch(mb)
    return table


def remember_piece_table(mb: MicroBatch, table: PieceTable) -> None:
    """Keep ``table`` (``mb``'s, built elsewhere: a planner process) as what :func:`piece_table` returns."""
    vars(mb)[TABLE_SLOT] = table


@dataclass(frozen=True)
class PieceTable:
    """All pieces of a micro-batch as int64 columns (``[P]`` each, ``needed`` bool), rows in
    (rank, canonical) order, and what the schedules of its ranks read of the whole micro-batch.

    The derived parts (:attr:`distances`, :attr:`buffer_tokens`) are computed
    on first read and kept; :meth:`with_derived` computes them all, so a pickle of the table
    carries them.
    """

    rank: np.ndarray
    slot: np.ndarray  # the piece's sample's position in the micro-batch's samples
    start: np.ndarray
    stop: np.ndarray
    offset: np.ndarray  # first row of the piece in its rank's local buffer
    needed: np.ndarray  # bool: some other rank holds a later piece of the same sample
    compact: np.ndarray  # first row in its rank's compact send buffer (-1 if not needed)
    cp_size: int
    by_sample: np.ndarray  # rows in (sample, start) order
    sample_bounds: np.ndarray  # sample slot k's pieces: by_sample[sample_bounds[k]:sample_bounds[k + 1]]

    @classmethod
    def from_microbatch(cls, mb: MicroBatch) -> PieceTable:
        """The checked table of ``mb``: numpy passes over its :attr:`~MicroBatch.piece_columns`
        (read once per micro-batch object), no Python work per piece or sample.

        Raises:
            PlanError: as :func:`~ringpack.attention.compile_schedule` lists for the pieces and samples.
        """
        cp = len(mb.shards)
        samples = _sample_ids(mb.samples)
        rank, sample, start, stop = _read_pieces(mb)
        slot = _slots_of(samples, rank, sample)
        by_sample = _check_pieces(rank, slot, start, stop, samples)
        length = stop - start
        offset = _exclusive_cumsum_by(rank, length)
        needed = _needed(rank, slot, by_sample)
        compact = np.where(needed, _exclusive_cumsum_by(rank, np.where(needed, length, 0)), -1)
        bounds = np.searchsorted(slot[by_sample], np.arange(len(samples) + 1))
        return cls(rank, slot, start, stop, offset, needed, compact, cp, by_sample, bounds)

    @cached_property
    def buffer_tokens(self) -> tuple[int, ...]:
        """Tokens of each rank's compact send buffer (its needed pieces), ``cp_size`` entries."""
        sizes = np.bincount(self.rank, weights=np.where(self.needed, self.stop - self.start, 0), minlength=self.cp_size)
        return tuple(sizes.astype(np.int64).tolist())

    @cached_property
    def distances(self) -> tuple[int, ...]:
        """The ring distances ``t`` at which some rank ``r`` needs keys of rank ``(r - t) mod C``,
        ascending (the same on every rank, so all skip the same distances): :func:`ring_distances`."""
        return tuple(ring_distances(self))

    def with_derived(self) -> PieceTable:
        """The table, its derived parts computed (what a planner process sends along)."""
        _ = self.buffer_tokens, self.distances
        return self

    def rows_of(self, rank: int) -> np.ndarray:
        """The rows of ``rank``'s pieces (rows are in rank order: a search, not a scan)."""
        lo, hi = np.searchsorted(self.rank, (rank, rank + 1))
        return np.arange(lo, hi)


def _sample_ids(samples: Sequence[int]) -> np.ndarray:
    """int64 ``[n]`` of ``samples`` (integers: ``compile_schedule`` checks their types first)."""
    return np.fromiter(samples, dtype=np.int64, count=len(samples))


def _read_pieces(mb: MicroBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(rank, sample, start, stop)`` of every piece of ``mb``: its cached columns, or, for pieces
    those refuse (not a Piece, a field not an integer), a per-piece read that names the first."""
    try:
        return mb.piece_columns
    except (TypeError, ValueError, OverflowError):
        pass
    rows = []
    for r, shard in enumerate(mb.shards):
        for p in shard.pieces:
            if not isinstance(p, Piece):
                raise PlanError(f"cp rank {r}: microbatch.shards[{r}].pieces must all be Piece objects")
            rows.append((r, p.sample, p.start, p.stop))
    table = np.array(rows).reshape(-1, 4)
    if table.size and table.dtype.kind not in "iu":  # floats would be truncated, None cannot be cast
        bad = next((row for row in rows if not all(is_int(x) and abs(x) < 2**62 for x in row[1:])), rows[0])
        raise PlanError(
            f"cp rank {bad[0]}: piece [{bad[2]}, {bad[3]}) of sample {bad[1]} must have integer bounds below 2**62"
        )
    return tuple(np.ascontiguousarray(table[:, j], dtype=np.int64) for j in range(4))


def _slots_of(samples: np.ndarray, rank: np.ndarray, sample: np.ndarray) -> np.ndarray:
    """Each piece's sample slot (its sample's position in ``samples``): a lookup table over the ids
    where they are small (dataset indices), else one sort and a search.

    Raises:
        PlanError: a sample listed twice, or a piece of a sample the micro-batch does not list.
    """
    if samples.size and samples.min() >= 0 and samples.max() < max(16 * (samples.size + sample.size), 1 << 21):
        where = np.full(int(samples.max()) + 1, -1, dtype=np.int64)
        where[samples] = np.arange(samples.size)
        twice = np.flatnonzero(where[samples] != np.arange(samples.size))
        if twice.size:
            raise PlanError(f"microbatch lists sample {samples[twice[0]]} twice")
        slot = where[np.clip(sample, 0, where.size - 1)]
        unknown = np.flatnonzero((slot < 0) | (samples[np.maximum(slot, 0)] != sample))
    else:
        order = np.argsort(samples, kind="stable")
        ordered = samples[order]
        twice = np.flatnonzero(ordered[1:] == ordered[:-1])
        if twice.size:
            raise PlanError(f"microbatch lists sample {ordered[twice[0]]} twice")
        at = np.minimum(np.searchsorted(ordered, sample), max(samples.size - 1, 0))
        unknown = np.flatnonzero(ordered[at] != sample) if samples.size else np.arange(sample.size)
        slot = order[at] if samples.size else at
    if unknown.size:
        i = unknown[0]
        raise PlanError(f"cp rank {rank[i]}: piece of sample {sample[i]}, which the micro-batch does not list")
    return slot


def _needed(rank: np.ndarray, slot: np.ndarray, by_sample: np.ndarray) -> np.ndarray:
    """bool ``[n]``: some other rank needs the piece (holds a later piece of its sample).

    The pieces tile their samples (:func:`_check_pieces`), so in (sample, start) order a piece is
    needed unless every later piece of its sample is on its own rank: unless the run of pieces of
    one (sample, rank) it ends reaches its sample's last piece. The rule of
    :func:`ringpack.traffic.needed_pieces`, in one pass.
    """
    needed = np.zeros(rank.size, dtype=bool)
    if not rank.size:
        return needed
    s_slot, s_rank = slot[by_sample], rank[by_sample]
    last_of_sample = np.r_[s_slot[1:] != s_slot[:-1], True]
    run_end = np.r_[(s_rank[1:] != s_rank[:-1]) | last_of_sample[:-1], True]
    # the last index of each piece's (sample, rank) run, and whether that run ends its sample
    run_last = np.flatnonzero(run_end)
    ends_sample = last_of_sample[run_last][np.searchsorted(run_last, np.arange(rank.size))]
    needed[by_sample] = ~ends_sample
    return needed


def _check_pieces(rank, slot, start, stop, samples) -> np.ndarray:
    """Raise :class:`PlanError` unless the pieces tile each listed sample's tokens ``[0, n)``: none
    empty or negative, canonical order per rank, no overlap, no gap, every sample in some piece.
    Returns the pieces' order by (sample, start)."""
    bad = np.flatnonzero(start < 0)
    if bad.size:
        i = bad[0]
        raise PlanError(f"cp rank {rank[i]}: piece [{start[i]}, {stop[i]}) of sample {samples[slot[i]]} starts below 0")
    bad = np.flatnonzero(start >= stop)
    if bad.size:
        i = bad[0]
        raise PlanError(f"cp rank {rank[i]}: empty piece [{start[i]}, {stop[i]}) of sample {samples[slot[i]]}")
    same_rank = rank[1:] == rank[:-1]
    order = (slot[1:] > slot[:-1]) | ((slot[1:] == slot[:-1]) & (start[1:] > start[:-1]))
    bad = np.flatnonzero(same_rank & ~order)
    if bad.size:
        i = bad[0] + 1
        raise PlanError(
            f"cp rank {rank[i]}: pieces are not in canonical order at sample {samples[slot[i]]} [{start[i]}, {stop[i]})"
        )
    width = int(stop.max()) + 1 if stop.size else 1
    if width * (len(samples) + 1) < 2**62:  # one int64 key sorts faster than two
        by_sample = np.argsort(slot * width + start, kind="stable")
    else:
        by_sample = np.lexsort((start, slot))
    s_slot, s_start, s_stop = slot[by_sample], start[by_sample], stop[by_sample]
    same = s_slot[1:] == s_slot[:-1]
    bad = np.flatnonzero(same & (s_start[1:] < s_stop[:-1]))
    if bad.size:
        i = by_sample[bad[0] + 1]
        raise PlanError(
            f"sample {samples[slot[i]]}: piece [{start[i]}, {stop[i]}) on cp rank {rank[i]} overlaps another piece"
        )
    first = np.r_[True, ~same] if s_slot.size else np.zeros(0, dtype=bool)
    gap_from = np.where(first, 0, np.r_[0, s_stop[:-1]])  # where each piece should start
    bad = np.flatnonzero(s_start != gap_from)
    if bad.size:
        i = by_sample[bad[0]]
        raise PlanError(
            f"sample {samples[slot[i]]}: tokens [{gap_from[bad[0]]}, {start[i]}) are in no piece "
            f"(the next piece, [{start[i]}, {stop[i]}), is on cp rank {rank[i]})"
        )
    missing = np.flatnonzero(np.bincount(slot, minlength=len(samples)) == 0)
    if missing.size:
        raise PlanError(f"sample {samples[missing[0]]} is listed in the micro-batch but is in no piece")
    return by_sample


def _exclusive_cumsum_by(group: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Exclusive running sum of ``values`` restarting whenever ``group`` changes (rows sorted by group)."""
    total = np.cumsum(values) - values
    starts = np.r_[True, group[1:] != group[:-1]] if group.size else np.zeros(0, dtype=bool)
    base = np.maximum.accumulate(np.where(starts, np.arange(group.size), 0)) if group.size else group
    return total - total[base]


def ring_distances(table: PieceTable, max_pairs: int = 1 << 20) -> list[int]:
    """The ring distances ``t`` at which some rank ``r`` needs keys of rank ``(r - t) mod C`` in the
    piece table's micro-batch (the same list on every rank).

    The pieces tile their samples, so ``r`` needs ``s`` when ``s`` holds a piece of a sample that
    comes before one of ``r``'s, in the sample's (start) order (``table.by_sample``,
    ``table.sample_bounds``). Samples are visited in order of their rank span (highest minus
    lowest rank holding them), their piece pairs a growing batch of at most ``max_pairs`` at a
    time: a sample spanning ``w`` ranks can only add distances ``1..w`` and ``C-w..C-1``, and once
    those are all found it and every sample of no wider span are skipped. Work is bounded by the
    sum over samples of their piece counts squared, and is usually a small part of it; memory is
    bounded."""
    if not table.rank.size:
        return []
    rank = table.rank[table.by_sample]  # rank of each piece, samples' pieces in start order
    first = table.sample_bounds[:-1]
    size = np.diff(table.sample_bounds)
    todo = np.flatnonzero(size > 1)
    span = np.maximum.reduceat(rank, first[todo]) - np.minimum.reduceat(rank, first[todo]) if todo.size else todo
    by_span = np.argsort(span, kind="stable")
    todo, span = todo[by_span], span[by_span]
    pairs = np.cumsum(np.minimum(size[todo], span + 1) ** 2)  # at most one group per rank of the span
    cp = table.cp_size
    found = np.zeros(cp, dtype=bool)
    heads = todo[np.flatnonzero(run_starts(span))] if todo.size else todo
    _mark_distances(found, rank, first[heads], size[heads])  # one sample of each span first
    at, batch = 0, 1
    while at < todo.size and not found[1:].all():
        width = int(span[at])
        same_span = int(np.searchsorted(span, width, side="right"))
        if found[1 : width + 1].all() and found[cp - width :].all():
            at, batch = same_span, 1  # every distance this span allows is found: skip its samples
            continue
        done = int(pairs[at - 1]) if at else 0
        upto = min(max(int(np.searchsorted(pairs, done + batch, side="right")), at + 1), same_span)
        _mark_distances(found, rank, first[todo[at:upto]], size[todo[at:upto]])
        at, batch = upto, min(4 * max(batch, int(pairs[upto - 1]) - done), max_pairs)
    return (np.flatnonzero(found[1:]) + 1).tolist()


def _mark_distances(found: np.ndarray, rank: np.ndarray, firsts: np.ndarray, sizes: np.ndarray) -> None:
    """Mark in ``found`` (one entry per ring distance) ``(r - s) mod C`` for the ranks ``r``, ``s``
    holding pieces of one sample with one of ``s``'s before one of ``r``'s (sample ``k``'s pieces,
    in start order: ``rank[firsts[k] + arange(sizes[k])]``), over each sample's (sample, rank)
    groups: ``s``'s first piece comes before ``r``'s last."""
    if not sizes.size:
        return
    at = concat_ranges(firsts, sizes)
    sample = np.repeat(np.arange(sizes.size), sizes)
    order = np.lexsort((at, rank[at], sample))
    at, sample, held = at[order], sample[order], rank[at][order]
    head = run_starts(sample) | run_starts(held)
    g_first, g_last = at[head], at[np.append(head[1:], True)]
    g_rank, g_sample = held[head], sample[head]
    lo = np.flatnonzero(run_starts(g_sample))
    count = np.diff(np.append(lo, g_sample.size))
    per_group = np.repeat(count, count)
    i = np.repeat(np.arange(g_rank.size), per_group)
    j = concat_ranges(np.repeat(lo, count), per_group)
    need = g_first[j] < g_last[i]  # a group with itself: distance 0, not a ring step
    found[(g_rank[i[need]] - g_rank[j[need]]) % found.size] = True
