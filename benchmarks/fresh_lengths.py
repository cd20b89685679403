"""Training on fresh sample lengths: what cuDNN's per-shape graph builds cost ring attention, with
and without the schedule's dense shape buckets.

Run on a machine with 2 GPUs (one process per GPU):

    torchrun --nproc_per_node=2 benchmarks/fresh_lengths.py --out fresh_lengths.json

Every step draws a new heavy-tailed mix (``attention.py``'s benchmark mix, seed = step), splits it
with ``balanced``, compiles the schedules (not timed: a DataLoader worker's job) and times one
forward+backward of ring attention over it, the way each attention layer meets a new micro-batch
in training (``--layers`` forward+backward calls per step: a model's layers share the cached
graphs, so one layer per step overstates what builds cost). Each configuration runs the same
steps twice, in the order of ``--configs`` (default: ``torch_flash``; ``cudnn_hybrid`` with the
default buckets; ``cudnn_hybrid`` with exact dense shapes, ``dense_buckets=None``, the behaviour
before buckets). The first pass meets every
shape for the first time ("fresh"); the second repeats the steps with every graph built ("warm").

Columns: total seconds of each pass, the fresh pass's total after 1/8, 1/4 and 1/2 of the steps, the
mean step of the fresh pass's last quarter and of the warm pass, and the new dense shapes per step
(cuDNN builds a forward and a backward graph for each) in the first and the last quarter of the
fresh pass: with buckets that count falls towards zero as training goes on; with exact shapes it
does not. ``--count-shapes N`` (no GPU) instead compiles the schedules of N such steps and prints
how many distinct dense shapes each bucket setting has met by step 16, 100, 300, 1000 and 3000
(summed over the ranks, each of which builds its own), i.e. how far the builds go. Before the first
configuration, one untimed ring step on short samples warms NCCL and the flash kernels, and one
cuDNN call on an unused shape loads cuDNN. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import case_lengths, init_distributed, local_index, split_for

from ringpack.attention.schedule import DEFAULT_DENSE_BUCKETS

CONFIGS = f"torch_flash,cudnn_hybrid:{DEFAULT_DENSE_BUCKETS},cudnn_hybrid:none"


def parse_configs(text: str) -> list[tuple[str, int | None]]:
    """``backend[:buckets],...`` -> ``[(backend, dense_buckets)]``.

    Buckets ``none`` mean exact shapes; torch_flash has no buckets.
    """
    configs = []
    for item in text.split(","):
        backend, _, buckets = item.partition(":")
        configs.append((backend, None if buckets in ("", "none") else int(buckets)))
    return configs


def dense_shapes(schedule) -> set[tuple[int, int, int, bool]]:
    """The dense kernel's shapes a schedule runs: (batch, queries, keys, causal) per dense part, padding included."""
    calls = ([schedule.local] if schedule.local is not None else []) + [
        c for step in schedule.steps for c in step.calls
    ]
    return {(d.batch, d.q_run, d.k_run, call.causal) for call in calls for d in call.dense}


def count_shapes(
    tokens: int, steps: int, world: int, slack: float, settings=(8, 16, 32, None), dense_threshold: int | None = None
) -> dict:
    """Distinct dense shapes (rank, queries, dense keys, causal) met by each step mark, per bucket setting (CPU only);
    ``dense_threshold``: compile_schedule's (None: its default)."""
    from ringpack.attention import compile_schedule

    seen: dict = {b: set() for b in settings}
    marks: dict = {}
    for s in range(steps):
        lengths = case_lengths("mix", tokens * world, 1000 + s)
        mb = split_for("balanced", lengths, world, slack)
        for b in settings:
            for rank in range(world):
                options = (
                    dict(dense_buckets=b)
                    if dense_threshold is None
                    else dict(dense_buckets=b, dense_threshold=dense_threshold)
                )
                seen[b] |= {(rank, *shape) for shape in dense_shapes(compile_schedule(mb, rank, **options))}
        if s + 1 in (16, 100, 300, 1000, 3000, 10000) or s + 1 == steps:
            marks[s + 1] = {str(b): len(v) for b, v in seen.items()}
    return marks


