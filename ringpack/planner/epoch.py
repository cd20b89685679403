"""``make_plan``: sample lengths + :class:`PlanConfig` -> a :class:`Plan`.

The plan is a pure function of ``(lengths, config)`` (``config`` carries ``seed`` and ``epoch``),
so every rank computes the same plan, with the same number of steps, without communicating. The
stages: check the inputs and apply ``config.overflow`` (:func:`expand_overflow`,
:func:`split_document_limit`); shuffle by a keyed hash and cut into global batches, balanced
across a ``batch_window`` (:func:`global_batches`, :mod:`ringpack.planner.batch_window`); pack and
balance over DP ranks (:mod:`ringpack.planner.packing`, :mod:`ringpack.planner.solver`); split every
micro-batch over the CP ranks (:mod:`ringpack.planner.split`); bound every step
(:func:`step_lower_bound`). :func:`plan_step` plans one step alone.

Step cost, the quantity balanced and bounded: a micro-batch costs the *max* over its CP ranks of
``CostModel.cost(tokens, exact causal pairs, segments)``; a DP rank's step cost is the *sum* over
its micro-batches; the step costs the max over DP ranks.

See docs/planner.md, "The stages".
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringpack._hints import option
from ringpack.lengths import check_lengths
from ringpack.planner.batch_window import BalancedWindows, WindowMoves
from ringpack.planner.bounds import PriceProfile, price_profile, step_lower_bound
from ringpack.planner.limits import check_split_size
from ringpack.planner.packing import PackingProblem, fill_empty_bins, improve, pack_first_fit, pack_greedy
from ringpack.planner.partners import hold_partner_budget
from ringpack.planner.pool import split_over_nodes
from ringpack.planner.solver import refine
from ringpack.planner.split.strategies import split_groups
from ringpack.shard_plan import MicroBatch, Plan, PlanConfig, PlanError, Step

log = logging.getLogger(__name__)

__all__ = [
    "make_plan",
    "global_batches",
    "GlobalBatches",
    "as_lengths",
    "expand_overflow",
    "shuffle_order",
    "split_document_limit",
    "step_lower_bound",
    "split_microbatch",
    "pack_step",
    "split_step",
    "split_microbatches",
    "plan_step",
]

#: With ``microbatches_per_rank=0`` the planner uses the fewest micro-batches per DP rank that hold
#: the tokens, ``m``; when the token budget then keeps the step more than this far above its lower
#: bound (samples cannot move between DP ranks without overflowing a micro-batch), it also tries
#: ``m + 1`` and keeps whichever balances better.
AUTO_MICROBATCH_GAP = 0.01
#: ``overflow="split"`` may create at most this many documents per input sample (on average), at
#: least :data:`MIN_SPLIT_DOCUMENTS` and never more than :data:`MAX_SPLIT_DOCUMENTS` in all: a plan
#: holds every document as objects, so a sample of 2**40 tokens must not become 2**25 of them.
SPLIT_DOCUMENTS_PER_SAMPLE = 100
MIN_SPLIT_DOCUMENTS = 100_000
MAX_SPLIT_DOCUMENTS = 10**8


# ----------------------------------------------------------------------------------------- inputs
def as_lengths(lengths: Any) -> np.ndarray:
    """Validate and convert lengths to a 1-D int64 array; :class:`PlanError` names the first bad sample."""
    arr = check_lengths(lengths, error=PlanError)
    if arr.size == 0:
        raise PlanError("no samples to plan: lengths is empty")
    return arr


def split_document_limit(num_samples: int) -> int:
    """The most documents ``overflow="split"`` may leave of ``num_samples`` input samples."""
    return min(MAX_SPLIT_DOCUMENTS, max(SPLIT_DOCUMENTS_PER_SAMPLE * num_samples, MIN_SPLIT_DOCUMENTS))


def expand_overflow(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every sample longer than ``capacity`` into ``ceil(length / capacity)`` near-equal documents.

    Args:
        lengths: int64 ``[N]``, every entry >= 1.
        capacity: the most tokens of one document (one CP group's tokens), >= 1.

    Returns:
        ``(doc_lengths, doc_sample, doc_offset)``, int64 ``[D]``: document ``k`` is tokens
        ``[doc_offset[k], doc_offset[k] + doc_lengths[k])`` of input sample ``doc_sample[k]``.
        Documents keep input order (a cut sample's documents are consecutive). Identity when
        nothing is too long.

    Raises:
        PlanError: ``D`` would exceed :func:`split_document_limit` (checked before anything of size
            ``D`` is allocated), naming the sample cut into the most documents.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    pieces = -(-lengths // capacity)
    _check_document_count(lengths, pieces, capacity)
    doc_sample = np.repeat(np.arange(len(lengths), dtype=np.int64), pieces)
    first = np.concatenate([[0], np.cumsum(pieces)[:-1]])
    j = np.arange(len(doc_sample), dtype=np.int64) - np.repeat(first, pieces)
    k = pieces[doc_sample]
    L = lengths[doc_sample]
    doc_offset = (j * L) // k
    doc_end = ((j + 1) * L) // k
    return doc_end - doc_offset, doc_sample, doc_offset


def _check_document_count(lengths: np.ndarray, pieces: np.ndarray, capacity: int) -> None:
    """Refuse a split into more documents than :func:`split_document_limit` allows (bounded time and memory)."""
    limit = split_document_limit(len(lengths))
    worst = int(np.argmax(pieces)) if len(pieces) else 0
    most = int(pieces[worst]) if len(pieces) else 0
    if most > limit:
        cut = f"sample {worst} ({int(lengths[worst])} tokens) into {most:,} documents"
    else:  # every count is at most the limit, so the sum stays far inside int64
        total = int(pieces.sum())
        if total <= limit:
            return
        cut = (
            f"{int((pieces > 1).sum()):,} samples into {total:,} documents in all (sample {worst}, "
            f"{int(lengths[worst])} tokens, into {most:,})"
        )
    raise PlanError(
        f"{option('overflow', 'split')} would cut {cut} of at most {capacity} tokens; a split may leave at most "
        f"{limit:,} documents of {len(lengths):,} samples ({SPLIT_DOCUMENTS_PER_SAMPLE} per sample, at least "
        f"{MIN_SPLIT_DOCUMENTS:,}, at most {MAX_SPLIT_DOCUMENTS:,}). Raise {option('tokens_per_rank')} or "
        f"{option('cp')}, or leave such samples out with {option('overflow', 'drop')}"
    )


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = x.astype(np.uint64, copy=True)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


def shuffle_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)`` that depends only on ``(n, seed, epoch)``, on every platform.

    Sorts indices by a splitmix64 hash keyed with ``seed`` and ``epoch`` (no NumPy RNG stream,
    whose output may change between NumPy versions). The hashes are distinct (an odd multiple plus
    a key, then the finaliser, are bijections of 64-bit integers), so any sort gives this order and
    the fastest is used.
    """
    with np.errstate(over="ignore"):
        key = _mix64(np.array([(seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03 + 1) % 2**64], dtype=np.uint64))
        h = _mix64(np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + key)
    return np.argsort(h, kind="quicksort")


