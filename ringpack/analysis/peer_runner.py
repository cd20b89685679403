"""The peers a report compares ringpack with, run on the same data (docs/analysis.md, "Peers").

Both peers see the documents and global batches ringpack's plans see
(:func:`~ringpack.planner.epoch.global_batches`), with the same cost and communication models:

* ``wlb``: WLB-LLM's packing with per-document zigzag sharding, a real plan
  (:mod:`ringpack.planner.wlb`), measured exactly as ringpack's plans are;
* ``megatron-dcp``: Megatron-Core's dynamic CP, modelled (:mod:`ringpack.analysis.dynamic_cp`).

:func:`measure_peer` runs one on (a chunk of) an epoch, :func:`join_peer_parts` joins the chunks
``simulate`` runs apart, :func:`time_peer` gives its report row under a communication model, and
:func:`peer_rows` does all three for ``report``. A peer that cannot plan the data is left out of
the report with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringpack.analysis.dynamic_cp import DCP, DynamicCPSchedule, concat_schedules, dcp_schedule, timed_schedule
from ringpack.analysis.metrics import concat_metrics
from ringpack.analysis.packed import PackedSteps, evaluate_packed
from ringpack.analysis.report import timed
from ringpack.comm_model import CommModel
from ringpack.errors import PlanError
from ringpack.planner.wlb import WLBConfig, wlb_packing
from ringpack.shard_plan import PlanConfig

__all__ = [
    "WLB",
    "PEERS",
    "PEER_DESCRIPTIONS",
    "PeerPart",
    "PeerJob",
    "Peer",
    "parse_peers",
    "measure_peer",
    "try_measure_peer",
    "join_peer_parts",
    "time_peer",
    "peer_rows",
]

logger = logging.getLogger(__name__)

WLB = "wlb"
#: The peers ``ringpack report`` and ``ringpack simulate`` can add, in report order.
PEERS: tuple[str, ...] = (DCP, WLB)
PEER_DESCRIPTIONS: dict[str, str] = {
    DCP: "Megatron-Core dynamic context parallelism, modelled (optimistic for it): each sample on a CP sub-group of "
    "ceil_pow2(L / tokens_per_rank) GPUs of the DP x CP pool, split zigzag inside it, sub-groups placed LPT onto "
    "aligned GPU blocks (step = latest GPU). Each step holds the documents of ringpack's; no gap (the lower bound "
    "assumes fixed CP groups)",
    WLB: "WLB-LLM, a real plan: workload-aware packing (least-workload micro-batch, longest document first), "
    "per-document zigzag, and outlier delay queues that move long documents into later global batches. So its "
    "steps hold other documents than ringpack's, which trains each global batch as drawn (without --batch-window): "
    "its step figures (imbal, gap) are not the same work per step, while epoch time and tok/s cover the same "
    "documents in another order. Its gap is against the lower bound of the documents it put in each step",
}


@dataclass
class PeerPart:
    """A peer measured on (a chunk of) an epoch, before any communication model.

    ``metrics`` is a :class:`~ringpack.analysis.metrics.PlanMetrics` (``wlb``: a real plan, with
    ``bounds`` its steps' lower bounds) or a :class:`DynamicCPSchedule` (``megatron-dcp``).
    """

    name: str
    metrics: Any
    bounds: list[float | None]
    config: dict[str, Any]
    plan_hash: str | None = None


@dataclass(frozen=True)
class PeerJob:
    """What a worker needs to measure peer ``name`` on a chunk of lengths (simulate's tasks)."""

    name: str
    config: PlanConfig


@dataclass
class Peer:
    """One peer's report row: its name, what it is, and its figures (``result.summary()``, ``result.step_rows()``)."""

    name: str
    description: str
    result: Any  # report.StrategyResult (wlb) or ScheduleResult (megatron-dcp)


def parse_peers(text: str) -> list[str]:
    """``--peers``: ``none``, or a comma-separated list of :data:`PEERS` (``ValueError`` naming an unknown one)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return []
    unknown = [x for x in items if x not in PEERS]
    if unknown or not items or len(set(items)) != len(items):
        raise ValueError(f"--peers: {text!r}: give 'none' or distinct names of {', '.join(PEERS)}")
    return [p for p in PEERS if p in items]


def measure_peer(name: str, lengths: Any, config: PlanConfig) -> PeerPart:
    """Plan or schedule ``lengths`` as peer ``name`` on ``config``'s mesh, budget, cost model and global batches.

    A ``config.batch_window`` is ringpack's own and not applied: a peer starts from the global
    batches as drawn.

    Raises:
        ValueError: an unknown peer; :class:`~ringpack.errors.PlanError` as the peer's planner.
    """
    config = dataclasses.replace(config, batch_window=0)
    if name == DCP:
        schedule = dcp_schedule(lengths, config)
        return PeerPart(DCP, schedule, [None] * schedule.num_steps, schedule.config)
    if name == WLB:
        return _measure_wlb(lengths, config)
    raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")


def try_measure_peer(name: str, lengths: Any, config: PlanConfig) -> PeerPart | None:
    """:func:`measure_peer`, or ``None`` with a warning when the peer cannot plan the data (a :class:`PlanError`).

    A peer is an extra row: data ringpack plans but a peer cannot (a fixed ``microbatches_per_rank``
    too small for WLB's deferred documents, say) leaves the row out rather than failing the report.
    """
    try:
        return measure_peer(name, lengths, config)
    except PlanError as exc:
        logger.warning("peer %s left out: %s", name, exc)
        return None


def _measure_wlb(lengths: Any, config: PlanConfig) -> PeerPart:
    """WLB packing with per-document zigzag, measured from its piece table (the plan :func:`make_wlb_plan` makes)."""
    wlb = WLBConfig()
    cfg = dataclasses.replace(config, strategy="zigzag")
    packing = wlb_packing(lengths, cfg, wlb)
    packed = PackedSteps.of([(s.ids, s.bins, s.m) for s in packing.steps], packing.batches.lengths, cfg.dp)
    metrics, _ = evaluate_packed(
        packed, "zigzag", cp=cfg.cp, tokens_per_rank=cfg.tokens_per_rank, model=cfg.cost, name=WLB
    )
    described = {**cfg.to_dict(), "packing": WLB, "peer": WLB, "wlb": dataclasses.asdict(wlb)}
    return PeerPart(WLB, metrics, [step.lower_bound for step in packing.steps], described)


def join_peer_parts(parts: Sequence[PeerPart | None]) -> PeerPart | None:
    """One peer's chunks (simulate) as one part, steps in chunk order; ``None`` if any chunk is ``None``."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first.metrics, DynamicCPSchedule):
        metrics = concat_schedules([p.metrics for p in parts])
    else:
        metrics = concat_metrics([p.metrics for p in parts], first.name)
    return PeerPart(first.name, metrics, [b for p in parts for b in p.bounds], first.config)


def time_peer(part: PeerPart, comm: CommModel) -> Peer:
    """The report row of a measured peer under ``comm``; under ``"p2p"`` a peer is timed with the
    ring, the exchange its system runs (none of them has a targeted one)."""
    if comm.mode == "p2p":
        comm = dataclasses.replace(comm, mode="ring")
    if isinstance(part.metrics, DynamicCPSchedule):
        result = timed_schedule(part.metrics, comm)
    else:
        result = timed(part.metrics, comm, part.bounds, config=part.config, plan_hash=part.plan_hash)
    return Peer(part.name, PEER_DESCRIPTIONS[part.name], result)


def peer_rows(lengths: Any, config: PlanConfig, comm: CommModel, names: Sequence[str] = PEERS) -> list[Peer]:
    """Report rows of the peers ``names`` on ``lengths`` (as :func:`make_plan` plans them) under ``comm``.

    Args:
        lengths: sample lengths, 1-D integers >= 1.
        config: the plan config ringpack's rows use (mesh, budget, cost model, global batch, overflow).
        comm: the communication model of the report's headline times.
        names: peers of :data:`PEERS`.

    Returns:
        One :class:`Peer` per name, in order; a peer that cannot plan the data is left out with a
        warning (:func:`try_measure_peer`).
    """
    parts = [try_measure_peer(name, lengths, config) for name in names]
    return [time_peer(part, comm) for part in parts if part is not None]
