"""GPU checks of the attention runtime: bf16, ``torch_flash``, ``cudnn_hybrid`` and ``fa4`` backends, NCCL.

Two ways to run it on a machine with 2 GPUs::

    torchrun --nproc_per_node=2 tests/attention/test_gpu_ring.py      # prints error tables
    pytest -m "gpu or multigpu" tests/attention/test_gpu_ring.py -v     # also the 1-GPU checks

The torchrun check runs every plan x mode with ``torch_flash`` (and ``fa4`` where flash-attn-4
runs), then with ``cudnn_hybrid`` twice:
on the same plans with ``dense_threshold=256`` (many dense segments of odd lengths next to short
ones in one call) and on plans with 8300/4300-token samples at the default threshold (2048; long
causal-local and remote-full segments). It asserts that the hybrid runs really had dense
segments, local and remote, sharing calls with varlen ones, every form of shape bucket (padded
over local rows and past their end, key-split) and batched runs of equal short samples.

The bound: bf16 flash attention is not exact, so ringpack cannot be held to a fixed tolerance.
For every plan and tensor (out, dq, dk, dv, and out0: the output without gradients, where remote
dense blocks run in row chunks of at most 128 rows here) it is held to the error that single-GPU flash over
the whole packed batch has against an fp32 reference: ``err_ringpack <= 2 * err_flash + eps``
with ``eps = 2**-10 * max|reference|``, errors being max-abs over all tokens of all ranks.
Everything here skips cleanly without CUDA (pytest) and needs neither ortools nor datasets.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

if __name__ == "__main__":  # torchrun runs this file as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ringpack.attention import compile_schedule, ring_attention
from ringpack.modes import SEQUENCE_MODES
from ringpack.planner.split import split_contiguous, split_zigzag
from ringpack.shard_plan import Piece, microbatch_from_shards

try:
    import pytest
except ImportError:  # torchrun on a bare machine
    pytest = None

HEADS, KV_HEADS, HEAD_DIM = 16, 4, 128
DTYPE = torch.bfloat16
BOUND_FACTOR, EPS_REL = 2.0, 2.0**-10
NAMES = ("out", "dq", "dk", "dv")
CHECKED = NAMES + ("out0",)  # out0: the forward without gradients

# ------------------------------------------------------------------------------------------ plans

LENGTHS = [3001, 1500, 700, 333] + [100] * 6 + [129, 64, 33, 17, 5, 1, 1, 1200]  # six equal ones: batched dense calls
if os.environ.get("RINGPACK_TINY"):  # CPU dry run of the script (gloo + reference backend), about 1/25 the size
    LENGTHS = [120, 60, 28, 13] + [4] * 6 + [5, 2, 1, 1, 1, 1, 1, 45]


def gpu_plans(cp: int) -> list[tuple[str, object, dict[int, int]]]:
    """Plans for a CP group of ``cp`` ranks built without the planner (no ortools on GPU machines)."""
    lengths = {s: n for s, n in enumerate(LENGTHS)}
    samples = list(lengths)
    plans = [
        ("contiguous", split_contiguous(samples, LENGTHS, cp)),
        ("zigzag", split_zigzag(samples, LENGTHS, cp)),
    ]
    # balanced-like: short samples whole, round-robin over ranks; the long one cut unevenly over all ranks
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    for j, s in enumerate(samples[1:]):
        shards[j % cp].append(Piece(s, 0, lengths[s]))
    cuts = [0] + [int(lengths[0] * (r + 1) * (r + 2) / (cp * (cp + 1))) for r in range(cp)]
    for r in range(cp):
        shards[cp - 1 - r].append(Piece(0, cuts[r], cuts[r + 1]))
    plans.append(("balanced-like", microbatch_from_shards(samples, shards, lengths)))
    # interleaved: one sample in 7 uneven pieces alternating over ranks (several calls per step)
    bounds = sorted({int(f * lengths[0]) for f in (0, 0.0017, 0.133, 0.1336, 0.366, 0.633, 0.866, 1.0)})
    shards = [[] for _ in range(cp)]
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        shards[j % cp].append(Piece(0, a, b))
    for j, s in enumerate(samples[1:]):
        shards[(j + 1) % cp].append(Piece(s, 0, lengths[s]))
    plans.append(("interleaved", microbatch_from_shards(samples, shards, lengths)))
    # no split sample at all: no communication; and rank 0 holds nothing
    shards = [[] for _ in range(cp)]
    for j, s in enumerate(samples):
        shards[1 + j % (cp - 1) if cp > 1 else 0].append(Piece(s, 0, lengths[s]))
    plans.append(("no-split+empty-rank", microbatch_from_shards(samples, shards, lengths)))
    return [(name, mb, lengths) for name, mb in plans]


LONG_LENGTHS = [8300, 4300, 700, 333, 1, 2] + [
    512
] * 8  # no bucket lengths: their dense parts are padded; 8 x 512: a batch
if os.environ.get("RINGPACK_TINY"):
    LONG_LENGTHS = [100, 43, 7, 3, 1, 2] + [20] * 8


def long_plans(cp: int) -> list[tuple[str, object, dict[int, int]]]:
    """Plans whose calls hold segments above the default dense threshold (2048) next to short ones:
    sample 0 (8300) and sample 2 (700) cut into ``cp`` contiguous pieces, so every rank > 0 has a remote
    call with a 8300/cp x >= 8300/cp full block and a short one; the rest whole, round-robin."""
    lengths = {s: n for s, n in enumerate(LONG_LENGTHS)}
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    for s, n in lengths.items():
        if s in (0, 2):
            cuts = [n * r // cp for r in range(cp + 1)]
            for r in range(cp):
                shards[r].append(Piece(s, cuts[r], cuts[r + 1]))
        else:
            shards[s % cp].append(Piece(s, 0, n))
    plans = [("long-contiguous", microbatch_from_shards(list(lengths), shards, lengths))]
    plans.append(("long-zigzag", split_zigzag(list(lengths), LONG_LENGTHS, cp)))
    # long-last: sample 1 (4300, not a bucket length) whole at the end of rank 0's rows, so its dense
    # square is padded past them (a copy); sample 0 cut in cp pieces as above
    shards = [[Piece(0, LONG_LENGTHS[0] * r // cp, LONG_LENGTHS[0] * (r + 1) // cp)] for r in range(cp)]
    shards[0].append(Piece(1, 0, lengths[1]))
    for s in list(lengths)[2:]:
        shards[-1].append(Piece(s, 0, lengths[s]))
    plans.append(("long-last", microbatch_from_shards(list(lengths), shards, lengths)))
    return [(name, mb, lengths) for name, mb in plans]


COVERAGE = ("local", "remote", "mixed", "key_split", "padded_view", "padded_copy", "batched", "chunked")


def split_coverage(schedule) -> torch.Tensor:
    """[local dense segments, remote dense segments, calls with dense segments and a varlen rest,
    dense parts with a key split, dense parts padded over the following local rows, dense parts
    padded past the end of the local rows (copies), batched dense calls, remote dense segments that
    the forward without gradients cuts into row chunks]."""
    from ringpack.attention import engine

    calls = [c for c in (schedule.local, *(c for st in schedule.steps for c in st.calls)) if c is not None]
    local = len(schedule.local.dense) if schedule.local is not None else 0
    dense = [d for c in calls for d in c.dense]
    key_split = sum(d[5] < d[3] for d in dense)
    padded_view = sum(d[1] < d[4] and d[0] + d[4] <= schedule.num_tokens for d in dense)
    padded_copy = sum(d[0] + d[4] > schedule.num_tokens for d in dense)
    batched = sum(d.batch > 1 for d in dense)
    chunked = sum(
        len(engine._row_chunks(d, c.causal, engine.FORWARD_ONLY_PART_ROWS)) > 1 for c in calls for d in c.dense
    )
    return torch.tensor(
        [
            local,
            len(dense) - local,
            sum(bool(c.dense) and bool(c.rest) for c in calls),
            key_split,
            padded_view,
            padded_copy,
            batched,
            chunked,
        ],
        dtype=torch.float64,
    )


# ----------------------------------------------------------------------------------------- inputs


def make_inputs(lengths: dict[int, int], device: torch.device, seed: int = 0) -> dict[str, dict[int, torch.Tensor]]:
    """fp32 per-sample q/k/v/dout, identical on every rank (seeded on the host)."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[int, torch.Tensor]] = {name: {} for name in ("q", "k", "v", "dout")}
    for s, n in lengths.items():
        for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("dout", HEADS)):
            out[name][s] = torch.randn(n, heads, HEAD_DIM, generator=gen).to(device)
    return out


