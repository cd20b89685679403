"""Can cuDNN take a full block's keys padded up to a bucket length, with the padding masked by a
bias, instead of the flash "key tail" that shape buckets need today?

    python benchmarks/probes/cudnn_key_padding.py --out cudnn_key_padding.json

For non-causal blocks of ``m`` query rows (a bucket length) x ``n`` keys (not one), bf16, head_dim
128, it times forward and backward (CUDA events, graphs built beforehand) of:

* ``exact``: the dense cuDNN kernel on exactly ``n`` keys (one graph per ``n``: what buckets avoid);
* ``tail``: ringpack's key split, cuDNN on the bucket below ``n`` plus flash on the rest;
* ``bias_row``: cuDNN on keys zero-padded to the bucket above ``n``, with an additive bias
  ``[1, 1, 1, n_pad]`` (0, then -inf on the padding) broadcast over the query rows (stride 0);
* ``bias_full``: the same bias materialised as ``[1, 1, m, n_pad]``.

and checks every output (out, lse, dq, dk, dv) against the ``exact`` run. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _bucket_up(n: int, buckets: int) -> int:
    from ringpack.attention.schedule import dense_bucket

    down = int(dense_bucket(n, buckets))
    if down == n:
        return n
    step = 1 << max(int(n).bit_length() - 1 - (buckets.bit_length() - 1), 0)
    return down + step


def event_ms(fn, iters: int) -> float:
    """Mean milliseconds of `fn()` over `iters` calls after two untimed ones (CUDA events)."""
    import torch

    for _ in range(2):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def run(shapes: list[tuple[int, int]], heads: int, kv_heads: int, buckets: int, iters: int) -> list[dict]:
    import torch

    from ringpack.attention import kernels as K
    from ringpack.attention.schedule import dense_bucket

    dev, dt, scale = torch.device("cuda"), torch.bfloat16, 128**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    aten = torch.ops.aten
    seed, offset = K._cudnn_no_dropout_rng(dev)
    rows = []
    for m, n in shapes:
        q = torch.randn(m, heads, 128, device=dev, dtype=dt, generator=gen)
        k = torch.randn(n, kv_heads, 128, device=dev, dtype=dt, generator=gen)
        v = torch.randn(n, kv_heads, 128, device=dev, dtype=dt, generator=gen)
        dout = torch.randn_like(q)
        down, up = int(dense_bucket(n, buckets)), _bucket_up(n, buckets)
        kp = torch.cat((k, k.new_zeros(up - n, kv_heads, 128)))
        vp = torch.cat((v, v.new_zeros(up - n, kv_heads, 128)))
        row_bias = torch.zeros(1, 1, 1, up, device=dev, dtype=dt)
        row_bias[..., n:] = float("-inf")
        biases = {"bias_row": row_bias.expand(1, 1, m, up), "bias_full": row_bias.expand(1, 1, m, up).contiguous()}

        def exact_fwd():
            return K._cudnn_dense_fwd(q, k, v, scale, False)

        ref_out, ref_lse = exact_fwd()
        ref = dict(out=ref_out, lse=ref_lse)
        ref.update(zip(("dq", "dk", "dv"), K._cudnn_dense_bwd(dout, q, k, v, ref_out, ref_lse, scale, False)))
        variants = {
            "exact": (exact_fwd, lambda o, lse: K._cudnn_dense_bwd(dout, q, k, v, o, lse, scale, False)),
            "tail": (
                lambda: K.dense_attn_fwd(q, k, v, scale, False, "cudnn_hybrid", dense_keys=down),
                lambda o, lse: K.dense_attn_bwd(
                    dout, q, k, v, o.to(q.dtype), lse, scale, False, "cudnn_hybrid", dense_keys=down
                ),  # its out is float
            ),
        }
        for name, bias in biases.items():

            def fwd(bias=bias):
                res = aten._scaled_dot_product_cudnn_attention(
                    K._bhsd(q), K._bhsd(kp), K._bhsd(vp), bias, True, 0.0, False, False, scale=scale
                )
                return K._shd(res[0]), res[1]

            def bwd(o, lse4, bias=bias):
                dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                    K._bhsd(dout), K._bhsd(q), K._bhsd(kp), K._bhsd(vp), K._bhsd(o), lse4, seed, offset,
                    bias, None, None, m, up, 0.0, False, scale=scale,
                )  # fmt: skip
                return K._shd(dq), K._shd(dk)[:n], K._shd(dv)[:n]

            variants[name] = (fwd, bwd)
        for name, (fwd, bwd) in variants.items():
            row = dict(
                m=m, n=n, heads=heads, kv_heads=kv_heads, variant=name, keys=up if name.startswith("bias") else n
            )
            try:
                out, lse = fwd()
                grads = bwd(out, lse)
                got = dict(out=out, lse=lse.reshape(heads, m), dq=grads[0], dk=grads[1], dv=grads[2])
                row["max_err"] = {
                    key: float(
                        (got[key].float() - ref[key].float().reshape(got[key].shape)).abs().max()
                        / ref[key].float().abs().max()
                    )
                    for key in ref
                }
                row["fwd_ms"] = event_ms(fwd, iters)
                row["bwd_ms"] = event_ms(lambda: bwd(out, lse), iters)
            except Exception as exc:  # a refused layout is a result here, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="3840x2300,5120x4700,7680x6100,7680x12000", help="MxN,...")
    parser.add_argument("--heads", default="32x8,32x32", help="QxKV,...")
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="cudnn_key_padding.json")
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for hk in args.heads.split(","):
        h, kvh = (int(x) for x in hk.split("x"))
        rows += run(shapes, h, kvh, args.buckets, args.iters)
    print(f"{'m':>6} {'n':>6} {'heads':>6} {'variant':>9} {'keys':>6} {'fwd ms':>8} {'bwd ms':>8} {'max err':>8}")
    for r in rows:
        if "error" in r:
            print(
                f"{r['m']:>6} {r['n']:>6} {r['heads']}/{r['kv_heads']:<3} {r['variant']:>9} error: {r['error'][:120]}"
            )
            continue
        err = max(r["max_err"].values())
        print(
            f"{r['m']:>6} {r['n']:>6} {r['heads']:>3}/{r['kv_heads']:<2} {r['variant']:>9} {r['keys']:>6} "
            f"{r['fwd_ms']:8.3f} {r['bwd_ms']:8.3f} {err:8.1e}"
        )
    Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
