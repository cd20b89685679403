"""The log-sum-exp merge of partial attention results: one implementation for the engine's steps
and for a dense kernel call whose keys are split (``kernels.dense_attn_fwd(dense_keys=...)``)."""

from __future__ import annotations

import torch
from torch import Tensor

from ringpack.attention.fused_merge import fused_merge, fused_merge_applies

__all__ = ["Rows", "merge_partial"]

Rows = Tensor | slice | None  # which rows of the running result a partial covers (None: all)


def merge_partial(out: Tensor, lse: Tensor, part_out: Tensor, part_lse: Tensor, index: Rows) -> None:
    """Fold a partial attention result into the running one, in place, by log-sum-exp.

    ``lse [H, T]`` is the running log-sum-exp (float32/float64); ``out [T, H, D]`` the running
    output, in that dtype too, or in the input dtype when every row receives at most one partial
    result (one remote step): the merge is then computed in ``lse``'s dtype and rounded once, which
    is exactly what a float accumulator rounded at the end would give, because the local part it
    starts from was already rounded by its kernel. ``part_out [n, H, D]`` / ``part_lse [H, n]``
    belong to rows ``index`` (an index tensor, a slice, or ``None`` for all rows). A partial
    ``lse`` of ``+inf`` (flash kernels' value for a query without keys) counts as ``-inf``. The
    running ``lse`` must be finite for every row (in the engine each query attends at least itself
    in the local step; in a split dense call the first part has keys), so the weights below never
    see ``inf - inf``.
    """
    part_lse = part_lse.to(lse.dtype)
    if fused_merge_applies(out, lse, part_out, part_lse, index):  # CUDA: one kernel, same arithmetic
        fused_merge(out, lse, part_out, part_lse, index)
        return
    part_lse = part_lse.masked_fill(torch.isposinf(part_lse), float("-inf"))
    if isinstance(index, Tensor):
        old_out, old_lse = out.index_select(0, index), lse.index_select(1, index)
    else:
        old_out, old_lse = (out, lse) if index is None else (out[index], lse[:, index])
    new_lse = torch.logaddexp(old_lse, part_lse)
    w_old = torch.exp(old_lse - new_lse).transpose(0, 1).unsqueeze(-1)
    w_new = torch.exp(part_lse - new_lse).transpose(0, 1).unsqueeze(-1)
    if old_out.dtype == lse.dtype:
        old_out.mul_(w_old).addcmul_(part_out, w_new)  # in place: a view of out, or the gathered copy
    else:  # input-dtype accumulator: compute in float, round once
        old_out.copy_(torch.addcmul(old_out * w_old, part_out, w_new))
    if isinstance(index, Tensor):
        out.index_copy_(0, index, old_out)
        lse.index_copy_(1, index, new_lse)
    else:
        old_lse.copy_(new_lse)
