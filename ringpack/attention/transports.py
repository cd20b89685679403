"""The K/V movers by mode name: what builds one engine pass's transport over a CP group.

``"ring"``: :class:`~ringpack.attention.ring.RingTransport` (point to point, double-buffered);
``"allgather"``: :class:`~ringpack.attention.allgather.AllGatherTransport` (one all-gather, one
reduce-scatter). See docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from ringpack.attention.allgather import AllGatherTransport
from ringpack.attention.ring import RingTransport, TransportFactory

__all__ = ["MODES", "transport_factory"]

MODES = ("ring", "allgather")


def transport_factory(mode: str, group: dist.ProcessGroup | None) -> TransportFactory:
    """What builds the K/V mover of ``mode`` (one of :data:`MODES`) over ``group`` (None: the world)
    for one engine pass: called with the pass's :class:`~ringpack.attention.schedule.Schedule`."""
    transport = RingTransport if mode == "ring" else AllGatherTransport
    return functools.partial(transport, group=group if group is not None else dist.group.WORLD)
