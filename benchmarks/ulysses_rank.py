"""One rank of head-parallel (``mode="ulysses"``) CP against one bare flash-attn-4 call of its heads, on one GPU.

    PYTHONPATH=$PWD python benchmarks/ulysses_rank.py --out ulysses_rank.json [--cps 2,4,8] [--backends auto,fa4]

Under Ulysses a CP rank attends ``H / cp`` query heads (and the K/V heads they read) over every
token of the micro-batch, whole samples in the plan's order: one varlen kernel call. For the
kernel table's micro-batches (``one_rank_path.micro_batches``: heavy-tailed mixes of 16K, 64K and
128K tokens, single samples, 1K samples), cut into ``cp`` contiguous token ranges (pieces of
samples on several ranks), forward + backward, bf16, 32 query / 8 K/V heads, head_dim 128:

* ``bare fa4``: ``flash_attn.cute.flash_attn_varlen_func`` over the gathered rows of the rank's
  heads (what the rank's attention must cost at least);
* ``kernel <backend>``: ringpack's pass over the gathered rows (``HeadLayout.attention``, the
  one-rank schedule of whole samples) with that backend;
* ``rank <backend>``: the whole rank under :class:`~ringpack.attention.ulysses.UlyssesAttention`,
  its relayouts (packing heads into blocks, gathered order, the way home, K/V replicas) included,
  with each all-to-all replaced by one device copy of the rows the rank receives (the other
  ranks' data from memory): the interconnect is not measured, the rank's own work around it is.

GPU time per iteration with the host ahead (``one_rank_path.gpu_ms``), median of ``--iters``
after ``--warmup``; ``vs_bare`` is bare / row.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from one_rank_path import HEAD_DIM, HEADS, KV_HEADS, bare_fa4, gpu_ms, micro_batches, timing_parser

from ringpack.attention import compile_schedule, ring_attention
from ringpack.attention.engine import PassConfig
from ringpack.attention.kernels import resolve_backend
from ringpack.attention.ulysses import HeadSplit, UlyssesAttention
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

#: Where the tensors live (a CPU dry run of the closures sets "cpu", with the reference backend).
DEVICE = "cuda"


class MemoryExchange:
    """The relayout's exchange for one emulated rank: ``out`` filled by one device copy of as many
    rows from a buffer of other ranks' data (the bytes an all-to-all would write, no interconnect)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}

    def exchange_rows(self, out, send, out_splits, in_splits) -> None:
        key = (tuple(out.shape), out.dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.randn(out.shape, device=out.device).to(out.dtype)
        out.copy_(self.buffers[key])


def split_microbatch(lengths: list[int], cp: int) -> MicroBatch:
    """``lengths`` concatenated and cut into ``cp`` near-equal contiguous token ranges (samples cut anywhere)."""
    total = sum(lengths)
    bounds = [total * r // cp for r in range(cp + 1)]
    shards = []
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    for r in range(cp):
        lo, hi = bounds[r], bounds[r + 1]
        pieces = []
        for i in range(len(lengths)):
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a < b:
                pieces.append(Piece(i, a - starts[i], b - starts[i]))
        shards.append(pieces)
    return microbatch_from_shards(range(len(lengths)), shards, lengths)


def rank_rows(schedule, split: HeadSplit, backend: str):
    """A closure running rank 0's whole Ulysses pass (relayouts with memory exchanges) and its gradient."""
    local = schedule.num_tokens
    layout = schedule.head_layout
    q = torch.randn(local, split.heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(local, split.kv_heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(local, split.kv_heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(local, split.heads, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    config = PassConfig(HEAD_DIM**-0.5, resolve_backend(backend, q), None)
    group = MemoryExchange()
    return (lambda: UlyssesAttention.apply(q, k, v, layout, split, group, config)), grad


def gathered(layout, split: HeadSplit):
    total = layout.num_tokens
    shape = (total, split.rank_heads, HEAD_DIM)
    q = torch.randn(shape, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    kv = (total, split.rank_kv_heads, HEAD_DIM)
    k = torch.randn(kv, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(kv, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    return q, k, v, torch.randn(shape, device=DEVICE, dtype=torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = timing_parser(__doc__)
    parser.add_argument("--cps", default="2,4,8")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    cases = micro_batches(args.seed)
    wanted = [c for c in args.cases.split(",") if c] or list(cases)
    rows = []
    for case in wanted:
        lengths = cases[case]
        for cp in (int(c) for c in args.cps.split(",")):
            split = HeadSplit(heads=HEADS, kv_heads=KV_HEADS, cp=cp)
            schedule = compile_schedule(split_microbatch(lengths, cp), 0).to(DEVICE)
            layout = schedule.head_layout
            order = [lengths[s] for s in layout.samples]
            q, k, v, grad = gathered(layout, split)
            impls = {"bare fa4": (bare_fa4(q, k, v, order), grad)}
            for backend in args.backends.split(","):
                impls[f"kernel {backend}"] = (
                    (lambda b=backend: ring_attention(q, k, v, layout.attention, backend=b)),
                    grad,
                )
                impls[f"rank {backend}"] = rank_rows(schedule, split, backend)
            base = None
            for name, (run, g) in impls.items():
                ms = gpu_ms(run, g, args.iters, args.warmup, args.hold_ms)
                base = ms if base is None else base
                row = {"case": case, "cp": cp, "tokens": sum(lengths), "impl": name, "gpu_ms": ms, "vs_bare": base / ms}
                rows.append(row)
                print(f"{case:12s} cp={cp}  {name:14s} {ms:8.3f} ms  {base / ms:5.3f}x bare", flush=True)
    device = torch.cuda.get_device_name()
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