# -------------------------------------------------------------------------------------- CP split
def split_microbatch(samples: Sequence[int], lengths: Sequence[int], config: PlanConfig) -> MicroBatch:
    """Split one micro-batch's samples over the CP group by ``config.strategy`` (node by node when the
    group spans nodes, :func:`~ringpack.planner.pool.split_over_nodes`)."""
    return _split([samples], lengths, config)[0]


def _split(groups: Sequence[Sequence[int]], lengths: Sequence[int], config: PlanConfig) -> list[MicroBatch]:
    """Every micro-batch of ``groups`` split by ``config``: over its nodes, or over the CP group, then
    held to the partner budget (:func:`~ringpack.planner.partners.hold_partner_budget`)."""
    if config.nodes_per_group > 1:
        mbs = split_over_nodes(groups, lengths, config)
    else:
        mbs = split_groups(
            groups, lengths, config.cp, config.tokens_per_rank, config.cost, config.strategy, config.token_slack
        )
    return hold_partner_budget(groups, mbs, lengths, config)


# ------------------------------------------------------------------------------------------ steps
def _windows(order: np.ndarray, per_step: int, min_samples: int) -> list[np.ndarray]:
    """``order`` cut into global batches of ``per_step`` samples (0: one batch); a last batch of
    fewer than ``min_samples`` joins the one before it."""
    if per_step == 0 or per_step >= len(order):
        return [order]
    windows = [order[i : i + per_step] for i in range(0, len(order), per_step)]
    if len(windows) > 1 and len(windows[-1]) < max(min_samples, 1):
        tail = windows.pop()
        windows[-1] = np.concatenate([windows[-1], tail])
    return windows


