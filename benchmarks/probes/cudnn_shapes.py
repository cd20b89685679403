"""What a new segment length costs ringpack's cuDNN dense kernel, with and without PyTorch's
``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` (cuDNN's ragged path for BSHD inputs: one graph for every
sequence length instead of one per length).

    python benchmarks/probes/cudnn_shapes.py --out cudnn_shapes.json            # runs both settings
    python benchmarks/probes/cudnn_shapes.py --child 0|1 ...                    # one setting (internal)

Each setting runs in its own process (PyTorch may read the variable once). Per setting it times,
for causal segments and for non-causal blocks (queries != keys), through
``ringpack.attention.kernels.dense_attn_fwd/bwd`` (bf16, 32 query / 8 KV heads, head_dim 128):

* ``first_ms``: forward+backward of each of ``--new`` lengths never seen before (graph builds);
* ``steady_ms`` / ``tflops``: the same lengths again (built graphs);
* ``max_err``: the largest error of out/dq/dk/dv against PyTorch's flash kernel on the same
  segment, relative to the largest reference value (both are bf16 kernels).

Prints a table and writes JSON: the numbers that decide whether ``cudnn_hybrid`` can be the
default on data whose segment lengths never repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _child(avoid: bool, lengths: list[int], heads: int, kv_heads: int) -> list[dict]:
    import torch

    from ringpack.attention.kernels import dense_attn_bwd, dense_attn_fwd, varlen_attn_bwd, varlen_attn_fwd

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for causal in (True, False):
        shapes = [(n, n) if causal else (n, (n * 5) // 8 + 1) for n in lengths]
        warm = shapes[0][0] // 2 + 1  # build the kernel once on an unrelated length (the library itself)
        for phase in ("first", "steady"):
            for lq, lk in ([(warm, warm if causal else warm // 2)] if phase == "first" else []) + shapes:
                q = torch.randn(lq, heads, 128, device=dev, dtype=torch.bfloat16, generator=gen)
                k = torch.randn(lk, kv_heads, 128, device=dev, dtype=torch.bfloat16, generator=gen)
                v = torch.randn(lk, kv_heads, 128, device=dev, dtype=torch.bfloat16, generator=gen)
                dout = torch.randn_like(q)
                scale = 128**-0.5
                torch.cuda.synchronize()
                start = time.perf_counter()
                out, lse = dense_attn_fwd(q, k, v, scale, causal, "cudnn_hybrid")
                dq, dk, dv = dense_attn_bwd(dout, q, k, v, out, lse, scale, causal, "cudnn_hybrid")
                torch.cuda.synchronize()
                ms = (time.perf_counter() - start) * 1e3
                if (lq, lk) == (warm, warm if causal else warm // 2):
                    continue
                row = dict(avoid_recompile=avoid, causal=causal, lq=lq, lk=lk, phase=phase, ms=ms)
                pairs = lq * (lq + 1) // 2 if causal else lq * lk
                row["tflops"] = 4 * 128 * heads * pairs * 3.5 / (ms * 1e-3) / 1e12
                if phase == "steady":
                    cu_q = torch.tensor([0, lq], dtype=torch.int32, device=dev)
                    cu_k = torch.tensor([0, lk], dtype=torch.int32, device=dev)
                    ref_out, ref_lse = varlen_attn_fwd(q, k, v, cu_q, cu_k, lq, lk, scale, causal, "torch_flash")
                    ref = (
                        ref_out,
                        *varlen_attn_bwd(
                            dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, lq, lk, scale, causal, "torch_flash"
                        ),
                    )
                    got = (out, dq, dk, dv)
                    row["max_err"] = max(
                        float((g.float() - r.float()).abs().max() / r.float().abs().max()) for g, r in zip(got, ref)
                    )
                    row["lse_err"] = float((lse.float() - ref_lse.float()).abs().max())
                rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=int, choices=[0, 1])
    parser.add_argument("--new", type=int, default=6, help="new segment lengths per kind")
    parser.add_argument("--base", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", default="cudnn_shapes.json")
    args = parser.parse_args()
    lengths = [args.base + 1531 * i + 17 * (i % 3) for i in range(args.new)]
    if args.child is not None:
        print(json.dumps(_child(bool(args.child), lengths, args.heads, args.kv_heads)))
        return 0
    rows: list[dict] = []
    for avoid in (0, 1):
        env = dict(os.environ)
        env.pop("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", None)
        if avoid:
            env["TORCH_CUDNN_SDPA_AVOID_RECOMPILE"] = "1"
        cmd = [sys.executable, __file__, "--child", str(avoid), "--new", str(args.new), "--base", str(args.base),
               "--heads", str(args.heads), "--kv-heads", str(args.kv_heads)]  # fmt: skip
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if res.returncode:
            print(f"AVOID_RECOMPILE={avoid}: failed\n{res.stderr[-3000:]}")
            rows.append(dict(avoid_recompile=bool(avoid), error=res.stderr[-500:]))
            continue
        rows += json.loads(res.stdout.strip().splitlines()[-1])
    print(f"{'avoid':>5} {'causal':>6} {'lq':>6} {'lk':>6} {'phase':>6} {'ms':>9} {'TF/s':>6} {'max_err':>8}")
    for r in rows:
        if "error" in r:
            continue
        err = f"{r['max_err']:.2e}" if "max_err" in r else ""
        print(
            f"{int(r['avoid_recompile']):>5} {int(r['causal']):>6} {r['lq']:>6} {r['lk']:>6} {r['phase']:>6} "
            f"{r['ms']:9.2f} {r['tflops']:6.0f} {err:>8}"
        )
    Path(args.out).write_text(json.dumps(dict(lengths=lengths, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