def fp32_reference(x: dict[str, dict[int, torch.Tensor]], scale: float) -> dict[str, dict[int, torch.Tensor]]:
    """Per-sample causal SDPA in fp32 with autograd (inputs rounded to bf16 first, like the kernels see them)."""
    ref: dict[str, dict[int, torch.Tensor]] = {name: {} for name in NAMES}
    groups = HEADS // KV_HEADS
    for s in x["q"]:
        q, k, v = (x[n][s].to(DTYPE).float().requires_grad_() for n in ("q", "k", "v"))
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.repeat_interleave(groups, 1).transpose(0, 1)[None],
            v.repeat_interleave(groups, 1).transpose(0, 1)[None], is_causal=True, scale=scale,
        )[0].transpose(0, 1)  # fmt: skip
        o.backward(x["dout"][s].to(DTYPE).float())
        for name, t in zip(NAMES, (o.detach(), q.grad, k.grad, v.grad)):
            ref[name][s] = t
    return ref


def flash_whole_batch(x: dict[str, dict[int, torch.Tensor]], scale: float) -> dict[str, dict[int, torch.Tensor]]:
    """Single-GPU flash over the whole packed batch, calling the aten kernels directly (no ringpack code)."""
    samples = list(x["q"])
    q, k, v, dout = (torch.cat([x[n][s] for s in samples]).to(DTYPE) for n in ("q", "k", "v", "dout"))
    sizes = torch.tensor([x["q"][s].shape[0] for s in samples])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(torch.int32).to(q.device)
    m = int(sizes.max())
    if q.is_cuda:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, m, m, 0.0, True, False, scale=scale
        )
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu, cu, m, m, 0.0, True, seed, offset, scale=scale
        )
    else:  # CPU dry run of the script: the reference backend stands in for flash
        from ringpack.attention.kernels import varlen_attn_bwd, varlen_attn_fwd

        out, lse = varlen_attn_fwd(q, k, v, cu, cu, m, m, scale, True, "reference")
        dq, dk, dv = varlen_attn_bwd(dout, q, k, v, out, lse, cu, cu, m, m, scale, True, "reference")
    bounds = [0, *sizes.cumsum(0).tolist()]
    return {
        name: {s: t[bounds[j] : bounds[j + 1]] for j, s in enumerate(samples)}
        for name, t in zip(NAMES, (out, dq, dk, dv))
    }


