"""The cost-balanced CP split (``strategy="balanced"``): short samples stay whole, only samples
that must be split are split, and each rank's cost comes within a tolerance of the mean.

:func:`split_balanced` splits one micro-batch; :func:`split_balanced_many` splits many with the
same result, sharing the work (the planner's path). This module holds the tolerances and the flow
of one micro-batch through the split's parts, each in a module of its own:

* :mod:`~ringpack.planner.split.problem`: the problem and the ranks being filled;
* :mod:`~ringpack.planner.split.batch`: the problems of many micro-batches, built together;
* :mod:`~ringpack.planner.split.last_pieces`: carving, samples too big for any rank give their
  last pieces ranks of their own;
* :mod:`~ringpack.planner.split.best_fit`: samples placed whole by best fit;
* :mod:`~ringpack.planner.split.suffix_cuts`: the samples that fit whole nowhere cut from the back;
* :mod:`~ringpack.planner.split.fallbacks`: other splits for tight token budgets.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ringpack.planner.split.batch import ProblemBatch
from ringpack.planner.split.best_fit import best_fit, best_fit_lockstep, fill_from_lockstep
from ringpack.planner.split.fallbacks import retry_with_fallbacks
from ringpack.planner.split.last_pieces import Carving, carve_batch
from ringpack.planner.split.pieces import microbatch_from_slots
from ringpack.planner.split.problem import RankFill, Slice, SplitProblem
from ringpack.planner.split.suffix_cuts import choose_suffix_cuts, cut_suffixes
from ringpack.shard_plan import MicroBatch

if TYPE_CHECKING:
    from ringpack.cost import CostModel

__all__ = [
    "split_balanced",
    "split_balanced_many",
    "CP_BALANCE_TOLERANCE",
    "LOCKSTEP_MIN_GROUPS",
]


#: A rank may exceed the ideal cost ``sum(costs) / cp`` of its micro-batch by this fraction before
#: a sample that would otherwise stay whole is split instead. Splitting trades K/V traffic for
#: balance; 0.1% of imbalance is far below run-to-run noise and saves most splits.
CP_BALANCE_TOLERANCE = 1e-3


#: From this many micro-batches on, :func:`split_balanced_many` runs the best fit of all of them
#: in lockstep with numpy (one array operation per sample position instead of per sample).
LOCKSTEP_MIN_GROUPS = 8


def split_balanced(
    samples: Sequence[int],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    tolerance: float = CP_BALANCE_TOLERANCE,
    token_slack: float | None = None,
) -> MicroBatch:
    """Cost-balanced CP split: short samples stay whole, only samples that must be split are split.

    1. Every CP rank gets a cost room of ``(1 + tolerance) * sum(sample costs) / cp`` and a token
       room of ``tokens_per_rank``, tightened to ``(1 + token_slack)`` times the mean tokens per
       rank when ``token_slack`` is given (``PlanConfig.token_slack`` says when it pays; ``None`` leaves
       tokens free for the cost model to trade).
    2. Carving: samples that fit whole on no rank, most expensive first, each put their longest
       suffix an untouched rank holds on a rank of its own: the K/V a split sample sends is
       everything before its last piece, least when that piece fills a rank.
    3. Best fit: samples (and what is left of the carved ones), most expensive first, go *whole*
       to the rank with the smallest cost room that still holds them, so ranks fill one at a time
       and the room left is in few ranks, in large blocks. A placement is refused if it would
       leave a rank unable to reach its cost with the tokens it has left (no token costs more
       than the last one of the longest sample).
    4. Suffix cuts: samples that fit whole nowhere are cut from the back: the densest remaining
       suffix goes to the rank needing the densest content (highest cost room per free token), as
       long a suffix as fits there, and so on. If carving left some rank unable to reach its cost
       (the tokens left for it too cheap), the micro-batch is planned again without carving, and
       the cuts are tried both by density and with each sample's last piece on the rank where it
       is longest; the balanced one sending less K/V is kept.

    When tokens are tight (little free token room), best fit can leave ranks that cannot be
    balanced; the split is then retried with the costliest samples zigzagged first, then with
    whole short samples around deficit-driven zigzag of the long ones, and
    :func:`~ringpack.planner.split.baselines.split_zigzag_even` (every sample zigzagged, tokens
    even to one) is the last resort (:mod:`~ringpack.planner.split.fallbacks`). The first
    candidate within ``2 * tolerance`` of the ideal wins, else the one with the lowest max rank
    cost (earlier candidates, which split less, win ties within ``tolerance``). The token room is
    never exceeded, so every micro-batch of at most ``cp * tokens_per_rank`` tokens gets a valid
    split.

    Args:
        samples: the micro-batch's sample ids, in micro-batch order.
        lengths: tokens of every sample, indexed by id (a sequence or a 1-D integer array).
        cp: CP ranks, >= 1.
        tokens_per_rank: token budget of every rank.
        cost: the cost model the ranks are balanced by.
        tolerance: see :data:`CP_BALANCE_TOLERANCE`.
        token_slack: hold every rank within ``1 + token_slack`` of the mean tokens (>= 0), or ``None``
            for tokens free (``PlanConfig.token_slack`` and ``ROBUST_TOKEN_SLACK`` say when it pays).

    Returns:
        The micro-batch with one shard per CP rank.

    Raises:
        ValueError: the samples hold more than ``cp * tokens_per_rank`` tokens.
    """
    return split_balanced_many([samples], lengths, cp, tokens_per_rank, cost, tolerance, token_slack)[0]


def split_balanced_many(
    groups: Sequence[Sequence[int]],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    tolerance: float = CP_BALANCE_TOLERANCE,
    token_slack: float | None = None,
    lockstep: bool | None = None,
) -> list[MicroBatch]:
    """:func:`split_balanced` of every micro-batch in ``groups`` (lists of sample ids), in order.

    The result is the same as one :func:`split_balanced` call per group; only the work is shared.
    Sample costs and orders are computed for all groups at once
    (:class:`~ringpack.planner.split.batch.ProblemBatch`), and the best fit, which runs once per
    sample in each group, runs in lockstep over the groups: the ``i``-th costliest sample of
    every group is placed by one vectorised best fit over a (group, rank) table of rooms.
    ``lockstep=None`` does so from :data:`LOCKSTEP_MIN_GROUPS` groups on (the per-group loop is
    faster for a few); ``True``/``False`` force either path (the tests check that both give the
    same pieces). Suffix cuts and the fallbacks run per group.

    Raises:
        ValueError: a group holds more than ``cp * tokens_per_rank`` tokens.
    """
    if len(groups) == 0:
        return []
    batch = ProblemBatch.build(groups, lengths, cp, tokens_per_rank, cost, tolerance, token_slack)
    if cp == 1:
        return [
            microbatch_from_slots(samples, [[(k, 0, n) for k, n in enumerate(problem.lens)]], lengths, total)
            for samples, problem, total in zip(groups, batch.problems, batch.totals)
        ]
    carvings, table = carve_batch(batch)
    if lockstep is None:
        lockstep = len(groups) >= LOCKSTEP_MIN_GROUPS
    placed = whole = None
    if lockstep and int(batch.whole.counts.min()) > 0:
        placed = best_fit_lockstep(batch, table, [None if c is None else c.fill for c in carvings])
        if any(c is not None for c in carvings):  # for micro-batches planned again without carving
            whole = placed if table is batch.whole else best_fit_lockstep(batch, batch.whole, [None] * len(groups))
    out = []
    for g, samples in enumerate(groups):
        # one group at a time: its temporary pieces are freed before the next group's
        carving, carvings[g] = carvings[g], None
        placement = uncarved = None
        if placed is not None:
            placement, placed[g] = placed[g], None
        if whole is not None and carving is not None:
            uncarved, whole[g] = whole[g], None
        shards = _split_one(batch.problems[g], carving, placement, uncarved)
        out.append(microbatch_from_slots(samples, shards, lengths, batch.totals[g]))
    return out


def _split_one(
    problem: SplitProblem,
    carving: Carving | None,
    placement: tuple[list[float], list[int], list[int]] | None,
    uncarved: tuple[list[float], list[int], list[int]] | None = None,
) -> list[list[Slice]]:
    """The shards of one micro-batch: carving (if any), best fit, suffix cuts, fallbacks.

    ``placement``: the micro-batch's lockstep best fit, ``None`` to run best fit here;
    ``uncarved``: its lockstep best fit of the whole samples, for planning it again without
    carving (``None``: run that best fit here).
    """
    items = problem.whole_samples if carving is None else carving.items
    if placement is not None:
        shards = [[] for _ in range(problem.cp)] if carving is None else carving.fill.shards
        fill, leftovers = fill_from_lockstep(problem, items, placement, shards)
    else:
        fill = RankFill.empty(problem) if carving is None else carving.fill
        leftovers = best_fit(problem, items, fill)
    if carving is not None:
        # suffix cuts by density; when that leaves a rank unbalanced (the tokens left for it too
        # cheap to reach its cost), the micro-batch is planned again without carving
        cut_suffixes(problem, fill, leftovers, items.stops)
        if fill.max_cost() <= problem.accept:
            return fill.shards
        if uncarved is not None:
            fill, leftovers = fill_from_lockstep(
                problem, problem.whole_samples, uncarved, [[] for _ in range(problem.cp)]
            )
        else:
            fill = RankFill.empty(problem)
            leftovers = best_fit(problem, problem.whole_samples, fill)
    best = choose_suffix_cuts(problem, fill, leftovers)
    if best[0] > problem.accept:
        best = retry_with_fallbacks(problem, best)
    return best[1]
