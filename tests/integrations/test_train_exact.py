"""Training with DP x CP through ringpack equals single-process training, to fp64 precision.

The distributed side is the real example (`examples/train.py`): 4 gloo processes train a tiny
Llama with ringpack attention on packed, planned micro-batches. The reference is independent of
ringpack's runtime and planner output format: one process runs every sample of each global batch
*separately* through the same model with transformers' SDPA attention (its eager path softmaxes in
fp32), sums the next-token losses, divides by the global batch's loss tokens and steps the same
optimizer.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ringpack._spawn import run_ranks

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [  # (cp, strategy, packing): world 4 = DP x CP
    (2, "balanced", "balanced"),
    (2, "zigzag", "balanced"),
    (2, "contiguous", "balanced"),
    (4, "balanced", "balanced"),
    (1, "balanced", "first_fit"),
]
WORLD = 4
STEPS = 2


def load_example():
    spec = importlib.util.spec_from_file_location("ringpack_train_example", ROOT / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def example_args(example, cp: int, strategy: str, packing: str) -> argparse.Namespace:
    return example.parser().parse_args(
        [
            "--cp",
            str(cp),
            "--model",
            "tiny",
            "--dtype",
            "fp64",
            "--strategy",
            strategy,
            "--packing",
            packing,
            "--tokens-per-rank",
            str(96 // cp),
            "--samples",
            "40",
            "--samples-per-step",
            "16",
            "--steps",
            str(STEPS),
            "--lr",
            "1e-2",
            "--quiet",
        ]
    )


def worker(rank: int, world: int) -> dict | None:
    """One rank of the DP x CP run (gloo group and one intra-op thread set up by ringpack._spawn.run_ranks)."""
    example = load_example()
    results = {}
    for cp, strategy, packing in CONFIGS:
        args = example_args(example, cp, strategy, packing)
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


def reference(example, args):
    """Per-sample eager training on one process, over the same global batches."""
    from ringpack.data import BalancedBatchSampler

    samples = example.samples_for(args)
    sampler = BalancedBatchSampler(
        [len(s) for s in samples],
        0,
        WORLD // args.cp,
        args.cp,
        args.tokens_per_rank,
        strategy=args.strategy,
        packing=args.packing,
        samples_per_step=args.samples_per_step,
        seed=args.seed,
        cost=example._cost_model(args.model, args.cost_profile),
        cp_token_slack=args.cp_token_slack,
    )
    plan = sampler.plan()
    model = example.build_model(args.model, torch.float64, args.seed, attn="sdpa")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    losses, grads = [], []
    for step in plan.steps[:STEPS]:
        ids = [s for rank in step.microbatches for mb in rank for s in mb.samples]
        total = 0.0
        for s in ids:
            tokens = torch.as_tensor(samples[s], dtype=torch.long)
            if len(tokens) < 2:
                continue
            logits = model(input_ids=tokens[None], use_cache=False).logits[0]
            loss = torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum") / step.loss_tokens
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


@pytest.fixture(scope="module")
def distributed_results():
    # forkserver: torch is imported once by the server, not once per rank (the server is shared with the
    # attention tests' harness when both run in one session: its preload then counts)
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
    example = load_example()
    got = distributed_results[(cp, strategy, packing)]
    want_losses, want_grads = reference(example, example_args(example, cp, strategy, packing))
    assert len(got["losses"]) == STEPS
    for step in range(STEPS):
        assert got["losses"][step] == pytest.approx(want_losses[step], rel=1e-10, abs=1e-12)
        for name, want in want_grads[step].items():
            torch.testing.assert_close(
                got["grads"][step][name], want, rtol=1e-9, atol=1e-12, msg=lambda m: f"step {step} {name}: {m}"
            )