def local(per_sample: dict[int, torch.Tensor], mb, rank: int) -> torch.Tensor:
    pieces = mb.shards[rank].pieces
    any_t = next(iter(per_sample.values()))
    if not pieces:
        return any_t.new_zeros((0, *any_t.shape[1:]))
    return torch.cat([per_sample[p.sample][p.start : p.stop] for p in pieces])


def layout_inputs(x: dict[str, dict[int, torch.Tensor]], mb, rank: int, layout: str):
    """This rank's q, k, v in bf16 as ``layout`` lays them out, and a function returning their grads.

    ``contiguous``: three ``[T, H, D]`` leaves; ``head_major``: ``[H, T, D]`` leaves transposed to
    ``[T, H, D]`` views; ``fused``: head slices of one ``[T, H + 2 H_kv, D]`` leaf (a fused QKV)."""
    q, k, v = (local(x[n], mb, rank).to(DTYPE) for n in ("q", "k", "v"))
    if layout == "fused":
        fused = torch.cat([q, k, v], dim=1).requires_grad_()
        cuts = (q.shape[1], q.shape[1] + k.shape[1])
        views = (fused[:, : cuts[0]], fused[:, cuts[0] : cuts[1]], fused[:, cuts[1] :])
        return views, lambda: (fused.grad[:, : cuts[0]], fused.grad[:, cuts[0] : cuts[1]], fused.grad[:, cuts[1] :])
    if layout == "head_major":
        leaves = tuple(t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v))
        return tuple(t.transpose(0, 1) for t in leaves), lambda: tuple(t.grad.transpose(0, 1) for t in leaves)
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    return leaves, lambda: tuple(t.grad for t in leaves)


