"""The peer systems a report compares ringpack with, run on the same data (docs/analysis.md, "Peers").

Each peer is one module here exposing ``SYSTEM``, a :class:`~ringpack.analysis.peers.base.PeerSystem`,
and one entry of :data:`SYSTEMS`; ``report``, ``simulate`` and the benchmarks iterate the registry.
Both peers see the documents and global batches ringpack's plans see, with the same cost and
communication models: ``megatron-dcp`` (:mod:`~ringpack.analysis.peers.megatron_dcp`, modelled) and
``wlb`` (:mod:`~ringpack.analysis.peers.wlb`, a real plan measured as ringpack's are).

:func:`measure_peer` runs one on (a chunk of) an epoch, :func:`join_peer_parts` joins the chunks
``simulate`` runs apart, :func:`time_peer` gives its report row under a communication model, and
:func:`peer_rows` does all three for ``report``. A peer that cannot plan the data is left out with a warning.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringpack.analysis.peers import megatron_dcp, wlb
from ringpack.analysis.peers.base import Peer, PeerPart, PeerSystem
from ringpack.comm_model import HEAD_PARALLEL_MODES, CommModel
from ringpack.errors import PlanError
from ringpack.shard_plan import PlanConfig

__all__ = [
    "PEERS",
    "PEER_DESCRIPTIONS",
    "SYSTEMS",
    "WLB",
    "Peer",
    "PeerJob",
    "PeerPart",
    "PeerSystem",
    "join_peer_parts",
    "measure_peer",
    "parse_peers",
    "peer_rows",
    "time_peer",
    "try_measure_peer",
]

logger = logging.getLogger(__name__)

#: Every peer system, by name, in report order: a new peer is a module with a ``SYSTEM`` and a line here.
SYSTEMS: dict[str, PeerSystem] = {system.name: system for system in (megatron_dcp.SYSTEM, wlb.SYSTEM)}
#: The peers ``ringpack report`` and ``ringpack simulate`` can add, in report order.
PEERS: tuple[str, ...] = tuple(SYSTEMS)
PEER_DESCRIPTIONS: dict[str, str] = {name: system.description for name, system in SYSTEMS.items()}
WLB = wlb.WLB


@dataclass(frozen=True)
class PeerJob:
    """What a worker needs to measure peer ``name`` on a chunk of lengths (simulate's tasks)."""

    name: str
    config: PlanConfig


def parse_peers(text: str) -> list[str]:
    """``--peers``: ``none``, or a comma-separated list of :data:`PEERS` (``ValueError`` naming an unknown one)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if items == ["none"]:
        return []
    unknown = [x for x in items if x not in PEERS]
    if unknown or not items or len(set(items)) != len(items):
        raise ValueError(f"--peers: {text!r}: give 'none' or distinct names of {', '.join(PEERS)}")
    return [p for p in PEERS if p in items]


def _system(name: str) -> PeerSystem:
    system = SYSTEMS.get(name)
    if system is None:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)}")
    return system


def measure_peer(name: str, lengths: Any, config: PlanConfig) -> PeerPart:
    """Plan or schedule ``lengths`` as peer ``name`` on ``config``'s mesh, budget, cost model and global batches.

    A ``config.batch_window`` is ringpack's own and not applied: a peer starts from the global
    batches as drawn.

    Raises:
        ValueError: an unknown peer; :class:`~ringpack.errors.PlanError` as the peer's planner.
    """
    return _system(name).measure(lengths, dataclasses.replace(config, batch_window=0))


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


def join_peer_parts(parts: Sequence[PeerPart | None]) -> PeerPart | None:
    """One peer's chunks (simulate) as one part, steps in chunk order; ``None`` if any chunk is ``None``."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    metrics = _system(first.name).join(parts)
    return PeerPart(first.name, metrics, [b for p in parts for b in p.bounds], first.config)


def time_peer(part: PeerPart, comm: CommModel) -> Peer:
    """The report row of a measured peer under ``comm``; under ``"p2p"`` and the head-parallel modes
    a peer is timed with the ring, the exchange its system runs (the peers model sequence-split CP
    only, none with a targeted exchange)."""
    if comm.mode == "p2p" or comm.mode in HEAD_PARALLEL_MODES:
        comm = dataclasses.replace(comm, mode="ring")
    system = _system(part.name)
    return Peer(part.name, system.description, system.timed(part, comm))


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
