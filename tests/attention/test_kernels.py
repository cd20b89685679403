"""The kernel contract on the reference backend, checked against a naive per-segment loop, plus the custom ops."""

from __future__ import annotations

import pytest
import torch

from ringpack.attention import kernels
from ringpack.attention.kernels import resolve_backend, varlen_attn_bwd, varlen_attn_fwd
from ringpack.attention.merge import merge_partial


def naive_segment_attention(q, k, v, cu_q, cu_k, causal, scale):
    """Loop over segments, dense softmax per segment; bottom-right causal; empty rows -> out 0."""
    outs = []
    groups = q.shape[1] // k.shape[1]
    for b in range(cu_q.numel() - 1):
        qa, qb, ka, kb = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qs, ks, vs = q[qa:qb], k[ka:kb].repeat_interleave(groups, 1), v[ka:kb].repeat_interleave(groups, 1)
        s = torch.einsum("ihd,jhd->hij", qs, ks) * scale
        if causal:
            i = torch.arange(qb - qa)[:, None]
            j = torch.arange(kb - ka)[None, :]
            s = s.masked_fill(j > i + (kb - ka) - (qb - qa), float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)
        outs.append(torch.einsum("hij,jhd->ihd", p, vs))
    return torch.cat(outs) if outs else q.new_zeros(q.shape)


