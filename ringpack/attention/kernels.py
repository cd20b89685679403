"""Varlen attention kernels behind one contract (docs/attention.md, "The kernel contract")::

    varlen_attn_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, backend) -> (out[Tq, H, D], lse[H, Tq])
    varlen_attn_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, softmax_scale, causal, backend) -> (dq, dk, dv)

``q [Tq, H, D]``, ``k``/``v [Tk, H_kv, D]`` with ``H % H_kv == 0``; segment ``b`` pairs queries
``q[cu_q[b]:cu_q[b+1]]`` with keys ``k[cu_k[b]:cu_k[b+1]]``; ``causal`` is aligned bottom-right
(query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq``); ``lse`` is float32 (float64 for float64
inputs). Every backend agrees that a segment with no keys gives ``out = 0`` and ``lse = +-inf``, and
one with no queries ``dk = dv = 0`` for its keys. The backward takes the final (merged) ``out`` and
``lse``. Hybrid backends add a dense one-segment kernel (:func:`dense_attn_fwd`,
:func:`dense_attn_bwd`) for the segments the schedule marked. The entry points are
``torch.library`` custom ops with fake implementations; ``backend="auto"`` picks the first backend
of :func:`available_backends` (docs/attention.md, "Kernel backends").
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ringpack.attention import fa4
from ringpack.attention.merge import merge_partial
from ringpack.errors import DataError

__all__ = [
    "AUTO_CUDNN_HYBRID",
    "AUTO_FA4",
    "BACKENDS",
    "HYBRID_BACKENDS",
    "accum_dtype",
    "available_backends",
    "dense_attn_bwd",
    "dense_attn_bwd_parts",
    "dense_attn_fwd",
    "dense_attn_fwd_parts",
    "dense_backend",
    "resolve_backend",
    "varlen_attn_bwd",
    "varlen_attn_fwd",
    "varlen_backend",
    "warm_up_kernels",
]
# torch.ops.ringpack.{varlen,dense}_attn_{fwd,bwd} are the traceable custom-op forms (defined below)

BACKENDS = ("fa4", "flash_attn", "torch_flash", "cudnn_hybrid", "reference", "reference_hybrid")

# hybrid backend -> (varlen kernel, dense kernel)
HYBRID_BACKENDS = {
    "cudnn_hybrid": ("torch_flash", "cudnn"),
    "reference_hybrid": ("reference", "reference"),
}

# Whether backend="auto" picks cudnn_hybrid (ahead of flash_attn / torch_flash) where it was
# benchmarked: CUDA bf16 on compute capability 9.x (Hopper) with head_dim 128. There it is as fast as
# torch_flash where no segment reaches the dense threshold (it runs the same varlen calls) and
# 1.5-1.8x faster where segments do (BENCHMARKS.md). cuDNN builds a graph (~0.1 s) per new shape;
# the schedule's shape buckets bound those shapes, and benchmarks/fresh_lengths.py weighs the builds
# against the faster steps. Elsewhere (other GPUs, dtypes, head dims) auto keeps flash.
AUTO_CUDNN_HYBRID = True

# Whether backend="auto" picks fa4 (flash-attn-4) first wherever it runs: compute capability 9.x and
# 10.x, fp16/bf16, a head dim it supports. On H200 it is 1.29-1.33x cudnn_hybrid on mixed packed
# micro-batches and at or above cuDNN's dense kernel on single long samples (BENCHMARKS.md), so the
# dense split no longer pays there and fa4 runs every segment itself.
AUTO_FA4 = True
AUTO_CUDNN_HEAD_DIMS = (128,)
AUTO_CUDNN_CAPABILITY = 9
AUTO_CUDNN_DTYPES = (torch.bfloat16,)

# Whether cuDNN dense SDPA is given K/V with fewer heads than Q as they are (GQA). False: K/V heads
# of a dense segment are repeated to H and dK/dV summed back over each group (extra copies of one
# segment's K/V). tests/attention/test_gpu_cudnn_probe.py reports whether native GQA is exact; with
# torch 2.11 / cuDNN 9.19 on H200 it is (errors at bf16 level) and slightly faster than the repeat.
CUDNN_NATIVE_GQA = True


def varlen_backend(backend: str) -> str:
    """The varlen kernel a backend runs (itself, or a hybrid's varlen half)."""
    return HYBRID_BACKENDS[backend][0] if backend in HYBRID_BACKENDS else backend


def dense_backend(backend: str) -> str | None:
    """The dense one-segment kernel of a hybrid backend (None: the backend splits nothing)."""
    return HYBRID_BACKENDS[backend][1] if backend in HYBRID_BACKENDS else None


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """dtype of lse, of merged outputs and of gradient accumulators: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.cache
def _flash_attn_module():
    try:
        import flash_attn.flash_attn_interface as fai  # type: ignore[import-not-found]
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    return fai


def available_backends(device: torch.device | str, dtype: torch.dtype, head_dim: int | None = None) -> list[str]:
    """Backends usable for tensors of this device and dtype, best first (``reference_hybrid`` is for
    tests, never listed). ``fa4`` comes first wherever it runs (:data:`AUTO_FA4`,
    :func:`ringpack.attention.fa4.unusable_reason`). ``cudnn_hybrid`` comes next only where it was benchmarked faster
    (:data:`AUTO_CUDNN_HYBRID`: bf16, capability 9.x and a head_dim it was benchmarked with) and
    PyTorch's cuDNN attention is enabled (``torch.backends.cuda.enable_cudnn_sdp(False)``, a common
    workaround for cuDNN trouble, keeps ``auto`` on flash), else last.

    Raises:
        DataError: ``device`` is not a torch device or device string, ``dtype`` not a torch dtype.
    """
    if not isinstance(device, (torch.device, str)) or not isinstance(dtype, torch.dtype):
        raise DataError(f"available_backends needs a torch device and dtype, got {device!r} and {dtype!r}")
    device = torch.device(device)
    found = []
    half = dtype in (torch.float16, torch.bfloat16)
    if device.type == "cuda" and half:
        found = (["flash_attn"] if _flash_attn_module() is not None else []) + ["torch_flash"]
        if AUTO_FA4 and fa4.unusable_reason(device, dtype, head_dim) is None:
            found.insert(0, "fa4")
        if _cudnn_usable():
            first = (
                AUTO_CUDNN_HYBRID
                and dtype in AUTO_CUDNN_DTYPES
                and head_dim in AUTO_CUDNN_HEAD_DIMS
                and fa4.capability(device) == AUTO_CUDNN_CAPABILITY
                and torch.backends.cuda.cudnn_sdp_enabled()
            )
            found.insert(int("fa4" in found) if first else len(found), "cudnn_hybrid")
    if dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        found.append("reference")
    return found


@functools.cache
def _cudnn_usable() -> bool:
    return torch.backends.cudnn.is_available() and _cudnn_ragged_dense() is None


def _cudnn_ragged_dense() -> str | None:
    """Why cuDNN dense SDPA cannot be trusted in this process, or None.

    ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` makes PyTorch run dense cuDNN attention through its
    ragged path, with one graph per power-of-two length bucket. With torch 2.11 / cuDNN 9.19 on
    H200 (``benchmarks/probes/cudnn_shapes.py``) the forward stays exact, but the backward of every length
    after the first in a bucket returns wrong dQ (errors of 10^2-10^3 relative to the largest
    value). PyTorch reads the variable once per process, so it is refused here rather than
    silently producing wrong gradients.
    """
    value = os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "").strip().lower()
    if value in ("1", "true", "yes", "on", "y"):
        return (
            "TORCH_CUDNN_SDPA_AVOID_RECOMPILE is set: PyTorch's ragged cuDNN path returned wrong dQ in "
            "ringpack's GPU tests (torch 2.11); unset it to use 'cudnn_hybrid'"
        )
    return None


def resolve_backend(backend: str, q: Tensor) -> str:
    """The backend that runs ``q``'s device and dtype: ``backend`` itself, checked, or for ``"auto"``
    the first of :func:`available_backends` (fa4 where it runs, else cudnn_hybrid where it is the
    faster choice, else flash_attn if importable on CUDA, else torch_flash on CUDA fp16/bf16, else
    reference).

    Raises:
        DataError: (a ``ValueError``) an unknown name, or a backend that cannot run ``q`` (CPU or float32/64 tensors
            for a CUDA kernel, flash-attn or flash-attn-4 not importable, a GPU or head dim fa4
            does not support, cuDNN unavailable or refused).
    """
    if backend == "auto":
        usable = available_backends(q.device, q.dtype, q.shape[-1])
        if not usable:
            raise DataError(f"no attention backend supports {q.dtype} on {q.device}")
        return usable[0]
    if backend not in BACKENDS:
        raise DataError(f"unknown attention backend {backend!r}; choose 'auto' or one of {BACKENDS}")
    if backend not in ("reference", "reference_hybrid") and (
        q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16)
    ):
        raise DataError(f"backend {backend!r} needs CUDA fp16/bf16 tensors, got {q.dtype} on {q.device}")
    if backend == "fa4" and (reason := fa4.unusable_reason(q.device, q.dtype, q.shape[-1])):
        raise DataError(reason)
    if backend == "flash_attn" and _flash_attn_module() is None:
        raise DataError("backend 'flash_attn' requested but the flash-attn package is not importable")
    if backend == "cudnn_hybrid" and not _cudnn_usable():
        raise DataError(_cudnn_ragged_dense() or "backend 'cudnn_hybrid' requested but cuDNN is not available")
    return backend


def warm_up_kernels(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    backend: str = "auto",
) -> int:
    """Build, before training, what ``backend`` would otherwise compile during the first steps.

    Only ``fa4`` compiles kernels on first use (:func:`ringpack.attention.fa4.warm_up`: about 35 s
    on H200, 0.2 s from flash-attn-4's disk cache); for every other backend this does nothing.

    Args:
        heads, kv_heads, head_dim: the model's attention shape.
        dtype, device: what training runs attention in.
        backend: as given to ``ring_attention`` (``"auto"`` resolves as it would there).

    Returns:
        The number of kernel variants built now.

    Raises:
        DataError: the backend cannot run this dtype, device or head dim (:func:`resolve_backend`).
    """
    probe = torch.empty(1, heads, head_dim, device=device, dtype=dtype)
    if resolve_backend(backend, probe) != "fa4":
        return 0
    return fa4.warm_up(heads, kv_heads, head_dim, dtype, device)


# --------------------------------------------------------------------------------------- reference


def _segment_ids(cu: Tensor, total: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: segment index, position in its segment, and whether any segment covers it (no host sync)."""
    rows = torch.arange(total, device=cu.device, dtype=torch.int64)
    cu64 = cu.to(torch.int64)
    seg = torch.searchsorted(cu64[1:], rows, right=True)
    covered = rows < cu64[-1]
    seg = seg.clamp(max=cu64.numel() - 2)
    return seg, rows - cu64[seg], covered


def _segment_mask(cu_q: Tensor, cu_k: Tensor, tq: int, tk: int, causal: bool) -> Tensor:
    seg_q, pos_q, cov_q = _segment_ids(cu_q, tq)
    seg_k, pos_k, cov_k = _segment_ids(cu_k, tk)
    mask = (seg_q[:, None] == seg_k[None, :]) & cov_q[:, None] & cov_k[None, :]
    if causal:
        len_q = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
        len_k = (cu_k[1:] - cu_k[:-1]).to(torch.int64)
        shift = (len_k - len_q)[seg_q]  # bottom-right alignment
        mask &= pos_k[None, :] <= (pos_q + shift)[:, None]
    return mask


def _expand_kv(x: Tensor, heads: int) -> Tensor:
    groups = heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_kv(dx: Tensor, kv_heads: int) -> Tensor:
    t, heads, d = dx.shape
    return dx if heads == kv_heads else dx.view(t, kv_heads, heads // kv_heads, d).sum(2)


def _reference_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    ct = torch.promote_types(q.dtype, torch.float32)
    heads = q.shape[1]
    qf, kf, vf = q.to(ct), _expand_kv(k, heads).to(ct), _expand_kv(v, heads).to(ct)
    mask = _segment_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, Tq]; -inf where a query has no key
    p = torch.where(mask, torch.exp(s - lse[..., None]), 0.0)
    out = torch.einsum("hqk,khd->qhd", p, vf)
    lse = lse.masked_fill(torch.isneginf(lse), float("inf"))  # the flash kernels' convention
    return out.to(q.dtype).contiguous(), lse.to(accum_dtype(q.dtype)).contiguous()


def _reference_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    ct = torch.promote_types(q.dtype, torch.float32)
    heads, kv_heads = q.shape[1], k.shape[1]
    qf, kf, vf = q.to(ct), _expand_kv(k, heads).to(ct), _expand_kv(v, heads).to(ct)
    do, of = dout.to(ct), out.to(ct)
    mask = _segment_mask(cu_q, cu_k, q.shape[0], k.shape[0], causal)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    p = torch.where(mask, torch.exp(s - lse.to(ct)[..., None]), 0.0)
    dv = torch.einsum("hqk,qhd->khd", p, do)
    dp = torch.einsum("qhd,khd->hqk", do, vf)
    delta = (do * of).sum(-1).transpose(0, 1)  # [H, Tq]: rowsum(dO * O) with the final O
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kf) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, qf) * scale
    grads = dq.to(q.dtype), _reduce_kv(dk, kv_heads).to(k.dtype), _reduce_kv(dv, kv_heads).to(v.dtype)
    return tuple(g.contiguous() for g in grads)  # same layout as the flash kernels (and the fake impls)


# ------------------------------------------------------------------------------------- torch_flash

_NO_DROPOUT = 0.0


@functools.cache
def _no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """Placeholder philox (seed, offset) for the backward: with dropout 0 the kernel never reads them."""
    return torch.empty(2, dtype=torch.uint64, device=device), torch.empty((), dtype=torch.uint64, device=device)


def _flash_max_q(max_q: int) -> int:
    """With ``max_seqlen_q == 1`` and GQA, FA2's varlen forward switches to a decoding layout that
    assumes exactly one query per segment; the schedule's zero-query segments break that. An upper
    bound of 2 is still valid (it only sizes the launch grid) and keeps the general path."""
    return max(max_q, 2)


def _torch_flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, _flash_max_q(max_q), max_k, _NO_DROPOUT, causal, False, scale=scale
    )
    return out, lse


def _torch_flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    seed, offset = _no_dropout_rng(q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout, q, k, v, out, lse, cu_q, cu_k, _flash_max_q(max_q), max_k, _NO_DROPOUT, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


# -------------------------------------------------------------------------------------- flash_attn


@functools.cache
def _version_kwargs(fn: Callable) -> dict:
    """Arguments whose spelling changed across flash-attn 2.x: no sliding window, no softcap."""
    params = inspect.signature(fn).parameters
    kwargs: dict = (
        {"window_size_left": -1, "window_size_right": -1} if "window_size_left" in params else {"window_size": (-1, -1)}
    )
    if "softcap" in params:
        kwargs["softcap"] = 0.0
    return kwargs


def _flash_attn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    fn = _flash_attn_module()._flash_attn_varlen_forward
    res = fn(
        q, k, v, cu_q, cu_k, _flash_max_q(max_q), max_k,
        dropout_p=_NO_DROPOUT, softmax_scale=scale, causal=causal,
        alibi_slopes=None, return_softmax=False, **_version_kwargs(fn),
    )  # fmt: skip
    # 2.6+: (out, lse, S_dmask, rng_state); 2.4-2.5: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
    return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])


def _flash_attn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal):
    fn = _flash_attn_module()._flash_attn_varlen_backward
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fn(
        dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, _flash_max_q(max_q), max_k,
        dropout_p=_NO_DROPOUT, softmax_scale=scale, causal=causal,
        alibi_slopes=None, deterministic=False, rng_state=None, **_version_kwargs(fn),
    )  # fmt: skip
    return dq, dk, dv


_FWD = {"reference": _reference_fwd, "torch_flash": _torch_flash_fwd, "flash_attn": _flash_attn_fwd, "fa4": fa4.fa4_fwd}
_BWD = {"reference": _reference_bwd, "torch_flash": _torch_flash_bwd, "flash_attn": _flash_attn_bwd, "fa4": fa4.fa4_bwd}
for _name in HYBRID_BACKENDS:
    _FWD[_name], _BWD[_name] = _FWD[varlen_backend(_name)], _BWD[varlen_backend(_name)]


# ------------------------------------------------------------------------------ dense, one segment
#
# cuDNN's dense SDPA ops take [B, H, S, D]; a [S, H, D] row range seen through transpose(0, 1) is
# the "BSHD" layout (unit-stride head_dim, rows H*D apart) every SDPA kernel accepts, so q/k/v and
# out/dout go in as views, and cuDNN allocates out/dq/dk/dv in the layout of q/k/v. The ops return
# lse as fp32 [B, H, S, 1] (or [B, H, S] in some releases; natural log, like flash): we read it by
# logical index, so its layout does not matter, and hand the backward the same rank it returned.


def _bhsd(x: Tensor, batch: int = 1) -> Tensor:
    """``[B*S, H, D]`` (rows contiguous) -> ``[B, H, S, D]`` view (no copy)."""
    return x.view(batch, x.shape[0] // batch, *x.shape[1:]).transpose(1, 2)


def _shd(x: Tensor) -> Tensor:
    """``[B, H, S, D]`` -> ``[B*S, H, D]``, contiguous (a view when cuDNN wrote BSHD, as it does for BSHD inputs)."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def _lse_rows(lse: Tensor, batch: int) -> Tensor:
    """cuDNN's ``[B, H, S(, 1)]`` log-sum-exp -> ``[H, B*S]`` (a view for one batch)."""
    heads = lse.shape[1]
    return lse.reshape(batch, heads, -1).transpose(0, 1).reshape(heads, -1)


_cudnn_lse_rank = [4]  # rank of the lse the forward op returned last (the backward wants the same)


def _cudnn_qkv(q: Tensor, k: Tensor, v: Tensor, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, H, S, D]`` views of q, k, v for cuDNN (K/V heads repeated to H unless GQA is native)."""
    heads = q.shape[1]
    k, v = (k, v) if CUDNN_NATIVE_GQA else (_expand_kv(k, heads), _expand_kv(v, heads))
    return _bhsd(q, batch), _bhsd(k, batch), _bhsd(v, batch)


def _cudnn_dense_fwd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, batch: int = 1
) -> tuple[Tensor, Tensor]:
    heads, lq = q.shape[1], q.shape[0] // batch
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        *_cudnn_qkv(q, k, v, batch), None, True, _NO_DROPOUT, causal, False, scale=scale
    )
    out4, lse = res[0], res[1]
    if (
        tuple(out4.shape) != (batch, heads, lq, v.shape[-1])
        or lse.numel() != heads * lq * batch
        or tuple(lse.shape[:3]) != (batch, heads, lq)
    ):
        raise RuntimeError(
            f"cuDNN SDPA returned out {tuple(out4.shape)} / lse {tuple(lse.shape)} for q {tuple(q.shape)}: "
            "unknown layout"
        )
    _cudnn_lse_rank[0] = lse.dim()
    return _shd(out4), _lse_rows(lse, batch).to(accum_dtype(q.dtype))


def _cudnn_dense_bwd(
    dout, q, k, v, out, lse, scale: float, causal: bool, batch: int = 1
) -> tuple[Tensor, Tensor, Tensor]:
    heads, kv_heads, lq, lk = q.shape[1], k.shape[1], q.shape[0] // batch, k.shape[0] // batch
    lse = lse.to(accum_dtype(q.dtype)).reshape(heads, batch, lq).transpose(0, 1)  # fp32 for fp16/bf16, what cuDNN takes
    lse4 = (lse.unsqueeze(-1) if _cudnn_lse_rank[0] == 4 else lse).contiguous()
    seed, offset = _cudnn_no_dropout_rng(q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout, batch), *_cudnn_qkv(q, k, v, batch), _bhsd(out, batch), lse4,
        seed, offset, None, None, None, lq, lk, _NO_DROPOUT, causal, scale=scale,
    )  # fmt: skip
    return _shd(dq), _reduce_kv(_shd(dk), kv_heads), _reduce_kv(_shd(dv), kv_heads)


@functools.cache
def _cudnn_no_dropout_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    """Placeholder philox (seed, offset): with dropout 0 the cuDNN graph has no dropout node and never reads them."""
    return torch.zeros((), dtype=torch.int64, device=device), torch.zeros((), dtype=torch.int64, device=device)


def _even_cu(rows: int, batch: int, device) -> Tensor:
    """``cu_seqlens`` of ``batch`` equal segments over ``rows`` rows, made on the device (one arange
    kernel: no host-to-device copy, no sync)."""
    step = max(rows // batch, 1)
    return torch.arange(0, (batch + 1) * step, step, dtype=torch.int32, device=device)[: batch + 1]


def _device_segment(q: Tensor, k: Tensor, batch: int = 1) -> tuple[Tensor, Tensor]:
    """``cu_seqlens`` of ``batch`` equal segments of q and of k (``[0, Lq]`` / ``[0, Lk]`` for one)."""
    return _even_cu(q.shape[0], batch, q.device), _even_cu(k.shape[0], batch, q.device)


def _reference_dense_fwd(q, k, v, scale, causal, batch=1):
    cu_q, cu_k = _device_segment(q, k, batch)
    return _reference_fwd(q, k, v, cu_q, cu_k, q.shape[0] // batch, k.shape[0] // batch, scale, causal)


def _reference_dense_bwd(dout, q, k, v, out, lse, scale, causal, batch=1):
    cu_q, cu_k = _device_segment(q, k, batch)
    return _reference_bwd(dout, q, k, v, out, lse, cu_q, cu_k, q.shape[0] // batch, k.shape[0] // batch, scale, causal)


_DENSE_FWD = {"cudnn": _cudnn_dense_fwd, "reference": _reference_dense_fwd}
_DENSE_BWD = {"cudnn": _cudnn_dense_bwd, "reference": _reference_dense_bwd}


def _dense_kernel(backend: str, table: dict) -> Callable:
    dense = dense_backend(backend)
    if dense is None:
        raise ValueError(f"backend {backend!r} has no dense kernel; hybrid backends: {tuple(HYBRID_BACKENDS)}")
    return table[dense]


# ------------------------------------------------------------------------------------- custom ops
#
# Eager calls go straight to the backend: the custom-op dispatcher adds ~20 us per call and its
# first call imports torch._dynamo (seconds). Code being traced by torch.compile/export sees the
# custom ops instead, whose fake implementations give it shapes without running a kernel.


def varlen_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """One varlen attention forward (module docstring): returns ``(out[Tq,H,D], lse[H,Tq])``."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    if torch.compiler.is_compiling():
        return _varlen_attn_fwd_op(*args, backend)
    return _FWD[backend](*args)


def varlen_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """One varlen attention backward given the final ``out``/``lse``: returns ``(dq, dk, dv)``."""
    args = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    if torch.compiler.is_compiling():
        return _varlen_attn_bwd_op(*args, backend)
    return _BWD[backend](*args)


def dense_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    backend: str,
    dense_keys: int | None = None,
    batch: int = 1,
) -> tuple[Tensor, Tensor]:
    """Attention of one whole segment, ``q [Lq, H, D]`` x ``k/v [Lk, H_kv, D]`` (``causal`` needs ``Lq == Lk``),
    with a hybrid backend's dense kernel: returns ``(out [Lq, H, D], lse [H, Lq])`` as :func:`varlen_attn_fwd` would.

    ``dense_keys = n < Lk`` (non-causal only): the dense kernel takes keys ``:n`` and the hybrid's
    varlen kernel the rest, merged by log-sum-exp; ``out`` is then float32 (float64 for float64
    inputs), so the caller's merge still rounds once. The schedule uses it to keep the dense
    kernel's key counts to a few lengths (:func:`~ringpack.attention.schedule.dense_bucket`):
    cuDNN builds a graph for every new shape.

    ``batch = b > 1``: q/k/v hold ``b`` equal segments one after another (``Lq / b`` queries and
    ``Lk / b`` keys each), attended separately by one batched call (no key split).
    """
    if causal and q.shape[0] != k.shape[0]:
        raise ValueError(f"dense causal attention needs as many queries as keys, got {q.shape[0]} and {k.shape[0]}")
    _check_dense_keys(dense_keys, k.shape[0], causal)
    _check_batch(batch, q.shape[0], k.shape[0], dense_keys)
    if torch.compiler.is_compiling():
        return _dense_attn_fwd_op(q, k, v, softmax_scale, causal, backend, dense_keys, batch)
    return _dense_fwd(q, k, v, softmax_scale, causal, backend, dense_keys, batch)


def dense_attn_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    causal: bool,
    backend: str,
    dense_keys: int | None = None,
    batch: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of :func:`dense_attn_fwd` given the final (merged) ``out [Lq, H, D]`` and ``lse [H, Lq]``:
    ``(dq, dk, dv)`` in the input dtype (with ``dense_keys``, dq is the sum of both kernels' parts,
    rounded once)."""
    _check_dense_keys(dense_keys, k.shape[0], causal)
    _check_batch(batch, q.shape[0], k.shape[0], dense_keys)
    if torch.compiler.is_compiling():
        return _dense_attn_bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, backend, dense_keys, batch)
    return _dense_bwd(dout, q, k, v, out, lse, softmax_scale, causal, backend, dense_keys, batch)


def _check_dense_keys(dense_keys: int | None, num_keys: int, causal: bool) -> None:
    if dense_keys is None or dense_keys >= num_keys:
        return
    if causal or dense_keys < 1:
        raise ValueError(
            f"dense_keys={dense_keys} of {num_keys} keys: a key split needs a non-causal segment "
            "and at least one dense key"
        )


def _check_batch(batch: int, num_q: int, num_keys: int, dense_keys: int | None) -> None:
    if batch < 1 or num_q % batch or num_keys % batch:
        raise ValueError(f"batch={batch} does not divide {num_q} queries and {num_keys} keys into equal segments")
    if batch > 1 and dense_keys is not None and dense_keys < num_keys:
        raise ValueError("a batched dense call has no key split")


def _tail_segment(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor, int, int]:
    cu_q, cu_k = _device_segment(q, k)
    return cu_q, cu_k, q.shape[0], k.shape[0]


def dense_attn_fwd_parts(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float,
    causal: bool,
    backend: str,
    dense_keys: int | None = None,
    batch: int = 1,
) -> tuple[tuple[Tensor, Tensor], ...]:
    """:func:`dense_attn_fwd` as partial results of the same query rows, for a caller that folds
    them into its own accumulator (the engine, with ``merge_partial(..., part2=...)``): one
    ``(out, lse)``, or with a key split the dense kernel's over keys ``:dense_keys`` and the varlen
    kernel's over the rest, each in the input dtype. Merging them here would need a float copy of
    the rows (memory and a pass); the caller's merge takes both in one pass, rounding once.
    ``batch``: as in :func:`dense_attn_fwd` (one part)."""
    _check_batch(batch, q.shape[0], k.shape[0], dense_keys)
    n = k.shape[0] if dense_keys is None else dense_keys
    if n >= k.shape[0]:
        return (dense_attn_fwd(q, k, v, softmax_scale, causal, backend, batch=batch),)
    _check_dense_keys(dense_keys, k.shape[0], causal)
    core = dense_attn_fwd(q, k[:n], v[:n], softmax_scale, False, backend)
    tail = varlen_attn_fwd(q, k[n:], v[n:], *_tail_segment(q, k[n:]), softmax_scale, False, backend)
    return core, tail


def _dense_fwd(q, k, v, scale, causal, backend, dense_keys, batch=1):
    if dense_keys is None or dense_keys >= k.shape[0]:
        return _dense_kernel(backend, _DENSE_FWD)(q, k, v, scale, causal, batch)
    (out, lse), tail = dense_attn_fwd_parts(q, k, v, scale, causal, backend, dense_keys)  # its dense part is unsplit
    out = out.to(lse.dtype)  # the two parts are summed in float; the caller's merge rounds once
    merge_partial(out, lse, *tail, None)
    return out, lse


def dense_attn_bwd_parts(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    softmax_scale: float,
    causal: bool,
    backend: str,
    dense_keys: int | None = None,
    batch: int = 1,
) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """:func:`dense_attn_bwd` as the gradients of its kernels, one ``(dq, dk, dv)`` at a time, for a
    caller that adds them into its own sums: one triple, or with a key split the dense kernel's
    (``dk``/``dv`` of keys ``:dense_keys``) and then the varlen tail's (keys ``dense_keys:``); both
    ``dq`` cover every query row. Adding them one by one rounds as often as summing them here, and
    never holds both triples, or their concatenation, at once (peak memory). A generator: the tail's
    kernel runs when its part is asked for."""
    _check_dense_keys(dense_keys, k.shape[0], causal)
    _check_batch(batch, q.shape[0], k.shape[0], dense_keys)
    n = k.shape[0] if dense_keys is None else min(dense_keys, k.shape[0])
    if n == k.shape[0] or torch.compiler.is_compiling():  # (traced code sees the one custom op)
        yield dense_attn_bwd(
            dout, q, k, v, out, lse, softmax_scale, causal, backend, dense_keys=dense_keys, batch=batch
        )
        return
    yield dense_attn_bwd(dout, q, k[:n], v[:n], out, lse, softmax_scale, False, backend)
    yield _key_tail_bwd(dout, q, k[n:], v[n:], out, lse, softmax_scale, backend)


def _dense_bwd(dout, q, k, v, out, lse, scale, causal, backend, dense_keys, batch=1):
    if dense_keys is None or dense_keys >= k.shape[0]:
        return _dense_kernel(backend, _DENSE_BWD)(dout, q, k, v, out, lse, scale, causal, batch)
    (dq, dk, dv), (dq_tail, dk_tail, dv_tail) = dense_attn_bwd_parts(
        dout, q, k, v, out, lse, scale, causal, backend, dense_keys
    )
    return dq.add_(dq_tail), torch.cat((dk, dk_tail)), torch.cat((dv, dv_tail))


# Rows per segment when the backward of a key tail is cut into segments (see _key_tail_bwd), and
# the most key rows the copies may take.
TAIL_CHUNK_ROWS = 512
TAIL_COPY_ROWS = 2048


def _key_tail_bwd(dout, q, k, v, out, lse, scale: float, backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of all of a dense segment's queries against its few tail keys, with the varlen kernel.

    Flash's backward parallelises over key blocks, so one segment of a few hundred keys against
    thousands of queries runs a few dozen blocks that each walk every query row: on H200 the tail
    of an 8K x 5K block takes about a quarter of the dense kernel's time. Cutting the queries into
    segments of :data:`TAIL_CHUNK_ROWS`, each paired with its own copy of the tail keys (at most
    :data:`TAIL_COPY_ROWS` copied key rows), multiplies the blocks; the copies' dK/dV are summed.
    """
    n_q, n_k = q.shape[0], k.shape[0]
    chunks = max(1, min(-(-n_q // TAIL_CHUNK_ROWS), TAIL_COPY_ROWS // max(n_k, 1)))
    dout, out, lse = (x.contiguous() for x in (dout, out, lse))  # row views; the varlen kernels want them dense
    if chunks == 1:
        return _BWD[backend](dout, q, k, v, out, lse, *_tail_segment(q, k), scale, False)
    rows = -(-n_q // chunks)
    chunks = -(-n_q // rows)  # no empty segment
    steps = torch.arange(chunks + 1, dtype=torch.int32, device=q.device)
    cu_q, cu_k = (steps * rows).clamp_(max=n_q), steps * n_k
    dq, dk, dv = _BWD[backend](
        dout, q, k.repeat(chunks, 1, 1), v.repeat(chunks, 1, 1), out, lse, cu_q, cu_k, rows, n_k, scale, False
    )
    return dq, *(g.view(chunks, *k.shape).sum(0, dtype=accum_dtype(k.dtype)).to(k.dtype) for g in (dk, dv))


# Each op's implementation is its public function, which (not being traced) calls the backend directly.
_varlen_attn_fwd_op = torch.library.custom_op("ringpack::varlen_attn_fwd", varlen_attn_fwd, mutates_args=())


@_varlen_attn_fwd_op.register_fake
def _varlen_attn_fwd_fake(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, backend
):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=accum_dtype(q.dtype))


_varlen_attn_bwd_op = torch.library.custom_op("ringpack::varlen_attn_bwd", varlen_attn_bwd, mutates_args=())


@_varlen_attn_bwd_op.register_fake
def _varlen_attn_bwd_fake(
    dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, backend
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_dense_attn_fwd_op = torch.library.custom_op("ringpack::dense_attn_fwd", dense_attn_fwd, mutates_args=())


@_dense_attn_fwd_op.register_fake
def _dense_attn_fwd_fake(q, k, v, softmax_scale, causal, backend, dense_keys=None, batch=1):
    split = dense_keys is not None and dense_keys < k.shape[0]
    out = q.new_empty(q.shape, dtype=accum_dtype(q.dtype)) if split else torch.empty_like(q)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=accum_dtype(q.dtype))


_dense_attn_bwd_op = torch.library.custom_op("ringpack::dense_attn_bwd", dense_attn_bwd, mutates_args=())


@_dense_attn_bwd_op.register_fake
def _dense_attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, backend, dense_keys=None, batch=1):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
