"""What planning ahead costs a Python-heavy training loop: no sampler, the thread planner, the process planner.

    PYTHONPATH=$PWD python benchmarks/planner_loop.py [--samples 1000000] [--steps 6] [--step-s 1.0]
        [--pool-step-s 3.0] [--repeats 3] [--cases mesh,pool] [--out planner_loop.json]

The loop stands in for a training step that launches many small kernels: per step, a number of
``y = x * 2 + 1`` on 64-element tensors, calibrated so a step takes ``--step-s`` seconds alone
(``--pool-step-s`` for the pool), spread over the micro-batches the sampler hands DP rank 0 in
that step. Each case times ``--steps`` steps of that loop three ways: with no sampler, and iterating
a ``BalancedBatchSampler`` with ``planner="thread"`` and ``planner="process"``. The clock starts
once the sampler has handed out its first micro-batch (the first step's planning is start-up, not
the loop's), so what the loop loses is the planner working beside it. The three ways alternate,
``--repeats`` times, and each way's median is kept; the slowdown is against the median without a
sampler. Wall time needs a quiet machine with a core free for the planner; two CPU figures do
not: the loop thread's own CPU seconds, and the CPU seconds of the process's other threads while
the loop ran (``beside it``, as a share of the loop's CPU without a sampler): the most the
sampler's work in this process (a thread planning, or one receiving the planner process's arrays)
can have held the interpreter lock, which is what the loop can lose to it on a free core.

Cases, on ``--samples`` log-normal lengths (median 1,536, sigma 1.3, at most 131,072 tokens):
``mesh`` is DP=64 x CP=8, 32,768 tokens per rank, 8,192 samples per global batch; ``pool`` is
8,192 ranks as one CP group (``dp=1, cp=8192, gpus_per_node=8``, what ``ringpack.plan(world=8192)``
resolves to), 16,384 tokens per rank, one micro-batch per rank, over-long samples split, global
batches of 93% of the pool's tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time

import torch

from ringpack.analysis.simulate import synthetic_lengths
from ringpack.data.sampler import BalancedBatchSampler
from ringpack.shard_plan import PlanConfig

MODES = ("none", "thread", "process")


def configs(lengths, cases: list[str]) -> dict[str, PlanConfig]:
    out = {}
    if "mesh" in cases:
        out["mesh"] = PlanConfig(dp=64, cp=8, tokens_per_rank=32768, samples_per_step=8192)
    if "pool" in cases:
        world, tokens = 8192, 16384
        samples = int(0.93 * world * tokens / float(lengths.mean()))
        out["pool"] = PlanConfig(
            dp=1, cp=world, gpus_per_node=8, tokens_per_rank=tokens, samples_per_step=samples,
            microbatches_per_rank=1, overflow="split",
        )  # fmt: skip
    return out


def ops_per_second(x: torch.Tensor) -> float:
    """How many ``x * 2 + 1`` this process runs per second (alone, best of three)."""
    best = 0.0
    for _ in range(3):
        n, t0 = 2000, time.perf_counter()
        for _ in range(n):
            x * 2 + 1
        best = max(best, n / (time.perf_counter() - t0))
    return best


def process_cpu() -> float:
    """CPU seconds of every thread of this process so far (not of its child processes)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_once(mode: str, lengths, config: PlanConfig, steps: int, ops: int, x: torch.Tensor) -> dict[str, float]:
    """``steps`` steps of ``ops`` small ops each with ``mode``'s sampler: ``seconds`` (wall),
    ``waited`` (seconds waiting for the sampler), ``loop_cpu`` (the loop thread's CPU seconds) and
    ``beside_cpu`` (CPU seconds of this process's other threads meanwhile: the sampler's work on
    this interpreter, an upper bound of the time it can hold the interpreter lock)."""
    if mode == "none":
        t0, c0, p0 = time.perf_counter(), time.thread_time(), process_cpu()
        for _ in range(steps * ops):
            x * 2 + 1
        loop_cpu = time.thread_time() - c0
        return {"seconds": time.perf_counter() - t0, "waited": 0.0, "loop_cpu": loop_cpu,
                "beside_cpu": process_cpu() - p0 - loop_cpu}  # fmt: skip
    sampler = BalancedBatchSampler(lengths, config, 0, planner=mode)
    tickets = iter(sampler)
    ticket = next(tickets)  # start-up: the first step planned
    waited = 0.0
    t0, c0, p0 = time.perf_counter(), time.thread_time(), process_cpu()
    while True:
        for _ in range(ops // ticket.microbatches_in_step):
            x * 2 + 1
        t1 = time.perf_counter()
        ticket = next(tickets)
        waited += time.perf_counter() - t1
        if ticket.step >= steps:
            break
    seconds, loop_cpu, all_cpu = time.perf_counter() - t0, time.thread_time() - c0, process_cpu() - p0
    del tickets, sampler  # the sampler's planner (thread or process) ends with it
    gc.collect()
    return {"seconds": seconds, "waited": waited, "loop_cpu": loop_cpu, "beside_cpu": all_cpu - loop_cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds a mesh step's loop takes alone")
    ap.add_argument("--pool-step-s", type=float, default=3.0, help="seconds a pool step's loop takes alone")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default="mesh,pool")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lengths = synthetic_lengths(args.samples, "lognormal", seed=0, median=1536, sigma=1.3, max_len=131072)
    x = torch.ones(64)
    rate = ops_per_second(x)
    results = {"samples": args.samples, "steps": args.steps, "ops_per_s": rate, "cases": {}}
    print(f"{args.samples:,} lengths; {rate:,.0f} small ops/s alone; load {os.getloadavg()[0]:.1f} at start")
    for name, config in configs(lengths, args.cases.split(",")).items():
        step_s = args.pool_step_s if name == "pool" else args.step_s
        ops = int(rate * step_s)
        runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_once(mode, lengths, config, args.steps, ops, x))
        seconds = {m: [r["seconds"] for r in runs[m]] for m in MODES}
        waits = {m: [r["waited"] for r in runs[m]] for m in MODES}
        base = statistics.median(seconds["none"])
        base_cpu = statistics.median(r["loop_cpu"] for r in runs["none"])
        row = {
            m: {"seconds": seconds[m], "median_s": statistics.median(seconds[m]), "waited_s": waits[m]} for m in MODES
        }
        for m in MODES:
            row[m]["slowdown_pct"] = 100 * (row[m]["median_s"] / base - 1)
            row[m]["loop_cpu_s"] = [r["loop_cpu"] for r in runs[m]]
            row[m]["loop_cpu_slowdown_pct"] = 100 * (statistics.median(row[m]["loop_cpu_s"]) / base_cpu - 1)
            row[m]["beside_cpu_s"] = [r["beside_cpu"] for r in runs[m]]
            row[m]["beside_cpu_pct"] = 100 * statistics.median(row[m]["beside_cpu_s"]) / base_cpu
        row["samples_per_step"], row["dp"], row["cp"], row["step_s"] = (
            config.samples_per_step,
            config.dp,
            config.cp,
            step_s,
        )
        row["load_after"] = os.getloadavg()[0]
        results["cases"][name] = row
        print(
            f"{name}: DP={config.dp} x CP={config.cp}, {config.samples_per_step:,} samples a step, "
            f"{args.steps} steps of {step_s:g} s alone"
        )
        for m in MODES:
            runs_s = ", ".join(f"{s:.2f}" for s in seconds[m])
            waited = ", ".join(f"{s:.2f}" for s in waits[m])
            print(
                f"  {m:8s} median {row[m]['median_s']:7.2f} s  slowdown {row[m]['slowdown_pct']:+6.1f}%  "
                f"loop CPU {row[m]['loop_cpu_slowdown_pct']:+6.1f}%  beside it {row[m]['beside_cpu_pct']:5.1f}%  "
                f"(runs {runs_s}; waiting for the sampler {waited})"
            )
        print(f"  load {row['load_after']:.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
