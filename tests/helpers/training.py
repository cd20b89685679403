"""What the training-exactness tests share: the example loop, its arguments, and an independent reference.

The reference is independent of ringpack's runtime and planner output format: one process runs
every sample of each global batch *separately* through the same model with transformers' SDPA
attention (its eager path softmaxes in fp32), sums the next-token losses, divides by the global
batch's loss tokens and steps the same optimizer.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def load_example(name: str = "train") -> ModuleType:
    """``examples/<name>.py`` as a module (the examples are the tested code paths)."""
    path = ROOT / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ringpack_{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    sys.path.insert(0, str(path.parent))  # an example may import a sibling example
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def build_model(name: str, dtype: torch.dtype, seed: int, attn: str = "ringpack"):
    """The example's randomly initialised Llama of a named size."""
    return load_example().build_model(name, dtype, seed, attn=attn)


def example_args(cp: int, strategy: str = "balanced", packing: str = "balanced", steps: int = 2) -> argparse.Namespace:
    """The training example's arguments for a tiny fp64 run: 40 heavy-tailed samples, 16 per step."""
    return (
        load_example()
        .parser()
        .parse_args(
            [
                *("--cp", str(cp), "--model", "tiny", "--dtype", "fp64"),
                *("--strategy", strategy, "--packing", packing),
                *("--tokens-per-rank", str(96 // cp), "--samples", "40", "--samples-per-step", "16"),
                *("--steps", str(steps), "--lr", "1e-2", "--quiet"),
            ]
        )
    )


def plan_for(args: argparse.Namespace, world: int):
    """The plan every rank of a ``world``-process run of ``args`` follows."""

    example = load_example()
    samples = example.samples_for(args)
    sampler = example.make_sampler(args, [len(s) for s in samples], 0, world // args.cp, args.cp)
    return sampler.plan()


def reference(
    args: argparse.Namespace,
    world: int,
    steps: int,
    samples: list[np.ndarray] | None = None,
    make_optimizer: Callable | None = None,
    before_step: Callable | None = None,
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Per-sample eager training on one process over the global batches of ``plan_for(args, world)``.

    Returns each step's loss (per-token mean over the global batch) and every parameter's gradient
    as the optimizer step gets it. ``make_optimizer(params)`` defaults to the example's AdamW;
    ``before_step(model)`` runs between backward and the optimizer step (e.g. gradient clipping).
    """
    example = load_example()
    samples = example.samples_for(args) if samples is None else samples
    plan = plan_for(args, world)
    model = example.build_model(args.model, torch.float64, args.seed, attn="sdpa")
    model.train()
    params = list(model.parameters())
    optimizer = (make_optimizer or (lambda p: torch.optim.AdamW(p, lr=args.lr, foreach=False)))(params)
    losses, grads = [], []
    for step in plan.steps[:steps]:
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
        if before_step is not None:
            before_step(model)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, grads


def assert_same_training(got_losses, got_grads, want_losses, want_grads, steps: int, grad_rtol: float = 1e-9) -> None:
    """Losses equal to 1e-10 relative and every gradient element to ``grad_rtol`` (1e-12 absolute), step by step."""
    import pytest

    assert len(got_losses) == steps and len(got_grads) == steps
    for step in range(steps):
        assert got_losses[step] == pytest.approx(want_losses[step], rel=1e-10, abs=1e-12)
        assert set(got_grads[step]) == set(want_grads[step])
        for name, want in want_grads[step].items():
            torch.testing.assert_close(
                got_grads[step][name], want, rtol=grad_rtol, atol=1e-12, msg=lambda m: f"step {step} {name}: {m}"
            )
