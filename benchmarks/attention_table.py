"""Render ``benchmarks/attention.py`` JSON results as the Markdown tables of BENCHMARKS.md.

    python benchmarks/attention_table.py benchmarks/results/attention-*.json [--filter fwdbwd]

One row per measured implementation: case, tokens per GPU, heads, pass, implementation, slowest
rank's median ms (per call, with ``x L layers`` when the run queued L calls per iteration), useful
TFLOP/s per GPU, fraction of ideal scaling, the same two with the host ahead of the GPU (``gpu_ms``,
where measured), and peak memory per rank (MiB above the inputs) with the allowance where the
benchmark computed one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def rows_markdown(rows: list[dict], needle: str = "") -> str:
    head = (
        "| case | tok/GPU | heads q/kv | pass | implementation | ms | useful TF/s/GPU | % of ideal "
        "| GPU ms, host ahead | % of ideal (GPU) | peak MiB/rank (allowance) |"
    )
    lines = [head, "|" + "---|" * 11]
    for row in rows:
        text = " ".join(str(row.get(k, "")) for k in ("case", "shape", "pass", "impl"))
        if needle and not all(part in text for part in needle.split(",")):
            continue
        heads = row["shape"].replace("x", "/")
        impl = row["impl"] + (f" x{row['layers']} layers" if row.get("layers", 1) > 1 else "")
        if "ms" not in row:
            lines.append(
                f"| {row['case']} | {row['tokens_per_gpu']} | {heads} | {row['pass']} | {impl} "
                f"| error: {row.get('error', '')[:60]} | | | | | |"
            )
            continue
        mem = ""
        if row.get("peak_mib"):
            mem = " / ".join(f"{m:.0f}" for m in row["peak_mib"])
            if row.get("budget_mib"):
                mem += " (" + " / ".join(f"{m:.0f}" for m in row["budget_mib"]) + ")"
        frac = f"{row['ideal_frac']:.1%}" if "ideal_frac" in row else ""
        gpu = f"{row['gpu_ms']:.2f}" if row.get("gpu_ms") else ""
        gpu_frac = f"{row['gpu_ideal_frac']:.1%}" if "gpu_ideal_frac" in row else ""
        lines.append(
            f"| {row['case']} | {row['tokens_per_gpu']} | {heads} | {row['pass']} | {impl} | {row['ms']:.2f} "
            f"| {row['tflops']:.0f} | {frac} | {gpu} | {gpu_frac} | {mem} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    parser.add_argument(
        "--filter", default="", help="comma-separated substrings a row's case/shape/pass/impl must all contain"
    )
    args = parser.parse_args(argv)
    for name in args.files:
        data = json.loads(Path(name).read_text())
        print(f"`{name}` ({' '.join(data['meta'].get('argv', [])[1:])})\n")
        print(rows_markdown(data["rows"], args.filter))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
