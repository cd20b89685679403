"""``ringpack simulate`` and ``ringpack report`` at cluster scale: wall time, CPU time and peak memory.

    PYTHONPATH=$PWD python benchmarks/simulate_scale.py --out simulate_scale.json [--quick] [--cp64]

Draws heavy-tailed lengths once (log-normal, median 1,536 tokens, sigma 1.3, clipped to 128K; the
mix of docs/analysis.md's scale figures) into ``--data`` and runs each command as the command
line would, one at a time, under a fresh measuring process: wall seconds, user and system CPU
seconds of it and its workers, and the largest resident set of any of its processes (``getrusage``
of the waited children). The machine's load average before and after is recorded with each row, since a shared
machine slows every figure. ``--quick`` runs everything at a tenth of the samples; ``--cp64`` adds
the 8,192-GPU simulation with CP groups of 64 (DP=128), whose balanced split is far slower.
Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The length mix: log-normal with this median and sigma, clipped to this many tokens.
MIX = {"median": 1536.0, "sigma": 1.3, "max_len": 131072}


def draw(path: Path, samples: int, seed: int) -> Path:
    """Save ``samples`` lengths of :data:`MIX` at ``path`` (kept when it exists) and return it."""
    if not path.exists():
        sys.path.insert(0, str(ROOT))
        import numpy as np

        from ringpack.analysis.simulate import synthetic_lengths

        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, synthetic_lengths(samples, "lognormal", seed=seed, **MIX))
    return path


def run(name: str, argv: list[str], out: Path) -> dict:
    """Run ``ringpack argv`` under a fresh measuring process: its row (exit code, wall, CPU, peak RSS, load)."""
    load = os.getloadavg()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run(
        [sys.executable, __file__, "--measure", *argv], cwd=out, env=env, capture_output=True, text=True, check=True
    )
    measured = json.loads(child.stdout.strip().splitlines()[-1])
    row = {"name": name, "command": "ringpack " + " ".join(argv), **measured}
    row["load_before"] = [round(x, 2) for x in load]
    row["load_after"] = [round(x, 2) for x in os.getloadavg()]
    row["cpus"] = os.cpu_count()
    return row


def measure(argv: list[str]) -> dict:
    """``ringpack argv --quiet`` as a child of this process: its figures and those of the workers it waited for.

    ``getrusage(RUSAGE_CHILDREN)`` here covers only that command's processes, so its ``ru_maxrss``
    is the largest resident set of any of them.
    """
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ringpack", *argv, "--quiet"], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {
        "exit_code": proc.returncode,
        "wall_seconds": round(wall, 2),
        "user_seconds": round(usage.ru_utime, 2),
        "system_seconds": round(usage.ru_stime, 2),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),  # kB on Linux
    }
    if proc.returncode:
        out["error"] = (proc.stderr.strip().splitlines() or [""])[-1]
    return out


def cases(data: Path, quick: bool, cp64: bool) -> list[tuple[str, list[str]]]:
    n_big, n_mid = (100_000, 20_000) if quick else (1_000_000, 200_000)
    big = str(draw(data / f"lengths_{n_big}.npy", n_big, seed=1))
    mid = str(draw(data / f"lengths_{n_mid}.npy", n_mid, seed=2))
    report = ["report", "--lengths", mid, "--dp", "8", "--cp", "4", "--tokens-per-rank", "32768", "--overflow", "split"]
    shape = ["simulate", "--lengths", big, "--world", "8192", "--tokens-per-rank", "16384", "--overflow", "split"]
    rows = [
        (f"report {n_mid:,}, DP=8 x CP=4", [*report, "--out", "report"]),
        # one micro-batch per DP rank: the steps whose tokens exceed it are refused before planning
        (
            f"simulate {n_big:,}, 8192 GPUs, CP=8, m=1",
            [*shape, "--cp", "8", "--microbatches-per-rank", "1", "--out", "sim-m1"],
        ),
        (
            f"simulate {n_big:,}, 8192 GPUs, CP=8",
            [*shape, "--cp", "8", "--microbatches-per-rank", "0", "--out", "sim-cp8"],
        ),
    ]
    if cp64:
        rows.append(
            (
                "simulate 1M, 8192 GPUs, CP=64",
                [*shape, "--cp", "64", "--microbatches-per-rank", "0", "--out", "sim-cp64"],
            )
        )
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(sys.argv[2:])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="simulate_scale.json", help="result JSON")
    parser.add_argument("--data", default="bench-data", help="folder for the drawn lengths and the outputs")
    parser.add_argument("--quick", action="store_true", help="a tenth of the samples")
    parser.add_argument("--cp64", action="store_true", help="add the CP=64 simulation (slow)")
    args = parser.parse_args()
    data = Path(args.data).resolve()
    data.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, argv in cases(data, args.quick, args.cp64):
        rows.append(run(name, argv, data))
        r = rows[-1]
        note = f"  ({r['error']})" if "error" in r else ""
        print(
            f"{name:45s} exit {r['exit_code']}  {r['wall_seconds']:7.1f} s wall  "
            f"{r['user_seconds'] + r['system_seconds']:7.1f} s CPU  {r['peak_rss_mb']:7.0f} MB  "
            f"load {r['load_before'][0]:.1f}{note}",
            flush=True,
        )
    Path(args.out).write_text(json.dumps({"rows": rows, "quick": args.quick}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
