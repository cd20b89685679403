"""Training with DP x CP through ringpack equals single-process training, to fp64 precision.

The distributed side is the real example (`examples/train.py`): 4 gloo processes train a tiny
Llama with ringpack attention on packed, planned micro-batches. The reference is independent of
ringpack's runtime and planner output format: one process runs every sample of each global batch
*separately* through the same model with transformers' SDPA attention (its eager path softmaxes in
fp32), sums the next-token losses, divides by the global batch's loss tokens and steps the same
optimizer.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from ringpack._spawn import run_ranks
from tests.helpers.training import assert_same_training, example_args, load_example, reference

CONFIGS = [  # (cp, strategy, packing): world 4 = DP x CP
    (2, "balanced", "balanced"),
    (2, "zigzag", "balanced"),
    (2, "contiguous", "balanced"),
    (4, "balanced", "balanced"),
    (1, "balanced", "first_fit"),
]
WORLD = 4
STEPS = 2


def worker(rank: int, world: int) -> dict | None:
    """One rank of the DP x CP run (gloo group and one intra-op thread set up by ringpack._spawn.run_ranks)."""
    example = load_example()
    results = {}
    for cp, strategy, packing in CONFIGS:
        args = example_args(cp, strategy, packing, STEPS)
        grid = example.make_grid(cp)
        grads = []
        records = example.train(
            args,
            grid,
            example.samples_for(args),
            on_step=lambda step, model: grads.append({n: p.grad.clone() for n, p in model.named_parameters()}),
        )
        results[(cp, strategy, packing)] = dict(losses=[r["loss"] for r in records], grads=grads)
    dist.barrier()
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def distributed_results():
    # forkserver: torch is imported once by the server, not once per rank (the server is shared with the
    # attention tests' harness when both run in one pytest process: its preload then counts)
    return run_ranks(
        worker,
        WORLD,
        timeout_s=120.0,
        join_s=280.0,
        start_method="forkserver",
        preload=["torch", "torch.distributed", __name__],
    )[0]


@pytest.mark.slow
@pytest.mark.parametrize("cp, strategy, packing", CONFIGS, ids=[f"cp{c}-{s}-{p}" for c, s, p in CONFIGS])
def test_dp_cp_training_equals_single_process(distributed_results, cp, strategy, packing):
    got = distributed_results[(cp, strategy, packing)]
    want_losses, want_grads = reference(example_args(cp, strategy, packing, STEPS), WORLD, STEPS)
    assert_same_training(got["losses"], got["grads"], want_losses, want_grads, STEPS)
