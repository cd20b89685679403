"""What every peer system gives the report: :class:`PeerSystem`, and its measured and timed rows.

See docs/analysis.md, "Peers".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ringpack.comm_model import CommModel
from ringpack.shard_plan import PlanConfig

__all__ = ["Peer", "PeerPart", "PeerSystem"]


@dataclass
class PeerPart:
    """A peer measured on (a chunk of) an epoch, before any communication model.

    ``metrics`` is what the peer's :meth:`PeerSystem.timed` reads (a plan's
    :class:`~ringpack.analysis.metrics.PlanMetrics`, or a schedule of the peer's own);
    ``bounds`` the steps' lower bounds (``None`` where a step has none).
    """

    name: str
    metrics: Any
    bounds: list[float | None]
    config: dict[str, Any]
    plan_hash: str | None = None


@dataclass
class Peer:
    """One peer's report row: its name, what it is, and its figures (``result.summary()``, ``result.step_rows()``)."""

    name: str
    description: str
    result: Any


class PeerSystem(Protocol):
    """Another system run on ringpack's data: one module of :mod:`ringpack.analysis.peers` each.

    Every method sees the documents and global batches ringpack's plans see, with the same cost
    model; a peer that cannot plan the data raises :class:`~ringpack.errors.PlanError`.
    """

    #: the name ``--peers`` takes and the report's rows carry
    name: str
    #: what it is and how it is measured, printed under the report's table
    description: str

    def measure(self, lengths: Any, config: PlanConfig) -> PeerPart:
        """Plan or schedule ``lengths`` on ``config``'s mesh, budget, cost model and global batches."""
        ...

    def join(self, parts: Sequence[PeerPart]) -> Any:
        """The ``metrics`` of consecutive chunks' parts as one (steps in chunk order)."""
        ...

    def timed(self, part: PeerPart, comm: CommModel) -> Any:
        """The report row's figures of a measured part under ``comm``."""
        ...
