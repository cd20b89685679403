"""The peers ringpack's attention benchmark compares against, on the same packed data.

* ``ideal_*``: one GPU runs the whole packed micro-batch; the ideal CP time is that divided by the
  number of GPUs. Kernels: PyTorch's flash varlen kernel (one call, ``cu_seqlens`` = samples),
  flash-attn-4's varlen kernel (the same call, where the package is installed),
  cuDNN dense causal SDPA (only meaningful for a single sample) and compiled ``flex_attention``
  with a per-sample causal block mask.
* ``torch_cp_sdpa``: PyTorch's ``context_parallel`` with SDPA and head-tail load balancing, on a
  single causal sequence (it has no per-sample mask).
* ``torch_cp_flex``: PyTorch's flex-attention context parallel (all-gather of K/V) with a
  document block mask and its PTRR load balancer, for packed data.

These use PyTorch's private context-parallel API, whose names move between releases; every
function raises on failure and the benchmark records the error instead of a time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

Thunk = Callable[[], torch.Tensor]


def cu_seqlens(lengths: list[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


def ideal_flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> Thunk:
    """One torch flash varlen call over the whole packed batch ([T, H, D] layout, GQA native)."""
    cu = cu_seqlens(lengths, q.device)
    longest = max(lengths)
    scale = q.shape[-1] ** -0.5

    class FlashVarlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scale
            )
            ctx.save_for_backward(q, k, v, out, lse, rng, unused)
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse, rng, unused = ctx.saved_tensors
            return torch.ops.aten._flash_attention_backward(
                dout.contiguous(), q, k, v, out, lse, cu, cu, longest, longest, 0.0, True, rng, unused, scale=scale
            )

    return lambda: FlashVarlen.apply(q, k, v)


def ideal_fa4_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> Thunk:
    """One flash-attn-4 varlen call over the whole packed batch (its public autograd API, GQA native)."""
    from flash_attn.cute import flash_attn_varlen_func

    cu = cu_seqlens(lengths, q.device)
    longest = max(lengths)
    scale = q.shape[-1] ** -0.5

    def run() -> torch.Tensor:
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
            softmax_scale=scale, causal=True,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    return run


def ideal_cudnn_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Thunk:
    """Dense causal cuDNN SDPA over one sequence ([1, H, T, D]); K/V heads repeated for GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0).detach().requires_grad_(q.requires_grad)
    k4 = k.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0).detach().requires_grad_(k.requires_grad)
    v4 = v.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0).detach().requires_grad_(v.requires_grad)

    def run() -> torch.Tensor:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)

    return run


def document_block_mask(lengths: list[int], heads: int, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    total = int(doc.numel())

    def document_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    # _compile=True: evaluated blockwise; the eager path materialises a dense [T, T] mask (OOM at 128K)
    return create_block_mask(document_causal, B=1, H=1, Q_LEN=total, KV_LEN=total, device=device, _compile=True)


def ideal_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> Thunk:
    """Compiled flex_attention with a per-sample causal block mask ([1, H, T, D], GQA native)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    mask = document_block_mask(lengths, q.shape[1], q.device)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).detach().requires_grad_(t.requires_grad) for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    return lambda: compiled(q4, k4, v4, block_mask=mask, enable_gqa=gqa)


def _repeat_kv_4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    rep = q.shape[1] // k.shape[1]
    return (
        q.transpose(0, 1).unsqueeze(0),
        k.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0),
        v.repeat_interleave(rep, 1).transpose(0, 1).unsqueeze(0),
    )


def torch_cp_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str) -> Thunk:
    """PyTorch ``context_parallel`` + SDPA (head-tail balancing) on one causal sequence.

    ``q, k, v`` are the *global* [T, H, D] tensors (identical on every rank); the context manager
    shards them in place. K/V heads are repeated for GQA, as that path requires.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _cp_options.enable_load_balance = True
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    q4, k4, v4 = (t.detach().clone().contiguous() for t in _repeat_kv_4d(q, k, v))
    kernel = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    context = context_parallel(mesh, buffers=[q4, k4, v4], buffer_seq_dims=[2, 2, 2])
    context.__enter__()  # shards q4/k4/v4 in place and installs the dispatcher for the run
    grad = q.requires_grad

    def run() -> torch.Tensor:
        # fresh leaves per call: the context must resize the (grad-free) buffers back on exit
        leaves = [t.detach().requires_grad_(grad) for t in (q4, k4, v4)]
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(*leaves, is_causal=True)

    run.close = lambda: context.__exit__(None, None, None)  # type: ignore[attr-defined]
    return run


def torch_cp_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> Thunk:
    """PyTorch flex-attention context parallel: document block mask, PTRR load balancer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard,
        _ContextParallel,
        _PTRRLoadBalancer,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import flex_attention

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,))
    compiled = torch.compile(flex_attention, dynamic=False)

    class FlexModule(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return compiled(*args, **kwargs)

    module = FlexModule()
    parallelize_module(module, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.FLEX))
    mask = document_block_mask(lengths, q.shape[1], q.device)
    balancer = _PTRRLoadBalancer(mask, world)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).detach().contiguous() for t in (q, k, v))
    *local, local_mask = _context_parallel_shard(mesh, [q4, k4, v4, mask], [2, 2, 2, 2], load_balancer=balancer)
    for t in local:
        t.requires_grad_(q.requires_grad)
    gqa = q.shape[1] != k.shape[1]
    return lambda: module(*local, block_mask=local_mask, enable_gqa=gqa)
