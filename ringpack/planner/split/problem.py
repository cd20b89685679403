"""The balanced CP split's working objects: one micro-batch's problem and the CP ranks being filled.

* :class:`SplitProblem`: the micro-batch's samples (lengths, costs, placement order), the CP
  degree, every rank's cost and token room, the cost coefficients and the tolerances; read by
  every step of the split, changed by none.
* :class:`Items`: what is left to place of each sample, a prefix ``[0, stop)`` with its cost
  (every sample whole, :attr:`SplitProblem.whole_samples`, or what precedes carved last pieces).
* :class:`RankFill` (mutable): each rank's cost and token room left and its pieces.

Plain lists and floats, indexed by slot, because the inner loops run once per sample or piece and
numpy scalars cost far more there; slotted, not frozen, dataclasses because a planner step builds
them for hundreds of micro-batches (:class:`SplitProblem` and :class:`Items` are still never
assigned to after creation).

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Slice", "Items", "SplitProblem", "RankFill"]

#: ``(slot, start, stop)``: tokens ``[start, stop)`` of the sample at position ``slot`` of the micro-batch.
Slice = tuple[int, int, int]


@dataclass(slots=True)
class Items:
    """Sample prefixes to place: tokens ``[0, stops[k])`` of slot ``k``, costing ``costs[k]``.

    Attributes:
        stops: tokens left to place of each slot (0: nothing left).
        costs: cost of each slot's prefix as one piece.
        order: the slots to place, most expensive first (ties by slot); slots with nothing left
            are not listed.
    """

    stops: list[int]
    costs: list[float]
    order: list[int]


@dataclass(slots=True)
class SplitProblem:
    """One micro-batch to split over ``cp`` ranks by cost (the last three fields are derived).

    Attributes:
        lens: tokens of each slot (its sample's length).
        costs: cost of each slot's sample as one piece: ``token*len + pair*len*(len+1)/2 + segment``.
        order: all slots, most expensive first (ties by slot).
        cp: CP ranks.
        tokens_per_rank: token room of every rank (the budget, tightened by the token slack).
        token, pair, segment: the cost model's coefficients: per token, per causal pair, per piece.
        tolerance: the fraction of the ideal a rank's cost may exceed it by before a sample that
            could stay whole is split instead.
        ideal: ``sum(costs) / cp``, every rank's cost in a perfect split.
        cap: ``ideal * (1 + tolerance)``, every rank's cost room.
        accept: ``ideal * (1 + 2 * tolerance)``: a split whose largest rank cost is within it is
            kept without trying others.
    """

    lens: list[int]
    costs: list[float]
    order: list[int]
    cp: int
    tokens_per_rank: int
    token: float
    pair: float
    segment: float
    tolerance: float
    ideal: float = field(init=False)
    cap: float = field(init=False)
    accept: float = field(init=False)

    def __post_init__(self) -> None:
        self.ideal = sum(self.costs) / self.cp  # Python's left-to-right float sum
        self.cap = self.ideal * (1.0 + self.tolerance)
        self.accept = self.ideal * (1.0 + 2.0 * self.tolerance)

    @property
    def whole_samples(self) -> Items:
        """Every sample whole, most expensive first."""
        return Items(self.lens, self.costs, self.order)


@dataclass(slots=True)
class RankFill:
    """The CP ranks while a micro-batch is split over them; the split's steps update it in place.

    Attributes:
        cap: every rank's cost room when empty (:attr:`SplitProblem.cap`).
        room: cost room left on each rank.
        token_room: tokens each rank can still take.
        shards: the pieces each rank holds, as :data:`Slice` triples.
    """

    cap: float
    room: list[float]
    token_room: list[int]
    shards: list[list[Slice]]

    @classmethod
    def empty(cls, problem: SplitProblem) -> RankFill:
        """``problem.cp`` ranks holding nothing."""
        cp = problem.cp
        return cls(problem.cap, [problem.cap] * cp, [int(problem.tokens_per_rank)] * cp, [[] for _ in range(cp)])

    def max_cost(self) -> float:
        """The largest rank cost: the micro-batch's cost."""
        return self.cap - min(self.room)
