"""``mode="auto"``: each micro-batch's attention mode, chosen when its schedule is compiled.

:class:`ModeChoice` prices every candidate mode on the micro-batch with the cost and communication
models (:func:`~ringpack.comm_model.fastest_modes`: the slowest rank's predicted seconds) and picks
the fastest; :func:`~ringpack.attention.compile_schedule` stores the pick in ``Schedule.mode``, which
:func:`~ringpack.attention.ring_attention` runs (``"p2p"`` as the ring on a micro-batch over the
partner budget). Every rank of a CP group compiles the same
micro-batch with the same options, so every rank picks the same mode (the group check compares it).
See docs/attention.md, "Choosing the mode per micro-batch".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from ringpack.comm_model import MODES, CommModel, fastest_modes
from ringpack.cost import CostModel
from ringpack.errors import PlanError
from ringpack.shard_plan import MicroBatch
from ringpack.traffic import microbatch_over_budget

__all__ = ["AUTO", "ModeChoice", "resolve_mode"]


def _default_cost() -> CostModel:
    return CostModel.preset("llama3-8b")


@dataclass(frozen=True, kw_only=True)
class ModeChoice:
    """What ``mode="auto"`` chooses from, and the models that price each candidate per micro-batch.

    Raises:
        PlanError: ``modes`` empty or naming an unknown mode, or models of the wrong types.
    """

    modes: tuple[str, ...] = MODES
    """The modes it may pick; a micro-batch gets the fastest that can run its CP group (the
    head-parallel ones need query heads that are a multiple of their all-to-all's ranks)."""
    cost: CostModel = field(default_factory=_default_cost)
    """The compute prices (the plan's cost model)."""
    comm: CommModel = field(default_factory=CommModel)
    """The links and the model's heads (:meth:`CommModel.for_model`); its ``mode`` is not read and its
    ``gpus_per_node`` gives way to the schedule's."""

    def __post_init__(self) -> None:
        modes = (self.modes,) if isinstance(self.modes, str) else tuple(self.modes)
        unknown = [m for m in modes if m not in MODES]
        if unknown or not modes:
            raise PlanError(f"ModeChoice.modes must be some of {MODES}, got {list(modes)!r}")
        object.__setattr__(self, "modes", modes)
        if not isinstance(self.cost, CostModel):
            raise PlanError(f"ModeChoice.cost must be a CostModel, got {type(self.cost).__name__}")
        if not isinstance(self.comm, CommModel):
            raise PlanError(f"ModeChoice.comm must be a CommModel, got {type(self.comm).__name__}")

    def pick(self, microbatch: MicroBatch, gpus_per_node: int | None = None, max_partners: int = 0) -> str:
        """The fastest of :attr:`modes` for ``microbatch`` over nodes of ``gpus_per_node`` CP ranks
        (``"p2p"`` timed as the ring where its exchange exceeds the partner budget ``max_partners``,
        as it then runs: the decision remembered on the micro-batch, the planner's where it planned it,
        :func:`~ringpack.traffic.microbatch_over_budget`).

        Raises:
            PlanError: no candidate can run the micro-batch's CP size (each mode's reason named).
        """
        cp = len(microbatch.shards)
        comm = dataclasses.replace(self.comm, gpus_per_node=gpus_per_node, max_partners=max_partners)
        ranks, sample, start, stop = microbatch.piece_columns
        zeros = np.zeros_like(ranks)
        table = {"step": zeros, "dp": zeros, "microbatch": zeros, "cp": ranks, "sample": sample}
        table.update(start=start, stop=stop)
        over = microbatch_over_budget(microbatch, gpus_per_node, max_partners)  # decided once per micro-batch
        try:
            best = fastest_modes(table, cp, (1, 1, 1), self.cost, comm, self.modes, np.full((1, 1, 1), over))
        except ValueError as exc:
            raise PlanError(f"mode='auto': {exc}") from exc
        return self.modes[int(best.reshape(-1)[0])]


#: ``mode="auto"``: run each schedule's own mode (``Schedule.mode``).
AUTO = "auto"


def resolve_mode(mode: str, schedule) -> str:
    """The mode a call runs: ``mode`` itself, or for :data:`AUTO` the schedule's pick (``AUTO`` again
    when it has none, which the group check then refuses on every rank); ``"p2p"`` on a schedule over
    its partner budget (``schedule.partner_fallback``) runs ``"ring"``."""
    if mode == AUTO and schedule.mode is not None:
        mode = schedule.mode
    return "ring" if mode == "p2p" and getattr(schedule, "partner_fallback", False) else mode
