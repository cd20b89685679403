"""A packing's figures under a CP split, exactly the plan's, without building the plan (docs/analysis.md).

Tools that compare strategies on the same data (``report``, ``simulate``, the peers) pack a step
once (:func:`~ringpack.planner.epoch.pack_step`) and measure it under every split.
:class:`PackedSteps` says where each sample sits; :func:`evaluate_packed` gives
:func:`~ringpack.analysis.metrics.evaluate_plan`'s figures of the plan ``make_plan`` would build:
``zigzag`` (floor cuts, and its token-even fallback, whose extras go round robin) and
``contiguous`` from per-sample arrays, any other split from the planner a block of micro-batches
at a time. Work goes in blocks of :data:`~ringpack.analysis.metrics.BLOCK_ENTRIES` entries, so
memory does not grow with the pieces a large CP group cuts samples into; on request the plan's
piece table comes too, in plan order, for its content hash.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ringpack.analysis import metrics
from ringpack.analysis.metrics import PlanMetrics, from_rank_sums, sample_blocks
from ringpack.cost import CostModel, piece_pairs
from ringpack.shard_plan import TABLE_COLUMNS
from ringpack.traffic import needed_pieces

__all__ = [
    "PackedSteps",
    "evaluate_packed",
    "zigzag_chunk_sizes",
    "zigzag_even_chunk_sizes",
    "chunk_shares",
    "zigzag_shares",
]

#: A split of micro-batches (each a list of sample ids, in order) into their ``MicroBatch`` objects.
Split = Callable[[list[list[int]]], list]


# --------------------------------------------------------------------------------- zigzag chunks
def zigzag_chunk_sizes(lengths: np.ndarray, g: int) -> np.ndarray:
    """int64 ``[n, 2g]``: the chunks ``split_zigzag`` cuts each sample into (cuts at ``floor(k*L/(2g))``).

    Chunk ``k`` belongs to rank ``min(k, 2g-1-k)``; empty chunks (``L < 2g``) are pieces of no rank.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    cuts = (np.arange(2 * g + 1, dtype=np.int64)[None, :] * lengths[:, None]) // (2 * g)
    return np.diff(cuts, axis=1)


def zigzag_even_chunk_sizes(lengths: np.ndarray, turn: np.ndarray, g: int) -> np.ndarray:
    """int64 ``[n, 2g]``: the chunks ``split_zigzag_even`` gives each sample, in ``zigzag_chunk_sizes``' layout.

    ``split_zigzag_even`` deals a sample's ``L % g`` extra tokens to the ranks holding the fewest
    tokens so far, ties by rank; every rank then holds ``h`` or ``h + 1`` tokens with the fuller
    ones a prefix ``0 .. e-1``, so the extras go round robin: rank ``r`` gets one iff
    ``(r - turn) % g < L % g``, where ``turn`` (int64 ``[n]``) is the sum of ``L % g`` over the
    micro-batch's earlier samples, mod ``g``. Rank ``r``'s front half of its share is chunk ``r``,
    its back half chunk ``2g-1-r``, so the chunks lie along the sample as zigzag's do.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    base, extra = np.divmod(lengths, g)
    r = np.arange(g, dtype=np.int64)
    quota = base[:, None] + (((r[None, :] - np.asarray(turn, dtype=np.int64)[:, None]) % g) < extra[:, None])
    front = quota // 2
    return np.concatenate([front, (quota - front)[:, ::-1]], axis=1)


def _owners(g: int) -> np.ndarray:
    k = np.arange(2 * g, dtype=np.int64)
    return np.minimum(k, 2 * g - 1 - k)


def chunk_shares(sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's share of samples cut into zigzag-laid chunks: int64 ``[n, g]`` tokens, pairs, segments, kv_cross.

    ``sizes`` (int64 ``[n, 2g]``) are each sample's chunks along it, chunk ``k`` on rank
    ``min(k, 2g-1-k)``; a non-empty chunk is a piece. ``kv_cross`` counts a rank's tokens some
    other rank needs, the rule of :func:`ringpack.traffic.needed_pieces` (another rank holds a
    later piece of the sample) applied to this layout: a piece is needed iff a later non-empty
    chunk of the sample is on another rank.
    """
    n, two = sizes.shape
    g = two // 2
    stop = np.cumsum(sizes, axis=1)
    pairs = piece_pairs(stop - sizes, stop)
    nonempty = sizes > 0
    k = np.arange(two, dtype=np.int64)
    owner = _owners(g)
    last = two - 1 - np.argmax(nonempty[:, ::-1], axis=1)  # every sample has a token, so a last piece
    same = owner[None, :] == owner[last][:, None]  # chunks on the rank of the last piece
    elsewhere = nonempty & ~same
    last_elsewhere = np.where(elsewhere.any(axis=1), two - 1 - np.argmax(elsewhere[:, ::-1], axis=1), -1)
    needed = nonempty & (k[None, :] < np.where(same, last_elsewhere[:, None], last[:, None]))

    def fold(x: np.ndarray) -> np.ndarray:
        return x[:, :g] + x[:, ::-1][:, :g]

    return fold(sizes), fold(pairs), fold(nonempty.astype(np.int64)), fold(np.where(needed, sizes, 0))


