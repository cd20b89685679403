"""Train on ringpack's plan with a DeviceMesh and FSDP2 (``fully_shard``) or DDP reducing the gradients.

    torchrun --nproc_per_node=4 examples/train_fsdp.py --cp 2 --parallel fsdp2 --steps 5     # CPU (gloo) or GPU
    torchrun --nproc_per_node=4 examples/train_fsdp.py --cp 2 --parallel ddp --steps 5

The data, model and loss are those of ``examples/train.py`` (its functions and options are reused);
what differs is who reduces the gradients:

* a ``("dp", "cp")`` DeviceMesh (CP innermost: a CP group is ``cp`` consecutive ranks) gives each
  rank its sampler and collator coordinates, and ``mesh["cp"]`` is the attention's CP group;
* ``--parallel fsdp2`` shards every decoder layer and the root with ``fully_shard`` over all ranks
  (the flattened ``dp x cp`` mesh: CP ranks hold different tokens, so their gradients are summed
  like those of DP ranks); ``--parallel ddp`` wraps the model in DDP over all ranks;
* :func:`ringpack.integrations.distributed.sum_gradients` makes FSDP2 / DDP *sum* the gradients
  instead of averaging them, so ringpack's loss (each rank's token-loss sum over the global batch's
  loss tokens) gives exactly the single-device per-token mean;
* a step's micro-batches before its last run under ``gradient_sync(model, False)`` (DDP reduces a
  parameter's accumulated gradient, which must happen once per step).

``tests/integrations/test_fsdp_ddp_exact.py`` checks losses and gradients against single-process
training.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import (
    DTYPES,
    Grid,
    build_model,
    data_vocab,
    make_loader,
    microbatch_loss,
    parser,
    planned_steps,
    samples_for,
)

from ringpack.integrations.distributed import data_parallel_mesh, gradient_sync, mesh_coordinates, sum_gradients

PARALLEL = ("fsdp2", "ddp")


def make_mesh(cp: int) -> tuple[Any, Grid]:
    """The ``("dp", "cp")`` mesh over every rank and this rank's :class:`Grid` (its CP group: ``mesh["cp"]``)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % cp:
        raise ValueError(f"world size {world} is not a multiple of cp={cp}")
    device = torch.device("cpu")
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mesh = init_device_mesh(device.type, (world // cp, cp), mesh_dim_names=("dp", "cp"))
    c = mesh_coordinates(mesh)
    return mesh, Grid(dist.get_rank(), world, c.dp_rank, c.dp_size, c.cp_rank, c.cp_size, mesh["cp"], device)


def wrap(model: torch.nn.Module, mesh: Any, parallel: str) -> torch.nn.Module:
    """FSDP2 on every decoder layer and the root, or DDP, over all ranks; gradients summed, not averaged."""
    ranks = data_parallel_mesh(mesh)
    if parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=ranks)
        model = fully_shard(model, mesh=ranks)
    elif parallel == "ddp":
        device_ids = [model.device] if model.device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids, process_group=ranks.get_group())
    else:
        raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    return sum_gradients(model)


def train(args: argparse.Namespace, samples: list[np.ndarray], on_step=None) -> list[float]:
    """The loop; returns each step's loss (the global per-token mean). ``on_step(step, model)`` runs
    after backward, before the optimizer (every rank calls it: gathering sharded gradients is collective)."""
    mesh, grid = make_mesh(args.cp)
    vocab = data_vocab(args) if args.dataset else None  # a --tokenizer sizes the embedding
    model = build_model(args.model, DTYPES[args.dtype], args.seed, device=grid.device, vocab=vocab)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model = wrap(model, mesh, args.parallel)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    losses = []
    log = (lambda line: print(line, flush=True)) if grid.rank == 0 and args.verbose else None
    for step, batches in enumerate(planned_steps(make_loader(args, grid, samples), args.steps, log)):
        loss = torch.zeros((), dtype=torch.float64, device=grid.device)
        for index, batch in enumerate(batches):
            with gradient_sync(model, enabled=index + 1 == len(batches)):
                share = microbatch_loss(model, batch, grid, args.mode, args.backend) / batch["step_loss_tokens"]
                share.backward()
            loss += share.detach().double()
        dist.all_reduce(loss)  # the shares of all ranks sum to the step's per-token mean
        if on_step is not None:
            on_step(step, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if grid.rank == 0 and args.verbose:
            print(f"step {step:3d}  loss {losses[-1]:.6f}", flush=True)
    return losses


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient by its name in the unwrapped model (collective under FSDP2)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
        grads[name.removeprefix("module.")] = grad
    return grads


def fsdp_parser() -> argparse.ArgumentParser:
    p = parser()
    p.description = __doc__
    p.add_argument("--parallel", choices=PARALLEL, default="fsdp2", help="who reduces the gradients")
    return p


def main() -> int:
    args = fsdp_parser().parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    losses = train(args, samples_for(args))
    if dist.get_rank() == 0:
        print(f"{args.parallel} dp={dist.get_world_size() // args.cp} cp={args.cp}: {len(losses)} steps", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
