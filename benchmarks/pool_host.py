"""Host cost of pool plans, per global batch and per micro-batch (CPU, one process).

    PYTHONPATH=$PWD python benchmarks/pool_host.py [--worlds 64,1024,8192] [--fill 0.95] [--out pool_host.json]

Lengths: 1M log-normal samples (clipped at 131,072 tokens); one global batch of randomly drawn
samples filling ``--fill`` of the pool's tokens (``tokens_per_rank`` 16,384, 8 GPUs per node,
one micro-batch: the pool is one CP group). Per pool size:

* ``plan``: CPU seconds of ``ringpack.plan(lens, world=N, tokens_per_rank=16384,
  samples_per_step=len(lens), gpus_per_node=8)``, each of ``--repeats`` runs (the first one
  warms nothing up: every run is a whole plan).
* ``compile``: CPU milliseconds of ``compile_schedule(mb, rank, gpus_per_node=8, max_partners=...)``
  (the plan's partner budget, decided by the planner for each micro-batch) for a sample of
  ranks: the first, middle and last, ``--ranks`` random ones and the 4 with the most exchange
  partners (by :func:`ringpack.traffic.receivers`). ``cold``: on a micro-batch object that has not
  been read yet (its pieces read into columns and its piece table built, as a loader does with a
  micro-batch the planner did not send: a thread planner's); ``warm``: the same micro-batch again
  (columns and table kept on it); ``delivered``: what a loader worker does with a micro-batch the
  planner process sent: unpickle the ``PackedMicroBatch`` (pickled once, in ``planner ms``: with
  its piece table, partner-budget outcome and fingerprint), unpack it and compile, all timed.
  Each rank's figure is the median of ``--compile-repeats`` compiles (3: one stall of the machine
  does not make a rank's figure); the table gives the median and worst rank of each, and the most
  partners of a sampled rank (relays included, from its schedule).
* ``collate``: CPU milliseconds of ``PackedCollator.collate`` of one delivered micro-batch (unpickled
  and unpacked, as above: timed) for the first rank and the rank with most partners, schedule
  compiled and not. Token arrays are views of
  one array (no fetch cost): this times the collator's own work on a micro-batch of the whole pool,
  with every sample's tokens and (``o``) with only the samples the rank's pieces come from, as a
  sampler given ``cp_rank`` lists them.

The targets: ``compile_schedule`` of one rank of an 8,192-rank pool in <= 50 ms (median and worst);
one global batch planned in <= 1 s at 8,192 ranks and <= 150 ms at 1,024, on one core.
``planner ms`` / ``sent MB``: the planner process's work to pack one micro-batch (its piece table
built) and the pickle's size.
"""

from __future__ import annotations

import argparse
import json
import pickle
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ringpack
from ringpack.analysis.simulate import synthetic_lengths
from ringpack.attention import compile_schedule
from ringpack.data.collator import PackedCollator
from ringpack.data.sampler import rank_positions
from ringpack.piece_table import TABLE_SLOT
from ringpack.plan_config import DEFAULT_MAX_PARTNERS
from ringpack.planner.stream import PackedMicroBatch
from ringpack.shard_plan import MicroBatch
from ringpack.traffic import receivers

TOKENS_PER_RANK = 16384
GPUS_PER_NODE = 8


