"""The Triton merge (``fused_merge``) against the torch merge it replaces on CUDA (skipped without CUDA).

The torch path is the reference: it runs here on CPU copies of the same inputs, so both sides
compute in float32 from identical values; outputs may differ by float32 rounding in the
log-sum-exp: at most one unit in the last place of a half-precision output, about 1e-6 relative
for a float32 one.
"""

from __future__ import annotations

import pytest
import torch

from ringpack.attention.fused_merge import fused_merge_applies
from ringpack.attention.merge import merge_partial

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [128, 80])
@pytest.mark.parametrize("rows", [None, slice(3, 900)])
@pytest.mark.parametrize("two", [False, True])
def test_fused_merge_matches_the_torch_merge(dtype, head_dim, rows, two):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(head_dim)
    t, h = 1000, 6
    n = t if rows is None else rows.stop - rows.start
    out = torch.randn(t, h, head_dim, device=dev, generator=gen).to(dtype)
    lse = torch.randn(h, t, device=dev, generator=gen) * 4
    part = (
        torch.randn(h, n, head_dim, device=dev, generator=gen).to(dtype).transpose(0, 1)
    )  # strided, like cuDNN's BHSD
    part_lse = torch.randn(h, n, device=dev, generator=gen) * 4
    part_lse[:, ::7] = float("inf")  # flash kernels' "no keys" rows: must leave the row unchanged
    part2 = None
    if two:  # a second partial of the same rows (a dense call's key tail), contiguous, with its own empty rows
        part2 = (
            torch.randn(n, h, head_dim, device=dev, generator=gen).to(dtype),
            torch.randn(h, n, device=dev, generator=gen) * 4,
        )
        part2[1][:, ::7] = float("inf")
    assert fused_merge_applies(out, lse, part, part_lse, rows)
    want_out, want_lse = out.cpu(), lse.cpu()
    merge_partial(
        want_out,
        want_lse,
        part.cpu(),
        part_lse.cpu(),
        rows,
        part2=None if part2 is None else tuple(x.cpu() for x in part2),
    )
    untouched = out.clone()
    merge_partial(out, lse, part, part_lse, rows, part2=part2)
    torch.testing.assert_close(lse.cpu(), want_lse, rtol=1e-6, atol=1e-6)
    # one unit in the last place of a half-precision output; for float32 outputs the weights' own
    # float32 rounding (exp of lse differences that agree to ~1e-6) dominates (a few 1e-6)
    tol = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.cpu().float(), want_out.float(), rtol=tol, atol=tol)
    sel = slice(None) if rows is None else rows
    kept = torch.zeros(t, dtype=torch.bool)
    kept[sel] = True
    skip = torch.zeros(n, dtype=torch.bool)
    skip[::7] = True
    idx = torch.arange(t)[sel][skip]
    assert torch.equal(out[idx.to(dev)], untouched[idx.to(dev)])  # a partial without keys changes nothing
    assert torch.equal(out[~kept.to(dev)], untouched[~kept.to(dev)])  # rows outside the range are not touched


@pytest.mark.gpu
@needs_cuda
def test_gathered_rows_and_float64_take_the_torch_path():
    dev = torch.device("cuda")
    out, lse = torch.zeros(4, 2, 8, device=dev), torch.zeros(2, 4, device=dev)
    part, part_lse = torch.zeros(2, 2, 8, device=dev), torch.zeros(2, 2, device=dev)
    assert not fused_merge_applies(out, lse, part, part_lse, torch.tensor([0, 2], device=dev))
    assert not fused_merge_applies(out.double(), lse.double(), part.double(), part_lse.double(), None)
