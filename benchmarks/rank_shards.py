"""Measured balance of whole plans on one GPU: every rank shard of DP x CP plans, timed one by one.

    python benchmarks/rank_shards.py --out rank_shards.json            # one GPU, a few minutes
    python benchmarks/rank_shards.py --device cpu --tiny               # CPU dry run of the script

A GPU of a DP x CP job runs, per micro-batch, its own shard: the decoder layer's GEMMs over its
tokens and attention of each of its pieces against the keys before it in its sample (ring
attention computes exactly these blocks, wherever the keys live). This benchmark times that work
for every (step, DP rank, micro-batch, CP rank) of a plan on one GPU — one decoder layer's
forward + backward, compute only, the K/V already in memory — and composes the plan's measured
step time exactly as the plan's critical path is defined: max over CP ranks per micro-batch, sum
over micro-batches per DP rank, max over DP ranks per step. ``measured imbalance`` = measured time
of all steps / (all ranks' measured busy time / GPUs): 1.0 is a plan no rank waits in.

Plans per length mix (held-out seeds): first-fit packing by tokens + zigzag (common practice),
ringpack's packing + zigzag, ringpack's default (price-robust with the FLOP model), ringpack
balanced at the FLOP model's prices alone, and ringpack planned with a model fitted to the
*other* mixes' timings; the last two without the token guard, trading tokens for pairs as their
model says. The same shard geometry is timed once and reused.

Ranks are timed one by one, so a rank's time here is the sum of its work. In a ring, CP ranks also
meet inside every layer; the end-to-end benchmark (``benchmarks/train.py``) measures that.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ringpack
from ringpack.analysis.robustness import imbalance_across_prices
from ringpack.attention.kernels import resolve_backend
from ringpack.calibration.cases import Case
from ringpack.calibration.timing import AttentionShape, Clock, TimingSetup, time_case
from ringpack.cost import PRESETS, CostModel, ModelShape, piece_pairs
from ringpack.cost_fit import fit_nnls
from ringpack.shard_plan import NO_TOKEN_GUARD, Plan

VARIANTS = {
    # name: plan options
    "first-fit + zigzag": dict(packing="first_fit", strategy="zigzag"),
    "ringpack packing + zigzag": dict(strategy="zigzag"),
    "ringpack default": dict(),
    "ringpack at FLOP prices": dict(pair_price_range=(1.0, 1.0), cp_token_slack=NO_TOKEN_GUARD),
    "ringpack with fitted model": dict(fitted=True, cp_token_slack=NO_TOKEN_GUARD),
}


def mixes(count: int, seed: int, cap: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Held-out heavy-tailed length mixes (Pareto, log-normal, and both mixed), lengths times ``scale``."""
    out = {}
    for k in range(count):
        rng = np.random.default_rng(seed + k)
        if k % 3 == 0:
            lengths = (rng.pareto(1.1, 4000) * 600 + 1).astype(int)
        elif k % 3 == 1:
            lengths = rng.lognormal(7.6, 1.1, 4000).astype(int)
        else:
            lengths = np.concatenate([(rng.pareto(1.3, 2000) * 900 + 1), rng.lognormal(6.5, 1.0, 2000)]).astype(int)
        out[f"mix{k + 1}"] = np.clip((lengths * scale).astype(int), 1, cap)
    return out


@dataclasses.dataclass
class ShardTimer:
    """Times one rank shard (one decoder layer forward + backward, compute only); caches by geometry."""

    shape: ModelShape
    device: torch.device
    reps: int
    clock: Clock
    backend: str = "auto"
    cache: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        h, hd, s = self.shape.hidden, self.shape.head_dim, self.shape
        self.weights = [
            torch.randn(i, o, device=self.device, dtype=torch.bfloat16) * 0.02
            for i, o in ((h, (s.heads + 2 * s.kv_heads) * hd), (s.heads * hd, h), (h, 2 * s.ffn), (s.ffn, h))
        ]
        self.attn = AttentionShape(s.heads, s.kv_heads, hd)
        probe = torch.empty(1, s.heads, hd, device=self.device, dtype=torch.bfloat16)
        self.backend = resolve_backend(self.backend, probe) if self.device.type == "cuda" else "reference"

    def gemms(self, tokens: int) -> float:
        key = ("gemm", tokens)
        if key not in self.cache:
            x = [torch.randn(tokens, w.shape[0], device=self.device, dtype=torch.bfloat16) for w in self.weights]
            dy = [torch.randn(tokens, w.shape[1], device=self.device, dtype=torch.bfloat16) for w in self.weights]

            def step() -> None:
                for xi, w, dyi in zip(x, self.weights, dy):
                    torch.mm(xi, w)
                    torch.mm(dyi, w.t())
                    torch.mm(xi.t(), dyi)

            self.cache[key] = float(np.median(self.clock.measure(step, warmup=1, reps=self.reps)))
        return self.cache[key]

    def attention(self, mb, rank: int, lengths) -> float:
        pieces = mb.shards[rank].pieces
        key = ("attn", tuple((lengths[p.sample], p.start, p.stop) for p in pieces))
        if key not in self.cache:
            case = Case("plan", "", mb, rank, tuple(int(x) for x in lengths))
            setup = TimingSetup(self.attn, self.backend, self.device, torch.bfloat16, self.clock, self.reps, 1)
            self.cache[key] = time_case(case, setup)
        return self.cache[key]

    def shard(self, mb, rank: int, lengths) -> float:
        tokens = sum(p.stop - p.start for p in mb.shards[rank].pieces)
        if not tokens:
            return 0.0
        return self.gemms(tokens) + self.attention(mb, rank, lengths)


