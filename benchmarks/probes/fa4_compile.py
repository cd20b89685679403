"""How long flash-attn-4's first-use compiles take, and how many kernel variants a training run needs.

    python benchmarks/probes/fa4_compile.py --shapes 32x8x128,16x4x128 --out fa4-compile.json

For each attention shape (q heads x kv heads x head dim) and dtype it runs
:func:`ringpack.attention.fa4.warm_up` in a fresh process and records the variants compiled and the
seconds each took (the log lines of ``ringpack.attention.fa4``), then runs the warm-up again in a
second fresh process: with ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1`` set (and optionally
``FLASH_ATTENTION_CUTE_DSL_CACHE_DIR``) that second run loads the kernels from the disk cache,
which is what a restarted or resumed job sees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import logging, sys, time, json, torch
sys.path.insert(0, {root!r})
from ringpack.attention import fa4
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("ringpack.attention.fa4").addHandler(Keep())
logging.getLogger("ringpack.attention.fa4").setLevel(logging.INFO)
start = time.perf_counter()
import flash_attn.cute.interface  # noqa: F401  (import time counted apart)
imported = time.perf_counter() - start
heads, kv, dim = {shape}
compiled = fa4.warm_up(heads, kv, dim, getattr(torch, {dtype!r}))
print(json.dumps(dict(import_s=imported, total_s=time.perf_counter() - start, compiled=compiled, log=records)))
"""


def run_child(shape: tuple[int, int, int], dtype: str) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    code = CHILD.format(root=root, shape=shape, dtype=dtype)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        return dict(error=proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="32x8x128", help="q_heads x kv_heads x head_dim, comma separated")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--out", default="fa4-compile.json")
    args = parser.parse_args()
    rows = []
    for shape_text in args.shapes.split(","):
        shape = tuple(int(x) for x in shape_text.split("x"))
        for dtype in args.dtypes.split(","):
            for attempt in ("fresh", "again"):
                row = dict(shape=shape_text, dtype=dtype, run=attempt, **run_child(shape, dtype))
                rows.append(row)
                print(json.dumps(row), flush=True)
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        argv=sys.argv,
        disk_cache=os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1",
    )
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