def max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref|`` in fp32; ``inf`` for other shapes or a NaN/inf in either, which then fails
    every bound (a NaN would compare false and slip through, also through the group's MAX)."""
    if got.shape != ref.shape:
        return math.inf
    if not ref.numel():
        return 0.0
    err = float((got.float() - ref.float()).abs().max())  # torch's max propagates NaN
    return err if math.isfinite(err) else math.inf


# ------------------------------------------------------------------------------------ 2-GPU check


def run_distributed_check(
    backend: str = "torch_flash", dense_threshold: int | None = None, plans=gpu_plans, layouts=("contiguous",)
) -> list[str]:
    """Every plan x mode x q/k/v layout on this process group; returns failure lines (empty = pass).
    Prints the table on rank 0.

    ``dense_threshold`` (default: compile_schedule's) matters for hybrid backends only; for them the
    check also fails unless the plans had dense segments, local and remote, next to varlen rests."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    scale = HEAD_DIM**-0.5
    compile_kw = {} if dense_threshold is None else {"dense_threshold": dense_threshold}
    if os.environ.get("RINGPACK_TINY"):
        compile_kw["dense_buckets"] = 2  # tiny lengths sit below the default buckets' first octave
    table = ErrorTable()
    coverage = torch.zeros(len(COVERAGE), dtype=torch.float64)
    all_lengths: list[int] = []
    for name, mb, lengths in plans(world):
        all_lengths = list(lengths.values())
        x = make_inputs(lengths, device)
        ref, flash = fp32_reference(x, scale), flash_whole_batch(x, scale)
        sched = compile_schedule(mb, rank, **compile_kw)
        coverage += split_coverage(sched)
        sched = sched.to(device)
        for mode, layout in ((m, lay) for m in SEQUENCE_MODES for lay in layouts):
            got = run_rank(x, mb, rank, sched, mode, layout, backend)
            table.add(name, mode, layout, group_errors(got, ref, flash, mb, rank, device))
    coverage = coverage.to(device)
    dist.all_reduce(coverage)
    counts = dict(zip(COVERAGE, (int(c) for c in coverage.tolist())))
    split_line = dense_split_line(backend, dense_threshold, counts)
    failures = list(table.failures)
    if split_line and not all(counts.values()):
        failures.append(f"{backend}: the plans did not exercise the split ({split_line.strip(', ')})")
    if rank == 0:
        print(
            f"\nringpack {backend} bf16, CP={world}, H={HEADS}, H_kv={KV_HEADS}, D={HEAD_DIM}, "
            f"sample lengths={all_lengths}{split_line}"
        )
        print(table.text(), flush=True)
        SUMMARY.append(summary_line(backend, dense_threshold, plans.__name__, table, counts if split_line else None))
    return failures


def run_rank(x, mb, rank: int, sched, mode: str, layout: str, backend: str) -> dict[str, torch.Tensor]:
    """This rank's out and q/k/v gradients, and ``out0``: the output without gradients (remote dense
    blocks in row chunks of FORWARD_ONLY_PART_ROWS)."""
    (q, k, v), grads = layout_inputs(x, mb, rank, layout)
    out = ring_attention(q, k, v, sched, mode=mode, backend=backend)
    out.backward(local(x["dout"], mb, rank).to(DTYPE))
    got = dict(zip(NAMES, (out.detach(), *grads())))
    with torch.no_grad():
        got["out0"] = ring_attention(q, k, v, sched, mode=mode, backend=backend)
    return got


def group_errors(got, ref, flash, mb, rank: int, device) -> list[list[float]]:
    """Per checked tensor, the group's max of ``[ringpack err, flash err, max |reference|, ringpack-flash]``."""
    stats = []
    for t in CHECKED:
        r, f = local(ref[t[:3]], mb, rank), local(flash[t[:3]], mb, rank)
        stats += [max_err(got[t], r), max_err(f, r), float(r.abs().max()) if r.numel() else 0.0, max_err(got[t], f)]
    stats_t = torch.tensor(stats, dtype=torch.float64, device=device)
    dist.all_reduce(stats_t, op=dist.ReduceOp.MAX)
    return stats_t.view(len(CHECKED), 4).tolist()


