"""GPU benchmark of ringpack's ring and all-gather attention against ideal scaling and PyTorch's CP.

Run on a machine with 2 GPUs (one process per GPU):

    torchrun --nproc_per_node=2 benchmarks/attention.py --out attention.json

Cases (per-sample causal mask, bf16): (a) one sample, (b) a heavy-tailed mix, (c) many 1K-token
samples, at several tokens per GPU, for two head shapes (32 q / 8 kv heads, Llama-3-8B; 32 / 32).
Rows per case:

* ``ideal``: the fastest single-GPU kernel over the whole packed micro-batch, time / world size;
* ``ringpack <mode> <strategy>``: ringpack's runtime, mode ring or allgather, on the plan the
  strategy makes for this micro-batch (contiguous, zigzag, balanced);
* ``torch-cp sdpa-cudnn`` (case a) and ``torch-cp flex-ptrr`` (cases b, c): PyTorch's context
  parallel on the same data.

Times are medians over iterations of the slowest rank (every rank starts together after a barrier,
from an idle GPU, and the clock stops at a synchronise); ``busy`` lists each rank's own time. That
wall time charges the host's launch latency to every call, which training hides (the host queues
later layers while the GPU works), so each row also gets ``gpu_ms``: the GPU time of the same call
with the host ahead (:func:`queued`), and ``host_ms``, the host time to queue it. ``--layers L``
queues L calls back to back per timed iteration (forward, then one backward through all), as a
model's layers do, and reports times per call: a third clock, the wall clock of a pipeline of
layers, where the host queues one call while the GPU runs the one before. ``MiB`` is each rank's
peak memory above its inputs during the calls, and for ringpack rows ``of`` the allowance:
single-GPU flash attention over the rank's own tokens (measured) plus two K/V buffers of the largest
compact buffer. Useful TFLOP/s per GPU count only the causal pairs the mask keeps: ``4 * head_dim *
q_heads * pairs`` forward, x3.5 for forward+backward.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import peers

from ringpack.cost import piece_pairs
from ringpack.shard_plan import MicroBatch


# ----------------------------------------------------------------------------- data
def case_lengths(case: str, total: int, seed: int) -> list[int]:
    """Sample lengths that fill exactly ``total`` tokens for one benchmark case."""
    if case == "single":
        return [total]
    if case == "short":
        n, rest = divmod(total, 1024)
        return [1024] * n + ([rest] if rest else [])
    if case == "mix":  # heavy tail: Pareto lengths from 128 tokens up to half the micro-batch
        rng = np.random.default_rng(seed)
        lengths, used = [], 0
        cap = max(total // 2, 1)
        while used < total:
            length = int(min(cap, 128 * (1 + rng.pareto(1.1))))
            length = min(length, total - used)
            lengths.append(length)
            used += length
        return lengths
    raise ValueError(f"unknown case {case!r}")


def split_for(strategy: str, lengths: list[int], cp: int, slack: float) -> MicroBatch:
    """The micro-batch's CP split by one strategy (no ortools needed).

    ``balanced`` balances attention pairs alone (an attention-only cost model) under a per-rank
    token budget of ``(1 + slack) * T / cp``; the other two ignore costs by construction.
    """
    from ringpack.cost import CostModel
    from ringpack.planner import split

    samples = list(range(len(lengths)))
    if strategy == "balanced":
        budget = int(-(-sum(lengths) // cp) * (1 + slack))
        return split.split_balanced(
            samples, lengths, cp, tokens_per_rank=budget, cost=CostModel(token=0.0, pair=1.0, name="attention-pairs")
        )
    return getattr(split, f"split_{strategy}")(samples, lengths, cp)


def local_index(mb: MicroBatch, rank: int, lengths: list[int]) -> torch.Tensor:
    """Positions in the packed (global) batch of this rank's tokens, in its canonical order."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    parts = [np.arange(offsets[p.sample] + p.start, offsets[p.sample] + p.stop) for p in mb.shards[rank].pieces]
    return torch.from_numpy(np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64))


