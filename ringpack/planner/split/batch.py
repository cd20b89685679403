"""The balanced split of many micro-batches at once: their problems built together with numpy, and
the flat tables the lockstep best fit runs on.

Why together: a step of the planner splits hundreds of micro-batches of a few dozen samples each;
computing every sample's cost and every micro-batch's placement order in one array operation,
instead of one per micro-batch, removes most of the per-micro-batch overhead. The per-slot lists
of each :class:`~ringpack.planner.split.problem.SplitProblem` are slices of the same flat arrays,
so the problems are exactly those of one micro-batch alone.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ringpack.planner.split.problem import SplitProblem
from ringpack.ranges import cumsum0

if TYPE_CHECKING:
    from ringpack.cost import CostModel

__all__ = ["ProblemBatch", "PlacementTable"]


@dataclass(frozen=True)
class PlacementTable:
    """What best fit places in every micro-batch, as flat arrays (micro-batch after micro-batch).

    Attributes:
        costs: ``float64[N]``, each item's cost, in slot order within each micro-batch.
        tokens: ``int64[N]``, each item's tokens, in the same order.
        order: ``int64[N]``, indices into ``costs``/``tokens``: micro-batch after micro-batch, each
            one's items most expensive first (ties by slot).
        group: ``int64[N]``, the micro-batch of each entry (sorted).
        starts: ``int64[G + 1]``, where each micro-batch's entries start.
        counts: ``int64[G]``, how many of each micro-batch's items (in ``order``) to place; the
            rest have nothing left to place.
    """

    costs: np.ndarray
    tokens: np.ndarray
    order: np.ndarray
    group: np.ndarray
    starts: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class ProblemBatch:
    """The split problems of many micro-batches and their samples as flat arrays.

    Attributes:
        problems: one :class:`SplitProblem` per micro-batch, in order.
        totals: each micro-batch's tokens.
        caps: ``float64[G]``, each problem's cost room per rank.
        budgets: ``int64[G]``, each problem's token room per rank.
        whole: the samples as a :class:`PlacementTable` (every sample whole, all to place).
        slot: ``int64[N]``, each entry's position in its micro-batch.
    """

    problems: list[SplitProblem]
    totals: list[int]
    caps: np.ndarray
    budgets: np.ndarray
    whole: PlacementTable
    slot: np.ndarray

    @classmethod
    def build(
        cls,
        groups: Sequence[Sequence[int]],
        lengths: Sequence[int],
        cp: int,
        tokens_per_rank: int,
        cost: CostModel,
        tolerance: float,
        token_slack: float | None,
    ) -> ProblemBatch:
        """The problems of splitting each of ``groups`` (sample ids into ``lengths``) over ``cp`` ranks.

        Each micro-batch's token room is ``tokens_per_rank``, tightened to ``ceil(total / cp * (1 +
        token_slack))`` when ``token_slack`` is given. Raises ``ValueError`` when a micro-batch holds
        more than ``cp * tokens_per_rank`` tokens.
        """
        G = len(groups)
        sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=G)
        starts = cumsum0(sizes)
        bounds = starts.tolist()
        lens_of, flat = _gather_lengths(groups, lengths, bounds)
        totals = [sum(lens) for lens in lens_of]
        for total in totals:
            if total > cp * tokens_per_rank:
                raise ValueError(
                    f"micro-batch holds {total} tokens, more than cp*tokens_per_rank={cp * tokens_per_rank}"
                )
        if token_slack is None:
            budgets = [int(tokens_per_rank)] * G
        else:
            budgets = [min(tokens_per_rank, math.ceil(total / cp * (1.0 + token_slack))) for total in totals]
        a, b, seg = float(cost.token), float(cost.pair), float(cost.segment)
        # the same operations, in the same order, as a*l + b*0.5*l*(l+1) + seg on Python numbers
        W = a * flat + b * 0.5 * flat * (flat + 1) + seg
        gid = np.repeat(np.arange(G, dtype=np.int64), sizes)
        slot = np.arange(len(flat), dtype=np.int64) - starts[gid]
        ordered = np.lexsort((slot, -W, gid))  # most expensive first, ties by slot
        w_all, ord_slot = W.tolist(), slot[ordered].tolist()
        problems = [
            SplitProblem(
                lens_of[g],
                w_all[bounds[g] : bounds[g + 1]],
                ord_slot[bounds[g] : bounds[g + 1]],
                cp,
                budgets[g],
                a,
                b,
                seg,
                tolerance,
            )
            for g in range(G)
        ]
        caps = np.array([p.cap for p in problems], dtype=np.float64)
        whole = PlacementTable(W, flat, ordered, gid, starts, sizes)
        return cls(problems, totals, caps, np.array(budgets, dtype=np.int64), whole, slot)


def _gather_lengths(
    groups: Sequence[Sequence[int]], lengths: Sequence[int], bounds: list[int]
) -> tuple[list[list[int]], np.ndarray]:
    """Each group's sample lengths as a list, and all of them as one ``int64`` array."""
    N = bounds[-1]
    if isinstance(lengths, np.ndarray):
        ids = np.fromiter(itertools.chain.from_iterable(groups), dtype=np.int64, count=N)
        flat = lengths[ids].astype(np.int64, copy=False)
        flat_list = flat.tolist()
        return [flat_list[bounds[g] : bounds[g + 1]] for g in range(len(groups))], flat
    lens_of = [[int(lengths[x]) for x in samples] for samples in groups]
    return lens_of, np.fromiter(itertools.chain.from_iterable(lens_of), dtype=np.int64, count=N)