class ErrorTable:
    """Rows of errors against the bound ``BOUND_FACTOR * flash err + EPS_REL * max |reference|``."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.failures: list[str] = []
        self.worst: tuple[float, str] = (0.0, "")
        self.checked = 0

    def add(self, name: str, mode: str, layout: str, stats: list[list[float]]) -> None:
        for t, (ring_err, flash_err, ref_max, vs_flash) in zip(CHECKED, stats):
            limit = BOUND_FACTOR * flash_err + EPS_REL * ref_max
            ok = ring_err <= limit
            where = f"{name}/{mode}/{layout}/{t}"
            self.worst = max(self.worst, (ring_err / limit if limit else float("inf"), where))
            self.checked += 1
            self.rows.append(
                f"{name:<20} {mode:<9} {layout:<10} {t:<4} {ring_err:11.3e} {flash_err:11.3e} {vs_flash:11.3e} "
                f"{limit:11.3e}  {'ok' if ok else 'FAIL'}"
            )
            if not ok:
                self.failures.append(f"{where}: ringpack err {ring_err:.3e} > {limit:.3e} (flash err {flash_err:.3e})")

    @property
    def passed(self) -> int:
        return self.checked - sum(r.endswith("FAIL") for r in self.rows)

    def text(self) -> str:
        header = (
            f"{'plan':<20} {'mode':<9} {'layout':<10} {'t':<4} {'ringpack':>11} {'flash':>11} {'rp-flash':>11} "
            f"{'limit':>11}   (max abs err vs fp32)"
        )
        return "\n".join([header, *self.rows])


def dense_split_line(backend: str, dense_threshold: int | None, counts: dict[str, int]) -> str:
    """What the dense split covered, for the table's header (empty for a backend without a split)."""
    from ringpack.attention.kernels import dense_backend

    if dense_backend(backend) is None:
        return ""
    c = counts
    return (
        f", dense_threshold={dense_threshold or 'default'}: {c['local']} local + {c['remote']} remote dense segments, "
        f"{c['mixed']} calls dense+varlen, {c['key_split']} key splits, {c['padded_view']}+{c['padded_copy']} "
        f"padded over local rows+past their end (shape buckets), {c['batched']} batched, "
        f"{c['chunked']} remote cut into row chunks without gradients"
    )


def summary_line(backend: str, dense_threshold, plans_name: str, table: ErrorTable, counts: dict | None) -> str:
    line = (
        f"SUMMARY {backend:<16} threshold={str(dense_threshold or 'default'):<7} plans={plans_name:<9} "
        f"{table.passed}/{table.checked} within bound, worst err/limit {table.worst[0]:.2f} ({table.worst[1]})"
    )
    if counts is None:
        return line
    c = counts
    return line + (
        f", dense: {c['local']} local / {c['remote']} remote / {c['mixed']} mixed calls / "
        f"{c['key_split']} key splits / {c['padded_view']}+{c['padded_copy']} padded (views+copies) / "
        f"{c['batched']} batched / "
        f"{c['chunked']} chunked without gradients"
    )


SUMMARY: list[str] = []  # one line per run_distributed_check, printed last by main()


def main() -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    from ringpack.attention import engine

    engine.FORWARD_ONLY_PART_ROWS = (
        8 if os.environ.get("RINGPACK_TINY") else 128
    )  # the test plans' remote blocks are cut into row chunks
    try:
        cuda = torch.cuda.is_available()
        layouts = ("contiguous", "head_major", "fused")  # strided q/k/v views must give the same answer
        failures = run_distributed_check("torch_flash" if cuda else "reference", layouts=layouts)
        if cuda and "fa4" in _usable_flash_backends():
            failures += run_distributed_check("fa4", layouts=layouts)
        hybrid = "cudnn_hybrid" if cuda else "reference_hybrid"
        tiny = bool(os.environ.get("RINGPACK_TINY"))
        failures += run_distributed_check(hybrid, dense_threshold=8 if tiny else 256, layouts=layouts)
        failures += run_distributed_check(hybrid, dense_threshold=40 if tiny else None, plans=long_plans)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if SUMMARY:
        print("\n" + "\n".join(SUMMARY), flush=True)
    if failures:
        print("FAILED:\n" + "\n".join(failures), file=sys.stderr, flush=True)
        return 1
    return 0


def _usable_flash_backends() -> list[str]:
    """The non-hybrid CUDA kernel backends usable here (a hybrid's varlen half is one of these)."""
    from ringpack.attention.kernels import HYBRID_BACKENDS, available_backends

    usable = available_backends("cuda", DTYPE, HEAD_DIM) if torch.cuda.is_available() else []
    return [b for b in usable if b != "reference" and b not in HYBRID_BACKENDS]