# ----------------------------------------------------------------------------- timing
def run_layers(thunk, backward: bool, layers: int = 1) -> list[torch.Tensor]:
    """Queue ``layers`` calls of ``thunk`` back to back, then (``backward``) one backward through
    all of them, as a model's layers queue theirs: with several layers the host queues the next
    call while the GPU runs the last, so the wall time per layer stops charging host latency to
    each call. The calls share their inputs (no data dependency; one CUDA stream orders them)."""
    outs = []
    for _ in range(layers):
        out = thunk()
        outs.append(out[0] if isinstance(out, tuple) else out)
    if backward:
        grad = torch.ones_like(outs[0])
        torch.autograd.backward(outs, [grad] * layers)
    return outs


def timed(thunk, backward: bool, iters: int, warmup: int, layers: int = 1) -> tuple[float, list[float], list[float]]:
    """Median slowest-rank time (ms per layer), this case's per-rank medians and per-rank peak memory (MiB):
    the most any timed iteration allocated above what was allocated when it began (inputs, and
    the .grad a previous iteration left on the leaves, are not counted; the new gradients are).
    ``layers``: calls per iteration (:func:`run_layers`); times are divided by it, memory is not."""
    times, peaks = [], []
    for i in range(warmup + iters):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        outs = run_layers(thunk, backward, layers)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) * 1e3 / layers
        if i >= warmup:
            times.append(elapsed)
            peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        del outs
    mine = (statistics.median(times), max(peaks))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return max(g[0] for g in gathered), [g[0] for g in gathered], [g[1] for g in gathered]


#: The GPU's clock while it waits in ``torch.cuda._sleep`` (cycles per ms; H200 runs at up to 1.98 GHz,
#: so a lower clock only makes the wait longer, which is harmless).
SLEEP_CYCLES_PER_MS = 2_000_000


def queued(thunk, backward: bool, iters: int, hold_ms: float, layers: int = 1) -> tuple[float | None, float]:
    """Median ``(gpu_ms, host_ms)`` per layer of the call with the host ahead of the GPU, as in training.

    Every iteration first parks the GPU in a spin of ``hold_ms`` (``torch.cuda._sleep``), then
    queues the call (forward, and backward; ``layers`` of them, :func:`run_layers`); CUDA events
    around the calls time the GPU alone, so the host's launch latency is hidden as it is behind
    earlier layers in a real step. ``gpu_ms`` is None if the GPU reached the calls before the host
    had queued them all (``hold_ms`` too short): the figure would then include host time.
    """
    gpu, host, ahead = [], [], True
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(hold_ms * SLEEP_CYCLES_PER_MS))
        start.record()
        began = time.perf_counter()
        outs = run_layers(thunk, backward, layers)
        end.record()
        host.append((time.perf_counter() - began) * 1e3 / layers)
        ahead = ahead and not start.query()  # still spinning: everything was queued before the GPU got there
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / layers)
        del outs
    return (statistics.median(gpu) if ahead else None), statistics.median(host)


def budget_mib(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pieces: list[int], buffer_tokens: int, backward: bool
) -> float:
    """The issue's memory allowance for one rank: single-GPU attention over its own tokens (flash
    varlen, its pieces as segments, measured) plus two K/V buffers of the largest compact buffer."""
    peak = 0
    if q.shape[0]:
        thunk = peers.ideal_flash_varlen(*(t.detach().clone().requires_grad_(backward) for t in (q, k, v)), pieces)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = thunk()
        if backward:
            out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    kv_buffer = 2 * buffer_tokens * k.shape[1] * k.shape[2] * k.element_size()
    return (peak + 2 * kv_buffer) / 2**20


def useful_tflops(pairs: int, head_dim: int, heads: int, backward: bool, ms: float, gpus: int) -> float:
    flops = 4 * head_dim * heads * pairs * (3.5 if backward else 1.0)
    return flops / (ms * 1e-3) / gpus / 1e12


