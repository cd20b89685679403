"""Every figure a report prints, computed from a plan's piece table in a few numpy passes (docs/analysis.md).

One implementation of cost: per-piece tokens and exact causal pairs come from
:func:`ringpack.cost.piece_pairs` and are priced by :meth:`CostModel.cost`, the code the planner
balances with, applied to :attr:`Plan.piece_arrays` columns with no Python loop over pieces.
:class:`PlanMetrics` holds per step, DP rank, micro-batch and CP rank: a rank's cost; a
micro-batch's time (the max over its CP ranks); a DP rank's time (the sum over its micro-batches);
the step time (the max over DP ranks); each GPU's busy cost; the K/V crossing ranks
(:func:`ringpack.analysis.comm_model.kv_cross_tokens`); and the padding a zigzag that needs every
sample to be a multiple of ``2*cp`` would add (:func:`zigzag_rule_padding`; ringpack pads nothing).
The figures derived from them (idle fraction, max/mean, imbalance) are defined in docs/analysis.md,
"The figures". :func:`concat_metrics` stacks the steps of several parts of one plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ringpack.analysis.comm_model import kv_cross_tokens
from ringpack.cost import CostModel, piece_pairs
from ringpack.planner.bounds import critical_path, rank_grid
from ringpack.traffic import needed_pieces

__all__ = ["PlanMetrics", "concat_metrics", "evaluate", "evaluate_plan", "zigzag_rule_padding", "plan_label"]


@dataclass
class PlanMetrics:
    """Per step / DP rank / micro-batch / CP rank figures of one plan (arrays, cost unit of ``model``).

    Shapes: ``S`` steps, ``D`` DP ranks, ``M`` the most micro-batches any step gives a DP rank,
    ``C`` CP ranks. Micro-batch slots a step does not use hold zeros (``mb_exists`` is False).
    """

    name: str
    dp: int
    cp: int
    model: CostModel
    mb_exists: np.ndarray  # (S, D, M) bool
    tokens: np.ndarray  # (S, D, M, C) int64
    pairs: np.ndarray  # (S, D, M, C) int64
    segments: np.ndarray  # (S, D, M, C) int64
    cost: np.ndarray  # (S, D, M, C) float64
    kv_cross_tokens: np.ndarray  # (S, D, M, C) int64: tokens of this rank's K/V some other CP rank needs
    zigzag_padding: np.ndarray  # (S, D, M, C) int64: tokens the 2*cp-rule zigzag would pad onto this rank
    samples: np.ndarray  # (S,) samples planned per step
    loss_tokens: np.ndarray  # (S,) int64

    # ---------------------------------------------------------------- derived, all vectorised
    @property
    def num_steps(self) -> int:
        return int(self.cost.shape[0])

    @property
    def dp_time(self) -> np.ndarray:
        """(S, D): each DP rank's time, the sum of its micro-batches' times (the planner's definition)."""
        return critical_path(self.cost)[0]

    @property
    def step_cost(self) -> np.ndarray:
        """(S,): the slowest DP rank's time."""
        return critical_path(self.cost)[1]

    @property
    def busy(self) -> np.ndarray:
        """(S, D, C): each GPU's own work over the step."""
        return self.cost.sum(axis=2)

    def imbalance_at_pair_price(self, factor: float) -> float:
        """Whole-plan imbalance if a pair truly cost ``factor`` times the model's price: the sum over
        steps of the critical path over the sum of the mean GPU's busy cost, both at that price."""
        m = self.model
        cost = m.token * self.tokens + factor * m.pair * self.pairs + m.segment * self.segments
        busy = cost.sum() / (self.dp * self.cp)
        return float(critical_path(cost)[1].sum() / busy) if busy > 0 else 1.0

    @property
    def step_tokens(self) -> np.ndarray:
        return self.tokens.sum(axis=(1, 2, 3))

    @property
    def idle_fraction(self) -> np.ndarray:
        """(S,): ``1 - sum(busy) / (D*C*step time)``."""
        total = self.busy.sum(axis=(1, 2))
        capacity = self.dp * self.cp * self.step_cost
        return np.where(capacity > 0, 1.0 - total / np.where(capacity > 0, capacity, 1.0), 0.0)

    @property
    def max_mean(self) -> np.ndarray:
        """(S,): busiest GPU over mean GPU busy cost."""
        busy = self.busy.reshape(self.num_steps, -1)
        mean = busy.mean(axis=1)
        return np.where(mean > 0, busy.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)

    @property
    def dp_max_mean(self) -> np.ndarray:
        """(S,): slowest DP rank's time over the mean DP rank's."""
        t = self.dp_time
        mean = t.mean(axis=1)
        return np.where(mean > 0, t.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)

    @property
    def cp_max_mean(self) -> np.ndarray:
        """(S,): mean over the step's micro-batches of (slowest CP rank / mean CP rank)."""
        mean = self.cost.mean(axis=3)
        ratio = np.where(mean > 0, self.cost.max(axis=3) / np.where(mean > 0, mean, 1.0), 1.0)
        count = self.mb_exists.sum(axis=(1, 2))
        return np.where(count > 0, (ratio * self.mb_exists).sum(axis=(1, 2)) / np.maximum(count, 1), 1.0)

    @property
    def step_seconds(self) -> np.ndarray:
        """(S,): predicted compute time of each step (cost model; no communication)."""
        return self.model.seconds(self.step_cost)

    def kv_bytes(self, bytes_per_token: float) -> np.ndarray:
        """(S, D, M, C): K/V bytes each rank's pieces put on the wire (``bytes_per_token`` all layers)."""
        return self.kv_cross_tokens * float(bytes_per_token)

    def summary(self) -> dict[str, float]:
        """Epoch-level figures (sums over steps; ratios of sums)."""
        step_cost = self.step_cost
        total_busy = float(self.busy.sum())
        total_capacity = float(self.dp * self.cp * step_cost.sum())
        tokens = int(self.tokens.sum())
        seconds = float(self.model.seconds(step_cost.sum()))
        return {
            "steps": self.num_steps,
            "microbatches": int(self.mb_exists.sum()),
            "samples": int(self.samples.sum()),
            "tokens": tokens,
            "loss_tokens": int(self.loss_tokens.sum()),
            "step_cost_total": float(step_cost.sum()),
            "busy_cost_total": total_busy,
            "idle_fraction": 1.0 - total_busy / total_capacity if total_capacity > 0 else 0.0,
            "idle_gpu_seconds": float(self.model.seconds(total_capacity - total_busy)),
            "max_mean_mean": float(self.max_mean.mean()) if self.num_steps else 1.0,
            "max_mean_worst": float(self.max_mean.max()) if self.num_steps else 1.0,
            "dp_max_mean_mean": float(self.dp_max_mean.mean()) if self.num_steps else 1.0,
            "cp_max_mean_mean": float(self.cp_max_mean.mean()) if self.num_steps else 1.0,
            "predicted_seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "padding_tokens": 0,
            "zigzag_rule_padding_tokens": int(self.zigzag_padding.sum()),
            "kv_cross_tokens": int(self.kv_cross_tokens.sum()),
        }


def concat_metrics(parts: Sequence[PlanMetrics], name: str) -> PlanMetrics:
    """Stack the steps of several metrics of one strategy (micro-batch axis padded to the widest)."""
    M = max(p.cost.shape[2] for p in parts)

    def pad(a: np.ndarray) -> np.ndarray:
        if a.shape[2] == M:
            return a
        width = [(0, 0)] * a.ndim
        width[2] = (0, M - a.shape[2])
        return np.pad(a, width)

    first = parts[0]
    fields = ("mb_exists", "tokens", "pairs", "segments", "cost", "kv_cross_tokens", "zigzag_padding")
    stacked = {f: np.concatenate([pad(getattr(p, f)) for p in parts], axis=0) for f in fields}
    return PlanMetrics(
        name=name,
        dp=first.dp,
        cp=first.cp,
        model=first.model,
        samples=np.concatenate([p.samples for p in parts]),
        loss_tokens=np.concatenate([p.loss_tokens for p in parts]),
        **stacked,
    )


def zigzag_rule_padding(lengths: np.ndarray, cp: int) -> np.ndarray:
    """(N, C) padding tokens each CP rank gets when each sample is padded to a multiple of ``2*cp``.

    The padded sample (length ``P = L + ((-L) mod 2cp)``) is cut into ``2*cp`` chunks of ``P/2cp``
    tokens, rank ``r`` takes chunks ``r`` and ``2cp-1-r``, and the padding is the tail ``[L, P)``.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    two_c = 2 * cp
    padded = lengths + (-lengths) % two_c
    chunk = padded // two_c
    r = np.arange(cp, dtype=np.int64)[None, :]
    out = np.zeros((lengths.size, cp), dtype=np.int64)
    for first in (r, two_c - 1 - r):  # two chunks per rank: a loop of 2, vectorised over samples
        lo = first * chunk[:, None]
        hi = lo + chunk[:, None]
        out += np.clip(hi - np.maximum(lo, lengths[:, None]), 0, None)
    return out


def evaluate(
    arrays: Mapping[str, np.ndarray],
    lengths: np.ndarray,
    *,
    dp: int,
    cp: int,
    model: CostModel,
    name: str = "plan",
    shape: tuple[int, int, int] | None = None,
) -> PlanMetrics:
    """Metrics of a plan given as piece columns and its sample lengths.

    Args:
        arrays: the plan's piece table (``Plan.piece_arrays``): int64 columns ``[P]`` named
            ``step, dp, microbatch, cp, slot, sample, start, stop``, one row per piece.
        lengths: int64 ``[N]``, the planned samples' lengths.
        dp, cp: the mesh the plan is for.
        model: the cost model that prices each rank's tokens, pairs and pieces.
        name: the plan's label in reports.
        shape: ``(S, D, M)``: steps, DP ranks and the widest micro-batch count (``None``: from
            the columns).

    Returns:
        :class:`PlanMetrics` with ``(S, D, M, C)`` arrays (zeros in unused micro-batch slots).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    per_rank, cell, grid = rank_grid(arrays, dp, cp, shape)
    start, stop, sample = (np.asarray(arrays[k], dtype=np.int64) for k in ("start", "stop", "sample"))
    tokens = per_rank(stop - start)
    pairs = per_rank(piece_pairs(start, stop))
    segments = per_rank(None)
    exists = np.zeros(int(np.prod(grid)), dtype=bool)
    exists[cell] = True
    # one row per (micro-batch, sample): the piece with start == 0 is unique for each sample
    first = start == 0
    sample_cell, sample_length = cell[first], lengths[sample[first]]
    samples, loss = _per_step_samples(sample_cell, sample_length, grid)
    return PlanMetrics(
        name=name,
        dp=dp,
        cp=cp,
        model=model,
        mb_exists=exists.reshape(grid),
        tokens=tokens,
        pairs=pairs,
        segments=segments,
        cost=model.cost(tokens, pairs, segments),
        kv_cross_tokens=per_rank(np.asarray(kv_cross_tokens(arrays, shape=grid), dtype=np.int64)),
        zigzag_padding=_zigzag_padding_grid(sample_cell, sample_length, cp, grid),
        samples=samples,
        loss_tokens=loss,
    )


def _zigzag_padding_grid(
    sample_cell: np.ndarray, sample_length: np.ndarray, cp: int, grid: tuple[int, int, int]
) -> np.ndarray:
    """(S, D, M, C): the 2*cp-rule zigzag padding of each micro-batch's samples, per CP rank.

    Samples go through in blocks of :data:`BLOCK_ENTRIES` ``(sample, rank)`` entries, so memory
    stays bounded at any CP size.
    """
    padding = np.zeros((int(np.prod(grid)), cp), dtype=np.int64)
    for lo, hi in _blocks(sample_cell.size, cp):
        np.add.at(padding, sample_cell[lo:hi], zigzag_rule_padding(sample_length[lo:hi], cp))
    return padding.reshape(*grid, cp)


#: Entries of the largest ``(samples, ranks)`` or ``(samples, chunks)`` array a metric builds at a time:
#: work over more samples goes in blocks, so memory is bounded whatever the CP size.
BLOCK_ENTRIES = 1 << 20


def _blocks(n: int, width: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` ranges covering ``range(n)`` with at most :data:`BLOCK_ENTRIES` ``// width`` items each."""
    step = max(1, BLOCK_ENTRIES // max(width, 1))
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


def _per_step_samples(
    sample_cell: np.ndarray, sample_length: np.ndarray, grid: tuple[int, int, int]
) -> tuple[np.ndarray, np.ndarray]:
    """(S,) samples and (S,) loss tokens (``length - 1`` each) of every step."""
    steps, dp, microbatches = grid
    step_of_sample = sample_cell // (dp * microbatches)
    samples = np.bincount(step_of_sample, minlength=steps)
    loss = np.bincount(step_of_sample, weights=(sample_length - 1).astype(np.float64), minlength=steps)
    return samples, loss.astype(np.int64)


def evaluate_plan(plan, name: str | None = None) -> PlanMetrics:
    """:func:`evaluate` of a :class:`~ringpack.shard_plan.Plan` (its config's dp, cp and cost model)."""
    cfg = plan.config
    if name is None:
        name = plan_label(cfg)
    S = plan.num_steps
    M = max((len(rank) for step in plan.steps for rank in step.microbatches), default=0)
    return evaluate(
        plan.piece_arrays,
        np.asarray(plan.lengths),
        dp=cfg.dp,
        cp=cfg.cp,
        model=cfg.cost,
        name=name,
        shape=(S, cfg.dp, M),
    )


def plan_label(cfg) -> str:
    """``strategy/packing``, the name reports give a plan."""
    return f"{cfg.strategy}/{cfg.packing}"


# ------------------------------------------------------------------ baseline splits without plan objects
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
    owner = np.minimum(k, two - 1 - k)
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
    computed in blocks so temporaries stay within :data:`BLOCK_ENTRIES` entries.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    out = [np.zeros((lengths.size, g), dtype=np.int64) for _ in range(4)]
    for lo, hi in _blocks(lengths.size, 2 * g):
        for whole, part in zip(out, chunk_shares(zigzag_chunk_sizes(lengths[lo:hi], g))):
            whole[lo:hi] = part
    return out[0], out[1], out[2], out[3]


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


def _add_rows(out: Sequence[np.ndarray], cell: np.ndarray, rows: Sequence[np.ndarray]) -> None:
    """Add per-sample ``[n, C]`` rows into per-cell ``[cells, C]`` sums (``cell`` non-decreasing)."""
    if not cell.size:
        return
    starts = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    where = cell[starts]
    for total, values in zip(out, rows):
        total[where] += np.add.reduceat(values, starts, axis=0)


def _zigzag_grid(packed: PackedSteps, cp: int, tokens_per_rank: int) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` tokens, pairs, segments and K/V crossing of the ``zigzag`` strategy.

    As :func:`~ringpack.planner.epoch.split_microbatch`: floor-cut zigzag, and the token-even
    zigzag for a micro-batch where floor cuts put more than ``tokens_per_rank`` tokens on a rank.
    """
    sums = [np.zeros((packed.num_cells, cp), dtype=np.int64) for _ in range(4)]
    for lo, hi in _blocks(packed.cell.size, 2 * cp):
        _add_rows(sums, packed.cell[lo:hi], chunk_shares(zigzag_chunk_sizes(packed.length[lo:hi], cp)))
    over = sums[0].max(axis=1) > tokens_per_rank
    if not over.any():
        return sums
    for total in sums:
        total[over] = 0
    redo = over[packed.cell]
    cell, length = packed.cell[redo], packed.length[redo]
    extra = length % cp
    first = np.r_[True, cell[1:] != cell[:-1]]
    before = np.cumsum(extra) - extra  # extras of earlier samples, reset at every micro-batch
    turn = (before - np.maximum.accumulate(np.where(first, before, 0))) % cp
    for lo, hi in _blocks(cell.size, 2 * cp):
        _add_rows(sums, cell[lo:hi], chunk_shares(zigzag_even_chunk_sizes(length[lo:hi], turn[lo:hi], cp)))
    return sums


def _contiguous_grid(packed: PackedSteps, cp: int) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` tokens, pairs, segments and K/V crossing of the ``contiguous`` strategy.

    As ``split_contiguous``: a micro-batch's samples end to end, cut into ``cp`` ranges at
    ``floor(r*T/cp)``; a sample's pieces lie on consecutive ranks, each needed by the next.
    """
    cell, length = packed.cell, packed.length
    sums = [np.zeros((packed.num_cells, cp), dtype=np.int64) for _ in range(4)]
    if not cell.size:
        return sums
    begin = np.cumsum(length) - length  # every sample's first token, all micro-batches end to end
    first = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    cells = cell[first]
    base = begin[first]
    total = np.add.reduceat(length, first)
    r = np.arange(cp + 1, dtype=np.int64)
    edges = base[:, None] + (r[None, :] * total[:, None]) // cp  # [mbs, cp + 1] rank boundaries
    starts = edges[:, :-1].ravel()  # non-decreasing: flat slot = micro-batch * cp + rank
    stops = edges[:, 1:].ravel()
    lo = np.searchsorted(starts, begin, side="right") - 1
    hi = np.searchsorted(starts, begin + length - 1, side="right") - 1
    count = hi - lo + 1
    piece_of = np.repeat(np.arange(cell.size), count)
    slot = np.arange(piece_of.size) - np.repeat(np.cumsum(count) - count, count) + lo[piece_of]
    start = np.maximum(starts[slot], begin[piece_of]) - begin[piece_of]
    stop = np.minimum(stops[slot], begin[piece_of] + length[piece_of]) - begin[piece_of]
    keep = stop > start
    slot, start, stop, last = slot[keep], start[keep], stop[keep], (slot == hi[piece_of])[keep]
    size = stop - start
    per_slot = cells.size * cp
    values = (size, piece_pairs(start, stop), np.ones_like(size), np.where(last, 0, size))
    rows = np.repeat(cells, cp), np.tile(np.arange(cp), cells.size)
    for out, v in zip(sums, values):
        flat = np.zeros(per_slot, dtype=np.int64)
        np.add.at(flat, slot, v)
        out[rows] = flat
    return sums


def _split_grid(packed: PackedSteps, cp: int, split: Callable[[list[list[int]]], list]) -> list[np.ndarray]:
    """Per-cell ``[cells, C]`` tokens, pairs, segments and K/V crossing of the micro-batches ``split`` cuts.

    ``split`` turns a list of micro-batches (their sample ids, in order) into their
    :class:`~ringpack.shard_plan.MicroBatch` objects. It gets them in blocks of at most
    :data:`BLOCK_ENTRIES` pieces (counting ``min(L, 2*cp)`` per sample, what a zigzag cuts it
    into; at least one micro-batch), so only one block's objects exist at a time. Counted as
    :func:`evaluate` counts a piece table.
    """
    sums = [np.zeros(packed.num_cells * cp, dtype=np.int64) for _ in range(4)]
    cell, sample = packed.cell, packed.sample
    if not cell.size:
        return [x.reshape(-1, cp) for x in sums]
    first = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    last = np.r_[first[1:], cell.size]
    reach = np.cumsum(np.add.reduceat(np.minimum(packed.length, 2 * cp), first))
    lo = 0
    while lo < first.size:
        done = reach[lo - 1] if lo else 0
        hi = max(lo + 1, int(np.searchsorted(reach, done + BLOCK_ENTRIES, side="right")))
        groups = [sample[a:b].tolist() for a, b in zip(first[lo:hi].tolist(), last[lo:hi].tolist())]
        rows = [
            (k, c, p.sample, p.start, p.stop)
            for k, mb in zip(cell[first[lo:hi]].tolist(), split(groups))
            for c, shard in enumerate(mb.shards)
            for p in shard.pieces
        ]
        k, c, s, start, stop = np.asarray(rows, dtype=np.int64).reshape(-1, 5).T
        flat, size = k * cp + c, stop - start
        need = needed_pieces(k, c, s, start, stop)
        for total, values in zip(
            sums, (size, piece_pairs(start, stop), np.ones_like(size), np.where(need > 0, size, 0))
        ):
            np.add.at(total, flat, values)
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
    split: Callable[[list[list[int]]], list] | None = None,
) -> PlanMetrics:
    """:func:`evaluate` of the plan splitting ``packed`` by ``strategy``, without building the plan.

    The same figures, exactly, as :func:`evaluate_plan` of :func:`~ringpack.planner.make_plan`'s plan
    for that packing. ``zigzag`` and ``contiguous`` come from per-sample arrays (no objects, no
    piece table); any other strategy from ``split`` (the planner's split of a list of
    micro-batches, :func:`~ringpack.planner.epoch.split_groups`), a block of micro-batches at a
    time. Either way memory is bounded at any CP size.

    Raises:
        ValueError: a strategy other than ``zigzag`` or ``contiguous`` without ``split``.
    """
    if strategy == "zigzag":
        sums = _zigzag_grid(packed, cp, tokens_per_rank)
    elif strategy == "contiguous":
        sums = _contiguous_grid(packed, cp)
    elif split is not None:
        sums = _split_grid(packed, cp, split)
    else:
        raise ValueError(f"evaluate_packed measures {strategy!r} splits only through split=")
    grid = packed.grid
    tokens, pairs, segments, kv = (x.reshape(*grid, cp) for x in sums)
    exists = np.zeros(packed.num_cells, dtype=bool)
    exists[packed.cell] = True
    samples, loss = _per_step_samples(packed.cell, packed.length, grid)
    return PlanMetrics(
        name=name,
        dp=grid[1],
        cp=cp,
        model=model,
        mb_exists=exists.reshape(grid),
        tokens=tokens,
        pairs=pairs,
        segments=segments,
        cost=model.cost(tokens, pairs, segments),
        kv_cross_tokens=kv,
        zigzag_padding=_zigzag_padding_grid(packed.cell, packed.length, cp, grid),
        samples=samples,
        loss_tokens=loss,
    )