CASES = {
    # name: (cu_q, cu_k, causal)
    "plain-causal": ([0, 5, 6, 9], [0, 5, 6, 9], True),
    "bottom-right": ([0, 2, 5], [0, 6, 9], True),  # Lk > Lq: the diagonal sits bottom-right
    "more-queries-than-keys": ([0, 4], [0, 2], True),  # first rows see nothing: out 0, lse +inf
    "non-causal-with-gaps": ([0, 0, 3, 3, 5, 5], [0, 2, 4, 7, 8, 10], False),  # zero-query segments
    "empty-key-segment": ([0, 2, 4], [0, 0, 3], False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_reference_matches_naive_forward_and_backward(name, heads, kv_heads):
    cu_q_list, cu_k_list, causal = CASES[name]
    cu_q, cu_k = torch.tensor(cu_q_list, dtype=torch.int32), torch.tensor(cu_k_list, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    tq, tk, d = cu_q_list[-1], cu_k_list[-1], 8
    q = torch.randn(tq, heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(tk, kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(tk, kv_heads, d, generator=gen, dtype=torch.float64, requires_grad=True)
    scale = 0.3
    max_q = max(b - a for a, b in zip(cu_q_list, cu_q_list[1:]))
    max_k = max(b - a for a, b in zip(cu_k_list, cu_k_list[1:]))
    out, lse = varlen_attn_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, max_q, max_k, scale, causal, "reference")
    want = naive_segment_attention(q, k, v, cu_q, cu_k, causal, scale)
    assert lse.dtype == torch.float64 and lse.shape == (heads, tq)
    torch.testing.assert_close(out, want.detach(), rtol=0, atol=1e-12)
    empty_rows = (want.detach() == 0).all(-1).T  # [H, Tq]
    assert torch.isposinf(lse[empty_rows]).all() and torch.isfinite(lse[~empty_rows]).all()

    dout = torch.randn(tq, heads, d, generator=gen, dtype=torch.float64)
    (want * dout).sum().backward()
    dq, dk, dv = varlen_attn_bwd(
        dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, max_q, max_k, scale, causal, "reference"
    )
    torch.testing.assert_close(dq, q.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(dk, k.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(dv, v.grad, rtol=0, atol=1e-12)


def test_zero_query_segments_get_zero_key_gradients():
    cu_q, cu_k = torch.tensor([0, 0, 2], dtype=torch.int32), torch.tensor([0, 3, 5], dtype=torch.int32)
    q, k, v = torch.randn(2, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    out, lse = varlen_attn_fwd(q, k, v, cu_q, cu_k, 2, 3, 0.5, False, "reference")
    _, dk, dv = varlen_attn_bwd(torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 2, 3, 0.5, False, "reference")
    assert (dk[:3] == 0).all() and (dv[:3] == 0).all() and dk[3:].abs().sum() > 0


def test_reference_upcasts_half_inputs():
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    out, lse = varlen_attn_fwd(q, q, q, cu, cu, 3, 3, 0.5, True, "reference")
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


def test_custom_ops_pass_opcheck():
    fwd_op, bwd_op = torch.ops.ringpack.varlen_attn_fwd.default, torch.ops.ringpack.varlen_attn_bwd.default
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 6], dtype=torch.int32)
    q, k, v = torch.randn(5, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    torch.library.opcheck(fwd_op, (q, k, v, cu_q, cu_k, 3, 3, 0.35, True, "reference"))
    out, lse = fwd_op(q, k, v, cu_q, cu_k, 3, 3, 0.35, True, "reference")
    torch.testing.assert_close((out, lse), varlen_attn_fwd(q, k, v, cu_q, cu_k, 3, 3, 0.35, True, "reference"))
    torch.library.opcheck(bwd_op, (torch.randn_like(q), q, k, v, out, lse, cu_q, cu_k, 3, 3, 0.35, True, "reference"))


def test_compiled_function_traces_the_custom_op():
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)

    def f(q):
        return varlen_attn_fwd(q, q, q, cu, cu, 3, 3, 0.5, True, "reference")[0].sum()

    q = torch.randn(5, 2, 4)
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(q), f(q))


def test_fake_implementations_give_contract_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(7, 4, 16, dtype=torch.bfloat16), torch.empty(9, 2, 16, dtype=torch.bfloat16)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.ringpack.varlen_attn_fwd(q, k, k, cu, cu, 4, 5, 0.25, False, "torch_flash")
        dq, dk, dv = torch.ops.ringpack.varlen_attn_bwd(
            out, q, k, k, out, lse, cu, cu, 4, 5, 0.25, False, "torch_flash"
        )
    assert out.shape == q.shape and lse.shape == (4, 7) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_backend_resolution_on_cpu():
    q = torch.zeros(1, 1, 8)
    assert resolve_backend("auto", q) == "reference"
    assert kernels.available_backends("cpu", torch.float32) == ["reference"]
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("torch_flash", q)
    with pytest.raises(ValueError, match="unknown"):
        resolve_backend("cudnn", q)


def test_auto_puts_cudnn_hybrid_first_only_where_it_was_benchmarked(monkeypatch):
    """cudnn_hybrid leads the CUDA list for bf16 on capability 9.x with head_dim 128; elsewhere it comes last."""
    monkeypatch.setattr(kernels, "_cudnn_usable", lambda: True)
    monkeypatch.setattr(kernels, "_flash_attn_module", lambda: None)
    monkeypatch.setattr(kernels.fa4, "_interface", lambda: "ImportError: no flash-attn-4")
    monkeypatch.setattr(kernels.fa4, "capability", lambda device: 9)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "cudnn_hybrid"
    for head_dim in (64, None):
        assert kernels.available_backends("cuda", torch.bfloat16, head_dim)[:1] == ["torch_flash"]
        assert kernels.available_backends("cuda", torch.bfloat16, head_dim)[-2:] == ["cudnn_hybrid", "reference"]
    assert kernels.available_backends("cuda", torch.float16, 128)[0] == "torch_flash"  # benchmarked in bf16 only
    monkeypatch.setattr(kernels.fa4, "capability", lambda device: 8)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "torch_flash"
    monkeypatch.setattr(kernels.fa4, "capability", lambda device: 9)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: False)  # the user turned cuDNN attention off
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "torch_flash"
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "cudnn_hybrid"
    monkeypatch.setattr(kernels, "AUTO_CUDNN_HYBRID", False)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "torch_flash"
    assert kernels.available_backends("cuda", torch.float32, 128) == ["reference"]


def test_merge_is_exact_and_ignores_empty_partials():
    gen = torch.Generator().manual_seed(1)
    s = torch.randn(3, 5, 7, generator=gen, dtype=torch.float64)  # [H, T, keys]
    v = torch.randn(7, 3, 2, generator=gen, dtype=torch.float64)
    full = torch.einsum("htk,khd->thd", torch.softmax(s, -1), v)

    def part(lo, hi):
        p = torch.softmax(s[..., lo:hi], -1)
        return torch.einsum("htk,khd->thd", p, v[lo:hi]), torch.logsumexp(s[..., lo:hi], -1)

    out, lse = part(0, 3)
    rows = torch.tensor([0, 2, 4])
    o2, l2 = part(3, 7)
    merge_partial(out, lse, o2, l2, None)
    torch.testing.assert_close(out, full, rtol=0, atol=1e-14)
    before = out.clone()
    merge_partial(
        out, lse, torch.zeros(3, 3, 2, dtype=torch.float64), torch.full((3, 3), float("inf"), dtype=torch.float64), rows
    )
    torch.testing.assert_close(out, before, rtol=0, atol=0)


def test_hybrid_backends_resolve_and_their_dense_ops_trace():
    q = torch.zeros(1, 1, 8)
    assert resolve_backend("reference_hybrid", q) == "reference_hybrid"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend("cudnn_hybrid", q)
    assert kernels.varlen_backend("cudnn_hybrid") == "torch_flash" and kernels.dense_backend("torch_flash") is None
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    torch.library.opcheck(torch.ops.ringpack.dense_attn_fwd.default, (q, k, k, 0.3, True, "reference_hybrid"))
    out, lse = kernels.dense_attn_fwd(q, k, k, 0.3, True, "reference_hybrid")
    torch.library.opcheck(
        torch.ops.ringpack.dense_attn_bwd.default,
        (torch.randn_like(q), q, k, k, out, lse, 0.3, True, "reference_hybrid"),
    )
    with pytest.raises(ValueError, match="as many queries as keys"):
        kernels.dense_attn_fwd(q, k[:3], k[:3], 0.3, True, "reference_hybrid")
    with pytest.raises(ValueError, match="no dense kernel"):
        kernels.dense_attn_fwd(q, k, k, 0.3, True, "reference")
    with pytest.raises(ValueError, match="key split needs a non-causal"):
        kernels.dense_attn_fwd(q, k, k, 0.3, True, "reference_hybrid", dense_keys=3)
    torch.library.opcheck(torch.ops.ringpack.dense_attn_fwd.default, (q, k, k, 0.3, False, "reference_hybrid", 3))
    out, lse = kernels.dense_attn_fwd(q, k, k, 0.3, False, "reference_hybrid", dense_keys=3)
    torch.library.opcheck(
        torch.ops.ringpack.dense_attn_bwd.default,
        (torch.randn_like(q), q, k, k, out.to(q.dtype), lse, 0.3, False, "reference_hybrid", 3),
    )


@pytest.mark.parametrize("chunk_rows", [512, 2, 3])
@pytest.mark.parametrize("dense_keys", [1, 4, 8, 9, None])
def test_dense_key_split_is_exact(dense_keys, chunk_rows, monkeypatch):
    """Keys past ``dense_keys`` go to the varlen kernel and are merged in float: the same result
    (fp64) as one dense call, forward and backward, and a float output to keep the caller's rounding
    single. ``chunk_rows`` < 7 cuts the tail's backward into segments with copies of the tail keys."""
    monkeypatch.setattr(kernels, "TAIL_CHUNK_ROWS", chunk_rows)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(7, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    want_out, want_lse = kernels.dense_attn_fwd(q, k, v, 0.4, False, "reference_hybrid")
    out, lse = kernels.dense_attn_fwd(q, k, v, 0.4, False, "reference_hybrid", dense_keys=dense_keys)
    torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-12)
    want = kernels.dense_attn_bwd(dout, q, k, v, want_out, want_lse, 0.4, False, "reference_hybrid")
    got = kernels.dense_attn_bwd(
        dout, q, k, v, want_out, want_lse, 0.4, False, "reference_hybrid", dense_keys=dense_keys
    )
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    # the same gradients as the kernels' parts: dq summed, dk/dv of keys :dense_keys then the rest
    parts = list(
        kernels.dense_attn_bwd_parts(
            dout, q, k, v, want_out, want_lse, 0.4, False, "reference_hybrid", dense_keys=dense_keys
        )
    )
    split = dense_keys is not None and dense_keys < k.shape[0]
    assert [p[1].shape[0] for p in parts] == ([dense_keys, k.shape[0] - dense_keys] if split else [k.shape[0]])
    torch.testing.assert_close(sum(p[0] for p in parts), want[0], rtol=0, atol=1e-12)
    for i in (1, 2):
        torch.testing.assert_close(torch.cat([p[i] for p in parts]), want[i], rtol=0, atol=1e-12)
    half = kernels.dense_attn_fwd(q.float(), k.float(), v.float(), 0.4, False, "reference_hybrid", dense_keys=4)[0]
    assert half.dtype == torch.float32


@pytest.mark.parametrize("causal", [True, False])
def test_batched_dense_call_is_exact(causal):
    """``batch=3``: three equal segments one after another, attended separately by one dense call,
    equal the varlen kernel over the same segments (fp64), forward and backward; the custom ops
    agree with their fake implementations."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(15, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(15, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    cu = torch.tensor([0, 5, 10, 15], dtype=torch.int32)
    want_out, want_lse = kernels.varlen_attn_fwd(q, k, v, cu, cu, 5, 5, 0.4, causal, "reference")
    out, lse = kernels.dense_attn_fwd(q, k, v, 0.4, causal, "reference_hybrid", batch=3)
    torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-12)
    want = kernels.varlen_attn_bwd(dout, q, k, v, want_out, want_lse, cu, cu, 5, 5, 0.4, causal, "reference")
    got = kernels.dense_attn_bwd(dout, q, k, v, want_out, want_lse, 0.4, causal, "reference_hybrid", batch=3)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    torch.library.opcheck(
        torch.ops.ringpack.dense_attn_fwd.default, (q, k, v, 0.4, causal, "reference_hybrid", None, 3)
    )
    torch.library.opcheck(
        torch.ops.ringpack.dense_attn_bwd.default, (dout, q, k, v, out, lse, 0.4, causal, "reference_hybrid", None, 3)
    )
    with pytest.raises(ValueError, match="equal segments"):
        kernels.dense_attn_fwd(q, k, v, 0.4, causal, "reference_hybrid", batch=4)
    with pytest.raises(ValueError, match="no key split"):
        kernels.dense_attn_fwd(q, k, v, 0.4, False, "reference_hybrid", dense_keys=7, batch=3)


@pytest.mark.parametrize("value,refused", [("1", True), ("TRUE", True), ("on", True), ("0", False), ("", False)])
def test_cudnn_ragged_path_is_refused(monkeypatch, value, refused):
    """TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 gives wrong cuDNN dQ with torch 2.11: cudnn_hybrid must refuse it."""
    from ringpack.attention.kernels import _cudnn_ragged_dense

    monkeypatch.setenv("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", value)
    reason = _cudnn_ragged_dense()
    assert (reason is not None) == refused
    if refused:
        assert "TORCH_CUDNN_SDPA_AVOID_RECOMPILE" in reason and "cudnn_hybrid" in reason


@pytest.mark.parametrize("rows", [None, slice(1, 4), torch.tensor([4, 0, 2])])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_add_rows_rounds_once(rows, src_dtype):
    """dst[rows] += src for every row form, summed in float and rounded to dst's dtype once."""
    from ringpack.attention.engine import _add_rows

    gen = torch.Generator().manual_seed(3)
    dst = torch.randn(5, 2, 3, generator=gen).to(torch.bfloat16)
    n = 5 if rows is None else len(range(5)[rows]) if isinstance(rows, slice) else rows.numel()
    src = torch.randn(n, 2, 3, generator=gen).to(src_dtype)
    want = dst.float().clone()
    sel = slice(None) if rows is None else rows
    want[sel] += src.float()
    _add_rows(dst, rows, src)
    assert torch.equal(dst, want.to(torch.bfloat16))


@pytest.mark.parametrize("rows", [None, slice(1, 5), torch.tensor([0, 2, 5])])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_merge_of_two_partials_equals_two_merges(rows, dtype):
    """merge_partial(part2=...) folds two partials of the same rows in one pass: in float64 the same
    as two merges; into a bf16 output, the float merge rounded once."""
    gen = torch.Generator().manual_seed(4)
    n = 6 if rows is None else (rows.stop - rows.start if isinstance(rows, slice) else rows.numel())
    out = torch.randn(6, 3, 4, generator=gen, dtype=torch.float64)
    lse = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    parts = [
        (
            torch.randn(n, 3, 4, generator=gen, dtype=torch.float64),
            torch.randn(3, n, generator=gen, dtype=torch.float64),
        )
        for _ in range(2)
    ]
    parts[1][1][:, 0] = float("inf")  # a partial without keys
    want_out, want_lse = out.clone(), lse.clone()
    for part in parts:
        merge_partial(want_out, want_lse, *part, rows)
    got_out, got_lse = out.to(dtype), lse.clone()
    merge_partial(
        got_out,
        got_lse,
        *((p.to(dtype) if p.dim() == 3 else p) for p in parts[0]),
        rows,
        part2=tuple(p.to(dtype) if p.dim() == 3 else p for p in parts[1]),
    )
    torch.testing.assert_close(got_lse, want_lse, rtol=0, atol=1e-12)
    if dtype == torch.float64:
        torch.testing.assert_close(got_out, want_out, rtol=0, atol=1e-12)
    else:  # exact float merge of the bf16 inputs, rounded once
        ref_out, ref_lse = out.to(dtype).double(), lse.clone()
        for part_out, part_lse in parts:
            merge_partial(ref_out, ref_lse, part_out.to(dtype).double(), part_lse, rows)
        assert torch.equal(got_out, ref_out.to(dtype))


def test_dense_parts_merge_to_the_dense_call():
    """dense_attn_fwd_parts: one part without a key split; with one, the dense and the varlen part, which merged
    give dense_attn_fwd."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(7, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    want_out, want_lse = kernels.dense_attn_fwd(q, k, v, 0.4, False, "reference_hybrid")
    (whole,) = kernels.dense_attn_fwd_parts(q, k, v, 0.4, False, "reference_hybrid", dense_keys=9)
    torch.testing.assert_close(whole, (want_out, want_lse), rtol=0, atol=0)
    core, tail = kernels.dense_attn_fwd_parts(q, k, v, 0.4, False, "reference_hybrid", dense_keys=5)
    out, lse = core[0].clone(), core[1].clone()
    merge_partial(out, lse, *tail, None)
    torch.testing.assert_close((out, lse), (want_out, want_lse), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="key split"):
        kernels.dense_attn_fwd_parts(q, k[:7], v[:7], 0.4, True, "reference_hybrid", dense_keys=3)


def test_merge_into_an_input_dtype_output_rounds_once():
    """One remote step keeps out in bf16: the merge equals the float merge rounded once at the end."""
    gen = torch.Generator().manual_seed(2)
    out = torch.randn(6, 2, 4, generator=gen).to(torch.bfloat16)
    lse = torch.randn(2, 6, generator=gen)
    part, part_lse = torch.randn(3, 2, 4, generator=gen).to(torch.bfloat16), torch.randn(2, 3, generator=gen)
    for rows in (slice(2, 5), torch.tensor([5, 1, 3])):
        out_f, lse_f, out_b, lse_b = out.float(), lse.clone(), out.clone(), lse.clone()
        merge_partial(out_f, lse_f, part, part_lse, rows)
        merge_partial(out_b, lse_b, part, part_lse, rows)
        assert torch.equal(out_b, out_f.to(torch.bfloat16)) and torch.equal(lse_b, lse_f)


def test_compiled_key_split_backward_is_one_custom_op():
    """Traced code gets a key-split dense backward as the one custom op (one part over all keys)
    with the gradients eager code gets from the two parts."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 8, generator=gen)
    k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(2))
    out, lse = kernels.dense_attn_fwd(q, k, v, 0.4, False, "reference_hybrid")
    dout = torch.randn_like(q)

    def grads(dout, q, k, v, out, lse):
        parts = list(
            kernels.dense_attn_bwd_parts(dout, q, k, v, out, lse, 0.4, False, "reference_hybrid", dense_keys=4)
        )
        return len(parts), sum(p[0] for p in parts), torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])

    n_eager, *eager = grads(dout, q, k, v, out, lse)
    n_traced, *traced = torch.compile(grads, backend="eager", fullgraph=True)(dout, q, k, v, out, lse)
    assert (n_eager, n_traced) == (2, 1)
    torch.testing.assert_close(traced, eager)