# ----------------------------------------------------------------------------- main
def init_distributed() -> tuple[int, int, torch.device]:
    """One process per GPU under torchrun: NCCL group, this rank's GPU as the current device."""
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    return rank, world, device


def add_schedule_args(parser: argparse.ArgumentParser) -> None:
    """``--dense-threshold`` / ``--dense-buckets`` / ``--no-dense-batches``: compile_schedule's kernel-split options.

    The defaults are the library's.
    """
    from ringpack.attention.schedule import DEFAULT_DENSE_BUCKETS, DEFAULT_DENSE_THRESHOLD

    parser.add_argument(
        "--dense-threshold",
        type=int,
        default=DEFAULT_DENSE_THRESHOLD,
        help="hybrid backends: segments this long go to the dense kernel",
    )
    parser.add_argument(
        "--dense-buckets",
        type=lambda x: None if x == "none" else int(x),
        default=DEFAULT_DENSE_BUCKETS,
        help="hybrid backends: dense lengths per octave (compile_schedule's dense_buckets; 'none': exact shapes)",
    )
    parser.add_argument(
        "--no-dense-batches",
        dest="dense_batches",
        action="store_false",
        help=(
            "hybrid backends: leave runs of equal short samples to the varlen kernel (compile_schedule's dense_batches)"
        ),
    )


