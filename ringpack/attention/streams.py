"""Launch a transfer that waits only for the tensors it moves, not for kernels queued after them.

NCCL makes a transfer wait for everything queued on the current stream. The engine packs the send
buffer, marks it (:func:`mark`), queues the local kernel and only then issues the transfer, from a
side stream that waits for the mark alone (:func:`issued_after`): the transfer, and the host time
of issuing it, overlap the kernel. On CPU (gloo) there are no streams and both are no-ops.

Invariant (PyTorch's caching allocator hands a block to the next allocation on the same stream
without waiting for the kernels that used it): every buffer the transfer reads or writes is
allocated on the compute stream *before* the mark, and stays alive until the compute stream has
waited for the transfer (``work.wait()``). A buffer allocated after the local kernel is queued
could share that kernel's memory and be overwritten (wrong dK/dV in backward). See
docs/attention.md, "Ring and all-gather".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["issued_after", "mark"]

_side_streams: dict[int, torch.cuda.Stream] = {}


def mark(t: Tensor) -> torch.cuda.Event | None:
    """An event after everything queued so far on ``t``'s current CUDA stream (None off CUDA)."""
    if t.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return event


@contextlib.contextmanager
def issued_after(event: torch.cuda.Event | None, device: torch.device) -> Iterator[None]:
    """Issue collectives inside this block from a side stream that waits only for ``event``."""
    if event is None or device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    stream.wait_event(event)
    with torch.cuda.stream(stream):
        yield
