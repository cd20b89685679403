"""The K/V movers by mode name: what builds one engine pass's transport over a CP group.

``"ring"``: :class:`~ringpack.attention.ring.RingTransport` (point to point, double-buffered);
``"allgather"``: :class:`~ringpack.attention.allgather.AllGatherTransport` (one all-gather, one
reduce-scatter); ``"p2p"``: :class:`~ringpack.attention.p2p.TargetedTransports` (each needed piece
straight to the ranks that need it). ``"ulysses"`` moves no K/V between sequence pieces: it
exchanges heads (:mod:`ringpack.attention.ulysses`), so it has no transport here; the hybrid
modes ``"ulysses+p2p"`` and ``"ulysses+ring"`` exchange heads within nodes and use the ``p2p`` or
``ring`` transport between them (:mod:`ringpack.attention.hybrid`). See
docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from ringpack.attention.allgather import AllGatherTransport
from ringpack.attention.kv_transport import TransportFactory
from ringpack.attention.p2p import TargetedTransports
from ringpack.attention.ring import RingTransport

__all__ = ["MODES", "transport_factory"]

MODES = ("ring", "allgather", "p2p", "ulysses", "ulysses+p2p", "ulysses+ring")


def transport_factory(mode: str, group: dist.ProcessGroup | None) -> TransportFactory:
    """What builds the K/V mover of ``mode`` (``"ring"``, ``"allgather"`` or ``"p2p"``) over ``group`` (None: the world)
    for one engine pass: called with the pass's :class:`~ringpack.attention.schedule.Schedule`."""
    group = group if group is not None else dist.group.WORLD
    if mode == "p2p":
        return TargetedTransports(group)
    return functools.partial(RingTransport if mode == "ring" else AllGatherTransport, group=group)