def schedule_options(args: argparse.Namespace) -> dict:
    """compile_schedule's keyword arguments from :func:`add_schedule_args`' options."""
    return dict(
        dense_threshold=args.dense_threshold, dense_buckets=args.dense_buckets, dense_batches=args.dense_batches
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="16384,65536", help="tokens per GPU, comma separated")
    parser.add_argument("--cases", default="single,mix,short")
    parser.add_argument("--shapes", default="32x8,32x32", help="q_heads x kv_heads, comma separated")
    parser.add_argument("--strategies", default="contiguous,zigzag,balanced")
    parser.add_argument("--modes", default="ring,allgather")
    parser.add_argument("--passes", default="fwd,fwdbwd")
    parser.add_argument(
        "--peers",
        default="ideal,fa4,torch,flex",
        help="comparisons: ideal kernels (fa4: also bare flash-attn-4), torch CP, flex (compiled; slow to build)",
    )
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backends", default="auto", help="ringpack kernel backends, comma separated (a row each)")
    add_schedule_args(parser)
    parser.add_argument("--slack", type=float, default=0.125, help="balanced: per-rank token budget above T/cp")
    parser.add_argument(
        "--gpu-time-max-ms",
        type=float,
        default=100.0,
        help=(
            "also time rows up to this wall time with the host ahead (gpu_ms; longer calls hide launch latency anyway)"
        ),
    )
    parser.add_argument(
        "--forward-part-rows",
        default="default",
        help="the forward without gradients: remote dense blocks in row chunks of at most this many rows "
        "(engine.FORWARD_ONLY_PART_ROWS; 'none': whole blocks)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="calls queued back to back per timed iteration, as a model's layers (times are per call; "
        "peak memory is for all of them, and no allowance is computed)",
    )
    parser.add_argument("--out", default="attention.json")
    args = parser.parse_args()
    if args.layers < 1:
        parser.error("--layers must be at least 1")

    rank, world, device = init_distributed()
    from ringpack.attention import compile_schedule, engine, ring_attention

    if args.forward_part_rows != "default":
        engine.FORWARD_ONLY_PART_ROWS = None if args.forward_part_rows == "none" else int(args.forward_part_rows)

    rows = []
    started = time.time()

    def save() -> None:
        """Rewrite the JSON (rank 0) after every row: a run cut short by a time limit keeps what it measured."""
        if rank == 0:
            meta = dict(
                torch=torch.__version__,
                device=torch.cuda.get_device_name(device),
                world=world,
                date=time.strftime("%Y-%m-%d"),
                argv=sys.argv,
                layers=args.layers,
                forward_part_rows=engine.FORWARD_ONLY_PART_ROWS,
                elapsed_s=round(time.time() - started, 1),
            )
            Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    def record(row: dict) -> None:
        rows.append(row)
        save()
        if rank == 0:
            busy = " ".join(f"{b:.1f}" for b in row.get("busy_ms", []))
            mem = " ".join(f"{m:.0f}" for m in row.get("peak_mib", []))
            if row.get("budget_mib"):
                mem += " of " + " ".join(f"{m:.0f}" for m in row["budget_mib"])
            err = f"  ERROR {row['error']}" if row.get("error") else ""
            print(
                f"{row['case']:6s} {row['tokens_per_gpu']:>6d} {row['shape']:>5s} {row['pass']:6s} "
                f"{row['impl']:28s} {row.get('ms', float('nan')):9.2f} ms {row.get('tflops', float('nan')):7.1f} TF/s "
                f"{row.get('ideal_frac', float('nan')):6.1%}  busy [{busy}]  MiB [{mem}]  "
                f"gpu {row.get('gpu_ms') or float('nan'):.2f} ms {row.get('gpu_ideal_frac', float('nan')):6.1%}{err}",
                flush=True,
            )

    for tokens in [int(t) for t in args.tokens.split(",")]:
        for case in args.cases.split(","):
            lengths = case_lengths(case, tokens * world, args.seed)
            pairs = int(piece_pairs(np.zeros(len(lengths)), np.array(lengths)).sum())
            for shape in args.shapes.split(","):
                heads, kv_heads = (int(x) for x in shape.split("x"))
                gen = torch.Generator(device=device).manual_seed(args.seed)
                total = sum(lengths)
                q = torch.randn(total, heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                k = torch.randn(total, kv_heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                v = torch.randn(total, kv_heads, args.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                for pass_name in args.passes.split(","):
                    backward = pass_name == "fwdbwd"
                    base = dict(
                        case=case,
                        tokens_per_gpu=tokens,
                        shape=shape,
                        samples=len(lengths),
                        layers=args.layers,
                        **{"pass": pass_name},
                    )
                    ideal_ms = ideal_gpu_ms = None

                    def run_row(impl: str, make, gpus: int, budget: list[float] | None = None) -> None:
                        nonlocal ideal_ms, ideal_gpu_ms
                        row = dict(base, impl=impl)
                        thunk = None
                        try:
                            thunk = make()
                            ms, busy, peak = timed(thunk, backward, args.iters, args.warmup, args.layers)
                            if ms * args.layers <= args.gpu_time_max_ms:
                                gpu, host = queued(
                                    thunk,
                                    backward,
                                    args.iters,
                                    hold_ms=max(busy) * args.layers + 5.0,
                                    layers=args.layers,
                                )
                                ranks = [None] * world
                                dist.all_gather_object(ranks, (gpu, host))
                                gpu_busy = [
                                    None if g is None else g / (world if impl.startswith("ideal") else 1)
                                    for g, _ in ranks
                                ]
                                row.update(
                                    host_ms=[h for _, h in ranks],
                                    gpu_busy_ms=gpu_busy,
                                    gpu_ms=None if None in gpu_busy else max(gpu_busy),
                                )
                                if impl.startswith("ideal") and row["gpu_ms"] is not None:
                                    ideal_gpu_ms = (
                                        row["gpu_ms"] if ideal_gpu_ms is None else min(ideal_gpu_ms, row["gpu_ms"])
                                    )
                            if impl.startswith("ideal"):
                                ms, busy = ms / world, [b / world for b in busy]
                            row.update(
                                ms=ms,
                                busy_ms=busy,
                                peak_mib=peak,
                                tflops=useful_tflops(pairs, args.head_dim, heads, backward, ms, world),
                            )
                            if budget is not None and not impl.startswith("ideal"):
                                row["budget_mib"] = budget
                            if impl.startswith("ideal"):
                                ideal_ms = ms if ideal_ms is None else min(ideal_ms, ms)
                        except Exception as exc:  # a failing peer must not sink the whole table
                            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                            if os.environ.get("RINGPACK_BENCH_TRACE"):
                                traceback.print_exc()
                        finally:
                            close = getattr(thunk, "close", None)
                            if close:
                                close()
                        if ideal_ms and "ms" in row:
                            row["ideal_frac"] = ideal_ms / row["ms"]
                        if ideal_gpu_ms and row.get("gpu_ms"):
                            row["gpu_ideal_frac"] = ideal_gpu_ms / row["gpu_ms"]
                        record(row)
                        torch.cuda.empty_cache()

                    def leaf(t: torch.Tensor) -> torch.Tensor:
                        return t.detach().clone().requires_grad_(backward)

                    if "ideal" in args.peers:
                        per = f"(1 GPU)/{world}"
                        run_row(
                            f"ideal flash-varlen {per}",
                            lambda: peers.ideal_flash_varlen(leaf(q), leaf(k), leaf(v), lengths),
                            1,
                        )
                        if "fa4" in args.peers:
                            run_row(
                                f"ideal fa4-varlen {per}",
                                lambda: peers.ideal_fa4_varlen(leaf(q), leaf(k), leaf(v), lengths),
                                1,
                            )
                        if case == "single":
                            run_row(
                                f"ideal cudnn-dense {per}",
                                lambda: peers.ideal_cudnn_dense(leaf(q), leaf(k), leaf(v)),
                                1,
                            )
                        if "flex" in args.peers:
                            run_row(
                                f"ideal flex {per}", lambda: peers.ideal_flex(leaf(q), leaf(k), leaf(v), lengths), 1
                            )
                        whole = split_for("contiguous", lengths, 1, args.slack)  # cp=1: every sample whole
                        solo = compile_schedule(whole, 0, **schedule_options(args)).to(device)

                        def solo_call(backend: str):
                            """The 1-GPU ringpack call on fresh leaves, made when its row starts."""
                            ql, kl, vl = leaf(q), leaf(k), leaf(v)
                            return lambda: ring_attention(ql, kl, vl, solo, backend=backend)

                        for backend in args.backends.split(","):
                            run_row(f"ideal ringpack {backend} {per}", functools.partial(solo_call, backend), 1)
                    for strategy in filter(None, args.strategies.split(",")):
                        mb = split_for(strategy, lengths, world, args.slack)
                        index = local_index(mb, rank, lengths).to(device)
                        schedule = compile_schedule(mb, rank, **schedule_options(args)).to(device)
                        mine = [p.stop - p.start for p in mb.shards[rank].pieces] or [0]
                        budgets = None  # one call's allowance: not comparable with the peak of several layers
                        if args.layers == 1:
                            allowance = budget_mib(
                                *(t.index_select(0, index) for t in (q, k, v)),
                                mine,
                                max(schedule.buffer_tokens),
                                backward,
                            )
                            budgets = [None] * world
                            dist.all_gather_object(budgets, allowance)
                        for backend, mode in itertools.product(args.backends.split(","), args.modes.split(",")):

                            def make(mode=mode, backend=backend, schedule=schedule, index=index):
                                ql, kl, vl = (leaf(t.index_select(0, index)) for t in (q, k, v))
                                return lambda: ring_attention(ql, kl, vl, schedule, mode=mode, backend=backend)

                            tag = "" if backend == "auto" else f" [{backend}]"
                            run_row(f"ringpack {mode} {strategy}{tag}", make, world, budgets)
                    if "torch" in args.peers:
                        if case == "single":
                            run_row(
                                "torch-cp sdpa-cudnn headtail",
                                lambda: peers.torch_cp_sdpa(leaf(q), k, v, "cudnn"),
                                world,
                            )
                        elif "flex" in args.peers:
                            run_row("torch-cp flex ptrr", lambda: peers.torch_cp_flex(leaf(q), k, v, lengths), world)
                del q, k, v
                torch.cuda.empty_cache()

    save()
    if rank == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
