"""The cudnn_hybrid wrapper on CPU: the two cuDNN SDPA aten ops get a CPU emulation for this module.

The emulation follows the ops' contract as PyTorch's meta functions and cuDNN source state it
([B, H, S, D] in, out in q's layout, natural-log lse [B, H, S, 1] fp32, dk/dv shaped like k/v,
backward from the given out/lse with ``max_q``/``max_k`` = the sequence lengths) and refuses
what the wrapper must not send (K/V with fewer heads unless native GQA is on, wrong lse shape,
wrong max lengths). So the wrapper's views, lse conversions, GQA repeat/reduce and argument order
are tested in fp64 on every plan, through the real engine. Whether the real ops match this
contract is what tests/attention/test_gpu_cudnn_probe.py checks on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringpack.attention import kernels
from tests.helpers.attention import (
    Problem,
    assert_within,
    dense_reference,
    handmade_microbatches,
    max_errors,
    random_microbatch,
    run_all_ranks,
)


def _scores(q, k, scale, causal):
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if causal:
        lq, lk = q.shape[2], k.shape[2]
        assert lq == lk, "the wrapper only sends causal segments with Lq == Lk"
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    return s


def _check_heads(q, k):
    assert k.shape[1] == q.shape[1] or kernels.CUDNN_NATIVE_GQA, "K/V heads must be repeated unless CUDNN_NATIVE_GQA"
    return k.repeat_interleave(q.shape[1] // k.shape[1], 1)


def _fwd(
    query,
    key,
    value,
    attn_bias,
    compute_log_sumexp,
    dropout_p=0.0,
    is_causal=False,
    return_debug_mask=False,
    *,
    scale=None,
):
    assert attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and query.dim() == 4 and query.stride(-1) == 1
    s = _scores(query, _check_heads(query, key), scale, is_causal)
    lse = torch.logsumexp(s, -1)
    out = torch.empty_like(query)  # q's layout, like cuDNN's alloc_with_matching_layout
    out.copy_(torch.einsum("bhqk,bhkd->bhqd", torch.softmax(s, -1), _check_heads(query, value)))
    empty = query.new_empty(0)
    seed = torch.zeros((), dtype=torch.int64)
    return (
        out,
        lse.unsqueeze(-1).float() if query.dtype != torch.float64 else lse.unsqueeze(-1),
        empty,
        empty,
        query.shape[2],
        key.shape[2],
        seed,
        seed,
        empty,
    )


def _bwd(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    b, h, lq, _ = query.shape
    assert (max_q, max_k) == (lq, key.shape[2]), f"max_q/max_k {max_q}/{max_k} must be the lengths {lq}/{key.shape[2]}"
    assert tuple(logsumexp.shape) == (b, h, lq, 1), f"lse {tuple(logsumexp.shape)}"
    assert attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
    kk, vv = _check_heads(query, key), _check_heads(query, value)
    p = torch.exp(_scores(query, kk, scale, is_causal) - logsumexp)
    dv = torch.einsum("bhqk,bhqd->bhkd", p, grad_out)
    dp = torch.einsum("bhqd,bhkd->bhqk", grad_out, vv)
    ds = p * (dp - (grad_out * out).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, kk) * scale
    dk = torch.einsum("bhqk,bhqd->bhkd", ds, query) * scale
    groups = h // key.shape[1]
    dk, dv = (x.view(b, key.shape[1], groups, *x.shape[2:]).sum(2) for x in (dk, dv))
    return tuple(torch.empty_like(t).copy_(g) for t, g in ((query, dq), (key, dk), (value, dv)))


@pytest.fixture(scope="module")
def emulated_cudnn():
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_cudnn_attention", _fwd, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention_backward", _bwd, "CPU")
    yield
    lib._destroy()


@pytest.fixture
def cudnn_hybrid_on_cpu(emulated_cudnn, monkeypatch):
    """cudnn_hybrid with its dense half on the emulated ops and its varlen half on the reference kernel."""
    monkeypatch.setitem(kernels._FWD, "cudnn_hybrid", kernels._reference_fwd)
    monkeypatch.setitem(kernels._BWD, "cudnn_hybrid", kernels._reference_bwd)


@pytest.mark.parametrize("native_gqa", [False, True])
@pytest.mark.parametrize("causal,lq,lk,dense_keys", [(True, 7, 7, None), (False, 5, 9, None), (False, 5, 9, 4)])
def test_dense_wrapper_matches_the_reference(cudnn_hybrid_on_cpu, monkeypatch, native_gqa, causal, lq, lk, dense_keys):
    monkeypatch.setattr(kernels, "CUDNN_NATIVE_GQA", native_gqa)
    gen = torch.Generator().manual_seed(0)
    q_all = torch.randn(lq + 4, 4, 8, generator=gen, dtype=torch.float64)
    k_all, v_all = (torch.randn(lk + 4, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    q, k, v = q_all[2 : 2 + lq], k_all[1 : 1 + lk], v_all[3 : 3 + lk]  # row slices, as the engine passes them
    dout = torch.randn_like(q)
    got_out, got_lse = kernels.dense_attn_fwd(q, k, v, 0.3, causal, "cudnn_hybrid", dense_keys=dense_keys)
    want_out, want_lse = kernels.dense_attn_fwd(q, k, v, 0.3, causal, "reference_hybrid")
    torch.testing.assert_close((got_out, got_lse), (want_out, want_lse), rtol=0, atol=1e-12)
    assert got_out.is_contiguous() and got_lse.shape == (4, lq)
    got = kernels.dense_attn_bwd(dout, q, k, v, got_out, got_lse, 0.3, causal, "cudnn_hybrid", dense_keys=dense_keys)
    want = kernels.dense_attn_bwd(dout, q, k, v, want_out, want_lse, 0.3, causal, "reference_hybrid")
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name,mb,lengths", handmade_microbatches()[:6], ids=lambda x: x if isinstance(x, str) else "")
@pytest.mark.parametrize("buckets", [None, 1])
def test_engine_with_cudnn_hybrid_is_exact(cudnn_hybrid_on_cpu, name, mb, lengths, buckets):
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=9)
    ref = dense_reference(problem)
    for r, got in enumerate(run_all_ranks(problem, backend="cudnn_hybrid", dense_threshold=2, dense_buckets=buckets)):
        assert_within(max_errors(problem, r, ref, got), 1e-10, f"rank {r}")


@pytest.mark.parametrize("seed", range(6))
def test_random_plans_with_cudnn_hybrid_are_exact(cudnn_hybrid_on_cpu, seed):
    rng = np.random.default_rng(100 + seed)
    mb, lengths = random_microbatch(rng, int(rng.integers(1, 5)), num_samples=4, max_len=16)
    problem = Problem.make(mb, lengths, 4, 1, 8, seed=seed)
    ref = dense_reference(problem, 0.6)
    buckets = (None, 1, 2, 8)[seed % 4]
    for r, got in enumerate(
        run_all_ranks(
            problem, 0.6, backend="cudnn_hybrid", dense_threshold=int(rng.integers(1, 6)), dense_buckets=buckets
        )
    ):
        assert_within(max_errors(problem, r, ref, got), 1e-10, f"rank {r}")
