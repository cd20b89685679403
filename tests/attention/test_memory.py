"""What the engine itself holds in memory at its peak (CPU, kernels replaced by stand-ins that only allocate).

The bound to hold is single-GPU attention plus two K/V buffers. Kernel outputs are new tensors
that the engine copies or merges into the rank's result, so its peak is the result plus whatever
kernel outputs are alive at the same time. These tests count live tensor storages (a dispatch
mode sees every allocation; a finaliser sees it freed) while a local call runs with several dense
parts and a long run of short segments, and check that at most one part's output is alive beside
the result: a part kept by a loop variable through the next kernel, or a run of short segments
taken by one kernel, shows up here as a second part or a part as large as the run.
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ringpack.attention import compile_schedule, kernel_calls, kernels, ring
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

HEADS, KV_HEADS, DIM = 4, 1, 16


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages allocated inside the mode and still alive; ``peak`` is their maximum."""

    def __init__(self, ignore: list[torch.Tensor]) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0
        self._ignore = {t.untyped_storage().data_ptr() for t in ignore}

    def _gone(self, ptr: int) -> None:
        self.now -= self.live.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, size = storage.data_ptr(), storage.nbytes()
                if ptr and size and ptr not in self.live and ptr not in self._ignore:
                    self.live[ptr] = size
                    self.now += size
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._gone, ptr)
        return out


def _stub_fwd(q, k, v, *args, **kwargs):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]))


def _stub_bwd(dout, q, k, v, *args, **kwargs):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@pytest.fixture
def stub_kernels(monkeypatch):
    """The hybrid reference backend with kernels that allocate their outputs and compute nothing."""
    for table, stub in (
        (kernels._FWD, _stub_fwd),
        (kernels._BWD, _stub_bwd),
        (kernels._DENSE_FWD, _stub_fwd),
        (kernels._DENSE_BWD, _stub_bwd),
    ):
        for name in ("reference", "reference_hybrid"):
            if name in table:
                monkeypatch.setitem(table, name, stub)


def _one_rank(lengths: list[int]) -> MicroBatch:
    shards = [[Piece(i, 0, n) for i, n in enumerate(lengths)]]
    return microbatch_from_shards(list(range(len(lengths))), shards, lengths)


def _rows_bytes(rows: int, heads: int) -> int:
    return rows * heads * DIM * 4  # float32


# two long samples (dense, padded up), a long run of short ones, a long sample, another run
LENGTHS = [300, 7] + [13] * 5 + [9, 11] * 20 + [200] + [5, 6, 7] * 8


def _inputs(num_tokens: int):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(num_tokens, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))


@pytest.mark.parametrize("run_rows", [64, 8192])
def test_forward_holds_one_part_beside_the_result(stub_kernels, monkeypatch, run_rows):
    monkeypatch.setattr(kernel_calls, "LOCAL_RUN_ROWS", run_rows)
    sched = compile_schedule(_one_rank(LENGTHS), 0, dense_threshold=64, dense_buckets=2)
    local = sched.local
    assert len(local.dense) >= 2 and len(local.rest) >= 2, "the plan must have several parts"
    if run_rows < 8192:  # the run of 40 short samples (400 rows) is cut into calls of at most 64 rows
        assert all(int(c.cu_seqlens_q[-1]) <= run_rows for c in local.rest) and len(local.rest) >= 8
    q, k, v = _inputs(sched.num_tokens)
    part_rows = max([d.q_run * d.batch for d in local.dense] + [int(c.cu_seqlens_q[-1]) for c in local.rest])
    with LiveBytes([q, k, v]) as mem:
        out, lse = ring.attention_forward(q, k, v, sched, ring.PassConfig(0.5, "reference_hybrid"))
    result = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    one_part = _rows_bytes(part_rows, HEADS) + part_rows * HEADS * 4  # its out and lse
    assert mem.peak <= result + one_part + 4096, f"peak {mem.peak} B: result {result} + one part {one_part}"


