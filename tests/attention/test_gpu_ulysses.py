"""Head-parallel CP with every rank of the group in one process: ``ulysses`` and the hybrids, bf16 on one GPU.

Every CP rank runs as a thread (:mod:`tests.helpers.head_parallel`): the all-to-alls go through the
relayout's pluggable exchange and the K/V between nodes through a transport over memory, so the
runtime's own forward and backward run for every rank, with the other ranks' data from memory.

On one GPU (``pytest -m gpu``): bf16 with every usable backend (``auto``, ``fa4`` where
flash-attn-4 runs, ``cudnn_hybrid`` with the dense split, ``torch_flash``, ``flash_attn`` where
installed), on the plans of ``test_gpu_ring.py``, held to the bound used there: each of
out/dq/dk/dv within ``2 x`` the error of single-GPU flash over the whole packed batch (both against
an fp32 reference) plus ``2**-10 x max|reference|``. On CPU (always): the same emulation in fp64
and fp32 with the reference backend, exact against the dense reference, eager and traced passes.
Nothing here imports ortools or datasets.
"""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_gpu_ring import (
    BOUND_FACTOR,
    DTYPE,
    EPS_REL,
    HEAD_DIM,
    NAMES,
    flash_whole_batch,
    fp32_reference,
    gpu_plans,
    local,
    make_inputs,
    max_err,
)
from tests.helpers.attention import (
    Problem,
    dense_reference,
    handmade_microbatches,
    max_errors,
    targeted_microbatches,
    within,
)
from tests.helpers.head_parallel import run_head_parallel

#: (mode, CP size, gpus_per_node)
LAYOUTS = [
    ("ulysses", 2, None),
    ("ulysses", 4, None),
    ("ulysses", 8, None),
    ("ulysses+p2p", 4, 2),
    ("ulysses+p2p", 8, 4),
    ("ulysses+ring", 8, 2),
]

# ------------------------------------------------------------------------------------------- CPU

CPU_PLANS = {
    4: ("skip-rank", "two-runs-via-a-proxy-of-4"),
    6: ("pairs-of-6", "length-1-reverse-of-6"),
    8: ("ranks-0-and-5-of-8", "all-to-one-of-8"),
}


def _cpu_cases(cp: int):
    named = {name: (mb, lengths) for name, mb, lengths in handmade_microbatches() + targeted_microbatches()}
    return [(name, *named[name]) for name in CPU_PLANS[cp]]


@pytest.mark.parametrize("traced", [False, True], ids=["eager", "traced"])
@pytest.mark.parametrize(
    ("mode", "cp", "node"),
    [("ulysses", 4, None), ("ulysses", 8, None), ("ulysses+p2p", 6, 3), ("ulysses+p2p", 8, 2), ("ulysses+ring", 8, 4)],
)
def test_the_emulated_group_is_exact_on_cpu(mode, cp, node, traced):
    heads, kv_heads = (8, 2) if cp != 6 else (6, 3)
    for name, mb, lengths in _cpu_cases(cp):
        problem = Problem.make(mb, lengths, heads, kv_heads, 4, seed=cp)
        ref = dense_reference(problem)
        got = run_head_parallel(problem, mode, gpus_per_node=node, traced=traced)
        for rank, result in enumerate(got):
            errors = max_errors(problem, rank, ref, result)
            assert within(errors, 1e-10), (name, rank, errors)


def test_the_emulated_group_is_exact_in_fp32():
    name, mb, lengths = _cpu_cases(8)[0]
    problem = Problem.make(mb, lengths, 8, 2, 4, seed=5, dtype=torch.float32)
    ref = dense_reference(problem)
    for mode, node in (("ulysses", None), ("ulysses+p2p", 2)):
        for rank, result in enumerate(run_head_parallel(problem, mode, gpus_per_node=node)):
            assert result["out"].dtype == torch.float32
            assert within(max_errors(problem, rank, ref, result), 1e-5), (mode, rank)


def test_a_corrupted_exchange_fails_the_check(monkeypatch):
    """The emulation compares what it should: rows swapped in the all-to-all break exactness."""
    from tests.helpers import head_parallel

    real = head_parallel.ThreadedGroup.exchange_rows

    def swapped(self, out, send, out_splits, in_splits):
        real(self, out, send, out_splits, in_splits)
        if out.shape[0] > 1:
            out[[0, 1]] = out[[1, 0]]

    monkeypatch.setattr(head_parallel.ThreadedGroup, "exchange_rows", swapped)
    name, mb, lengths = _cpu_cases(4)[0]
    problem = Problem.make(mb, lengths, 8, 2, 4, seed=1)
    ref = dense_reference(problem)
    got = run_head_parallel(problem, "ulysses")
    assert not all(within(max_errors(problem, r, ref, result), 1e-10) for r, result in enumerate(got))


# ------------------------------------------------------------------------------------------- GPU


def _gpu_backends() -> list[str]:
    """``auto`` and every kernel backend usable here in bf16 (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    from ringpack.attention.kernels import available_backends

    usable = [b for b in available_backends("cuda", DTYPE, HEAD_DIM) if not b.startswith("reference")]
    return ["auto", *usable]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", _gpu_backends() or ["auto"])
@pytest.mark.parametrize(("mode", "cp", "node"), LAYOUTS)
def test_head_parallel_bf16_on_one_gpu(backend, mode, cp, node):
    dev = torch.device("cuda")
    scale = HEAD_DIM**-0.5
    dense_threshold = 256 if backend == "cudnn_hybrid" else None
    for name, mb, lengths in gpu_plans(cp):
        x = make_inputs(lengths, dev, seed=cp)
        ref, flash = fp32_reference(x, scale), flash_whole_batch(x, scale)
        problem = Problem(mb, lengths, *({s: t.to(DTYPE) for s, t in x[n].items()} for n in ("q", "k", "v", "dout")))
        got = run_head_parallel(
            problem, mode, scale, backend=backend, device=dev, gpus_per_node=node, dense_threshold=dense_threshold
        )
        for rank, result in enumerate(got):
            for t in NAMES:
                r, f = local(ref[t], mb, rank), local(flash[t], mb, rank)
                if not r.numel():
                    continue
                assert result[t].dtype == DTYPE
                limit = BOUND_FACTOR * max_err(f, r) + EPS_REL * float(r.abs().max())
                assert max_err(result[t], r) <= limit, (
                    f"{backend} {mode} {name} cp={cp} rank {rank} {t}: {max_err(result[t], r):.3e} > {limit:.3e}"
                )
