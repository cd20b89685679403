"""The K/V mover of each sequence-split mode of the table (:mod:`ringpack.modes`), by name.

:data:`TRANSPORTS` maps each of :data:`~ringpack.modes.SEQUENCE_MODES` to what builds its
:class:`~ringpack.attention.kv_transport.TransportFactory` over a CP group: ``"ring"``:
:class:`~ringpack.attention.ring.RingTransport` (point to point, double-buffered);
``"allgather"``: :class:`~ringpack.attention.allgather.AllGatherTransport` (one all-gather, one
reduce-scatter); ``"p2p"``: :class:`~ringpack.attention.p2p.TargetedTransports` (each needed piece
straight to the ranks that need it). The head-parallel modes move heads instead
(:mod:`ringpack.attention.ulysses`); a hybrid's row names the sequence mode it runs between nodes,
whose transport comes from here too. A new sequence mode is its transport module, its row in the
table and its line here. See docs/attention.md, "Modes".
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.distributed as dist

from ringpack.attention.allgather import AllGatherTransport
from ringpack.attention.kv_transport import TransportFactory
from ringpack.attention.p2p import TargetedTransports
from ringpack.attention.ring import RingTransport
from ringpack.modes import MODES

__all__ = ["MODES", "TRANSPORTS", "transport_factory"]

#: Each sequence mode's builder of a transport factory over a CP group (never None: the world).
TRANSPORTS: dict[str, Callable[[dist.ProcessGroup], TransportFactory]] = {
    "ring": lambda group: functools.partial(RingTransport, group=group),
    "allgather": lambda group: functools.partial(AllGatherTransport, group=group),
    "p2p": TargetedTransports,
}


def transport_factory(mode: str, group: dist.ProcessGroup | None) -> TransportFactory:
    """What builds the K/V mover of the sequence ``mode`` (one of :data:`TRANSPORTS`) over ``group``
    (None: the world) for one engine pass: called with the pass's
    :class:`~ringpack.attention.schedule.Schedule`.

    Raises:
        KeyError: ``mode`` is not a sequence mode (callers check the mode against the table first).
    """
    return TRANSPORTS[mode](group if group is not None else dist.group.WORLD)