def global_batch(lengths: np.ndarray, world: int, fill: float, seed: int) -> np.ndarray:
    """Randomly drawn samples up to ``fill`` of the pool's tokens."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    take = int(np.searchsorted(np.cumsum(lengths[order]), fill * world * TOKENS_PER_RANK, side="right"))
    return lengths[order[:take]]


def cpu_ms(fn) -> tuple[float, object]:
    start = time.process_time()
    out = fn()
    return (time.process_time() - start) * 1000, out


def median_cpu_ms(fn, repeats: int, before=lambda: None) -> tuple[float, object]:
    """The median of ``repeats`` :func:`cpu_ms` of ``fn`` (``before()`` untimed ahead of each), and
    the last result."""
    times = []
    for _ in range(repeats):
        before()
        ms, out = cpu_ms(fn)
        times.append(ms)
    return float(np.median(times)), out


def forget_columns(mb: MicroBatch) -> None:
    """The micro-batch as a fresh object would be: its pieces not read into columns, no piece table."""
    vars(mb).pop("piece_columns", None)
    vars(mb).pop(TABLE_SLOT, None)


def busiest_ranks(mb: MicroBatch, count: int) -> list[int]:
    """The ``count`` ranks with the most direct exchange partners (senders and receivers)."""
    rank, sample, start, stop = mb.piece_columns
    piece, to = receivers(np.zeros_like(rank), rank, sample, start, stop)
    frm = rank[piece]
    pairs = np.unique(np.concatenate([frm * len(mb.shards) + to, to * len(mb.shards) + frm]))
    partners = np.bincount(pairs // len(mb.shards), minlength=len(mb.shards))
    return np.argsort(-partners, kind="stable")[:count].tolist()


def one_pool(lengths: np.ndarray, world: int, args: argparse.Namespace) -> dict:
    lens = global_batch(lengths, world, args.fill, args.seed)
    plan_s = []
    for _ in range(args.repeats):
        ms, plan = cpu_ms(
            lambda: ringpack.plan(
                lens,
                world=world,
                tokens_per_rank=TOKENS_PER_RANK,
                samples_per_step=len(lens),
                gpus_per_node=GPUS_PER_NODE,
                max_partners=args.max_partners,
            )
        )
        plan_s.append(ms / 1000)
    mb = plan.steps[0].microbatches[0][0]
    budget = plan.config.max_partners  # the schedules check it, as the collator's do
    rng = np.random.default_rng(args.seed)
    busy = busiest_ranks(mb, 4)
    ranks = sorted({0, world // 2, world - 1, *rng.integers(0, world, args.ranks).tolist(), *busy})
    per_rank = []
    planner_ms, sent = cpu_ms(lambda: pickle.dumps(PackedMicroBatch.of(mb)))  # what the planner process sends
    reps = args.compile_repeats
    for r in ranks:
        compile_rank = lambda m: compile_schedule(m, r, gpus_per_node=GPUS_PER_NODE, max_partners=budget)
        cold, schedule = median_cpu_ms(lambda: compile_rank(mb), reps, before=lambda: forget_columns(mb))
        warm, _ = median_cpu_ms(lambda: compile_rank(mb), reps)
        delivered, _ = median_cpu_ms(lambda: compile_rank(pickle.loads(sent).unpack()), reps)
        partners = 2 if schedule.partner_fallback else schedule.exchange.partners  # the ring's, over the budget
        per_rank.append({"rank": r, "cold_ms": cold, "warm_ms": warm, "delivered_ms": delivered, "partners": partners})
    base = np.arange(int(lens.max()) + 1, dtype=np.int64)
    tokens = [base[:n] for n in lens[np.asarray(mb.samples)].tolist()]  # sample ids index the batch's lengths
    collate = []
    for r in (0, busy[0]):
        for compiled in (True, False):
            collator = PackedCollator(r, world, compile_schedules=compiled)
            ms, _ = cpu_ms(
                lambda: collator.collate(
                    pickle.loads(sent).unpack(), tokens, gpus_per_node=GPUS_PER_NODE, max_partners=budget
                )
            )
            collate.append({"rank": r, "schedule": compiled, "ms": ms})
            # the ticket of a sampler given the rank's cp_rank: only the samples its pieces come from
            own = rank_positions(mb, r).tolist()
            mine = [tokens[k] for k in own]
            ms, _ = cpu_ms(
                lambda: collator.collate(
                    pickle.loads(sent).unpack(), mine, gpus_per_node=GPUS_PER_NODE, positions=own, max_partners=budget
                )
            )
            collate.append({"rank": r, "schedule": compiled, "ms": ms, "own_rows": len(own)})
    cold = [x["cold_ms"] for x in per_rank]
    warm = [x["warm_ms"] for x in per_rank]
    delivered = [x["delivered_ms"] for x in per_rank]
    return {
        "world": world,
        "samples": len(lens),
        "pieces": int(mb.piece_columns[0].size),
        "plan_seconds": float(np.median(plan_s)),
        "plan_seconds_all": plan_s,
        "compile_cold_ms": {"median": float(np.median(cold)), "worst": float(max(cold))},
        "compile_warm_ms": {"median": float(np.median(warm)), "worst": float(max(warm))},
        "compile_delivered_ms": {"median": float(np.median(delivered)), "worst": float(max(delivered))},
        "planner_pack_ms": planner_ms,
        "sent_bytes": len(sent),
        "compile_ranks": per_rank,
        "collate": collate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="64,1024,8192", help="pool sizes (ranks), comma-separated")
    parser.add_argument("--fill", type=float, default=0.95, help="share of the pool's tokens the global batch fills")
    parser.add_argument("--repeats", type=int, default=3, help="plans per pool size")
    parser.add_argument("--ranks", type=int, default=6, help="random ranks compiled besides the fixed ones")
    parser.add_argument(
        "--compile-repeats", type=int, default=3, help="compiles per rank and kind, their median reported"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-partners", type=int, default=DEFAULT_MAX_PARTNERS, help="the plan's partner budget (0: none)"
    )
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    lengths = synthetic_lengths(1_000_000, "lognormal", max_len=131072)
    rows = []
    print(
        f"{'ranks':>6} {'samples':>8} {'pieces':>7} {'plan s':>7} "
        f"{'compile cold ms (median/worst)':>31} {'warm ms':>13} {'delivered ms':>13} {'partners max':>12} "
        f"{'collate ms':>24} {'planner ms':>10} {'sent MB':>7}"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        row = one_pool(lengths, world, args)
        rows.append(row)
        cold, warm, delivered = row["compile_cold_ms"], row["compile_warm_ms"], row["compile_delivered_ms"]
        collate = " ".join(
            f"{x['ms']:.0f}" + ("" if x["schedule"] else "*") + ("o" if "own_rows" in x else "") for x in row["collate"]
        )
        print(
            f"{world:>6} {row['samples']:>8} {row['pieces']:>7} {row['plan_seconds']:>7.3f} "
            f"{cold['median']:>15.1f} / {cold['worst']:<13.1f} {warm['median']:>5.1f} / {warm['worst']:<5.1f} "
            f"{delivered['median']:>5.1f} / {delivered['worst']:<5.1f} "
            f"{max(x['partners'] for x in row['compile_ranks']):>12} {collate:>24} "
            f"{row['planner_pack_ms']:>10.1f} {row['sent_bytes'] / 1e6:>7.2f}"
        )
    print("collate: ranks 0 and the busiest, with the schedule and without (*), all rows and own rows (o)")
    result = {"machine": platform.platform(), "processor": platform.processor(), "args": vars(args), "pools": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
