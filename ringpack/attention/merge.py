"""The log-sum-exp merge of partial attention results: one implementation for the engine's steps
and for a dense call whose keys are split between two kernels (``kernels.dense_attn_fwd_parts``).
See docs/attention.md, "Ring and all-gather" (precision).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ringpack.attention.fused_merge import fused_merge, fused_merge_applies

__all__ = ["Rows", "merge_partial"]

Rows = Tensor | slice | None  # which rows of the running result a partial covers (None: all)


def merge_partial(
    out: Tensor,
    lse: Tensor,
    part_out: Tensor,
    part_lse: Tensor,
    index: Rows,
    part2: tuple[Tensor, Tensor] | None = None,
) -> None:
    """Fold a partial attention result into the running one, in place, by log-sum-exp.

    ``lse [H, T]`` is the running log-sum-exp (float32/float64); ``out [T, H, D]`` the running
    output, in that dtype too, or in the input dtype when every row receives at most one partial
    result (one remote step): the merge is then computed in ``lse``'s dtype and rounded once, which
    is exactly what a float accumulator rounded at the end would give, because the local part it
    starts from was already rounded by its kernel. ``part_out [n, H, D]`` / ``part_lse [H, n]``
    belong to rows ``index`` (an index tensor, a slice, or ``None`` for all rows). ``part2``: a
    second ``(out, lse)`` partial of the same rows (a dense call whose keys were split between two
    kernels), folded in the same pass, so the rows are still rounded once and no float copy of
    them is made. A partial ``lse`` of ``+inf`` (flash kernels' value for a query without keys)
    counts as ``-inf``. The running ``lse`` must be finite for every row (in the engine each query
    attends at least itself in the local step), so the weights below never see ``inf - inf``.
    """
    parts = [(part_out, part_lse.to(lse.dtype))] + ([] if part2 is None else [(part2[0], part2[1].to(lse.dtype))])
    if all(fused_merge_applies(out, lse, o, o_lse, index) for o, o_lse in parts):  # CUDA: one kernel, same arithmetic
        fused_merge(out, lse, *parts[0], index, part2=parts[1] if len(parts) > 1 else None)
        return
    parts = [(o, o_lse.masked_fill(torch.isposinf(o_lse), float("-inf"))) for o, o_lse in parts]
    if isinstance(index, Tensor):
        old_out, old_lse = out.index_select(0, index), lse.index_select(1, index)
    else:
        old_out, old_lse = (out, lse) if index is None else (out[index], lse[:, index])
    new_lse = old_lse
    for _, part_lse in parts:
        new_lse = torch.logaddexp(new_lse, part_lse)
    w_old = torch.exp(old_lse - new_lse).transpose(0, 1).unsqueeze(-1)
    merged = old_out.mul_(w_old) if old_out.dtype == lse.dtype else old_out * w_old  # in place when out is float
    for part_out, part_lse in parts:
        merged.addcmul_(part_out, torch.exp(part_lse - new_lse).transpose(0, 1).unsqueeze(-1))
    if merged is not old_out:  # input-dtype accumulator: computed in float, rounded once
        old_out.copy_(merged)
    if isinstance(index, Tensor):
        out.index_copy_(0, index, old_out)
        lse.index_copy_(1, index, new_lse)
    else:
        old_lse.copy_(new_lse)
