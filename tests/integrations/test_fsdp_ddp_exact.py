"""FSDP2 and DDP reducing ringpack's gradients equal single-process training, to fp64 precision.

4 gloo processes run ``examples/train_fsdp.py`` on a ``("dp", "cp") = (2, 2)`` DeviceMesh: FSDP2
(``fully_shard`` per decoder layer and root over all four ranks) or DDP over all four ranks, each
made to sum gradients by :func:`ringpack.integrations.distributed.sum_gradients`. Losses and every
parameter's gradient of two optimizer steps must equal the per-sample single-process reference of
``tests/helpers/training.py``. The pool layout too: one CP group of all four ranks (``dp=1, cp=4``)
with the targeted K/V exchange, under FSDP2, flat and planned over nodes of two ranks (the exchange
relayed across them).
"""

from __future__ import annotations

import pytest

from ringpack._spawn import run_ranks
from tests.helpers.training import assert_same_training, example_args, load_example, reference

WORLD, CP, STEPS = 4, 2, 2
#: name -> (parallel, cp, K/V exchange mode, gpus_per_node)
RUNS = {
    "fsdp2": ("fsdp2", CP, "ring", None),
    "ddp": ("ddp", CP, "ring", None),
    "fsdp2 pool p2p": ("fsdp2", WORLD, "p2p", None),
    "fsdp2 pool p2p relayed": ("fsdp2", WORLD, "p2p", 2),
}


def worker(rank: int, world: int) -> dict | None:
    example = load_example("train_fsdp")
    results = {}
    for name, (parallel, cp, mode, node) in RUNS.items():
        args = example_args(cp, steps=STEPS)
        args.parallel, args.mode, args.gpus_per_node = parallel, mode, node
        grads = []
        losses = example.train(
            args, example.samples_for(args), on_step=lambda step, model: grads.append(example.full_gradients(model))
        )
        results[name] = dict(losses=losses, grads=grads)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def distributed_results():
    return run_ranks(worker, WORLD, timeout_s=120.0, join_s=280.0, name="fsdp2/ddp training")[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_training_equals_single_process(distributed_results, name):
    got = distributed_results[name]
    args = example_args(RUNS[name][1], steps=STEPS)
    args.gpus_per_node = RUNS[name][3]
    want_losses, want_grads = reference(args, WORLD, STEPS)
    assert_same_training(got["losses"], got["grads"], want_losses, want_grads, STEPS, grad_rtol=1e-10)


def test_the_relayed_pool_run_crosses_nodes():
    """The plan of the relayed run puts a sample over both nodes, so its schedules relay K/V."""
    from ringpack.attention import compile_schedule
    from tests.helpers.training import plan_for

    args = example_args(WORLD, steps=STEPS)
    args.gpus_per_node = RUNS["fsdp2 pool p2p relayed"][3]
    plan = plan_for(args, WORLD)
    assert plan.config.gpus_per_node == args.gpus_per_node
    relays = [
        compile_schedule(mb, r, gpus_per_node=args.gpus_per_node).exchange.relayed
        for step in plan.steps[:STEPS]
        for mb in step.microbatches[0]
        for r in range(WORLD)
    ]
    assert any(relays)
