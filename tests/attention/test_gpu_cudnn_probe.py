"""Probe of the cuDNN dense SDPA ops that ``cudnn_hybrid`` relies on (one GPU; skipped without CUDA).

    python tests/attention/test_gpu_cudnn_probe.py        # prints FACT lines and kernel timings
    pytest -m gpu tests/attention/test_gpu_cudnn_probe.py  # asserts the facts the code relies on

Facts (each printed as ``FACT <name>: <value>``):

* ``strided_inputs``: the forward accepts ``[1, H, S, D]`` views of row slices of ``[T, H, D]``
  tensors (BSHD strides, non-zero offset) and is right;
* ``lse_layout`` / ``lse_base``: shape, strides and dtype of the returned logsumexp, and whether it
  is natural log (the merge needs natural log, like flash);
* ``backward``: the backward with that lse is right; ``lse_rank_accepted``: which lse ranks
  (``[1,H,S,1]`` / ``[1,H,S]``) the backward accepts;
* ``backward_uses_given_out_lse``: the backward computes a call's *share* of the gradient when given
  the final merged out/lse (what the ring does); checked by splitting the keys in two halves;
* ``native_gqa``: whether K/V with fewer heads than Q are accepted and exact (then
  ``kernels.CUDNN_NATIVE_GQA = True`` saves the K/V repeat);
* ``graph_build_ms``: first call at a new sequence length (cuDNN builds a graph per shape) vs cached.

Timings: fwd+bwd ms and TFLOP/s of one causal segment per length, flash varlen vs cuDNN dense (as
``cudnn_hybrid`` runs it: with the K/V repeat, and natively if GQA works), to pick the threshold.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

try:
    import pytest
except ImportError:
    pytest = None

DTYPE = torch.bfloat16
TOL = 2e-2  # relative to max |reference|, as the flash contract test


def _ref(q, k, v, causal, scale):
    """fp32 attention with autograd on [S, H, D] (K/V heads repeated): out, natural-log lse."""
    heads = q.shape[1]
    qf, kf, vf = (x.float().detach().requires_grad_() for x in (q, k, v))
    kk, vv = (x.repeat_interleave(heads // x.shape[1], 1) for x in (kf, vf))
    s = torch.einsum("qhd,khd->hqk", qf, kk) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1 + lk - lq), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)
    return (qf, kf, vf), out, lse


def _bhsd(x):
    return x.transpose(0, 1).unsqueeze(0)


def _rel(got, want) -> float:
    """Max error relative to max |want|; ``inf`` for a NaN or inf in either (a NaN would pass ``< TOL``)."""
    err = float((got.float() - want.float()).abs().max()) / max(float(want.float().abs().max()), 1e-6)
    return err if math.isfinite(err) else math.inf


def _inputs(lq, lk, heads, kv_heads, d=128, pad=3, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(lq + 2 * pad, heads, d, device="cuda", generator=gen).to(DTYPE)[pad : pad + lq]
    k = torch.randn(lk + 2 * pad, kv_heads, d, device="cuda", generator=gen).to(DTYPE)[pad : pad + lk]
    v = torch.randn(lk + 2 * pad, kv_heads, d, device="cuda", generator=gen).to(DTYPE)[pad : pad + lk]
    return q, k, v, torch.randn_like(q)


def _fwd(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale
    )


def _bwd(dout, q, k, v, out4, lse, causal, scale):
    seed = torch.zeros((), dtype=torch.int64, device="cuda")
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhsd(dout),
        _bhsd(q),
        _bhsd(k),
        _bhsd(v),
        out4,
        lse,
        seed,
        seed,
        None,
        None,
        None,
        q.shape[0],
        k.shape[0],
        0.0,
        causal,
        scale=scale,
    )


SCALE = 0.09
PROBE_LEN = 1000  # queries and keys of the shared causal segment (8 heads)


def probe_facts() -> dict[str, object]:
    """Run every probe; values are strings/numbers, failures are recorded as 'ERROR: ...'."""
    facts: dict[str, object] = {}
    shared = {"inputs": _inputs(PROBE_LEN, PROBE_LEN, 8, 8)}  # forward results are added for the later probes
    probes = (
        ("strided_inputs", _probe_forward),
        ("backward", _probe_backward),
        ("lse_rank_accepted", _probe_lse_ranks),
        ("backward_uses_given_out_lse", _probe_gradient_shares),
        ("native_gqa", _probe_native_gqa),
        ("graph_build_ms", _probe_graph_build),
    )
    for name, probe in probes:
        try:
            facts[name] = probe(shared, facts)
        except Exception as exc:  # a probe must report, not stop the others
            facts[name] = f"ERROR: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return facts


def _errors(errs: list[float]) -> str:
    return ", ".join(f"{e:.1e}" for e in errs)


def _probe_forward(shared: dict, facts: dict) -> str:
    """The forward on strided row slices, against fp32; records the out and lse layouts and the lse's base."""
    q, k, v, _ = shared["inputs"]
    out4, lse = _fwd(q, k, v, True, SCALE)[:2]
    shared["out4"], shared["lse"] = out4, lse
    (qf, kf, vf), out, lse_ref = _ref(q, k, v, True, SCALE)
    shared["ref"] = (qf, kf, vf, out)
    bshd = out4[0].transpose(0, 1).is_contiguous()
    facts["out_layout"] = f"shape {tuple(out4.shape)} strides {out4.stride()} (BSHD view of [S,H,D]: {bshd})"
    facts["lse_layout"] = f"shape {tuple(lse.shape)} strides {lse.stride()} dtype {lse.dtype}"
    facts["lse_rank_returned"] = lse.dim()
    got = lse.reshape(8, PROBE_LEN).float()
    nat, log2 = _rel(got, lse_ref), _rel(got, lse_ref / math.log(2))
    if nat < 1e-2:
        facts["lse_base"] = f"natural (rel err {nat:.1e})"
    elif log2 < 1e-2:
        facts["lse_base"] = f"log2 (rel err {log2:.1e})"
    else:
        facts["lse_base"] = f"unknown (natural {nat:.1e}, log2 {log2:.1e})"
    err = _rel(out4[0].transpose(0, 1), out)
    return f"{'ok' if err < TOL else 'WRONG'} (out rel err {err:.1e})"


