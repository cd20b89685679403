"""How close the default plan stays to a plan told the true price of an attention pair (CPU).

    python benchmarks/price_robustness.py --out price_robustness.json

For several length mixes and DP x CP shapes (16K tokens per rank, global batches ~95% full), the
default plan is made with the FLOP cost model of Llama-3-8B; for each true pair price ``f`` (0.25x
to 2x the model's) a second plan is made knowing that price exactly
(``pair_price_range=(1, 1)``, the cost model's pair price times ``f``, tokens free to be traded
for pairs: no token guard). Both are priced at ``f``:
``loss = imbalance(default) / imbalance(told) - 1`` (imbalance: plan time over perfectly balanced
time, ``ringpack.analysis.robustness``). Also shown: the same for the plan balanced at the FLOP
price alone, and the K/V crossing CP ranks against zigzag's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringpack
from ringpack.analysis.robustness import PRICE_FACTORS, imbalance_across_prices
from ringpack.cost import CostModel
from ringpack.shard_plan import NO_TOKEN_GUARD
from ringpack.traffic import plan_kv_traffic

SHAPES = ((4, 8), (1, 8), (8, 1))
#: a plan of the cost model alone: its exact prices, and no token guard on the split
EXACT = dict(pair_price_range=(1, 1), cp_token_slack=NO_TOKEN_GUARD)


def mixes(n: int) -> dict[str, np.ndarray]:
    from ringpack.data.corpus import stdlib_corpus

    rng = np.random.default_rng(0)
    return {
        "pareto": np.clip((rng.pareto(1.1, n) * 800 + 1).astype(int), 1, 120_000),
        "lognormal": np.clip(rng.lognormal(7.5, 1.2, n).astype(int), 1, 120_000),
        "stdlib": np.asarray(stdlib_corpus().lengths)[:n],
    }


def losses(lengths: np.ndarray, dp: int, cp: int, cost: CostModel) -> dict:
    per_step = int(0.95 * dp * cp * 16384 / lengths.mean())
    base = dict(dp=dp, cp=cp, tokens_per_rank=16384, samples_per_step=per_step, overflow="split", seed=0)
    told = []
    for f in PRICE_FACTORS:
        priced = dataclasses.replace(cost, pair=cost.pair * f)
        told.append(imbalance_across_prices(ringpack.plan(lengths, cost=priced, **EXACT, **base), [1])[1])
    started = time.perf_counter()
    default = ringpack.plan(lengths, cost=cost, **base)
    seconds = time.perf_counter() - started
    exact = ringpack.plan(lengths, cost=cost, **EXACT, **base)
    zigzag = ringpack.plan(lengths, cost=cost, strategy="zigzag", **base)
    kv = {k: float(plan_kv_traffic(p)["unique"].sum()) for k, p in (("default", default), ("zigzag", zigzag))}
    return {
        "told": told,
        "default_loss": [v / t - 1 for v, t in zip(imbalance_across_prices(default).values(), told)],
        "flop_exact_loss": [v / t - 1 for v, t in zip(imbalance_across_prices(exact).values(), told)],
        "kv_vs_zigzag": kv["default"] / kv["zigzag"] if kv["zigzag"] else 0.0,
        "plan_ms_per_step": 1e3 * seconds / default.num_steps,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=3000)
    p.add_argument("--out", default="price_robustness.json")
    args = p.parse_args()
    cost = CostModel.preset("llama3-8b")
    rows = []
    print(f"loss against a plan told the true price, at pair price x{', x'.join(map(str, PRICE_FACTORS))}")
    for dp, cp in SHAPES:
        for name, lengths in mixes(args.samples).items():
            row = dict(mix=name, dp=dp, cp=cp, **losses(lengths, dp, cp, cost))
            rows.append(row)
            fmt = lambda xs: " ".join(f"{100 * x:+5.1f}%" for x in xs)
            print(
                f"{dp}x{cp} {name:9s} default {fmt(row['default_loss'])} | FLOP-exact {fmt(row['flop_exact_loss'])}"
                f" | K/V vs zigzag {row['kv_vs_zigzag']:.2f} | {row['plan_ms_per_step']:.1f} ms/step",
                flush=True,
            )
    meta = dict(date=time.strftime("%Y-%m-%d"), argv=sys.argv, factors=PRICE_FACTORS)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
