"""Equal-length samples: flash varlen against one batched cuDNN call.

    python benchmarks/probes/cudnn_batched.py --out cudnn_batched.json

A run of ``n`` consecutive samples of one length ``L`` (fixed-length packing, the benchmark's
"short" case) is, in memory, a ``[n, L, H, D]`` tensor: cuDNN's dense SDPA can take it as a batch
(a view, no copy) where ringpack's hybrid today sends short samples to flash varlen. For each
``L`` (``--tokens`` rows in all, bf16, head_dim 128) this times forward and backward (CUDA
events, graphs built beforehand) of both, checks that they agree, and prints a table and JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cudnn_key_padding import event_ms


def run(lengths: list[int], tokens: int, heads: int, kv_heads: int, iters: int) -> list[dict]:
    import torch

    from ringpack.attention import kernels as K

    dev, dt, scale = torch.device("cuda"), torch.bfloat16, 128**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    aten = torch.ops.aten
    seed, offset = K._cudnn_no_dropout_rng(dev)
    rows = []
    for length in lengths:
        n = tokens // length
        q = torch.randn(n * length, heads, 128, device=dev, dtype=dt, generator=gen)
        k, v = (torch.randn(n * length, kv_heads, 128, device=dev, dtype=dt, generator=gen) for _ in range(2))
        dout = torch.randn_like(q)
        cu = torch.arange(0, n * length + 1, length, dtype=torch.int32, device=dev)

        def batch(x):  # [n*L, H, D] -> [n, H, L, D] view
            return x.view(n, length, x.shape[1], 128).transpose(1, 2)

        def flash_fwd():
            return K.varlen_attn_fwd(q, k, v, cu, cu, length, length, scale, True, "torch_flash")

        def cudnn_fwd():
            res = aten._scaled_dot_product_cudnn_attention(
                batch(q), batch(k), batch(v), None, True, 0.0, True, False, scale=scale
            )
            return res[0], res[1]

        f_out, f_lse = flash_fwd()
        c_out, c_lse = cudnn_fwd()

        def flash_bwd():
            return K.varlen_attn_bwd(dout, q, k, v, f_out, f_lse, cu, cu, length, length, scale, True, "torch_flash")

        def cudnn_bwd():
            return aten._scaled_dot_product_cudnn_attention_backward(
                batch(dout), batch(q), batch(k), batch(v), c_out, c_lse, seed, offset,
                None, None, None, length, length, 0.0, True, scale=scale,
            )  # fmt: skip

        f_grads, c_grads = flash_bwd(), cudnn_bwd()
        got = [c_out.transpose(1, 2).reshape(-1, heads, 128)] + [
            g.transpose(1, 2).reshape(-1, g.shape[1], 128) for g in c_grads
        ]
        want = [f_out, *f_grads]
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max()) for a, b in zip(got, want))
        pairs = n * length * (length + 1) // 2
        row = dict(length=length, samples=n, heads=heads, kv_heads=kv_heads, max_rel_diff=err)
        for name, fwd, bwd in (("flash", flash_fwd, flash_bwd), ("cudnn", cudnn_fwd, cudnn_bwd)):
            row[f"{name}_fwd_ms"] = event_ms(fwd, iters)
            row[f"{name}_bwd_ms"] = event_ms(bwd, iters)
            row[f"{name}_tflops"] = (
                4 * 128 * heads * pairs * 3.5 / ((row[f"{name}_fwd_ms"] + row[f"{name}_bwd_ms"]) * 1e-3) / 1e12
            )
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,256,512,1024,2048,4096")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--heads", default="32x8,32x32", help="QxKV,...")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="cudnn_batched.json")
    args = parser.parse_args()
    rows = []
    for hk in args.heads.split(","):
        h, kvh = (int(x) for x in hk.split("x"))
        rows += run([int(x) for x in args.lengths.split(",")], args.tokens, h, kvh, args.iters)
    print(
        f"{'L':>5} {'n':>4} {'heads':>6} {'flash fwd':>9} {'bwd':>7} {'TF/s':>5} "
        f"{'cudnn fwd':>9} {'bwd':>7} {'TF/s':>5} {'speedup':>7} {'diff':>8}"
    )
    for r in rows:
        speed = (r["flash_fwd_ms"] + r["flash_bwd_ms"]) / (r["cudnn_fwd_ms"] + r["cudnn_bwd_ms"])
        print(
            f"{r['length']:>5} {r['samples']:>4} {r['heads']:>3}/{r['kv_heads']:<2} "
            f"{r['flash_fwd_ms']:9.3f} {r['flash_bwd_ms']:7.3f} {r['flash_tflops']:5.0f} "
            f"{r['cudnn_fwd_ms']:9.3f} {r['cudnn_bwd_ms']:7.3f} {r['cudnn_tflops']:5.0f} "
            f"{speed:7.2f}x {r['max_rel_diff']:8.1e}"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