def step_ms(run) -> float:
    """Slowest rank's milliseconds for one forward+backward (all ranks start together)."""
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    torch.cuda.synchronize()
    mine = (time.perf_counter() - start) * 1e3
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return max(gathered)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16384,65536", help="tokens per GPU, comma separated")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument(
        "--layers", type=int, default=1, help="attention calls (forward+backward) per step, on the step's schedule"
    )
    parser.add_argument("--shape", default="32x8", help="q_heads x kv_heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--slack", type=float, default=0.125)
    parser.add_argument("--world", type=int, default=2, help="--count-shapes: CP ranks")
    parser.add_argument(
        "--count-shapes", type=int, default=0, metavar="N", help="no GPU: count dense shapes over N steps"
    )
    parser.add_argument(
        "--configs", default=CONFIGS, help="backend[:dense buckets|none],... in the order run (default %(default)s)"
    )
    parser.add_argument(
        "--dense-threshold",
        type=int,
        default=None,
        help="--count-shapes: compile_schedule's dense_threshold (default: its own)",
    )
    parser.add_argument("--out", default="fresh_lengths.json")
    args = parser.parse_args()
    if args.count_shapes:
        result = {}
        for tokens in [int(t) for t in args.tokens.split(",")]:
            result[tokens] = count_shapes(
                tokens, args.count_shapes, args.world, args.slack, dense_threshold=args.dense_threshold
            )
            for step, counts in result[tokens].items():
                print(
                    f"{tokens:>6d} tokens/GPU, step {step:>5d}: distinct dense shapes "
                    + "  ".join(f"buckets={b}: {n}" for b, n in counts.items()),
                    flush=True,
                )
        meta = dict(date=time.strftime("%Y-%m-%d"), argv=sys.argv, world=args.world)
        Path(args.out).write_text(json.dumps(dict(meta=meta, shapes=result), indent=1))
        return 0

    rank, world, device = init_distributed()
    from ringpack.attention import compile_schedule, ring_attention
    from ringpack.attention.kernels import dense_attn_bwd, dense_attn_fwd

    heads, kv_heads = (int(x) for x in args.shape.split("x"))
    gen = torch.Generator(device=device).manual_seed(0)
    # cuDNN's library and first graph once, on a shape no step uses
    warm = [
        torch.randn(333, h, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
        for h in (heads, kv_heads, kv_heads)
    ]
    out, lse = dense_attn_fwd(*warm, 1.0, True, "cudnn_hybrid")
    dense_attn_bwd(torch.ones_like(out), *warm, out, lse, 1.0, True, "cudnn_hybrid")
    short = split_for("balanced", case_lengths("short", 2048 * world, 0), world, args.slack)  # no dense segment
    n = local_index(short, rank, case_lengths("short", 2048 * world, 0)).numel()
    qkv = [
        torch.randn(n, h, args.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        for h in (heads, kv_heads, kv_heads)
    ]
    ring_attention(*qkv, compile_schedule(short, rank).to(device), backend="torch_flash").sum().backward()
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        steps = []
        for s in range(args.steps):
            lengths = case_lengths("mix", tokens * world, 1000 + s)
            mb = split_for("balanced", lengths, world, args.slack)
            steps.append((mb, local_index(mb, rank, lengths).to(device), len(lengths)))
        for backend, buckets in parse_configs(args.configs):
            seen: set = set()
            row = dict(
                tokens_per_gpu=tokens,
                shape=args.shape,
                backend=backend,
                dense_buckets=buckets,
                steps=args.steps,
                layers=args.layers,
            )
            for pass_name in ("fresh", "warm"):
                times, new = [], []
                for mb, index, _ in steps:
                    schedule = compile_schedule(mb, rank, dense_buckets=buckets).to(device)
                    shapes = dense_shapes(schedule) if backend == "cudnn_hybrid" else set()
                    counts = [None] * world
                    dist.all_gather_object(counts, len(shapes - seen))
                    seen |= shapes
                    n = index.numel()
                    q = torch.randn(
                        n, heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True
                    )
                    k, v = (
                        torch.randn(
                            n,
                            kv_heads,
                            args.head_dim,
                            device=device,
                            dtype=torch.bfloat16,
                            generator=gen,
                            requires_grad=True,
                        )
                        for _ in range(2)
                    )

                    def run() -> None:
                        for _ in range(args.layers):
                            ring_attention(q, k, v, schedule, backend=backend).backward(
                                torch.ones(n, heads, args.head_dim, device=device, dtype=torch.bfloat16)
                            )

                    times.append(step_ms(run))
                    new.append(max(counts))
                    del q, k, v
                row[f"{pass_name}_total_s"] = sum(times) / 1e3
                row[f"{pass_name}_step_ms"] = times
                row[f"{pass_name}_late_mean_ms"] = statistics.fmean(times[-max(len(times) // 4, 1) :])
                if pass_name == "fresh":
                    row["new_shapes_per_step"] = new
            rows.append(row)
            if rank == 0:
                new, fresh = row["new_shapes_per_step"], row["fresh_step_ms"]
                quarter = max(len(new) // 4, 1)
                marks = " ".join(f"{sum(fresh[: max(len(fresh) // d, 1)]) / 1e3:6.2f}" for d in (8, 4, 2))
                print(
                    f"{tokens:>6d} {args.shape:>5s} x{args.layers} {backend:13s} buckets={str(buckets):5s} "
                    f"fresh {row['fresh_total_s']:7.2f} s (1/8 1/4 1/2: {marks})  warm {row['warm_total_s']:7.2f} s  "
                    f"last-quarter step fresh {row['fresh_late_mean_ms']:7.1f} "
                    f"/ warm {row['warm_late_mean_ms']:7.1f} ms  new shapes/step "
                    f"{statistics.fmean(new[:quarter]):4.1f} -> {statistics.fmean(new[-quarter:]):4.1f}",
                    flush=True,
                )
                meta = dict(
                    torch=torch.__version__,
                    device=torch.cuda.get_device_name(device),
                    world=world,
                    date=time.strftime("%Y-%m-%d"),
                    argv=sys.argv,
                )
                Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