def _probe_backward(shared: dict, facts: dict) -> str:
    """The backward given the forward's own out and lse, against fp32 autograd."""
    q, k, v, dout = shared["inputs"]
    qf, kf, vf, out = shared["ref"]
    out.backward(dout.float())
    dq, dk, dv = _bwd(dout, q, k, v, shared["out4"], shared["lse"], True, SCALE)
    errs = [_rel(g[0].transpose(0, 1), r.grad) for g, r in zip((dq, dk, dv), (qf, kf, vf))]
    return f"{'ok' if max(errs) < TOL else 'WRONG'} (dq/dk/dv rel err {_errors(errs)})"


def _probe_lse_ranks(shared: dict, facts: dict) -> str:
    """Which lse ranks (``[1,H,S,1]`` / ``[1,H,S]``) the backward accepts."""
    q, k, v, dout = shared["inputs"]
    lse = shared["lse"]
    ok = []
    for rank, shaped in ((4, lse.reshape(1, 8, PROBE_LEN, 1)), (3, lse.reshape(1, 8, PROBE_LEN))):
        try:
            _bwd(dout, q, k, v, shared["out4"], shaped.contiguous(), True, SCALE)
            torch.cuda.synchronize()
            ok.append(str(rank))
        except Exception:
            pass
    return "ranks " + (", ".join(ok) or "none")


def _probe_gradient_shares(shared: dict, facts: dict) -> str:
    """Keys split in two halves, each half's backward given the merged out/lse: the sum of the
    shares must be the whole gradient (what the ring relies on)."""
    lk, lq = 1200, 700
    qs, ks, vs, ds = _inputs(lq, lk, 8, 8, seed=2)
    (qf, kf, vf), out, _ = _ref(qs, ks, vs, False, SCALE)
    out.backward(ds.float())
    halves = [(0, 500), (500, lk)]
    parts = [_fwd(qs, ks[a:b], vs[a:b], False, SCALE)[:2] for a, b in halves]
    lses = torch.stack([p[1].reshape(8, lq).float() for p in parts])
    lse = torch.logsumexp(lses, 0)
    merged = sum(
        p[0][0].transpose(0, 1).float() * torch.exp(part_lse - lse).T[..., None] for p, part_lse in zip(parts, lses)
    ).to(DTYPE)
    lse_shape = shared["lse"].shape
    lse_in = lse.reshape(lse_shape[:1] + (8, lq) + lse_shape[3:]).contiguous()
    grads = [_bwd(ds, qs, ks[a:b], vs[a:b], _bhsd(merged), lse_in, False, SCALE) for a, b in halves]
    dq = sum(g[0][0].transpose(0, 1).float() for g in grads)
    dk = torch.cat([g[1][0].transpose(0, 1).float() for g in grads])
    dv = torch.cat([g[2][0].transpose(0, 1).float() for g in grads])
    errs = [_rel(dq, qf.grad), _rel(dk, kf.grad), _rel(dv, vf.grad), _rel(merged, out)]
    return f"{'ok' if max(errs) < TOL else 'WRONG'} (dq/dk/dv/out rel err {_errors(errs)})"


