"""Pool plans and the chosen layout against the peers as the cluster grows (cost and communication models).

    python benchmarks/pool_vs_peers.py [--worlds 64,256,1024,4096,8192] [--source lognormal|stdlib]
        [--max-partners 16] [--out pool-vs-peers.json] [--plot gap.png]

For every cluster size: the same global batches (``--steps`` of them, ``--fill`` of the cluster's
tokens each, micro-batches per rank as the planner chooses them, log-normal lengths of median 1,536
clipped at 131,072 unless ``--lengths``) are planned by
:func:`ringpack.planner.layout.choose_layout` (every fixed CP size and the pool, each under every
attention mode the model's heads allow: ring, all-gather, targeted exchange, ulysses and the
hybrids) and by the peers of :mod:`ringpack.analysis.peers` (Megatron-Core dynamic CP and WLB-LLM)
at CP = one node. ``--source stdlib`` draws the lengths from the shipped standard-library corpus
instead. Printed and written per size: tokens/s of the chosen layout, of the pool (its best mode),
of fixed CP = one node (ringpack), of the best layout under each mode, of each peer, and the chosen
layout's ratio to the best peer, and the pool's targeted exchange's partners under the plans' partner
budget (``--max-partners``, the default budget unless given): per micro-batch, the micro-batches
that run the ring over it, and kept over the steps. The plot draws the ratios against the cluster size.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ringpack.analysis.peers import PEERS, peer_rows
from ringpack.analysis.simulate import synthetic_lengths
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.lengths import read_lengths
from ringpack.plan_config import DEFAULT_MAX_PARTNERS
from ringpack.planner.layout import choose_layout
from ringpack.shard_plan import PlanConfig


def one_world(lengths: np.ndarray, world: int, args: argparse.Namespace) -> dict:
    """Every layout and peer on the same global batches of a ``world``-GPU cluster."""
    cost = CostModel.preset(args.model)
    node = args.gpus_per_node
    per_step = int(args.fill * world * args.tokens_per_rank / lengths.mean())
    rng = np.random.default_rng(args.seed + world)
    batch = lengths[rng.permutation(len(lengths))[: per_step * args.steps]]
    t0 = time.perf_counter()
    choice = choose_layout(
        batch,
        world,
        node,
        args.tokens_per_rank,
        cost,
        CommModel.for_model(cost),
        steps=args.steps,
        samples_per_step=per_step,
        microbatches_per_rank=args.microbatches_per_rank,
        batch_window=args.batch_window,
        max_partners=args.max_partners,
    )
    layout_s = time.perf_counter() - t0
    feasible = [c for c in choice.candidates if c.feasible]
    pool = max((c for c in feasible if c.name == "pool"), key=lambda c: c.tokens_per_second)
    one_node = f"cp={node}" if world > node else "pool"  # a cluster of one node: its pool is CP = the node
    fixed_node = max((c for c in feasible if c.name == one_node), key=lambda c: c.tokens_per_second)
    pool_p2p = next(c for c in feasible if c.name == "pool" and c.mode == "p2p")
    config = PlanConfig(
        dp=world // node,
        cp=node,
        tokens_per_rank=args.tokens_per_rank,
        samples_per_step=per_step,
        microbatches_per_rank=args.microbatches_per_rank,
        cost=cost,
    )
    t0 = time.perf_counter()
    ring = CommModel.for_model(cost, mode="ring", gpus_per_node=node)
    peers = {p.name: p.result.summary()["tokens_per_second_comm"] for p in peer_rows(batch, config, ring, PEERS)}
    peers_s = time.perf_counter() - t0
    best_peer = max(peers.values()) if peers else float("nan")
    best = choice.best
    by_mode = {}
    for c in feasible:  # fastest first: the first of each mode is its best layout
        by_mode.setdefault(c.mode, {"layout": c.name, "tokens_per_second": c.tokens_per_second})
    row = {
        "world": world,
        "batch_window": args.batch_window,
        "samples_per_step": per_step,
        "steps": args.steps,
        "max_partners": args.max_partners,
        "chosen": {"layout": best.label, "tokens_per_second": best.tokens_per_second, **partners_of(best)},
        "pool": {"layout": pool.label, "tokens_per_second": pool.tokens_per_second, **partners_of(pool)},
        "pool_p2p": partners_of(pool_p2p),
        "fixed_node": {"layout": fixed_node.label, "tokens_per_second": fixed_node.tokens_per_second},
        "by_mode": by_mode,
        "peers": peers,
        "chosen_over_best_peer": best.tokens_per_second / best_peer,
        "pool_over_best_peer": pool.tokens_per_second / best_peer,
        "fixed_node_over_best_peer": fixed_node.tokens_per_second / best_peer,
        "reason": choice.reason,
        "candidates": [
            {"layout": c.label, "tokens_per_second": c.tokens_per_second, "step_seconds": c.step_seconds}
            for c in feasible
        ],
        "seconds": {"layouts": layout_s, "peers": peers_s},
    }
    print(
        f"{world:>6} GPUs: chosen {best.label} {best.tokens_per_second / 1e6:.3f}M tok/s, pool {pool.label} "
        f"{pool.tokens_per_second / 1e6:.3f}M, cp={node} {fixed_node.tokens_per_second / 1e6:.3f}M, "
        + ", ".join(f"{k} {v / 1e6:.3f}M" for k, v in peers.items())
        + f"; chosen / best peer {row['chosen_over_best_peer']:.3f} ({layout_s:.0f} s + {peers_s:.0f} s)",
        flush=True,
    )
    modes = (f"{m} {v['layout']} {v['tokens_per_second'] / 1e6:.3f}M" for m, v in by_mode.items())
    print("        by mode: " + ", ".join(modes), flush=True)
    q = row["pool_p2p"]
    print(
        f"        pool p2p (max_partners {args.max_partners}): {pool_p2p.tokens_per_second / 1e6:.3f}M tok/s, "
        f"partners per micro-batch median {q['microbatch_partners_median']:.0f} max {q['microbatch_partners_max']}, "
        f"{q['ring_fallback']} micro-batches run the ring, kept over the steps {q['partners_kept_max']} "
        f"({q['nccl_gib_kept']:.2f} GiB)",
        flush=True,
    )
    return row


def partners_of(c) -> dict:
    """A timed layout's partners: per micro-batch (what the budget bounds) and kept over the steps."""
    return {
        "tokens_per_second": c.tokens_per_second,
        "microbatch_partners_median": c.microbatch_partners_median,
        "microbatch_partners_max": c.microbatch_partners_max,
        "ring_fallback": c.ring_fallback,
        "partners_kept_max": c.partners_max,
        "nccl_gib_kept": c.partner_memory_bytes / 2**30,
    }


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = [r["world"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for key, label in (
        ("chosen_over_best_peer", "ringpack, chosen layout"),
        ("pool_over_best_peer", "ringpack pool"),
        ("fixed_node_over_best_peer", "ringpack, CP = one node"),
    ):
        ax.plot(worlds, [r[key] for r in rows], marker="o", label=label)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s / best peer's (Megatron DCP, WLB-LLM)")
    window = rows[0].get("batch_window", 0)
    ax.set_title(f"Predicted tokens/s / the best peer's (batch window {window})", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", default="64,256,1024,4096,8192")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=16384)
    p.add_argument("--fill", type=float, default=1.0, help="global batch tokens / the cluster's tokens")
    p.add_argument("--microbatches-per-rank", type=int, default=0, help="0: the planner chooses, per step")
    p.add_argument("--steps", type=int, default=6, help="global batches per cluster size")
    p.add_argument("--batch-window", type=int, default=0, help="ringpack's window across global batches")
    p.add_argument("--max-partners", type=int, default=DEFAULT_MAX_PARTNERS, help="the plans' partner budget (0: none)")
    p.add_argument("--samples", type=int, default=1_000_000)
    p.add_argument("--lengths", help="a lengths file (default: draws of --source)")
    p.add_argument("--source", default="lognormal", choices=("lognormal", "stdlib"), help="the drawn lengths")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pool-vs-peers.json")
    p.add_argument("--plot", help="PNG of the ratios against the cluster size")
    p.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --out file")
    args = p.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text())["rows"], Path(args.plot or "gap.png"))
        return 0
    if args.lengths:
        lengths = np.asarray(read_lengths(args.lengths), dtype=np.int64)
    else:
        lengths = synthetic_lengths(args.samples, args.source, seed=args.seed, median=1536, sigma=1.3, max_len=131072)
    rows = [one_world(lengths, int(w), args) for w in args.worlds.split(",")]
    doc = {"machine": platform.node(), "python": platform.python_version(), "args": vars(args), "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
