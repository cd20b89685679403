"""``torch.compile(fullgraph=True)`` over ringpack attention: no graph break, eager's numbers, no recompiles.

The engine is one custom op (``torch.ops.ringpack.ring_attention``) taking the schedule as an
opaque runtime input, so compiled code equals eager code (the same engine functions run), a CP
group's point-to-point transfers stay out of the graph, and a new micro-batch's schedule reuses it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringpack._spawn import run_ranks
from ringpack.attention import compile_schedule, ring_attention, traced
from ringpack.modes import MODES
from ringpack.shard_plan import Piece, microbatch_from_shards

pytestmark = pytest.mark.skipif(not traced.OPAQUE_SCHEDULE, reason="this torch has no opaque objects for custom ops")


def _microbatch(lengths: list[int], cp: int = 1):
    """Samples of ``lengths`` cut into ``cp`` equal-ish contiguous parts, part r on CP rank r."""
    shards = [[] for _ in range(cp)]
    for s, n in enumerate(lengths):
        cuts = np.linspace(0, n, cp + 1).round().astype(int)
        for r in range(cp):
            if cuts[r + 1] > cuts[r]:
                shards[r].append(Piece(s, int(cuts[r]), int(cuts[r + 1])))
    return microbatch_from_shards(list(range(len(lengths))), shards, dict(enumerate(lengths)))


def _run(fn, schedule, seed: int):
    """``fn(q, k, v, schedule)``'s output and the gradients of a fixed function of it (float64).

    Head dim 16: no token count here equals a tensor dim, which dynamic shapes would tie together
    (a recompile when they part)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(schedule.num_tokens, 4, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(schedule.num_tokens, 2, 16, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv"
    )
    out = fn(q, k, v, schedule)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return [out.detach(), *grads]


def _no_recompiles(index: int):
    """From the second micro-batch on, a recompilation is an error (the first call compiles)."""
    return torch._dynamo.config.patch(error_on_recompile=index > 0)


def _ops_in_graphs(backend: str):
    """A compile backend that records the ringpack engine ops of every graph it gets."""
    seen: list[list[str]] = []

    def record(gm, example_inputs):
        seen.append([str(n.target) for n in gm.graph.nodes if "ringpack" in str(n.target)])
        return torch._dynamo.backends.registry.lookup_backend(backend)(gm, example_inputs)

    return record, seen


HEAD_PARALLEL = [
    ("ulysses", "aot_eager", "reference"),
    pytest.param("ulysses", "inductor", "reference_hybrid", marks=pytest.mark.slow),
    pytest.param("ulysses+p2p", "aot_eager", "reference_hybrid", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("mode", "compiler", "backend"),
    [("ring", c, b) for c in ("aot_eager", "inductor") for b in ("reference", "reference_hybrid")] + HEAD_PARALLEL,
)
def test_compiled_attention_equals_eager(backend, compiler, mode):
    torch._dynamo.reset()
    attention = lambda q, k, v, s: ring_attention(q, k, v, s, mode=mode, backend=backend)
    record, seen = _ops_in_graphs(compiler)
    compiled = torch.compile(attention, fullgraph=True, backend=record, dynamic=True)
    for index, lengths in enumerate(([7, 1, 12], [30, 3], [5, 5, 5, 2])):
        node = 1 if "+" in mode else None  # the hybrids: nodes of one GPU
        options = dict(dense_threshold=4, dense_buckets=None, gpus_per_node=node, hybrid_layout="+" in mode)
        schedule = compile_schedule(_microbatch(lengths), 0, **options)
        with _no_recompiles(index):
            got = _run(compiled, schedule, 1)
        for a, b in zip(got, _run(attention, schedule, 1)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert seen and all(ops == ["ringpack.ring_attention.default"] for ops in seen)


@pytest.mark.slow
def test_compiled_llama_equals_eager():
    from ringpack.data import PackedCollator
    from tests.helpers.training import build_model

    torch._dynamo.reset()
    model = build_model("tiny", torch.float64, seed=5)

    def logits(model, batch):
        return model(
            input_ids=batch["input_ids"][None],
            position_ids=batch["position_ids"][None],
            ringpack_schedule=batch["schedule"],
            ringpack_backend="reference",
            use_cache=False,
        ).logits

    compiled = torch.compile(logits, fullgraph=True, backend="aot_eager", dynamic=True)
    rng = np.random.default_rng(0)
    for index, lengths in enumerate(([9, 4, 13], [21, 2], [6, 6, 6])):
        batch = PackedCollator(0, 1).collate(_microbatch(lengths), [rng.integers(0, 97, n) for n in lengths])
        results = []
        for fn in (compiled, logits):
            model.zero_grad()
            with _no_recompiles(index):
                out = fn(model, batch)
                out.square().mean().backward()
            results.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
        for got, want in zip(*results):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_without_opaque_objects_the_engine_runs_outside_the_graph(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(traced, "OPAQUE_SCHEDULE", False)
    attention = lambda q, k, v, s: ring_attention(q, k, v, s, backend="reference")
    schedule = compile_schedule(_microbatch([7, 1, 12]), 0)
    want = _run(attention, schedule, 2)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="_outside_graph"):
        torch.compile(attention, fullgraph=True, backend="aot_eager")(*_run_inputs(schedule), schedule)
    torch._dynamo.reset()
    for got, ref in zip(_run(torch.compile(attention, backend="aot_eager"), schedule, 2), want):
        assert torch.equal(got, ref)


def _run_inputs(schedule):
    return [torch.randn(schedule.num_tokens, h, 8, dtype=torch.float64) for h in (4, 2, 2)]


CP_MODES = MODES


def cp_worker(rank: int, world: int) -> dict:
    """Every mode over 2 gloo ranks (the hybrids in nodes of 1), compiled and eager, over three micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    results = {}
    for mode in CP_MODES:
        torch._dynamo.reset()
        attention = lambda q, k, v, s: ring_attention(q, k, v, s, mesh, mode, backend="reference")
        compiled = torch.compile(attention, fullgraph=True, backend="aot_eager", dynamic=True)
        same = []
        for index, lengths in enumerate(([9, 6], [13, 6, 3], [4, 20])):
            schedule = compile_schedule(
                _microbatch(lengths, world), rank, gpus_per_node=1 if "+" in mode else None, hybrid_layout="+" in mode
            )
            with _no_recompiles(index):
                got = _run(compiled, schedule, rank)
            same.append(all(torch.equal(a, b) for a, b in zip(got, _run(attention, schedule, rank))))
        results[mode] = same
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", CP_MODES)
def test_compiled_context_parallel_attention_over_gloo(cp_results, mode):
    for rank, results in enumerate(cp_results):
        assert results[mode] == [True, True, True], f"rank {rank}: compiled results differ from eager"


@pytest.fixture(scope="module")
def cp_results():
    return run_ranks(cp_worker, 2, timeout_s=60.0, join_s=240.0, name="compiled ring attention")
