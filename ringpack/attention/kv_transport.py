"""The contract between the attention engine and the movers of K/V: :class:`KVTransport`.

The engine (:mod:`ringpack.attention.engine`) runs a schedule's local and remote steps and asks a
transport, built per pass by a :data:`TransportFactory`, for each remote step's K/V buffer and to
take the dK/dV home; :func:`pass_schedule` is the schedule one pass runs. The transports
(:mod:`ringpack.attention.ring`, :mod:`ringpack.attention.allgather`,
:mod:`ringpack.attention.p2p`) implement it and only move bytes; the engine imports none of them.
See docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from ringpack.attention.schedule import Schedule

__all__ = ["KVTransport", "TransportFactory", "pass_schedule"]


class KVTransport(Protocol):
    """Moves compact K/V buffers to where the schedule's remote steps need them, and dK/dV back.

    Forward: ``begin(kv)``, ``start()``, then ``buffer(i)`` for each remote step ``i`` in order.
    Backward: the same, plus ``push_grad(i, dkv)`` after each step's kernels (``dkv``: the
    buffer's dK and dV, two ``[n, H_kv, D]`` tensors in ``grad_dtype``, or ``None`` if no query of
    this rank used it) and ``finish()`` for this rank's own (``[2, n, H_kv, D]``, ``None`` if this
    rank sends nothing). ``send_capacity``: the row count ``kv`` is packed to (zero padded; ``None``: exactly
    the rows sent).

    ``kv`` is what this rank sends: ``[2, n, H_kv, D]`` packed to ``send_capacity``, or (with
    ``send_capacity = None``) possibly the pair of K and V row views when the rows are one range.
    ``begin`` allocates what the first transfer writes and marks the end of the packing; ``start``
    issues that transfer, waiting for the mark only (:mod:`ringpack.attention.streams`). The
    engine queues the local kernel in between, so the transfer overlaps it and the host time of
    issuing it does not leave the GPU idle.
    """

    send_capacity: int | None

    def begin(self, kv: Tensor | Sequence[Tensor], grad_dtype: torch.dtype | None = None) -> None: ...

    def start(self) -> None: ...

    def buffer(self, i: int) -> Tensor: ...

    def push_grad(self, i: int, dkv: Sequence[Tensor] | None) -> None: ...

    def finish(self) -> Tensor | None: ...


TransportFactory = Callable[[Schedule], KVTransport]


def pass_schedule(schedule: Schedule, make_transport: TransportFactory) -> Schedule:
    """The schedule one engine pass runs: ``make_transport.pass_schedule(schedule)`` where the
    factory has one (the targeted exchange runs only the steps of this rank's sources), else
    ``schedule``."""
    own = getattr(make_transport, "pass_schedule", None)
    return schedule if own is None else own(schedule)
