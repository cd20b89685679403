"""Independent brute force for every reported figure: explicit token loops over plan objects.

Nothing here uses ringpack's cost, comm or metrics code: pairs are counted from a dense causal
document mask, K/V needs token by token, zigzag padding by materialising the padded sample.
"""

from __future__ import annotations

import numpy as np


def tokens_of(shard) -> list[tuple[int, int]]:
    return [(p.sample, pos) for p in shard.pieces for pos in range(p.start, p.stop)]


def dense_pairs(mb, rank: int) -> int:
    """Ones of the [this rank's queries x every key of the micro-batch] causal document mask."""
    keys = [t for shard in mb.shards for t in tokens_of(shard)]
    queries = tokens_of(mb.shards[rank])
    if not queries:
        return 0
    ks = np.array(keys)
    qs = np.array(queries)
    mask = (qs[:, None, 0] == ks[None, :, 0]) & (ks[None, :, 1] <= qs[:, None, 1])
    return int(mask.sum())


def rank_cost(mb, rank: int, model) -> float:
    shard = mb.shards[rank]
    return model.token * len(tokens_of(shard)) + model.pair * dense_pairs(mb, rank) + model.segment * len(shard.pieces)


def kv_needed_tokens(mb, rank: int) -> int:
    """Tokens of this rank whose K/V some query on another rank attends (key pos <= query pos, same sample)."""
    latest: dict[tuple[int, int], int] = {}  # (other rank, sample) -> its last query position
    for r, shard in enumerate(mb.shards):
        for sample, pos in tokens_of(shard):
            latest[(r, sample)] = max(latest.get((r, sample), -1), pos)
    count = 0
    for sample, pos in tokens_of(mb.shards[rank]):
        if any(latest.get((r, sample), -1) >= pos for r in range(len(mb.shards)) if r != rank):
            count += 1
    return count


def zigzag_padding(length: int, cp: int) -> list[int]:
    """Materialise the padded sample, cut 2*cp equal chunks, deal chunks r and 2cp-1-r to rank r."""
    padded = length
    while padded % (2 * cp):
        padded += 1
    chunk = padded // (2 * cp)
    out = []
    for r in range(cp):
        positions = list(range(r * chunk, (r + 1) * chunk)) + list(
            range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk)
        )
        out.append(sum(1 for p in positions if p >= length))
    return out


def figures(plan) -> list[dict]:
    """Per step: every figure of the report, by explicit loops."""
    cfg = plan.config
    model = cfg.cost
    steps = []
    for step in plan.steps:
        busy = [[0.0] * cfg.cp for _ in range(cfg.dp)]
        dp_time = [0.0] * cfg.dp
        kv = 0
        pad = 0
        cp_ratios = []
        mb_costs = []
        for d, rank in enumerate(step.microbatches):
            per_dp = []
            for mb in rank:
                costs = [rank_cost(mb, r, model) for r in range(cfg.cp)]
                per_dp.append(costs)
                for r in range(cfg.cp):
                    busy[d][r] += costs[r]
                dp_time[d] += max(costs)
                mean = sum(costs) / cfg.cp
                cp_ratios.append(max(costs) / mean if mean > 0 else 1.0)
                kv += sum(kv_needed_tokens(mb, r) for r in range(cfg.cp))
                pad += sum(sum(zigzag_padding(plan.lengths[s], cfg.cp)) for s in mb.samples)
            mb_costs.append(per_dp)
        step_cost = max(dp_time)
        flat = [b for row in busy for b in row]
        mean_busy = sum(flat) / len(flat)
        steps.append(
            {
                "step_cost": step_cost,
                "step_seconds": step_cost / model.flops_per_second,
                "rank_busy": busy,
                "dp_time": dp_time,
                "microbatch_costs": mb_costs,
                "idle_fraction": 1 - sum(flat) / (len(flat) * step_cost),
                "imbalance": step_cost / mean_busy,
                "max_mean": max(flat) / mean_busy,
                "dp_max_mean": max(dp_time) / (sum(dp_time) / len(dp_time)),
                "cp_max_mean": sum(cp_ratios) / len(cp_ratios),
                "kv_tokens": kv,
                "zigzag_rule_padding_tokens": pad,
                "tokens": sum(mb.num_tokens for rank in step.microbatches for mb in rank),
                "samples": sum(len(mb.samples) for rank in step.microbatches for mb in rank),
            }
        )
    return steps