def _plan_step(index: int, ids: np.ndarray, lengths: np.ndarray, config: PlanConfig, length_list: list[int]) -> Step:
    """Step ``index`` of samples ``ids`` (one global batch): packing, the CP split of every
    micro-batch, the lower bound. ``length_list`` is ``lengths`` as a list (for the per-sample splits)."""
    bins, m, bound = pack_step(index, ids, lengths, config)
    return split_step(ids, bins, m, lengths, config, length_list, bound)


def pack_step(index: int, ids: np.ndarray, lengths: np.ndarray, config: PlanConfig) -> tuple[np.ndarray, int, float]:
    """The packing stage of step ``index``: where each of its samples ``ids`` goes, before any CP split.

    Args:
        index: the step's index (named in errors).
        ids: int64 ``[n]``, the step's samples (its global batch, in window order).
        lengths: int64, every sample's length (indexed by ``ids``).
        config: the plan config (``strategy`` plays no part: every strategy shares the packing).

    Returns:
        ``(bins, m, bound)``: int64 ``[n]`` micro-batch of each sample (DP rank ``bin // m``, index
        ``bin % m``), the micro-batches per DP rank, and the step's lower bound (:func:`step_lower_bound`).

    Raises:
        PlanError: the samples cannot fill, or do not fit, ``dp x m`` micro-batches.
    """
    dp, cp = config.dp, config.cp
    L = lengths[ids]
    W = config.cost.sample_cost(L)
    m_lo, m_hi = _microbatch_range(index, L, config)
    bound = step_lower_bound(W, L, dp, cp, config.cost)
    if config.packing == "first_fit":
        bins, m = _pack_first_fit(L, W, m_lo, config)
    else:
        bins, m = _pack_balanced(L, W, m_lo, m_hi, bound * cp, config)
    if bins is None:
        raise PlanError(
            f"step {index}: {len(ids)} samples ({int(L.sum())} tokens) do not fit dp={dp} x {m} micro-batches of "
            f"cp*tokens_per_rank={config.group_capacity} tokens with {config.packing!r} packing; raise "
            + option("tokens_per_rank")
            + (f" or {option('microbatches_per_rank')} (0 chooses it)" if config.microbatches_per_rank else "")
        )
    return bins, m, bound


def split_step(
    ids: np.ndarray,
    bins: np.ndarray,
    m: int,
    lengths: np.ndarray,
    config: PlanConfig,
    length_list: list[int],
    bound: float | None,
) -> Step:
    """The CP split stage: the step whose samples ``ids`` sit in micro-batches ``bins``, split by ``config.strategy``.

    ``bins``, ``m`` and ``bound`` as :func:`pack_step` returns them (or any packing of ``ids``
    into ``dp * m`` non-empty micro-batches); ``length_list`` is ``lengths`` as a list (read by
    the per-micro-batch splits only).
    """
    mbs = split_microbatches(_microbatch_groups(ids, bins, config.dp * m), lengths, config, length_list)
    ranks = tuple(tuple(mbs[d * m : (d + 1) * m]) for d in range(config.dp))
    return Step(microbatches=ranks, lower_bound=bound)


def split_microbatches(
    groups: Sequence[Sequence[int]], lengths: np.ndarray, config: PlanConfig, length_list: list[int]
) -> list[MicroBatch]:
    """Every micro-batch of ``groups`` (sample ids, in micro-batch order) split by ``config``: over
    its nodes when the CP group spans several, else by ``config.strategy`` over the group.

    A micro-batch's split depends on its own samples alone, so any grouping of a step's (or
    several steps') micro-batches gives the same splits; ``balanced`` shares its work over the
    group. ``length_list`` is ``lengths`` as a list (read by the per-micro-batch splits only).
    """
    return _split(groups, lengths if config.strategy == "balanced" else length_list, config)


