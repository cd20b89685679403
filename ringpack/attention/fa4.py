"""The ``fa4`` kernels: FlashAttention-4 (PyPI ``flash-attn-4``, module ``flash_attn.cute``) behind
the varlen contract of :mod:`ringpack.attention.kernels`.

flash-attn-4 is written in the CuTe DSL and compiled on first use, for Hopper (SM90) and Blackwell
(SM100) GPUs. Its compile key holds the dtype, head dims, GQA ratio, causality and a few launch
choices, not the lengths: a training run compiles a handful of variants (:func:`warm_up` compiles
all of them up front; about 35 s on H200, 0.2 s from flash-attn-4's disk cache) and the log says
when one is built. Two lengths-dependent choices of the
package would otherwise add variants mid-run: a call whose longest segment fits one tile, and a
call with more than 256 segments. The first is avoided by passing a segment-length bound of at least
:data:`MIN_SEQLEN_BOUND` (a bound only sizes the launch grid; the extra tiles find no rows and
exit), the second is compiled by :func:`warm_up`. See docs/attention.md (flash-attn-4).
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch import Tensor

from ringpack.errors import DataError

__all__ = [
    "MIN_SEQLEN_BOUND",
    "TESTED_VERSIONS",
    "capability",
    "compiled_kernels",
    "fa4_bwd",
    "fa4_fwd",
    "unusable_reason",
    "warm_up",
]

log = logging.getLogger(__name__)

# The releases ringpack's GPU checks ran on (pyproject's ``gpu`` extra pins the same range): the
# wrapper calls the package's separate forward and backward, which are not a stable public API.
TESTED_VERSIONS = ">=4.0.0b36,<4.1"

# Compute capabilities (major) the package's forward and backward both support and ringpack checked.
CAPABILITIES = (9, 10)

# Lower bound on the max_seqlen hints handed to the kernels: above one tile (at most 128 rows on
# every supported GPU and head dim) so the single-tile variants are never compiled mid-run.
MIN_SEQLEN_BOUND = 257

# More segments than this switch the package to a scheduler variant with a block-to-segment table.
MANY_SEGMENTS = 256


@functools.cache
def _interface():
    """``flash_attn.cute.interface``, or the import error's first line (a string) when it cannot load."""
    try:
        from flash_attn.cute import interface  # type: ignore[import-not-found]
    except Exception as exc:  # not installed, or built for another torch/CUDA
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return interface


