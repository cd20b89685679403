"""Host cost of the targeted exchange (``mode="p2p"``) against the CP group size (CPU, one process).

    PYTHONPATH=$PWD python benchmarks/probes/targeted_host.py --out targeted_host.json

Two questions, each with the rank's pieces and partners fixed while the group grows:

* compiling the rank's exchange map (:mod:`ringpack.attention.exchange`, given the piece table and
  the ring steps that ``compile_schedule`` builds anyway), against the whole ``compile_schedule``
  of that rank (which also reads and checks every piece of the micro-batch);
* the host work one engine pass spends on the transport up to issuing its first transfer: the
  pass's schedule (:func:`~ringpack.attention.p2p.targeted_schedule`), the transport, ``begin``
  (send rows, receive buffers) and ``start`` (the point-to-point operations), against the ring's.

Medians of ``--repeat`` runs, in microseconds. A one-process gloo group stands in for the CP group
and ``batch_isend_irecv`` is replaced by a no-op: nothing is sent, only host work is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ringpack._spawn import free_port
from ringpack.attention import compile_schedule
from ringpack.attention.engine import pack_kv
from ringpack.attention.exchange import compile_exchange, exchange_ranges, neighbourhood
from ringpack.attention.p2p import TargetedTransport, targeted_schedule
from ringpack.attention.ring import RingTransport
from ringpack.piece_table import PieceTable
from ringpack.shard_plan import Piece, microbatch_from_shards

RANK = 3


def microbatch(cp: int, partners: int, samples_per_rank: int = 16):
    """Rank 3 receives one sample from each of ``partners`` ranks and sends one to as many others,
    beside whole samples of its own; every other rank holds ``samples_per_rank`` samples, half of
    them split with its next free neighbour (so the group's traffic grows with the group)."""
    others = [r for r in range(cp) if r != RANK]
    assert 2 * partners <= len(others), "partners fit in the group"
    lengths: dict[int, int] = {}
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    sample = 0
    for src in others[:partners]:  # rank 3 needs these ranks' pieces
        lengths[sample] = 64
        shards[src].append(Piece(sample, 0, 32))
        shards[RANK].append(Piece(sample, 32, 64))
        sample += 1
    for dst in others[partners : 2 * partners]:  # these ranks need rank 3's pieces
        lengths[sample] = 64
        shards[RANK].append(Piece(sample, 0, 32))
        shards[dst].append(Piece(sample, 32, 64))
        sample += 1
    for _ in range(samples_per_rank - 2 * partners):
        lengths[sample] = 48
        shards[RANK].append(Piece(sample, 0, 48))
        sample += 1
    free = others[2 * partners :] or others
    for j, r in enumerate(free):
        for i in range(samples_per_rank):
            lengths[sample] = 48
            if i % 2 and len(free) > 1:
                shards[r].append(Piece(sample, 0, 24))
                shards[free[(j + 1) % len(free)]].append(Piece(sample, 24, 48))
            else:
                shards[r].append(Piece(sample, 0, 48))
            sample += 1
    return microbatch_from_shards(list(lengths), shards, lengths)


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def compile_rows(sizes: list[int], partners: int, repeat: int) -> list[dict]:
    rows = []
    for cp in sizes:
        mb = microbatch(cp, partners)
        table = PieceTable.from_microbatch(mb)
        mine = np.flatnonzero(table.rank == RANK)
        steps = compile_schedule(mb, RANK).steps  # their calls are not read: this times the map only

        def exchange_map():
            receives, sends = exchange_ranges(table, mine, RANK)
            return compile_exchange(receives, sends, RANK, cp, steps)

        ex = exchange_map()
        rows.append(
            {
                "cp": cp,
                "pieces": int(table.rank.size),
                "neighbourhood": int(neighbourhood(table, mine).size),
                "partners": ex.partners,
                "ring_steps": len(steps),
                "exchange_map_us": median_us(exchange_map, repeat),
                "compile_schedule_us": median_us(lambda: compile_schedule(mb, RANK), max(3, repeat // 10)),
            }
        )
    return rows


def pass_rows(sizes: list[int], partner_counts: list[int], repeat: int) -> list[dict]:
    rows = []
    for cp in sizes:
        for partners in partner_counts:
            if 2 * partners > cp - 1:
                continue
            sched = compile_schedule(microbatch(cp, partners), RANK)
            k = torch.randn(sched.num_tokens, 2, 64)
            kv = pack_kv(k, k, sched.send_index)

            def targeted():
                transport = TargetedTransport(targeted_schedule(sched), dist.group.WORLD)
                transport.begin(kv)
                transport.start()

            def ring():
                transport = RingTransport(sched, dist.group.WORLD)
                transport.begin(kv)
                transport.start()

            rows.append(
                {
                    "cp": cp,
                    "partners": sched.exchange.partners,
                    "p2p_pass_us": median_us(targeted, repeat),
                    "ring_pass_us": median_us(ring, repeat),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64,512", help="CP group sizes (comma-separated)")
    parser.add_argument("--partners", default="2,8,32", help="the rank's partner counts for the pass timing")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.batch_isend_irecv = lambda ops: []  # every transport's host work up to the post, nothing sent
    try:
        result = {
            "compile": compile_rows(sizes, partners=2, repeat=args.repeat),
            "pass": pass_rows(sizes, [int(x) for x in args.partners.split(",")], args.repeat),
        }
    finally:
        dist.destroy_process_group()
    for name, rows in result.items():
        print(name)
        keys = list(rows[0])
        print("  " + "  ".join(f"{k:>20}" for k in keys))
        for row in rows:
            print("  " + "  ".join(f"{row[k]:>20.1f}" if isinstance(row[k], float) else f"{row[k]:>20}" for k in keys))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
