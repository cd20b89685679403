"""Launch a transfer that waits only for the tensors it moves, not for kernels queued after them.

PyTorch's NCCL process group makes its communication stream wait for everything queued on the
*current* stream when a transfer is issued. The engine wants the opposite order on the host: pack
the send buffer, queue the local attention kernel, and only then issue the transfer, because
issuing a batched point-to-point call takes a few hundred microseconds of host time during which
the GPU would otherwise sit idle (0.4-0.5 ms per forward on H200).
Issuing the transfer from a side stream that waits on an event recorded right after the packing
keeps the transfer independent of the local kernel, so both run at once.

Memory safety with PyTorch's caching allocator, which recycles a block for the next allocation
on the same stream without waiting for the kernels that used it before: every buffer the
transfer reads or writes is allocated on the compute stream *before* the mark is recorded, so any
earlier user of its memory was queued before the mark and the transfer waits for it; the caller
keeps the buffers alive until the compute stream has waited for the transfer (``work.wait()``).
A buffer allocated after the local kernel is queued could reuse a block that kernel still uses,
and the transfer would overwrite it (wrong dK/dV in backward).
On CPU (gloo) there are no streams and every helper is a no-op.
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
