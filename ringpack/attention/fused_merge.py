"""One-kernel log-sum-exp merge on CUDA (Triton), for the merges whose rows are a range.

It reads the running output and the partial (or two partials of the same rows: a dense call whose
keys were split) once and writes the merged output and lse once, where the torch path
(:func:`ringpack.attention.merge.merge_partial`) runs about eight kernels; it computes in float32
like the torch path and rounds outputs once. Used only where it applies: CUDA tensors, Triton
importable, rows given as a slice or all rows, float32/float16/bfloat16 outputs with a float32 lse;
everything else takes the torch path, the reference the GPU tests compare it against. See
docs/attention.md, "Ring and all-gather" (precision).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["fused_merge", "fused_merge_applies"]


@functools.cache
def _kernel():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # CPU-only installs
        return None

    @triton.jit
    def merge_kernel(
        out_ptr, lse_ptr, part_ptr, plse_ptr, part2_ptr, plse2_ptr,
        n_rows, heads, head_dim,
        out_s_t, out_s_h, part_s_t, part_s_h, part2_s_t, part2_s_h, lse_s_h, plse_s_h, plse2_s_h,
        TWO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flattened (token, head)
        live = r < n_rows * heads
        t, h = (r // heads).to(tl.int64), r % heads  # 64-bit offsets: T x H x D may pass 2^31
        old_lse = tl.load(lse_ptr + h * lse_s_h + t, mask=live, other=0.0)
        part_lse = tl.load(plse_ptr + h * plse_s_h + t, mask=live, other=float("-inf"))
        part_lse = tl.where(part_lse == float("inf"), float("-inf"), part_lse)  # flash: no keys -> +inf
        top = tl.maximum(old_lse, part_lse)  # finite: every row attends itself in the local step
        total = tl.exp(old_lse - top) + tl.exp(part_lse - top)
        if TWO:
            part2_lse = tl.load(plse2_ptr + h * plse2_s_h + t, mask=live, other=float("-inf"))
            part2_lse = tl.where(part2_lse == float("inf"), float("-inf"), part2_lse)
            top2 = tl.maximum(top, part2_lse)
            total = total * tl.exp(top - top2) + tl.exp(part2_lse - top2)
            top = top2
        new_lse = top + tl.log(total)
        w_old, w_new = tl.exp(old_lse - new_lse), tl.exp(part_lse - new_lse)
        d = tl.arange(0, BLOCK_D)
        both = live[:, None] & (d[None, :] < head_dim)
        out_at = out_ptr + (t * out_s_t + h * out_s_h)[:, None] + d[None, :]
        part_at = part_ptr + (t * part_s_t + h * part_s_h)[:, None] + d[None, :]
        old = tl.load(out_at, mask=both, other=0.0).to(tl.float32)
        new = tl.load(part_at, mask=both, other=0.0).to(tl.float32)
        merged = old * w_old[:, None] + new * w_new[:, None]
        if TWO:
            part2_at = part2_ptr + (t * part2_s_t + h * part2_s_h)[:, None] + d[None, :]
            new2 = tl.load(part2_at, mask=both, other=0.0).to(tl.float32)
            merged += new2 * tl.exp(part2_lse - new_lse)[:, None]
        tl.store(out_at, merged.to(out_ptr.dtype.element_ty), mask=both)
        tl.store(lse_ptr + h * lse_s_h + t, new_lse, mask=live)

    return merge_kernel


def fused_merge_applies(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, index) -> bool:
    """Whether :func:`fused_merge` can do this merge (otherwise the caller uses the torch path)."""
    return (
        out.is_cuda
        and (index is None or isinstance(index, slice))
        and out.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and lse.dtype == torch.float32
        and part_lse.dtype == torch.float32
        and out.stride(-1) == 1
        and part_out.stride(-1) == 1
        and lse.stride(-1) == 1
        and part_lse.stride(-1) == 1
        and out.shape[-1] <= 256
        and _kernel() is not None
    )


def fused_merge(
    out: Tensor,
    lse: Tensor,
    part_out: Tensor,
    part_lse: Tensor,
    index: slice | None,
    part2: tuple[Tensor, Tensor] | None = None,
) -> None:
    """In place: rows ``index`` of ``out [T, H, D]`` / ``lse [H, T]`` merged with ``part_out [n, H, D]``
    / ``part_lse [H, n]``, and with ``part2`` (a second such pair) in the same pass if given (see
    :func:`ringpack.attention.merge.merge_partial` for the contract). Its log-sum-exp is the textbook
    ``m + log(e^(a-m) + e^(b-m))``, which agrees with the torch path's ``torch.logaddexp`` to float32
    rounding."""
    rows_out = out if index is None else out[index]
    rows_lse = lse if index is None else lse[:, index]
    n, heads, head_dim = rows_out.shape
    if n == 0:
        return
    part2_out, part2_lse = part2 if part2 is not None else (part_out, part_lse)  # unread unless TWO
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    block_r = max(1, 4096 // block_d)  # about 4K elements per program
    grid = (-(-n * heads // block_r),)
    _kernel()[grid](
        rows_out, rows_lse, part_out, part_lse, part2_out, part2_lse,
        n, heads, head_dim,
        rows_out.stride(0), rows_out.stride(1), part_out.stride(0), part_out.stride(1),
        part2_out.stride(0), part2_out.stride(1), rows_lse.stride(0), part_lse.stride(0), part2_lse.stride(0),
        TWO=part2 is not None, BLOCK_R=block_r, BLOCK_D=block_d,
    )  # fmt: skip
