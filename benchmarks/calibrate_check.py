"""GPU check of ``ringpack calibrate``: fit the cost model on one GPU and report how well it predicts.

Run on one GPU (about a minute: the default grid is ~80 rank shards, the held-out set 54):

    python benchmarks/calibrate_check.py --out calibration/profile.json

It times ringpack's attention (forward+backward, ``--backend``, default auto) on the default shape
grid (GPU execution time: ``--timer gpu``, the default, hides the host's launch time), fits the
profile model ``time = token*tokens + pair*pairs + segment*pieces`` (+ per-micro-batch constants
that are equal on every rank and stay out of the profile) and the kernel model (calls, tiles, launch
grid, ring rows, dense calls: a diagnostic), times the model's linear layers, and evaluates both on
held-out heavy-tailed micro-batches split by contiguous / zigzag / balanced over 2 CP ranks (each
rank timed on its own, compute only). It prints the per-rank table and the fit quality (Pearson r,
max and mean relative error, slowest-rank hit rate), writes the profile (``CostModel.save``) and
the report JSON next to it, and exits 1 when the held-out fit of ``--gate`` (default: the profile
model, what the planner loads) misses ``--min-r`` or ``--max-err``. Several backends:
``--backends torch_flash,cudnn_hybrid`` runs one calibration per backend
(``<out stem>.<backend>.json``) and a side-by-side line at the end. No GPU:
``ringpack calibrate --refit REPORT.json`` refits a stored report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringpack.cli import main as ringpack_cli


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="calibration/profile.json")
    parser.add_argument(
        "--backends", default="auto", help="comma-separated backends, one calibration each (default auto)"
    )
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--mode", default="linear", choices=["linear", "attention"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--min-r", type=float, default=0.98, help="fail below this held-out Pearson r (default 0.98)")
    parser.add_argument(
        "--max-err", type=float, default=0.15, help="fail above this held-out max relative error (default 0.15)"
    )
    parser.add_argument(
        "--gate",
        default="profile",
        choices=["profile", "kernel"],
        help="which model's held-out fit the thresholds apply to (default profile: what the planner loads)",
    )
    parser.add_argument("--timer", default="gpu", choices=["gpu", "wall"])
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("calibrate_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    out = Path(args.out)
    summary = []
    ok = True
    for backend in backends:
        path = out if len(backends) == 1 else out.with_name(f"{out.stem}.{backend}{out.suffix}")
        argv = [
            "--out",
            str(path),
            "--backend",
            backend,
            "--model",
            args.model,
            "--mode",
            args.mode,
            "--reps",
            str(args.reps),
            "--timer",
            args.timer,
        ]
        if args.quick:
            argv.append("--quick")
        started = time.perf_counter()
        code = ringpack_cli(["calibrate", *argv])
        if code:
            return code
        report = json.loads(path.with_name(path.stem + ".report.json").read_text())
        held, kernel = report["held_out"], report["kernel_model"]["held_out"]
        gated = held if args.gate == "profile" else kernel
        passed = gated["r"] >= args.min_r and gated["max_rel_err"] <= args.max_err
        ok &= passed
        summary.append(
            f"{report['meta']['backend']:14s} profile held-out r={held['r']:.4f} "
            f"max err {100 * held['max_rel_err']:5.1f}% mean {100 * held['mean_rel_err']:4.1f}% "
            f"slowest rank {100 * held['slowest_rank_hit']:3.0f}% | kernel model r={kernel['r']:.4f} "
            f"max err {100 * kernel['max_rel_err']:5.1f}% mean {100 * kernel['mean_rel_err']:4.1f}% "
            f"slowest rank {100 * kernel['slowest_rank_hit']:3.0f}% | pairs-only max err "
            f"{100 * report['baseline']['held_out']['max_rel_err']:5.1f}% | timer {report['meta']['timer']} | "
            f"{time.perf_counter() - started:.0f} s {'ok' if passed else 'FAIL'} ({args.gate})"
        )
        print()
    print("\n".join(summary))
    print(f"thresholds ({args.gate} model): held-out r >= {args.min_r}, max relative error <= {args.max_err:.0%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