def zigzag_shares(lengths: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's share of samples split zigzag over ``g`` ranks (:func:`zigzag_chunk_sizes`).

    Returns ``(tokens, pairs, segments, kv_cross)``, int64 ``[n, g]`` (:func:`chunk_shares`),
    computed in blocks so temporaries stay within ``BLOCK_ENTRIES`` entries.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    out = [np.zeros((lengths.size, g), dtype=np.int64) for _ in range(4)]
    for lo, hi in sample_blocks(lengths.size, 2 * g):
        for whole, part in zip(out, chunk_shares(zigzag_chunk_sizes(lengths[lo:hi], g))):
            whole[lo:hi] = part
    return out[0], out[1], out[2], out[3]


# ---------------------------------------------------------------------------------------- packing
@dataclass(frozen=True)
class PackedSteps:
    """Where every sample of some steps sits, before any CP split: one row per sample, sorted by cell.

    ``cell`` is the flat ``(step, dp rank, micro-batch)`` index of the ``(S, D, M)`` grid;
    samples of one micro-batch are consecutive, in micro-batch order (their window order).
    """

    grid: tuple[int, int, int]
    cell: np.ndarray  # (n,) int64, non-decreasing
    sample: np.ndarray  # (n,) int64 ids into the lengths
    length: np.ndarray  # (n,) int64

    @classmethod
    def of(cls, steps: Sequence[tuple[np.ndarray, np.ndarray, int]], lengths: np.ndarray, dp: int) -> PackedSteps:
        """From ``(ids, bins, m)`` per step (:func:`ringpack.planner.epoch.pack_step`'s packing of ``ids``)."""
        M = max((m for _, _, m in steps), default=0)
        cells, samples = [], []
        for s, (ids, bins, m) in enumerate(steps):
            order = np.argsort(bins, kind="stable")  # a micro-batch's samples keep their window order
            b = np.asarray(bins, dtype=np.int64)[order]
            cells.append((s * dp + b // m) * M + b % m)
            samples.append(np.asarray(ids, dtype=np.int64)[order])
        cell = np.concatenate(cells) if cells else np.zeros(0, dtype=np.int64)
        sample = np.concatenate(samples) if samples else np.zeros(0, dtype=np.int64)
        return cls((len(steps), dp, M), cell, sample, np.asarray(lengths, dtype=np.int64)[sample])

    @property
    def num_cells(self) -> int:
        return int(np.prod(self.grid))

    @property
    def firsts(self) -> np.ndarray:
        """int64 ``[micro-batches]``: the first row of every micro-batch."""
        cell = self.cell
        return np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]]) if cell.size else np.zeros(0, dtype=np.int64)

    @property
    def slot(self) -> np.ndarray:
        """int64 ``[n]``: each sample's position in its micro-batch (the piece table's ``slot``)."""
        firsts = self.firsts
        sizes = np.diff(np.r_[firsts, self.cell.size])
        return np.arange(self.cell.size) - np.repeat(firsts, sizes)

    def table(
        self, row: np.ndarray, cp: np.ndarray, start: np.ndarray, stop: np.ndarray, slot: np.ndarray
    ) -> dict[str, np.ndarray]:
        """The piece-table columns of pieces ``[start, stop)`` of samples at rows ``row`` on CP ranks
        ``cp``, each sample at place ``slot`` of its micro-batch."""
        _, D, M = self.grid
        cell = self.cell[row]
        columns = (cell // (D * M), cell // M % D, cell % M, cp, slot, self.sample[row], start, stop)
        return {name: np.ascontiguousarray(c, dtype=np.int64) for name, c in zip(TABLE_COLUMNS, columns)}


def _add_rows(out: Sequence[np.ndarray], cell: np.ndarray, rows: Sequence[np.ndarray]) -> None:
    """Add per-sample ``[n, C]`` rows into per-cell ``[cells, C]`` sums (``cell`` non-decreasing)."""
    if not cell.size:
        return
    starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    where = cell[starts]
    for total, values in zip(out, rows):
        total[where] += np.add.reduceat(values, starts, axis=0)


# ------------------------------------------------------------------------------------- the splits
def _zigzag_blocks(packed: PackedSteps, cp: int, tokens_per_rank: int):
    """``(rows, sizes)`` blocks: every sample's zigzag chunks (``[len(rows), 2cp]``), as ``split_microbatch`` cuts.

    Floor cuts, and the token-even zigzag for every sample of a micro-batch where floor cuts put
    more than ``tokens_per_rank`` tokens on a rank. Each block's rows are ascending.
    """
    cell, length = packed.cell, packed.length
    tokens = np.zeros((packed.num_cells, cp), dtype=np.int64)
    for lo, hi in sample_blocks(cell.size, 2 * cp):
        sizes = zigzag_chunk_sizes(length[lo:hi], cp)
        _add_rows([tokens], cell[lo:hi], [sizes[:, :cp] + sizes[:, ::-1][:, :cp]])
    over = (tokens.max(axis=1) > tokens_per_rank)[cell]
    regular, redo = np.flatnonzero(~over), np.flatnonzero(over)
    for lo, hi in sample_blocks(regular.size, 2 * cp):
        yield regular[lo:hi], zigzag_chunk_sizes(length[regular[lo:hi]], cp)
    if redo.size:
        c, extra = cell[redo], length[redo] % cp
        first = np.r_[True, c[1:] != c[:-1]]
        before = np.cumsum(extra) - extra  # extras of earlier samples, reset at every micro-batch
        turn = (before - np.maximum.accumulate(np.where(first, before, 0))) % cp
        for lo, hi in sample_blocks(redo.size, 2 * cp):
            yield redo[lo:hi], zigzag_even_chunk_sizes(length[redo[lo:hi]], turn[lo:hi], cp)


def _zigzag_sums(packed: PackedSteps, cp: int, tokens_per_rank: int, tables: list | None) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` tokens, pairs, segments and K/V crossing of the ``zigzag`` strategy."""
    sums = [np.zeros((packed.num_cells, cp), dtype=np.int64) for _ in range(4)]
    owner = _owners(cp)
    for rows, sizes in _zigzag_blocks(packed, cp, tokens_per_rank):
        _add_rows(sums, packed.cell[rows], chunk_shares(sizes))
        if tables is not None:
            i, k = np.nonzero(sizes)
            stop = np.cumsum(sizes, axis=1)[i, k]
            tables.append((rows[i], owner[k], stop - sizes[i, k], stop, packed.slot[rows[i]]))
    return sums


def _contiguous_pieces(packed: PackedSteps, cp: int) -> tuple[np.ndarray, ...]:
    """``(row, rank slot, start, stop, last)`` of every piece of ``split_contiguous``, in sample order.

    A micro-batch's samples end to end are cut into ``cp`` ranges at ``floor(r*T/cp)``; the rank
    slot is ``micro-batch * cp + rank``, and a sample's last piece is the only one no other rank needs.
    """
    cell, length = packed.cell, packed.length
    begin = np.cumsum(length) - length  # every sample's first token, all micro-batches end to end
    first = packed.firsts
    total = np.add.reduceat(length, first)
    r = np.arange(cp + 1, dtype=np.int64)
    edges = begin[first][:, None] + (r[None, :] * total[:, None]) // cp  # [mbs, cp + 1] rank boundaries
    starts, stops = edges[:, :-1].ravel(), edges[:, 1:].ravel()  # non-decreasing
    lo = np.searchsorted(starts, begin, side="right") - 1
    hi = np.searchsorted(starts, begin + length - 1, side="right") - 1
    count = hi - lo + 1
    row = np.repeat(np.arange(cell.size), count)
    slot = np.arange(row.size) - np.repeat(np.cumsum(count) - count, count) + lo[row]
    start = np.maximum(starts[slot], begin[row]) - begin[row]
    stop = np.minimum(stops[slot], begin[row] + length[row]) - begin[row]
    keep = stop > start
    return row[keep], slot[keep], start[keep], stop[keep], (slot == hi[row])[keep]


def _contiguous_sums(packed: PackedSteps, cp: int, tables: list | None) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` tokens, pairs, segments and K/V crossing of the ``contiguous`` strategy."""
    sums = [np.zeros((packed.num_cells, cp), dtype=np.int64) for _ in range(4)]
    if not packed.cell.size:
        return sums
    row, slot, start, stop, last = _contiguous_pieces(packed, cp)
    size = stop - start
    cells = packed.cell[packed.firsts]
    where = np.repeat(cells, cp), np.tile(np.arange(cp), cells.size)
    for out, v in zip(sums, (size, piece_pairs(start, stop), np.ones_like(size), np.where(last, 0, size))):
        flat = np.zeros(cells.size * cp, dtype=np.int64)
        np.add.at(flat, slot, v)
        out[where] = flat
    if tables is not None:
        tables.append((row, slot % cp, start, stop, packed.slot[row]))
    return sums


def _split_sums(packed: PackedSteps, cp: int, split: Split, tables: list | None) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` sums of the micro-batches ``split`` cuts, counted as ``evaluate`` counts a table.

    ``split`` gets them in blocks of at most ``BLOCK_ENTRIES`` pieces (counting ``min(L, 2*cp)``
    per sample, what a zigzag cuts it into; at least one micro-batch), so only one block's
    objects exist at a time.
    """
    sums = [np.zeros(packed.num_cells * cp, dtype=np.int64) for _ in range(4)]
    cell, sample = packed.cell, packed.sample
    first = packed.firsts
    last = np.r_[first[1:], cell.size]
    reach = np.cumsum(np.add.reduceat(np.minimum(packed.length, 2 * cp), first)) if cell.size else []
    lo = 0
    while lo < first.size:
        done = reach[lo - 1] if lo else 0
        budget = done + metrics.BLOCK_ENTRIES  # the module attribute, read each time
        hi = max(lo + 1, int(np.searchsorted(reach, budget, side="right")))
        groups = [sample[a:b].tolist() for a, b in zip(first[lo:hi].tolist(), last[lo:hi].tolist())]
        pieces = []
        for a, group, mb in zip(first[lo:hi].tolist(), groups, split(groups)):
            # a sample's row is its place in the packing; its slot, its place in the micro-batch the
            # split made (which may list the samples in another order, as a split over nodes does)
            row_of = {s: a + j for j, s in enumerate(group)}
            slot_of = {s: j for j, s in enumerate(mb.samples)}
            pieces += [
                (row_of[p.sample], c, p.start, p.stop, slot_of[p.sample])
                for c, shard in enumerate(mb.shards)
                for p in shard.pieces
            ]
        row, c, start, stop, slot = np.asarray(pieces, dtype=np.int64).reshape(-1, 5).T
        k = cell[row]
        size = stop - start
        need = needed_pieces(k, c, sample[row], start, stop)
        values = (size, piece_pairs(start, stop), np.ones_like(size), np.where(need > 0, size, 0))
        for total, v in zip(sums, values):
            np.add.at(total, k * cp + c, v)
        if tables is not None:
            tables.append((row, c, start, stop, slot))
        lo = hi
    return [x.reshape(-1, cp) for x in sums]


def evaluate_packed(
    packed: PackedSteps,
    strategy: str,
    *,
    cp: int,
    tokens_per_rank: int,
    model: CostModel,
    name: str,
    split: Split | None = None,
    with_table: bool = False,
) -> tuple[PlanMetrics, dict[str, np.ndarray] | None]:
    """:func:`~ringpack.analysis.metrics.evaluate` of the plan splitting ``packed`` by ``strategy``, without the plan.

    Args:
        packed: where every sample sits.
        strategy: ``zigzag`` and ``contiguous`` are cut here; any other needs ``split``.
        cp, tokens_per_rank, model, name: the CP size, the token budget (zigzag's fallback), the
            cost model, the plan's label.
        split: the planner's split of a list of micro-batches
            (:func:`~ringpack.planner.epoch.split_microbatches` with the plan's config).
        with_table: also return the plan's piece table (``Plan.piece_arrays``: the same rows in
            plan order) for its content hash.

    Returns:
        ``(metrics, table)``: exactly :func:`~ringpack.analysis.metrics.evaluate_plan`'s figures
        of the plan :func:`~ringpack.planner.make_plan` builds for this packing; ``table`` is
        ``None`` unless asked for.

    Raises:
        ValueError: a strategy other than ``zigzag`` or ``contiguous`` without ``split``.
    """
    tables: list | None = [] if with_table else None
    if strategy == "zigzag":
        sums = _zigzag_sums(packed, cp, tokens_per_rank, tables)
    elif strategy == "contiguous":
        sums = _contiguous_sums(packed, cp, tables)
    elif split is not None:
        sums = _split_sums(packed, cp, split, tables)
    else:
        raise ValueError(f"evaluate_packed measures {strategy!r} splits only through split=")
    metrics = from_rank_sums(sums, packed.cell, packed.length, grid=packed.grid, cp=cp, model=model, name=name)
    if tables is None:
        return metrics, None
    empty = np.zeros(0, dtype=np.int64)
    columns = (np.concatenate([empty, *parts]) for parts in zip(*tables)) if tables else (empty,) * 5
    row, rank, start, stop, slot = columns
    order = np.lexsort((start, slot, rank, packed.cell[row]))  # plan order
    return metrics, packed.table(row[order], rank[order], start[order], stop[order], slot[order])