def _microbatch_range(index: int, L: np.ndarray, config: PlanConfig) -> tuple[int, int]:
    """The fewest and most micro-batches per DP rank to try for a step of samples with lengths ``L``.

    Every strategy fits any micro-batch of at most ``cp * tokens_per_rank`` tokens (zigzag falls
    back to its token-even form, see :func:`split_microbatch`), so packing only needs the group
    capacity. Raises :class:`PlanError` when the samples cannot give every micro-batch one.
    """
    dp, capacity, m_fixed = config.dp, config.group_capacity, config.microbatches_per_rank
    n, total = len(L), int(L.sum())
    m_lo = m_fixed or max(1, -(-total // (dp * capacity)))
    m_hi = m_fixed or max(m_lo, n // dp)
    if n < dp * m_lo:
        raise PlanError(
            f"step {index}: {n} samples cannot fill dp={dp} x {m_lo} micro-batches "
            f"({total} tokens, {capacity} tokens per micro-batch); every micro-batch needs a sample: "
            f"use more samples per step ({option('samples_per_step')}), a larger {option('tokens_per_rank')}, "
            f"or fewer micro-batches per rank ({option('microbatches_per_rank')})"
        )
    return m_lo, m_hi


def _pack_first_fit(L: np.ndarray, W: np.ndarray, m_lo: int, config: PlanConfig) -> tuple[np.ndarray | None, int]:
    """``packing="first_fit"``: the bin of every sample (``None`` if they do not fit) and ``m``."""
    dp, capacity = config.dp, config.group_capacity
    bins, m = pack_first_fit(L, dp, m_lo, config.microbatches_per_rank, capacity)
    if bins is None or len(L) < dp * m:
        return None, m
    return fill_empty_bins(PackingProblem(W, L, dp, m, capacity), bins), m


def _price_scenarios(
    L: np.ndarray, W: np.ndarray, lower_bound: float, config: PlanConfig
) -> tuple[list[tuple[np.ndarray, float]], float]:
    """``(sample costs, bound of the heaviest DP rank)`` at every price packing must balance, and
    the best any packing can do relative to those bounds at once.

    Exact prices: the model's, and 1. A pair-price range: its ends and the kinks of the step's
    lower bound between them (:func:`~ringpack.planner.bounds.price_points`: rank costs are linear
    in the price, so a packing within a factor of the bound at these points is within it at every
    price of the range), and :func:`~ringpack.planner.bounds.robust_bound`.
    """
    if config.price_range == (1.0, 1.0):
        return [(W, lower_bound)], 1.0
    profile: PriceProfile = price_profile(L, config.dp, config.cp, config.cost, config.price_range)
    if profile.prices.size == 1:  # prices without pairs: one scenario
        return [(W, lower_bound)], 1.0
    scenarios = []
    for factor, bound in zip(profile.prices.tolist(), profile.bounds.tolist()):
        priced = dataclasses.replace(config.cost, pair=config.cost.pair * factor)
        scenarios.append((priced.sample_cost(L), bound * config.cp))
    return scenarios, profile.robust


#: With several price scenarios and at least :data:`PLATEAU_MIN_SAMPLES` samples in the step, the
#: local search looks at the :data:`PLATEAU_NEIGHBOURS` lightest DP ranks and stops when
#: :data:`PLATEAU_PATIENCE` iterations lowered the highest one by less than this fraction: every
#: rank then sits at the top at one price or another, and lowering them one at a time buys nothing
#: (below that size the full search is cheap).
PLATEAU_PROGRESS = 1e-4
PLATEAU_PATIENCE = 2
PLATEAU_NEIGHBOURS = 4
PLATEAU_MIN_SAMPLES = 512


def _pack(
    problem: PackingProblem,
    lower_bound: float,
    config: PlanConfig,
    fallback: Callable[[], np.ndarray | None] | None = None,
) -> np.ndarray | None:
    """Greedy, local search and (if enabled) CP-SAT: the bin of every sample, ``None`` if they do not fit.

    ``fallback``: called for a feasible packing to search from when greedy packing places no answer.
    """
    if problem.num_bins == 1:  # one CP group for the whole step (a pool): it holds every sample, or none fits
        fits = int(np.sum(problem.tokens)) <= problem.capacity
        return np.zeros(len(problem.tokens), dtype=np.int64) if fits else None
    bins = pack_greedy(problem)
    if bins is None and fallback is not None:
        bins = fallback()
    if bins is None:
        return None
    plateau = {}
    if np.ndim(problem.weights) == 2 and len(problem.tokens) >= PLATEAU_MIN_SAMPLES:
        plateau = {"min_progress": PLATEAU_PROGRESS, "patience": PLATEAU_PATIENCE, "neighbours": PLATEAU_NEIGHBOURS}
    bins = improve(problem, fill_empty_bins(problem, bins), lower_bound, **plateau)
    if config.solver_time_limit_s > 0:
        bins = refine(problem, bins, lower_bound, config.solver_time_limit_s)
    return bins


def _pack_robust(
    L: np.ndarray, m: int, scenarios: list[tuple[np.ndarray, float]], robust: float, config: PlanConfig
) -> tuple[np.ndarray, float] | None:
    """Pack for ``m`` micro-batches per DP rank, balanced in every price scenario at once.

    Each scenario's costs are divided by its bound, so a DP rank's height (its largest load over
    the scenarios) is how far it is from the bound at its worst price; packing minimises the
    largest height, and stops within reach of ``robust``, the best any packing can do. Returns
    ``(bins, height)`` with ``height`` the largest height over ``robust`` (comparable across
    ``m``), or ``None`` when the samples do not fit.
    """
    if len(scenarios) == 1:
        weights, bound = scenarios[0]
        problem = PackingProblem(weights, L, config.dp, m, config.group_capacity)
        bins = _pack(problem, bound, config)
        return None if bins is None else (bins, float(problem.heights(bins).max()) / bound)
    columns = np.column_stack([w / bound for w, bound in scenarios])
    problem = PackingProblem(columns, L, config.dp, m, config.group_capacity)
    bins = _pack(problem, robust, config, lambda: _scenario_start(L, m, scenarios, config))
    return None if bins is None else (bins, float(problem.heights(bins).max()) / robust)


def _scenario_start(
    L: np.ndarray, m: int, scenarios: list[tuple[np.ndarray, float]], config: PlanConfig
) -> np.ndarray | None:
    """A feasible packing for when greedy packing of the joint prices places no answer: greedy
    packing is order-dependent, and the joint weights' order can strand a sample that one price's
    own order places. The first scenario whose greedy packing fits (None if none does)."""
    for weights, _ in scenarios:
        bins = pack_greedy(PackingProblem(weights, L, config.dp, m, config.group_capacity))
        if bins is not None:
            return bins
    return None


def _pack_balanced(
    L: np.ndarray, W: np.ndarray, m_lo: int, m_hi: int, lower_bound: float, config: PlanConfig
) -> tuple[np.ndarray | None, int]:
    """``packing="balanced"`` for ``m = m_lo, ...`` micro-batches per DP rank (:func:`_pack_robust`).

    ``lower_bound``: of the heaviest DP rank's summed weights. With ``microbatches_per_rank=0``,
    one more micro-batch per rank than the fewest that fit is tried only when the token budget
    keeps the step more than :data:`AUTO_MICROBATCH_GAP` above the bound; the better packing is
    kept, each charged the cost model's ``microbatch`` constant per micro-batch (a DP rank's load
    is ``cp`` times its ranks' time, so the charge is ``m * cp * microbatch``). Returns the bin of
    every sample (``None`` if no ``m`` fits) and ``m``.
    """
    scenarios, robust = _price_scenarios(L, W, lower_bound, config)
    m_fixed = config.microbatches_per_rank
    best = None  # (height over the bound, m, bins)
    first_ok = m_lo
    for m in range(m_lo, m_hi + 1):
        packed = _pack_robust(L, m, scenarios, robust, config)
        if packed is None:
            if best is not None:
                break
            continue
        bins, top = packed
        charged = top + (m * config.cp * config.cost.microbatch / lower_bound if lower_bound > 0 else 0.0)
        if best is None:
            first_ok = m
        if best is None or charged < best[0] * (1 - 1e-9):
            best = (charged, m, bins)
        if m_fixed or top <= 1 + AUTO_MICROBATCH_GAP or m > first_ok:
            break
    if best is None:
        return None, m_hi
    return best[2], best[1]


def _microbatch_groups(ids: np.ndarray, bins: np.ndarray, num_bins: int) -> list[list[int]]:
    """The samples ``ids`` of each bin; a micro-batch's samples keep their (shuffled) window order."""
    order = np.argsort(bins, kind="stable")
    edges = np.searchsorted(bins[order], np.arange(num_bins + 1)).tolist()
    ids_sorted = ids[order].tolist()
    groups = [ids_sorted[edges[b] : edges[b + 1]] for b in range(num_bins)]
    assert all(groups), "empty micro-batch"
    return groups


@dataclasses.dataclass(frozen=True)
class GlobalBatches:
    """The documents of an epoch and the ids of every global batch, exactly as :func:`make_plan` cuts them.

    Attributes:
        lengths: int64 ``[N]``, the documents' lengths (input samples after ``config.overflow``).
        windows: one int64 array of document ids per step, in shuffled order; dropped documents
            are in none.
        dropped: ids of documents longer than a CP group that ``overflow="drop"`` leaves out.
        origins: ``(input sample, offset)`` of every document when ``overflow="split"`` cut some.

    With ``config.batch_window`` set, ``windows`` is a
    :class:`~ringpack.planner.batch_window.BalancedWindows`: the shuffle's batches with costly
    samples gathered inside blocks of ``batch_window + 1``, each block computed on first use.
    """

    lengths: np.ndarray
    windows: Sequence[np.ndarray]
    dropped: tuple[int, ...]
    origins: tuple[tuple[int, int], ...]

    def moves(self) -> WindowMoves | None:
        """What ``config.batch_window`` moved (:meth:`BalancedWindows.moves`: computes every block),
        ``None`` without a window."""
        return self.windows.moves() if isinstance(self.windows, BalancedWindows) else None


def global_batches(lengths: Any, config: PlanConfig) -> GlobalBatches:
    """The documents and global batches :func:`make_plan` plans for ``(lengths, config)``.

    Args:
        lengths: tokens of every sample, a 1-D integer sequence or array, each >= 1.
        config: the plan config (its overflow rule, ``samples_per_step``, seed and epoch matter).

    Returns:
        :class:`GlobalBatches`.

    Raises:
        PlanError: as :func:`make_plan` for bad lengths, ``overflow="error"`` or nothing left.
    """
    docs, dropped, origins = _apply_overflow(as_lengths(lengths), config)
    keep = np.ones(len(docs), dtype=bool)
    keep[list(dropped)] = False
    order = shuffle_order(len(docs), config.seed, config.epoch)
    order = order[keep[order]]
    if order.size == 0:
        raise PlanError(
            f"no samples left to plan: all {len(docs)} are longer than {config.group_capacity} tokens and were dropped"
        )
    min_samples = config.dp * max(config.microbatches_per_rank, 1)
    _warn_one_step(order.size, config)
    windows: Sequence[np.ndarray] = _windows(order, config.samples_per_step, min_samples)
    if config.batch_window:
        windows = BalancedWindows(windows, docs, config)
    return GlobalBatches(docs, windows, dropped, origins)


#: More samples than this per DP rank in the single step of ``samples_per_step=0`` is called out:
#: a whole epoch as one optimizer step is almost never what a training run means.
ONE_STEP_SAMPLES_PER_RANK = 1024


def _warn_one_step(num_samples: int, config: PlanConfig) -> None:
    if config.samples_per_step == 0 and num_samples > ONE_STEP_SAMPLES_PER_RANK * config.dp:
        log.warning(
            "%s puts all %s samples into one optimizer step (one global batch for the epoch); set %s "
            "to the global batch in samples",
            option("samples_per_step", 0),
            f"{num_samples:,}",
            option("samples_per_step"),
        )


def plan_step(batches: GlobalBatches, index: int, config: PlanConfig, length_list: list[int] | None = None) -> Step:
    """Step ``index`` of the plan of ``batches`` (:func:`global_batches` of the lengths and ``config``).

    The same step :func:`make_plan` plans as ``steps[index]``: steps depend on each other only
    through the global batches, so any step can be planned alone (and with another cost model:
    ``config.cost`` may differ from the one ``batches`` were cut with; nothing else may).
    ``length_list`` is ``batches.lengths.tolist()``, when the caller keeps it for many steps.

    Raises:
        PlanError: as :func:`make_plan` for this step's global batch.
        IndexError: ``index`` outside the steps.
    """
    ids = batches.windows[index]
    if length_list is None:  # only the per-micro-batch splits read it
        length_list = [] if config.strategy == "balanced" else batches.lengths.tolist()
    return _plan_step(index, ids, batches.lengths, config, length_list)


def make_plan(lengths: Any, config: PlanConfig, *, progress: Callable[[int, int], None] | None = None) -> Plan:
    """Plan ``lengths`` (one per sample) for ``config``; docs/planner.md gives the rules.

    Args:
        lengths: tokens of every sample, a 1-D integer sequence or array, each >= 1.
        config: parallelism, token budget, cost model, strategies, seed and epoch.
        progress: called after every step with ``(steps planned, steps in the plan)``
            (e.g. :meth:`ringpack.progress.Progress.advance_to`).

    Returns:
        The plan, valid by construction (``Plan.validate()`` checks every invariant): one
        :class:`Step` per global batch; the same on every rank for the
        same ``(lengths, config)``.

    Raises:
        PlanError: invalid or empty ``lengths``; a sample longer than one CP group holds with
            ``overflow="error"``; no sample left after dropping; a global batch whose samples
            cannot fill, or do not fit, its ``dp x m`` micro-batches; ``overflow="split"`` cutting
            samples into more documents than :func:`split_document_limit` allows; a ``config``
            that is not a PlanConfig, a ``progress`` that is not callable; a balanced split over
            more CP ranks in one node than :data:`~ringpack.planner.limits.MAX_BALANCED_CP`.
    """
    if not isinstance(config, PlanConfig):
        raise PlanError(f"config must be a PlanConfig, got {type(config).__name__}")
    if progress is not None and not callable(progress):
        raise PlanError(f"progress must be None or a callable, got {type(progress).__name__}")
    check_split_size(config)
    batches = global_batches(lengths, config)
    lengths, windows = batches.lengths, batches.windows
    length_list = lengths.tolist()
    steps = []
    for s, ids in enumerate(windows):
        steps.append(_plan_step(s, ids, lengths, config, length_list))
        if progress is not None:
            progress(s + 1, len(windows))
    return Plan(
        config=config, lengths=tuple(length_list), steps=tuple(steps), dropped=batches.dropped, origins=batches.origins
    )


def overflow_documents(lengths: np.ndarray, config: PlanConfig) -> np.ndarray:
    """The documents a plan of ``config`` trains: ``lengths`` (int64 ``[N]``, each >= 1) after
    ``config.overflow`` on samples longer than one CP group holds (``"split"``: cut by
    :func:`expand_overflow`; ``"drop"``: left out).

    Raises:
        PlanError: ``overflow="error"`` and a sample too long, naming the first.
    """
    docs, dropped, _ = _apply_overflow(lengths, config)
    return np.delete(docs, dropped) if dropped else docs


def _apply_overflow(
    lengths: np.ndarray, config: PlanConfig
) -> tuple[np.ndarray, tuple[int, ...], tuple[tuple[int, int], ...]]:
    """``config.overflow`` on samples longer than one CP group holds: ``(lengths, dropped, origins)``.

    ``"error"`` raises :class:`PlanError` naming the first; ``"drop"`` lists them in ``dropped``;
    ``"split"`` returns the documents' lengths (:func:`expand_overflow`) and each document's
    ``(sample, offset)`` in ``origins``.
    """
    capacity = config.group_capacity
    too_long = np.flatnonzero(lengths > capacity)
    if not too_long.size:
        return lengths, (), ()
    if config.overflow == "error":
        first = int(too_long[0])
        raise PlanError(
            f"sample {first} has {int(lengths[first])} tokens, more than one CP group holds "
            f"(cp={config.cp} x tokens_per_rank={config.tokens_per_rank} = {capacity}); "
            f"{too_long.size} sample(s) too long. Raise {option('tokens_per_rank')} or {option('cp')}, or use "
            f"{option('overflow', 'drop')} or {option('overflow', 'split')}"
        )
    if config.overflow == "drop":
        return lengths, tuple(int(x) for x in too_long), ()
    lengths, doc_sample, doc_offset = expand_overflow(lengths, capacity)
    return lengths, (), tuple(zip(doc_sample.tolist(), doc_offset.tolist()))
