r"""Where the time of one ringpack attention configuration goes, per rank (torch.profiler, GPU kernels).

Run by torchrun like ``benchmarks/attention.py`` and with the same case definitions:

    torchrun --nproc_per_node=2 benchmarks/profile_attention.py --tokens 16384 --case mix \
        --strategy balanced --backend cudnn_hybrid --out profile.txt

Prints (and writes) each rank's wall time per iteration, its GPU kernels grouped by name and the
last iteration's timeline (kernels in launch order, idle gaps of the compute stream, NCCL kernels
beside them), plus the same for the whole micro-batch on one GPU (``--solo``), so the gap to ideal
scaling can be attributed to kernels (slower kernel choice, extra gathers/merges), to exposed
transfers or to idle GPU time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import add_schedule_args, case_lengths, init_distributed, local_index, schedule_options, split_for


def timeline(prof, min_gap_us: float = 15.0) -> str:
    """The GPU kernels of the last profiled iteration in launch order, one line per run of equal names.

    Shows where a rank sits idle (``gap`` lines: the compute stream has no kernel for at least
    ``min_gap_us``) and which transfers overlap which kernels (NCCL kernels run on their own stream).
    """
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name) as trace:
            events = json.load(trace)["traceEvents"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    marks = sorted(e["ts"] for e in events if e.get("name") == ITERATION_MARK)
    if marks:
        kernels = [e for e in kernels if e["ts"] >= marks[-1]]
    if not kernels:
        return "(no kernels)"
    t0, lines, run, ends = kernels[0]["ts"], [], None, {}

    def flush() -> None:
        if run is not None:
            lines.append(f"{run[2] - t0:9.0f} {run[3]:7.0f} s{run[1]} x{run[4]} {run[0]}")

    for e in kernels:
        name, stream = e["name"][:70], e.get("tid")
        nccl = "nccl" in name.lower()
        last_end = ends.get(nccl)
        if run is not None and run[0] == name and run[1] == stream and not (e["ts"] - last_end >= min_gap_us):
            run[3] += e["dur"]
            run[4] += 1
        else:
            flush()
            if not nccl and last_end is not None and e["ts"] - last_end >= min_gap_us:
                lines.append(f"{last_end - t0:9.0f} {'':>7} gap {e['ts'] - last_end:.0f} us")
            run = [name, stream, e["ts"], e["dur"], 1]
        ends[nccl] = max(ends.get(nccl, 0), e["ts"] + e["dur"])
    flush()
    return "  start_us  dur_us stream count kernel\n" + "\n".join(lines)


ITERATION_MARK = "ringpack-iteration"


def profiled(thunk, backward: bool, iters: int) -> tuple[float, str]:
    """Mean wall ms per iteration, the profiler's kernel table and the last iteration's timeline (after warm-up)."""
    for _ in range(2):
        out = thunk()
        if backward:
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(iters):
            torch.cuda.synchronize()  # the last iteration's timeline starts from an idle GPU
            with record_function(ITERATION_MARK):
                out = thunk()
                if backward:
                    out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3 / iters
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
    return wall, table + "\n" + timeline(prof)


def add_config_args(parser: argparse.ArgumentParser, case: str, backend: str, iters: int, out: str) -> None:
    """The options of a tool that looks at one configuration (this one, ``probes/profile_host.py``): case,
    tokens per GPU, head shape, backend, mode, pass, iterations, balanced slack, schedule options, seed, output."""
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--case", default=case)
    parser.add_argument("--shape", default="32x8")
    parser.add_argument("--backend", default=backend)
    parser.add_argument("--mode", default="ring")
    parser.add_argument("--pass", dest="pass_name", default="fwdbwd")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--slack", type=float, default=0.125)
    add_schedule_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=out)


def config_inputs(
    args: argparse.Namespace, world: int, device: torch.device
) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The configuration's sample lengths and the whole micro-batch's bf16 q, k, v (head_dim 128).

    The same on every rank.
    """
    lengths = case_lengths(args.case, args.tokens * world, args.seed)
    heads, kv_heads = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    q, k, v = (
        torch.randn(sum(lengths), h, 128, device=device, dtype=torch.bfloat16, generator=gen)
        for h in (heads, kv_heads, kv_heads)
    )
    return lengths, q, k, v


def write_ranks(text: str, out: str, world: int, rank: int) -> None:
    """Every rank's report, gathered: rank 0 writes them to ``out`` and prints them."""
    gathered = [None] * world
    dist.all_gather_object(gathered, text)
    if rank == 0:
        Path(out).write_text("\n\n".join(gathered))
        print("\n\n".join(gathered))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, case="mix", backend="cudnn_hybrid", iters=5, out="profile.txt")
    parser.add_argument("--strategies", default="balanced,zigzag")
    parser.add_argument("--solo", action="store_true", help="also profile the whole micro-batch on one GPU")
    args = parser.parse_args()

    rank, world, device = init_distributed()
    from ringpack.attention import compile_schedule, ring_attention

    backward = args.pass_name == "fwdbwd"
    lengths, q, k, v = config_inputs(args, world, device)
    report = []

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(backward)

    if args.solo:
        solo = compile_schedule(split_for("contiguous", lengths, 1, args.slack), 0, **schedule_options(args)).to(device)
        ql, kl, vl = leaf(q), leaf(k), leaf(v)
        wall, table = profiled(lambda: ring_attention(ql, kl, vl, solo, backend=args.backend), backward, args.iters)
        report.append(f"### rank {rank}: whole micro-batch on one GPU: {wall:.2f} ms/iter\n{table}")
    for strategy in args.strategies.split(","):
        mb = split_for(strategy, lengths, world, args.slack)
        index = local_index(mb, rank, lengths).to(device)
        schedule = compile_schedule(mb, rank, **schedule_options(args)).to(device)
        ql, kl, vl = (leaf(t.index_select(0, index)) for t in (q, k, v))
        dist.barrier()
        wall, table = profiled(
            lambda: ring_attention(ql, kl, vl, schedule, mode=args.mode, backend=args.backend), backward, args.iters
        )
        report.append(
            f"### rank {rank}: {args.mode} {strategy}: {wall:.2f} ms/iter, calls {schedule.num_kernel_calls}\n{table}"
        )
    text = f"lengths ({len(lengths)}): {sorted(lengths, reverse=True)[:8]}...\n" + "\n".join(report)
    write_ranks(text, args.out, world, rank)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
