"""Where the host's time goes when it queues one ringpack attention call (cProfile, GPU kept busy).

Run by torchrun like ``benchmarks/attention.py``, with the same case definitions:

    torchrun --nproc_per_node=2 benchmarks/probes/profile_host.py --tokens 16384 --case short --out host.txt

With a small micro-batch the host, not the GPU, can set the pace: the synchronised wall time of
``benchmarks/attention.py`` charges every launch to the call, and a step whose host work exceeds
its GPU work leaves the GPU idle. This script parks the GPU in a spin (``torch.cuda._sleep``) so
that no launch ever waits, then profiles the host alone over a few forward(+backward) calls and
prints, per rank, the host milliseconds per call and the functions that take them (``tottime``:
time in the function itself, Python or a torch operator; ``cumtime``: with its callees).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attention import SLEEP_CYCLES_PER_MS, init_distributed, local_index, schedule_options, split_for
from profile_attention import add_config_args, config_inputs, write_ranks


def host_profile(thunk, backward: bool, iters: int, top: int) -> tuple[float, str]:
    """Host ms per call (median) and the cProfile table of ``iters`` calls queued behind a GPU spin."""
    for _ in range(2):  # warm-up: graph builds, allocator
        out = thunk()
        if backward:
            out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    grad = torch.ones_like(out)
    times, prof = [], cProfile.Profile()
    for _ in range(iters):
        torch.cuda.synchronize()
        torch.cuda._sleep(50 * SLEEP_CYCLES_PER_MS)  # launches below never wait for the GPU
        began = time.perf_counter()
        prof.enable()
        out = thunk()
        if backward:
            out.backward(grad)
        prof.disable()
        times.append((time.perf_counter() - began) * 1e3)
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    times.sort()
    return times[len(times) // 2], text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser, case="short", backend="auto", iters=20, out="host.txt")
    parser.add_argument("--strategy", default="balanced")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()

    rank, world, device = init_distributed()
    from ringpack.attention import compile_schedule, ring_attention

    backward = args.pass_name == "fwdbwd"
    lengths, q, k, v = config_inputs(args, world, device)
    mb = split_for(args.strategy, lengths, world, args.slack)
    index = local_index(mb, rank, lengths).to(device)
    schedule = compile_schedule(mb, rank, **schedule_options(args)).to(device)
    ql, kl, vl = (t.index_select(0, index).requires_grad_(backward) for t in (q, k, v))
    dist.barrier()
    ms, table = host_profile(
        lambda: ring_attention(ql, kl, vl, schedule, mode=args.mode, backend=args.backend),
        backward,
        args.iters,
        args.top,
    )
    text = (
        f"### rank {rank}: {args.case} {args.tokens} {args.shape} {args.pass_name} {args.mode} {args.strategy}: "
        f"host {ms:.3f} ms per call\n{table}"
    )
    write_ranks(text, args.out, world, rank)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