def _probe_native_gqa(shared: dict, facts: dict) -> str:
    """K/V with a quarter of Q's heads, given as they are: accepted and exact?"""
    qg, kg, vg, dg = _inputs(777, 777, 16, 4, seed=3)
    (qf, kf, vf), out, _ = _ref(qg, kg, vg, True, SCALE)
    out.backward(dg.float())
    out4, lse = _fwd(qg, kg, vg, True, SCALE)[:2]
    dq, dk, dv = _bwd(dg, qg, kg, vg, out4, lse, True, SCALE)
    if dk.shape[1] != 4:
        return f"WRONG (dk has {dk.shape[1]} heads)"
    errs = [_rel(out4[0].transpose(0, 1), out)]
    errs += [_rel(g[0].transpose(0, 1), r.grad) for g, r in zip((dq, dk, dv), (qf, kf, vf))]
    return f"{'exact' if max(errs) < TOL else 'WRONG'} (out/dq/dk/dv rel err {_errors(errs)})"


def _probe_graph_build(shared: dict, facts: dict) -> str:
    """fwd+bwd time at a new length (cuDNN builds a graph) and again (cached)."""
    times = []
    qb, kb, vb, db = _inputs(4099, 4099, 8, 8, seed=4)
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out4, lse = _fwd(qb, kb, vb, True, SCALE)[:2]
        _bwd(db, qb, kb, vb, out4, lse, True, SCALE)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return f"first call {times[0]:.1f} ms, cached {times[1]:.1f} ms (fwd+bwd, new length 4099)"


def _time(fn, iters=5) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def timings(lengths=(1024, 2048, 4096, 8192, 16384, 32768), heads=32, kv_heads=8) -> list[str]:
    """fwd+bwd of one causal segment: flash varlen vs the dense kernels cudnn_hybrid would use."""
    from ringpack.attention import kernels

    lines = [
        f"{'len':>6} {'flash ms':>9} {'TF/s':>6} {'cudnn ms':>9} {'TF/s':>6} {'cudnn-gqa ms':>12} {'TF/s':>6}"
        f"   (causal, H={heads}, H_kv={kv_heads}, d=128, fwd+bwd)"
    ]
    for n in lengths:
        q, k, v, dout = _inputs(n, n, heads, kv_heads, pad=0, seed=n)
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        flops = 4 * 128 * heads * n * (n + 1) / 2 * 3.5

        def flash():
            out, lse = kernels.varlen_attn_fwd(q, k, v, cu, cu, n, n, 0.088, True, "torch_flash")
            kernels.varlen_attn_bwd(dout, q, k, v, out, lse, cu, cu, n, n, 0.088, True, "torch_flash")

        def dense():
            out, lse = kernels.dense_attn_fwd(q, k, v, 0.088, True, "cudnn_hybrid")
            kernels.dense_attn_bwd(dout, q, k, v, out, lse, 0.088, True, "cudnn_hybrid")

        cells = []
        for fn, native in ((flash, None), (dense, False), (dense, True)):
            old = kernels.CUDNN_NATIVE_GQA
            try:
                if native is not None:
                    kernels.CUDNN_NATIVE_GQA = native
                ms = _time(fn)
                cells.append(f"{ms:9.2f} {flops / ms / 1e9:6.0f}")
            except Exception as exc:
                cells.append(f"{'error':>9} {type(exc).__name__[:6]:>6}")
            finally:
                kernels.CUDNN_NATIVE_GQA = old
        lines.append(f"{n:>6} {cells[0]} {cells[1]} {cells[2]:>19}")
        del q, k, v, dout
        torch.cuda.empty_cache()
    return lines


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA: nothing to probe")
        return 0
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    facts = probe_facts()
    for name, value in facts.items():
        print(f"FACT {name}: {value}")
    print("\n".join(timings()))
    bad = [
        n
        for n in ("strided_inputs", "backward", "backward_uses_given_out_lse")
        if not str(facts.get(n, "")).startswith("ok")
    ]
    bad += [] if str(facts.get("lse_base", "")).startswith("natural") else ["lse_base"]
    print("PROBE " + ("OK" if not bad else f"FAILED: {bad}"))
    return 1 if bad else 0


if pytest is not None:
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

    @pytest.fixture(scope="module")
    def facts():
        return probe_facts()

    @pytest.mark.gpu
    @needs_cuda
    @pytest.mark.parametrize("name", ["strided_inputs", "backward", "backward_uses_given_out_lse"])
    def test_cudnn_fact_holds(facts, name):
        assert str(facts[name]).startswith("ok"), f"{name}: {facts[name]}"

    @pytest.mark.gpu
    @needs_cuda
    def test_cudnn_lse_is_natural_log_with_an_accepted_rank(facts):
        assert str(facts["lse_base"]).startswith("natural"), facts["lse_base"]
        # the backward is handed the rank the forward returned (kernels._cudnn_lse_rank)
        assert str(facts["lse_rank_returned"]) in str(facts["lse_rank_accepted"]), facts

    @pytest.mark.gpu
    @needs_cuda
    def test_native_gqa_only_if_exact(facts):
        from ringpack.attention import kernels

        print(f"native_gqa: {facts['native_gqa']}")
        if kernels.CUDNN_NATIVE_GQA:
            assert str(facts["native_gqa"]).startswith("exact"), facts["native_gqa"]


if __name__ == "__main__":
    sys.exit(main())