def unusable_reason(device: torch.device | str, dtype: torch.dtype, head_dim: int | None) -> str | None:
    """Why ``fa4`` cannot run tensors of this device, dtype and head dim, in one line; None when it can.

    ``head_dim=None`` skips the head-dim check (every supported GPU takes 64 and 128).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"backend 'fa4' needs CUDA tensors, got {device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"backend 'fa4' needs float16 or bfloat16 tensors, got {dtype}"
    interface = _interface()
    if isinstance(interface, str):
        return f"backend 'fa4' needs the flash-attn-4 package ({interface}); pip install 'ringpack[gpu]'"
    major = capability(device)
    if major not in CAPABILITIES:
        return (
            f"backend 'fa4' runs on compute capability 9.x (Hopper) and 10.x (Blackwell); "
            f"{device} has {major}.x: use 'flash_attn' or 'torch_flash'"
        )
    if head_dim is not None and not _head_dim_ok(head_dim, major):
        limits = "8-256" if major == 9 else "8-128 or 256"
        return f"backend 'fa4' takes head_dim {limits}, a multiple of 8, on {major}.x GPUs; got {head_dim}"
    return None


def _head_dim_ok(head_dim: int, major: int) -> bool:
    if head_dim % 8:
        return False
    return 8 <= head_dim <= 256 if major == 9 else (8 <= head_dim <= 128 or head_dim == 256)


def capability(device: torch.device | str) -> int:
    """Major compute capability of a CUDA device (0 if it cannot be read)."""
    try:
        return torch.cuda.get_device_capability(device)[0]
    except Exception:  # no driver in this process
        return 0


def compiled_kernels() -> int:
    """How many forward and backward kernel variants flash-attn-4 holds compiled in this process."""
    interface = _interface()
    if isinstance(interface, str):
        return 0
    caches = (interface._flash_attn_fwd.compile_cache, interface._flash_attn_bwd.compile_cache)
    return sum(len(getattr(cache, "cache", ())) for cache in caches)


def _bound(max_seqlen: int) -> int:
    return max(int(max_seqlen), MIN_SEQLEN_BOUND)


def _logged(what: str, run, *args):
    """Run one kernel call; when it compiled a new variant, log which and how long it took."""
    before = compiled_kernels()
    start = time.perf_counter()
    result = run(*args)
    if compiled_kernels() > before:
        log.info(
            "flash-attn-4 built a %s kernel variant in %.1f s (compiled, or loaded from its disk cache)",
            what,
            time.perf_counter() - start,
        )
    return result


def fa4_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Tensor, Tensor]:
    """The contract's forward. A query without keys gets ``out = 0``, ``lse = -inf``."""
    interface = _interface()

    def run():
        out, lse, *_ = interface._flash_attn_fwd(
            q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_bound(max_q), max_seqlen_k=_bound(max_k),
            softmax_scale=scale, causal=causal, return_lse=True,
        )  # fmt: skip
        return out, lse

    if q.shape[0] == 0:  # the package returns no lse for an empty call
        return torch.empty_like(q), q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return _logged("forward", run)


def fa4_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal) -> tuple[Tensor, Tensor, Tensor]:
    """The contract's backward, given the final (merged) ``out`` and ``lse``."""
    interface = _interface()

    def run():
        dq, dk, dv = interface._flash_attn_bwd(
            q, k, v, out, dout, lse, scale, causal,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=_bound(max_q), max_seqlen_k=_bound(max_k),
        )[:3]  # fmt: skip
        return dq, dk, dv

    return _logged("backward", run)


def warm_up(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda"
) -> int:
    """Compile every flash-attn-4 variant ringpack's runtime uses for one attention shape.

    The runtime calls causal kernels (the local step) and non-causal ones (remote blocks), each
    with few or with more than :data:`MANY_SEGMENTS` segments, forward and backward: eight kernels,
    run here once on tiny inputs. Call it once per attention shape before training (the first
    training step then compiles nothing).

    Args:
        heads, kv_heads, head_dim: the model's attention shape (``heads % kv_heads == 0``).
        dtype: float16 or bfloat16.
        device: the CUDA device training runs on.

    Returns:
        The number of kernel variants compiled now (0 when all were compiled already).

    Raises:
        DataError: (a ``ValueError``) fa4 cannot run this shape here (:func:`unusable_reason`), or ``heads`` is not
            a positive multiple of a positive ``kv_heads``.
    """
    if kv_heads < 1 or heads < 1 or heads % kv_heads:
        raise DataError(f"heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    reason = unusable_reason(device, dtype, head_dim)
    if reason:
        raise DataError(reason)
    before = compiled_kernels()
    start = time.perf_counter()
    for segments in (2, MANY_SEGMENTS + 1):
        cu = torch.arange(segments + 1, device=device, dtype=torch.int32) * 2
        q = torch.randn(2 * segments, heads, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(2 * segments, kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        for causal in (True, False):
            out, lse = fa4_fwd(q, k, v, cu, cu, 2, 2, head_dim**-0.5, causal)
            fa4_bwd(torch.ones_like(out), q, k, v, out, lse, cu, cu, 2, 2, head_dim**-0.5, causal)
    torch.cuda.synchronize(device)
    compiled = compiled_kernels() - before
    log.info("flash-attn-4 warm-up: %d kernel variants built in %.1f s", compiled, time.perf_counter() - start)
    return compiled
