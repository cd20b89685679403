"""ringpack's one-rank attention path against one bare flash-attn-4 call, on the kernel table's micro-batches.

    PYTHONPATH=$PWD python benchmarks/one_rank_path.py --out one_rank.json [--profile mix-64K]

For each micro-batch (heavy-tailed mixes of 16K, 64K and 128K tokens, one 16K and one 64K sample,
16 and 64 samples of 1K), forward + backward, bf16, 32 query / 8 K/V heads, head_dim 128:

* ``bare``: ``flash_attn.cute.flash_attn_varlen_func`` over the whole micro-batch (its own autograd);
* ``ringpack <backend>``: ``ring_attention`` on the micro-batch's one-rank schedule.

Times are GPU time per iteration with the host ahead (the GPU parked in a spin while the host
queues, CUDA events around the calls), median of ``--iters`` after ``--warmup``; useful TFLOP/s
counts the causal pairs only (``4 * head_dim * heads * pairs`` forward, x3.5 forward + backward).
``--profile CASE`` adds, for that case, the CUDA kernels and copies each implementation runs per
iteration (name, calls, total microseconds) from ``torch.profiler``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import case_lengths

from ringpack.attention import compile_schedule, ring_attention
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SLEEP_CYCLES_PER_MS = 1_500_000


def micro_batches(seed: int) -> dict[str, list[int]]:
    """The kernel table's micro-batches as sample lengths."""
    return {
        "mix-16K": case_lengths("mix", 16384, seed),
        "mix-64K": case_lengths("mix", 65536, seed),
        "mix-128K": case_lengths("mix", 131072, seed),
        "single-16K": [16384],
        "single-64K": [65536],
        "short-16x1K": [1024] * 16,
        "short-64x1K": [1024] * 64,
    }


def one_rank(lengths: list[int]) -> MicroBatch:
    pieces = [Piece(i, 0, n) for i, n in enumerate(lengths)]
    return microbatch_from_shards(range(len(lengths)), [pieces], lengths)


def bare_fa4(q, k, v, lengths):
    from flash_attn.cute import flash_attn_varlen_func

    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=q.device)
    longest = max(lengths)

    def run():
        out = flash_attn_varlen_func(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest, causal=True
        )
        return out[0] if isinstance(out, tuple) else out

    return run


def ringpack_path(q, k, v, lengths, backend: str):
    schedule = compile_schedule(one_rank(lengths), 0).to(q.device)
    return lambda: ring_attention(q, k, v, schedule, backend=backend)


def fwd_bwd(run, grad) -> None:
    out = run()
    out.backward(grad)


def gpu_ms(run, grad, iters: int, warmup: int, hold_ms: float) -> float:
    for _ in range(warmup):
        fwd_bwd(run, grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(hold_ms * SLEEP_CYCLES_PER_MS))
        start.record()
        fwd_bwd(run, grad)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernels(run, grad) -> list[dict]:
    """The CUDA kernels and memory operations of one iteration: name, calls, total microseconds."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fwd_bwd(run, grad)
        torch.cuda.synchronize()
    rows = [
        {"name": e.key[:90], "calls": e.count, "us": round(e.device_time_total, 1)}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["us"])


def timing_parser(description: str) -> argparse.ArgumentParser:
    """The flags this benchmark and ``ulysses_rank.py`` share: output, backends, cases, timing."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--backends", default="auto,fa4")
    parser.add_argument("--cases", default="")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hold-ms", type=float, default=20.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = timing_parser(__doc__)
    parser.add_argument("--profile", default="", help="comma-separated cases to profile")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    cases = micro_batches(args.seed)
    wanted = [c for c in args.cases.split(",") if c] or list(cases)
    for case in wanted:
        lengths = cases[case]
        total = sum(lengths)
        q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(total, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        pairs = sum(n * (n + 1) // 2 for n in lengths)
        flops = 4 * HEAD_DIM * HEADS * pairs * 3.5
        impls = {"bare fa4": bare_fa4(q, k, v, lengths)}
        impls.update({f"ringpack {b}": ringpack_path(q, k, v, lengths, b) for b in args.backends.split(",")})
        for name, run in impls.items():
            ms = gpu_ms(run, grad, args.iters, args.warmup, args.hold_ms)
            row = {"case": case, "samples": len(lengths), "tokens": total, "impl": name, "gpu_ms": ms}
            row["tflops"] = flops / ms / 1e9
            if case in args.profile.split(","):
                row["kernels"] = kernels(run, grad)
            rows.append(row)
            print(f"{case:12s} {len(lengths):4d} samples  {name:18s} {ms:8.3f} ms  {row['tflops']:6.0f} TFLOP/s")
        base = next(r["gpu_ms"] for r in rows if r["case"] == case and r["impl"] == "bare fa4")
        for r in rows:
            if r["case"] == case:
                r["vs_bare"] = base / r["gpu_ms"]
    device = torch.cuda.get_device_name()
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