# ------------------------------------------------------------------------------------- pytest side

if pytest is not None:
    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

    @pytest.mark.gpu
    @needs_cuda
    def test_auto_backend_on_this_gpu():
        """auto resolves to fa4 where flash-attn-4 runs (Hopper, Blackwell), else to cudnn_hybrid on
        Hopper with head_dim 128 (where it is the faster choice), else to flash."""
        from ringpack.attention import fa4, kernels

        q = torch.zeros(3, 4, 128, device="cuda", dtype=DTYPE)
        major = torch.cuda.get_device_capability()[0]
        if fa4.unusable_reason("cuda", DTYPE, 128) is None:
            assert kernels.resolve_backend("auto", q) == "fa4"
            assert kernels.resolve_backend("auto", q[..., :64].contiguous()) == "fa4"
            return
        hopper = major == 9 and kernels._cudnn_usable()
        assert kernels.resolve_backend("auto", q) == (
            "cudnn_hybrid" if hopper else kernels.available_backends("cuda", DTYPE)[0]
        )
        assert kernels.resolve_backend("auto", q[..., :64].contiguous()) in ("flash_attn", "torch_flash")

    def _backends() -> list[str]:
        return _usable_flash_backends()

    @pytest.mark.gpu
    @needs_cuda
    @pytest.mark.parametrize("backend", _backends() or ["torch_flash"])
    @pytest.mark.parametrize(
        "cu_q,cu_k,causal,heads,kv_heads",
        [
            ([0, 70, 300], [0, 70, 300], True, 8, 8),  # the local step: Lq == Lk
            ([0, 0, 64, 64, 200, 200], [0, 50, 180, 190, 260, 300], False, 8, 2),  # zero-query segments, GQA
            ([0, 0, 1, 1, 2, 2], [0, 9, 30, 40, 41, 45], False, 8, 2),  # max_seqlen_q == 1 with GQA
            ([0, 40, 300], [0, 100, 400], True, 4, 4),  # bottom-right causal (Lk > Lq): contract only
            (
                [0, 0, 70, 70, 300],
                [0, 100, 170, 200, 430],
                True,
                8,
                2,
            ),  # causal with zero-query segments: a split local call's rest
            ([0, 5, 9, 40], [0, 0, 7, 7], False, 8, 2),  # segments with no keys: out = 0, lse = +-inf
        ],
    )
    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_flash_kernel_contract(backend, cu_q, cu_k, causal, heads, kv_heads, dtype):
        """Each flash backend against the reference on the same fp16/bf16 inputs, with the schedule's edge cases."""
        from ringpack.attention.kernels import varlen_attn_bwd, varlen_attn_fwd

        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(0)
        cq, ck = torch.tensor(cu_q, dtype=torch.int32, device=dev), torch.tensor(cu_k, dtype=torch.int32, device=dev)
        mq, mk = max(b - a for a, b in zip(cu_q, cu_q[1:])), max(b - a for a, b in zip(cu_k, cu_k[1:]))
        q = torch.randn(cu_q[-1], heads, 64, device=dev, generator=gen).to(dtype)
        k, v = (torch.randn(cu_k[-1], kv_heads, 64, device=dev, generator=gen).to(dtype) for _ in range(2))
        dout = torch.randn_like(q)
        res = {}
        for b in (backend, "reference"):
            out, lse = varlen_attn_fwd(q, k, v, cq, ck, mq, mk, 0.125, causal, b)
            res[b] = (out, lse, *varlen_attn_bwd(dout, q, k, v, out, lse, cq, ck, mq, mk, 0.125, causal, b))
        keyless = torch.isinf(res["reference"][1])  # queries without keys: lse may be +inf or -inf
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), res[backend], res["reference"]):
            if name == "lse":
                assert torch.equal(torch.isinf(got), keyless), f"{backend}: lse is infinite on other rows"
                got, want = got.masked_fill(keyless, 0.0), want.masked_fill(keyless, 0.0)
            assert bool(torch.isfinite(got).all()), f"{backend} {name}: not finite"
            err, size = max_err(got, want), float(want.float().abs().max())
            assert err <= 2e-2 * max(size, 1.0), f"{backend} {name}: max err {err:.3e} (max |ref| {size:.3e})"
        covered = torch.zeros(cu_k[-1], dtype=torch.bool, device=dev)
        for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            covered[ka:kb] |= qb > qa
        assert (res[backend][3][~covered] == 0).all() and (res[backend][4][~covered] == 0).all(), (
            "zero-query keys need dk = dv = 0"
        )

    @pytest.mark.gpu
    @needs_cuda
    @pytest.mark.parametrize(
        "causal,lq,lk,heads,kv_heads",
        [(True, 333, 333, 8, 8), (True, 3001, 3001, 16, 4), (False, 700, 1500, 16, 4), (False, 2049, 257, 8, 1)],
    )
    def test_cudnn_dense_kernel_contract(causal, lq, lk, heads, kv_heads):
        """cudnn_hybrid's dense_attn_fwd/bwd against the reference on bf16 inputs (odd lengths, GQA, row slices)."""
        from ringpack.attention.kernels import dense_attn_bwd, dense_attn_fwd

        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(1)
        pad = 5  # the segment is a row slice of a bigger [T, H, D] tensor, as in the engine
        q_all = torch.randn(lq + 2 * pad, heads, 128, device=dev, generator=gen).to(DTYPE)
        k_all, v_all = (torch.randn(lk + 2 * pad, kv_heads, 128, device=dev, generator=gen).to(DTYPE) for _ in range(2))
        q, k, v = q_all[pad : pad + lq], k_all[pad : pad + lk], v_all[pad : pad + lk]
        dout = torch.randn_like(q)
        res = {}
        for b in ("cudnn_hybrid", "reference_hybrid"):
            out, lse = dense_attn_fwd(q, k, v, 0.09, causal, b)
            assert out.shape == q.shape and lse.shape == (heads, lq) and lse.dtype == torch.float32
            res[b] = (out, lse, *dense_attn_bwd(dout, q, k, v, out, lse, 0.09, causal, b))
        for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), res["cudnn_hybrid"], res["reference_hybrid"]):
            err, size = max_err(got, want), float(want.float().abs().max())
            assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            assert err <= 2e-2 * max(size, 1.0), f"cudnn {name}: max err {err:.3e} (max |ref| {size:.3e})"

    @pytest.mark.gpu
    @needs_cuda
    @pytest.mark.parametrize(
        "backend,dense_threshold",
        [("torch_flash", None), ("cudnn_hybrid", 256)] + [("fa4", None)] * ("fa4" in _backends()),
    )
    @pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
    @pytest.mark.parametrize("mode", ["ring", "p2p", "p2p-relayed"])
    def test_engine_bf16_on_one_gpu(cp, backend, dense_threshold, mode):
        """All CP ranks simulated on one GPU (loopback transports; ``p2p``: the targeted exchange's
        steps and rows; ``p2p-relayed``: those of the node-relayed exchange over nodes of 2 ranks,
        each rank's rows followed through its proxy): bf16 within the flash bound."""
        from tests.helpers.attention import Problem, run_all_ranks

        dev = torch.device("cuda")
        scale = HEAD_DIM**-0.5
        for name, mb, lengths in gpu_plans(cp):
            x = make_inputs(lengths, dev, seed=cp)
            ref, flash = fp32_reference(x, scale), flash_whole_batch(x, scale)
            problem = Problem(
                mb, lengths, *({s: t.to(DTYPE) for s, t in x[n].items()} for n in ("q", "k", "v", "dout"))
            )
            for rank, got in enumerate(
                run_all_ranks(
                    problem,
                    scale,
                    backend=backend,
                    device=dev,
                    dense_threshold=dense_threshold,
                    mode=mode.split("-")[0],
                    gpus_per_node=2 if mode == "p2p-relayed" else None,
                )
            ):
                for t in NAMES:
                    r, f = local(ref[t], mb, rank), local(flash[t], mb, rank)
                    if not r.numel():
                        continue
                    limit = BOUND_FACTOR * max_err(f, r) + EPS_REL * float(r.abs().max())
                    assert max_err(got[t], r) <= limit, (
                        f"{backend} {mode} {name} cp={cp} rank {rank} {t}: {max_err(got[t], r):.3e} > {limit:.3e}"
                    )

    @pytest.mark.multigpu
    @pytest.mark.slow
    @needs_2_gpus
    def test_two_gpus_with_torchrun():
        """The __main__ check over NCCL on 2 GPUs (ring and all-gather, every plan)."""
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        print(proc.stdout)
        assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    sys.exit(main())