def test_backward_holds_one_part_beside_the_gradients(stub_kernels, monkeypatch):
    monkeypatch.setattr(kernel_calls, "LOCAL_RUN_ROWS", 64)
    sched = compile_schedule(_one_rank(LENGTHS), 0, dense_threshold=64, dense_buckets=2)
    q, k, v = _inputs(sched.num_tokens)
    out, lse = ring.attention_forward(q, k, v, sched, ring.PassConfig(0.5, "reference_hybrid"))
    dout = torch.randn_like(out)
    local = sched.local
    part_rows = max([d.q_run * d.batch for d in local.dense] + [int(c.cu_seqlens_q[-1]) for c in local.rest])
    with LiveBytes([q, k, v, out, lse, dout]) as mem:
        grads = ring.attention_backward(dout, q, k, v, out, lse, sched, ring.PassConfig(0.5, "reference_hybrid"))
    result = sum(g.numel() * g.element_size() for g in grads)
    # one part's dq/dk/dv and its padded lse (the dense parts' padding rows are views: no copies)
    one_part = _rows_bytes(part_rows, HEADS + 2 * KV_HEADS) + part_rows * HEADS * 4
    assert mem.peak <= result + one_part + 4096, f"peak {mem.peak} B: gradients {result} + one part {one_part}"


def test_live_bytes_counts_what_is_alive():
    with LiveBytes([]) as mem:
        a = torch.empty(1000)
        b = torch.empty(500)
        del a
        c = torch.empty(100)
    assert mem.peak == 6000 and mem.now == 2400
    del b, c
    assert mem.now == 0 and np.isclose(mem.peak, 6000)


def test_forward_without_gradients_holds_no_block_sized_partials_and_no_buffer_beside_the_first_part(stub_kernels):
    """The forward without gradients (``part_rows``), rank 1 of a sample split in two:

    * its remote block's keys are split (cuDNN part and flash key tail), so it returns two partial
      outputs of its query rows: run whole (as with gradients), two block-sized partials sit beside
      the result; in row chunks, two chunk-sized ones;
    * its local square is a part copied into the result: with gradients the first transfer's
      receive buffer is allocated before it (the transfer overlaps its kernel); without, after it
      is folded in, so the peak is the local step's own.
    """
    from ringpack.attention.engine import PassConfig, _local_forward, attention_forward
    from tests.helpers.attention import LoopbackTransport, LoopbackWorld

    class Receiving(LoopbackTransport):
        """Allocates the received buffer in ``begin``, as the ring does."""

        def begin(self, kv, grad_dtype=None):
            self.received = torch.empty_like(self.world.kv[self.origins[0]])

        def buffer(self, i):
            return self.received.copy_(self.world.kv[self.origins[i]])

    lengths = [600, 90]
    mb = microbatch_from_shards([0, 1], [[Piece(0, 0, 300)], [Piece(0, 300, 600), Piece(1, 0, 90)]], lengths)
    scheds = [compile_schedule(mb, r, dense_threshold=64, dense_buckets=2) for r in range(2)]
    (block,) = [d for st_ in scheds[1].steps for c in st_.calls for d in c.dense]
    assert block.q_run == 384 and block.k_run < block.k_len, (
        "rank 1's remote block: rows padded (over local rows), keys split"
    )
    assert [d.q_run for d in scheds[1].local.dense] == [384, 96], (
        "rank 1's local square is one of two parts copied into the result"
    )
    qs, ks, vs = zip(*(_inputs(s.num_tokens) for s in scheds))
    world = LoopbackWorld(scheds, list(ks), list(vs))
    ignore = [*qs, *ks, *vs, *world.kv]

    def beside_result(run) -> int:
        with LiveBytes(ignore) as mem:
            out, lse = run()
        return mem.peak - out.numel() * out.element_size() - lse.numel() * lse.element_size()

    def forward(part_rows):
        config = PassConfig(0.5, "reference_hybrid", lambda s: Receiving(s, world), part_rows)
        return attention_forward(qs[1], ks[1], vs[1], scheds[1], config)

    local = beside_result(
        lambda: _local_forward(qs[1], ks[1], vs[1], scheds[1].local, torch.float32, PassConfig(0.5, "reference_hybrid"))
    )
    with_grad, without = beside_result(lambda: forward(None)), beside_result(lambda: forward(64))
    row = _rows_bytes(1, HEADS) + HEADS * 4  # one query row's output and lse
    received = world.kv[0].numel() * world.kv[0].element_size()
    assert local >= 384 * row and received > 4096
    assert with_grad >= 2 * 384 * row + received, f"whole: {with_grad} B beside the result"
    assert without <= local + 4096, f"without gradients: {without} B beside the result, the local step alone {local} B"