def measure_plan(plan: Plan, timer: ShardTimer, steps: int) -> dict:
    """Measured rank times of the first ``steps`` steps and the rows (features, seconds) they give."""
    lengths = plan.lengths
    step_time, busy, rows = 0.0, 0.0, []
    for step in plan.steps[:steps]:
        dp_times = []
        for mbs in step.microbatches:
            total = 0.0
            for mb in mbs:
                ranks = [timer.shard(mb, c, lengths) for c in range(len(mb.shards))]
                total += max(ranks)
                busy += sum(ranks)
                for c, seconds in enumerate(ranks):
                    pieces = mb.shards[c].pieces
                    st = np.array([p.start for p in pieces], dtype=np.int64)
                    sp = np.array([p.stop for p in pieces], dtype=np.int64)
                    if len(pieces):
                        rows.append(((sp - st).sum(), piece_pairs(st, sp).sum(), len(pieces), seconds))
            dp_times.append(total)
        step_time += max(dp_times)
    gpus = plan.config.dp * plan.config.cp
    return {"measured_imbalance": step_time / (busy / gpus), "step_seconds": step_time, "rows": rows}


def fit_model(rows: list) -> CostModel:
    """Seconds per token / pair / piece fitted to measured rank shards (NNLS, relative)."""
    a = np.asarray(rows, dtype=np.float64)
    coef = fit_nnls(np.column_stack([a[:, :3], np.ones(len(a))]), a[:, 3])
    return CostModel(token=coef[0], pair=coef[1], segment=coef[2], unit="s", name="fitted")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3-8b", help="decoder layer shape (a cost-model preset)")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=16384)
    p.add_argument("--fill", type=float, default=0.95, help="global batch tokens / (dp * cp * tokens-per-rank)")
    p.add_argument("--mixes", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="steps timed per plan")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=101)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--extra", default="{}", help="plan options (a JSON object) added to 'ringpack default'")
    p.add_argument("--device", default="cuda")
    p.add_argument(
        "--backend", default="auto", help="attention kernels (ringpack.attention.BACKENDS; auto: training's)"
    )
    p.add_argument("--tiny", action="store_true", help="a tiny layer and budget (CPU dry run)")
    p.add_argument("--out", default="rank_shards.json")
    args = p.parse_args()
    args.extra = json.loads(args.extra)
    if args.tiny:
        args.tokens_per_rank, args.dp, args.cp = 512, 2, 2
    return args


def measure_variants(args: argparse.Namespace, timer: ShardTimer, flops: CostModel) -> tuple[list, dict]:
    """Every wanted variant of every mix, measured; the fitted variant last (fitted to the other mixes)."""
    data = mixes(args.mixes, args.seed, cap=args.cp * args.tokens_per_rank, scale=args.tokens_per_rank / 16384)
    results, measured_rows = [], {}
    t0 = time.perf_counter()
    for fitted_pass in (False, True):
        for name, lengths in data.items():
            per_step = int(args.fill * args.dp * args.cp * args.tokens_per_rank / lengths.mean())
            base = dict(dp=args.dp, cp=args.cp, tokens_per_rank=args.tokens_per_rank, samples_per_step=per_step)
            base.update(overflow="split", seed=0, cost=flops)
            for variant in args.variants.split(","):
                options = dict(VARIANTS[variant])
                if options.pop("fitted", False) != fitted_pass:
                    continue
                if fitted_pass:  # held out: fitted to the other mixes' shards
                    options["cost"] = fit_model([r for m, rows in measured_rows.items() if m != name for r in rows])
                elif variant == "ringpack default":
                    options.update(args.extra)
                plan = ringpack.plan(lengths, **{**base, **options})
                m = measure_plan(plan, timer, args.steps)
                measured_rows.setdefault(name, []).extend(m.pop("rows"))
                row = dict(mix=name, variant=variant, **m, predicted=imbalance_across_prices(plan, [1.0])[1.0])
                if fitted_pass:
                    row["fitted_pair_per_token"] = options["cost"].pair / options["cost"].token
                results.append(row)
                print(
                    f"{name:5s} {variant:28s} measured {m['measured_imbalance']:.3f}  "
                    f"step {1e3 * m['step_seconds']:8.1f} ms  ({time.perf_counter() - t0:.0f} s)",
                    flush=True,
                )
    return results, measured_rows


def main() -> int:
    args = parse_args()
    shape = PRESETS[args.model]
    if args.tiny:
        shape = ModelShape("tiny", hidden=64, layers=1, heads=4, kv_heads=2, ffn=128)
    device = torch.device(args.device)
    timer = ShardTimer(shape, device, args.reps, Clock(device), args.backend)
    flops = CostModel.from_shape(dataclasses.replace(shape, layers=1, vocab=0))
    results, measured_rows = measure_variants(args, timer, flops)
    fitted = fit_model([r for rows in measured_rows.values() for r in rows])
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        date=time.strftime("%Y-%m-%d"),
        argv=sys.argv,
        model=args.model,
        backend=timer.backend,
        flop_pair_per_token=flops.pair / flops.token,
        fitted_pair_per_token=fitted.pair / fitted.token,
        fitted_segment_per_token=fitted.segment / fitted.token,
    )
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=results), indent=1))
    print(
        f"token:pair price ratio measured {fitted.token / fitted.pair:,.0f}, FLOP model {flops.token / flops.pair:,.0f}"
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
