"""GPU checks of the fa4 backend beyond the kernel contract (tests/attention/test_gpu_ring.py):
after :func:`ringpack.attention.fa4.warm_up` nothing compiles in the steady state, and
``torch.compile(fullgraph=True)`` over fa4 attention equals eager with no recompile per micro-batch.
Skipped cleanly without CUDA or flash-attn-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringpack.attention import compile_schedule, fa4, ring_attention, traced
from ringpack.attention.kernels import varlen_attn_bwd, varlen_attn_fwd
from tests.integrations.test_compile import _microbatch

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and fa4.unusable_reason("cuda", torch.bfloat16, HEAD_DIM) is not None,
        reason="flash-attn-4 does not run here",
    ),
]


def _random_call(rng: np.random.Generator, causal: bool):
    """cu_seqlens of a random call as the schedule makes them: 1-400 segments of 0-3000 rows."""
    segments = int(rng.integers(1, 401))
    q_len = rng.integers(0 if not causal else 1, 3000 // segments + 2, segments)
    k_len = q_len if causal else rng.integers(1, 3000 // segments + 2, segments)
    return [np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (q_len, k_len)]


def test_no_kernel_compiles_after_warm_up():
    """200 calls of every kind with varying segment counts, lengths and max lengths compile nothing new."""
    for dtype in (torch.bfloat16, torch.float16):
        fa4.warm_up(HEADS, KV_HEADS, HEAD_DIM, dtype)
        compiled = fa4.compiled_kernels()
        rng = np.random.default_rng(0)
        for i in range(200):
            causal = bool(i % 2)
            cu_q, cu_k = _random_call(rng, causal)
            q = torch.randn(int(cu_q[-1]), HEADS, HEAD_DIM, device="cuda", dtype=dtype)
            k, v = (torch.randn(int(cu_k[-1]), KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype) for _ in "kv")
            cq, ck = (torch.from_numpy(c).cuda() for c in (cu_q, cu_k))
            mq, mk = int(np.diff(cu_q).max()), int(np.diff(cu_k).max())
            out, lse = varlen_attn_fwd(q, k, v, cq, ck, mq, mk, HEAD_DIM**-0.5, causal, "fa4")
            varlen_attn_bwd(torch.randn_like(out), q, k, v, out, lse, cq, ck, mq, mk, HEAD_DIM**-0.5, causal, "fa4")
        torch.cuda.synchronize()
        assert fa4.compiled_kernels() == compiled, f"{dtype}: kernels compiled after the warm-up"
        assert fa4.warm_up(HEADS, KV_HEADS, HEAD_DIM, dtype) == 0


@pytest.mark.skipif(not traced.OPAQUE_SCHEDULE, reason="this torch has no opaque objects for custom ops")
def test_compiled_fa4_attention_equals_eager_without_recompiles():
    torch._dynamo.reset()
    attention = lambda q, k, v, s: ring_attention(q, k, v, s, backend="fa4")
    compiled = torch.compile(attention, fullgraph=True, dynamic=True)
    rng = np.random.default_rng(1)
    for index in range(20):
        lengths = [int(n) for n in rng.integers(1, 2000, int(rng.integers(1, 30)))]
        schedule = compile_schedule(_microbatch(lengths), 0).to("cuda")
        results = []
        for fn in (compiled, attention):
            gen = torch.Generator(device="cuda").manual_seed(index)
            q = torch.randn(schedule.num_tokens, HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
            k, v = (
                torch.randn(schedule.num_tokens, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).bfloat16()
                for _ in "kv"
            )
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            with torch._dynamo.config.patch(error_on_recompile=index > 0):
                out = fn(q, k, v, schedule)
            results.append([out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v))])
        for got, want in zip(*results):  # the same engine runs inside the custom op; only the loss may fuse
            torch.testing.assert_close(got, want)
