r"""End-to-end training throughput: ringpack's plans vs zigzag and first-fit packing.

    torchrun --nproc_per_node=2 benchmarks/train.py --grad-ckpt --max-len 32768 --out train.json
    torchrun --nproc_per_node=2 benchmarks/train.py --grad-ckpt --max-len 32768 --no-learn \
        --cost-profile step.json --measure-from 5 --out predicted.json     # check a step profile

Runs the real training example (``examples/train.py``: a randomly initialised Llama, bf16,
ringpack attention inside transformers) on the same heavy-tailed packed data (``--data pareto`` or
``stdlib``) under several (DP x CP, packing, CP split) variants, one after another in one process
group, and reports per variant the median step time, tokens/s over all GPUs and each rank's busy
time (forward+backward before the gradient all-reduce; the rest of the step is waiting for the
slowest rank plus the all-reduce). Steps before ``--measure-from`` are not counted: warm-up, and
by default the cost learner's first fit (it fits after step 3 and re-plans from step 5).

Variants (``--variants``, comma-separated):

* CP=2: ringpack ``balanced`` (cost packing + balanced split, learning the prices from the run),
  ``zigzag`` on ringpack's packing, ``first-fit+zigzag`` (token-count first-fit packing with
  per-sample zigzag: what common samplers plus the usual CP split do), and ``balanced at FLOP
  prices`` (the FLOP model alone, no price range, no token guard, no learner);
* DP=2: ringpack's cost-balanced packing vs token-count first-fit packing.

With ``--cost-profile`` and ``--no-learn`` every variant plans with the profile throughout, and each
rank's busy time is also predicted from the plan
(:func:`ringpack.calibration.step.predicted_busy`) and compared with the measured one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ringpack.shard_plan import NO_TOKEN_GUARD

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    # name: (cp, extra arguments of examples/train.py)
    "cp2 balanced": (2, []),
    "cp2 zigzag": (2, ["--strategy", "zigzag"]),
    "cp2 first-fit+zigzag": (2, ["--packing", "first_fit", "--strategy", "zigzag", "--no-learn-cost"]),
    "cp2 balanced at FLOP prices": (
        2,
        ["--no-learn-cost", "--pair-price-range", "1,1", "--cp-token-slack", str(NO_TOKEN_GUARD)],
    ),
    "dp2 balanced": (1, []),
    "dp2 first-fit": (1, ["--packing", "first_fit", "--no-learn-cost"]),
}


def load_example():
    spec = importlib.util.spec_from_file_location("ringpack_train_example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--model", default="llama-1b")
    p.add_argument("--tokens-per-gpu", type=int, default=65536)
    p.add_argument("--steps", type=int, default=10, help="steps per variant")
    p.add_argument(
        "--measure-from",
        type=int,
        default=5,
        help="first step timed (the cost learner fits after step 3 and re-plans from step 5)",
    )
    p.add_argument("--samples", type=int, default=800)
    p.add_argument("--data", choices=["pareto", "stdlib"], default="pareto", help="sample lengths (examples/train.py)")
    p.add_argument("--samples-per-step", type=int, default=48)
    p.add_argument("--len-scale", type=int, default=768, help="Pareto scale of sample lengths")
    p.add_argument(
        "--max-len", type=int, default=65536, help="longest sample (fits one GPU, so DP=2 runs the same data)"
    )
    p.add_argument("--grad-ckpt", action="store_true")
    p.add_argument("--cost-profile", help="calibrated profile for the planner (ringpack calibrate); default: FLOPs")
    p.add_argument("--backend", default="auto", help="ringpack kernel backend")
    p.add_argument(
        "--no-learn",
        action="store_true",
        help="plan every variant with --cost-profile (or FLOPs) throughout, without the cost learner; with "
        "--cost-profile each variant also reports every rank's busy time as the profile predicts it",
    )
    p.add_argument("--out", default="train.json")
    args = p.parse_args()

    example = load_example()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    results = []
    for name in args.variants.split(","):
        row = run_variant(example, args, name, world)
        results.append(row)
        if dist.get_rank() == 0:
            print_row(row)
            _write(args.out, world, results)  # after every variant: a run cut short keeps what it measured
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    return 0


def example_args(example, args: argparse.Namespace, cp: int, extra: list[str]) -> argparse.Namespace:
    """``examples/train.py``'s arguments for one variant of this benchmark's settings."""
    argv = ["--cp", str(cp), "--model", args.model, "--dtype", "bf16" if torch.cuda.is_available() else "fp32"]
    argv += ["--tokens-per-rank", str(args.tokens_per_gpu), "--samples", str(args.samples)]
    argv += ["--samples-per-step", str(args.samples_per_step), "--steps", str(args.steps)]
    argv += ["--len-scale", str(args.len_scale), "--max-len", str(args.max_len), "--data", args.data, "--quiet"]
    argv += extra + ["--backend", args.backend] + (["--grad-ckpt"] if args.grad_ckpt else [])
    argv += ["--cost-profile", args.cost_profile] if args.cost_profile else []
    argv += ["--no-learn-cost"] if args.no_learn and "--no-learn-cost" not in extra else []
    return example.parser().parse_args(argv)


def run_variant(example, args: argparse.Namespace, name: str, world: int) -> dict:
    """Train one variant and summarise its timed steps (a collective: every rank calls it)."""
    cp, extra = VARIANTS[name]
    grid = example.make_grid(cp)
    run_args = example_args(example, args, cp, extra)
    started = time.perf_counter()
    records = example.train(run_args, grid, example.samples_for(run_args))
    timed = records[args.measure_from :] or records[1:] or records
    spread = [(max(r["busy_s"]) - min(r["busy_s"])) / (sum(r["busy_s"]) / world) for r in timed]
    row = dict(
        variant=name,
        dp=world // cp,
        cp=cp,
        packing=run_args.packing,
        strategy=run_args.strategy,
        learned=bool(run_args.learn_cost),
        cost_models=[r["cost_model"] for r in records],
        steps=len(timed),
        busy_spread=statistics.median(spread),
        step_ms=1e3 * statistics.median(r["step_s"] for r in timed),
        tokens_per_s=sum(r["global_tokens"] for r in timed) / sum(r["step_s"] for r in timed),
        busy_ms=[1e3 * statistics.median(r["busy_s"][k] for r in timed) for k in range(world)],
        loss=[r["loss"] for r in records],
        wall_s=time.perf_counter() - started,
    )
    row["idle_frac"] = 1 - sum(row["busy_ms"]) / (world * row["step_ms"])
    if args.cost_profile and not run_args.learn_cost:
        row.update(busy_prediction(example, run_args, cp, world, timed))
    return row


def print_row(row: dict) -> None:
    busy = " ".join(f"{b:7.1f}" for b in row["busy_ms"])
    if "predicted_busy_ms" in row:
        print(
            f"{'':22s} predicted busy/rank [{' '.join(f'{b:7.1f}' for b in row['predicted_busy_ms'])}] ms: "
            f"total off by at most {row['busy_error']:.1%} per rank, {row['busy_error_step']:.1%} per step",
            flush=True,
        )
    learned_from = next((i for i, c in enumerate(row["cost_models"]) if c == "learned"), "-")
    print(
        f"{row['variant']:22s} step {row['step_ms']:8.1f} ms  {row['tokens_per_s']:10,.0f} tok/s  "
        f"busy/rank [{busy}] ms  spread {row['busy_spread']:6.1%}  idle {row['idle_frac']:6.1%}  "
        f"cost model from step {learned_from}",
        flush=True,
    )


def busy_prediction(example, run_args, cp: int, world: int, timed: list[dict]) -> dict:
    """Every rank's busy time over the timed steps as the cost profile predicts it, and the error.

    The plan is rebuilt from the same lengths and options (plans are deterministic), so it is the
    plan the variant ran. ``busy_error``: the largest relative error of a rank's total busy time over
    the timed steps; ``busy_error_step``: the largest over single (rank, step) pairs.
    """
    from ringpack.calibration.step import predicted_busy
    from ringpack.cost import CostModel

    model = CostModel.load(run_args.cost_profile)
    lengths = [len(s) for s in example.samples_for(run_args)]
    plan = example.make_sampler(run_args, lengths, 0, world // cp, cp).plan()
    predicted = np.array([predicted_busy(plan.steps[r["step"]], model).reshape(-1) for r in timed])
    measured = np.array([r["busy_s"] for r in timed])
    return dict(
        predicted_busy_ms=(1e3 * np.median(predicted, axis=0)).tolist(),
        predicted_busy_ms_per_step=(1e3 * predicted).tolist(),
        measured_busy_ms_per_step=(1e3 * measured).tolist(),
        busy_error=float(np.abs(predicted.sum(axis=0) / measured.sum(axis=0) - 1).max()),
        busy_error_step=float(np.abs(predicted / measured - 1).max()),
    )


def _write(out: str, world: int, rows: list[dict]) -> None:
    meta = dict(
        torch=torch.__version__,
        world=world,
        date=time.strftime("%Y-%m-%d"),
        argv=sys.argv,
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    )
    Path(out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    sys.exit(main())
