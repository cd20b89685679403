"""A training recipe: FSDP2 + context parallelism + per-layer ``torch.compile`` on a ``("dp", "cp")``
DeviceMesh, with ``torch.distributed.checkpoint`` (DCP) checkpoints that resume bit for bit.

    torchrun --nproc_per_node=8 examples/recipe.py --cp 2 --model llama-1b --tokens-per-rank 16384 \\
        --dtype bf16 --steps 1000 --warmup-steps 100 --max-norm 1.0 \\
        --checkpoint-dir ckpt --checkpoint-every 200                                  # GPUs, compiled
    torchrun --nproc_per_node=4 examples/recipe.py --cp 2 --steps 6 \\
        --checkpoint-dir /tmp/ckpt --checkpoint-every 3                               # CPU (gloo)

Run the same command again and it resumes from the newest complete checkpoint in ``--checkpoint-dir``.
The model, data and loss are those of ``examples/train.py``; the pieces, in the order applied:

* mesh: ``("dp", "cp")``, CP innermost (``examples/train_fsdp.py``'s ``make_mesh``); the sampler
  plans for the DP rank, the collator cuts for the CP rank, ``mesh["cp"]`` is attention's group;
* compile (``--compile``, on by default on GPUs): every decoder layer compiles in place with
  ``fullgraph=True`` before FSDP2 wraps it. ringpack attention is one custom op under compile, so a
  layer is one graph; compiling in place keeps parameter names, so checkpoints do not depend on it;
* FSDP2: ``fully_shard`` on every layer and the root over all ``dp x cp`` ranks, made to *sum*
  gradients (:func:`~ringpack.integrations.distributed.sum_gradients`: ringpack's loss rule);
* AdamW with a linear warm-up, optional gradient-norm clipping;
* data: ``BalancedBatchSampler`` + ``PackedCollator``; with ``--learn-cost`` a ``CostLearner``
  times micro-batches and re-plans with the measured prices;
* checkpoints: a DCP folder ``step-<N>`` per save holding the model and optimizer (sharded
  DTensors), the LR schedule and step count, and per rank the sampler's position and cost-model
  switches with the learner's observations (:class:`~ringpack.integrations.distributed.SamplerState`).
  DCP writes a folder's ``.metadata`` last, so a folder with one is complete.

N steps equal k steps, a save, a restore in fresh processes and N-k steps: the same losses and
parameters, bit for bit, wherever the kernels are deterministic and the cost learner's timings
repeat (``tests/integrations/test_recipe_resume.py`` checks it on CPU with the learner on a fake
clock). Real timings differ between runs: a resumed run keeps every cost-model switch made before
the save and fits its own timings after (``--no-learn-cost`` plans with the FLOP model throughout).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
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
from train_fsdp import make_mesh, wrap

from ringpack.integrations.distributed import SamplerState
from ringpack.training import CostLearner

CHECKPOINT_PREFIX = "step-"
LearnerFactory = Callable[[Any, Grid], "CostLearner | None"]


@dataclass
class Trainer:
    """Everything a training step touches and a checkpoint holds; ``step`` counts finished optimizer steps."""

    args: argparse.Namespace
    grid: Grid
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: torch.utils.data.DataLoader
    learner: CostLearner | None
    data_state: SamplerState
    step: int = 0

    @property
    def sampler(self) -> Any:
        return self.loader.batch_sampler


def apply_compile(model: torch.nn.Module, backend: str = "inductor") -> None:
    """Compile every decoder layer in place, whole (``fullgraph=True``: a graph break is an error).

    Call before ``fully_shard``. In place (``Module.compile``) keeps the parameter names, so
    compiled and eager runs read each other's checkpoints. The token count of a micro-batch varies:
    the first recompile marks it dynamic.
    """
    for layer in model.model.layers:
        layer.compile(backend=backend, fullgraph=True)


def linear_warmup(warmup_steps: int) -> Callable[[int], float]:
    """The LR factor of optimizer step ``s`` (0-based): rising linearly to 1 over ``warmup_steps`` steps."""
    return lambda step: min(1.0, (step + 1) / (warmup_steps + 1))


def default_learner(sampler: Any, grid: Grid) -> CostLearner:
    """The cost learner of ``examples/train.py``: host or CUDA-event timings, default fitting schedule."""
    return CostLearner(sampler, grid.cp_rank, device=grid.device)


def build(args: argparse.Namespace, samples: list[np.ndarray], make_learner: LearnerFactory | None = None) -> Trainer:
    """The mesh, the compiled and sharded model, optimizer, LR schedule, loader and cost learner.

    ``make_learner(sampler, grid)`` builds the learner when ``args.learn_cost`` (default
    :func:`default_learner`). Every rank builds the same model from ``args.seed``.
    """
    mesh, grid = make_mesh(args.cp)
    vocab = data_vocab(args) if args.dataset else None  # a --tokenizer sizes the embedding
    model = build_model(args.model, DTYPES[args.dtype], args.seed, device=grid.device, vocab=vocab)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    if args.compile:
        apply_compile(model, args.compile_backend)
    model = wrap(model, mesh, "fsdp2")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=False)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, linear_warmup(args.warmup_steps))
    loader = make_loader(args, grid, samples)
    learner = (make_learner or default_learner)(loader.batch_sampler, grid) if args.learn_cost else None
    return Trainer(
        args, grid, model, optimizer, scheduler, loader, learner, SamplerState(loader.batch_sampler, learner)
    )


# ------------------------------------------------------------------------------------ checkpoints


class TrainState:
    """Model, optimizer, LR schedule and step count as one DCP ``Stateful``.

    The model and optimizer states are ``torch.distributed.checkpoint.state_dict``'s: sharded
    DTensors by parameter name (DCP saves each shard once and can reshard on load).
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        t = self.trainer
        model_state, optimizer_state = get_state_dict(t.model, t.optimizer)
        return dict(model=model_state, optimizer=optimizer_state, lr_scheduler=t.scheduler.state_dict(), step=t.step)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t = self.trainer
        set_state_dict(t.model, t.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        t.scheduler.load_state_dict(state["lr_scheduler"])
        t.step = int(state["step"])


def checkpointed(trainer: Trainer) -> dict[str, Any]:
    """What a checkpoint holds: the training state and the data state (sampler + cost learner)."""
    return {"train": TrainState(trainer), "data": trainer.data_state}


def save(trainer: Trainer, folder: str | Path) -> Path:
    """Write ``folder/step-<N>`` (collective: every rank calls it); returns its path."""
    import torch.distributed.checkpoint as dcp

    path = Path(folder) / f"{CHECKPOINT_PREFIX}{trainer.step}"
    dcp.save(checkpointed(trainer), checkpoint_id=str(path))
    return path


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The complete ``step-<N>`` checkpoint in ``folder`` with the largest N (None if there is none)."""
    steps = {}
    for path in Path(folder).glob(f"{CHECKPOINT_PREFIX}*"):
        number = path.name.removeprefix(CHECKPOINT_PREFIX)
        if number.isdigit() and (path / ".metadata").is_file():
            steps[int(number)] = path
    return steps[max(steps)] if steps else None


def restore(trainer: Trainer, path: str | Path) -> None:
    """Load a checkpoint of :func:`save` into a freshly built trainer (collective), before iterating its loader.

    Raises:
        DataError: the sampler was built with other sizes, options or data than the saved run's.
        ValueError: the checkpoint was saved without the cost learner this run has.
        torch.distributed.checkpoint.api.CheckpointException: a checkpoint of another world size
            (it lacks this rank's ``data.rank<r>``) or of another model.
    """
    import torch.distributed.checkpoint as dcp

    dcp.load(checkpointed(trainer), checkpoint_id=str(path))


# ------------------------------------------------------------------------------------ training


def train_step(trainer: Trainer, batches: list[dict[str, Any]]) -> float:
    """One optimizer step over the step's micro-batches; the step's loss (the global per-token mean).

    FSDP2 reduce-scatters each micro-batch's gradients into the sharded accumulators (no unsharded
    gradient outlives its backward).
    """
    t, args = trainer, trainer.args
    loss = torch.zeros((), dtype=torch.float64, device=t.grid.device)
    for batch in batches:
        with t.learner.measure(batch) if t.learner is not None else contextlib.nullcontext():
            share = microbatch_loss(t.model, batch, t.grid, args.mode, args.backend) / batch["step_loss_tokens"]
            share.backward()
        loss += share.detach().double()
    t.data_state.mark_consumed(batches[-1])
    dist.all_reduce(loss)  # the shares of all ranks sum to the step's per-token mean
    if args.max_norm:
        torch.nn.utils.clip_grad_norm_(t.model.parameters(), args.max_norm, foreach=False)
    t.optimizer.step()
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)
    if t.learner is not None:
        t.learner.end_step()
    t.step += 1
    return float(loss)


def train(trainer: Trainer) -> list[float]:
    """Train from ``trainer.step`` to ``args.steps`` finished steps (0: to the end of the current epoch),
    saving every ``args.checkpoint_every`` steps and at the end when ``args.checkpoint_dir`` is set.
    Returns the loss of every step run."""
    args = trainer.args
    losses: list[float] = []
    log = (lambda line: print(line, flush=True)) if trainer.grid.rank == 0 and args.verbose else None
    for batches in planned_steps(trainer.loader, args.steps, log, done=trainer.step):
        start, lr = time.perf_counter(), trainer.optimizer.param_groups[0]["lr"]
        losses.append(train_step(trainer, batches))
        _log(trainer, losses[-1], lr, time.perf_counter() - start)
        if _due(args, trainer.step):
            save(trainer, args.checkpoint_dir)
    if losses and args.checkpoint_dir and not _due(args, trainer.step):
        save(trainer, args.checkpoint_dir)
    return losses


def _due(args: argparse.Namespace, step: int) -> bool:
    """Whether the periodic checkpoint falls on ``step``."""
    return bool(args.checkpoint_dir and args.checkpoint_every and step % args.checkpoint_every == 0)


def run(
    args: argparse.Namespace, samples: list[np.ndarray], make_learner: LearnerFactory | None = None
) -> tuple[Trainer, list[float]]:
    """Build, resume from ``args.checkpoint_dir``'s newest checkpoint (if any and ``args.resume``), train.

    Returns the trainer and the loss of every step this call ran.
    """
    trainer = build(args, samples, make_learner)
    latest = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir and args.resume else None
    if latest is not None:
        restore(trainer, latest)
        if trainer.grid.rank == 0 and args.verbose:
            print(f"resumed from {latest} (step {trainer.step})", flush=True)
    return trainer, train(trainer)


def _log(trainer: Trainer, loss: float, lr: float, seconds: float) -> None:
    if trainer.grid.rank == 0 and trainer.args.verbose:
        cost = trainer.sampler.config.cost.name
        print(
            f"step {trainer.step:5d}  loss {loss:.6f}  lr {lr:.3g}  {seconds * 1e3:8.1f} ms  plan: {cost}", flush=True
        )


def recipe_parser() -> argparse.ArgumentParser:
    p = parser()
    p.description = __doc__
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile every decoder layer (default: on with CUDA)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear LR warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-norm", type=float, default=0.0, help="clip the gradient norm to this (0: off)")
    p.add_argument("--checkpoint-dir", help="save DCP checkpoints here (step-<N>) and resume from the newest")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True, help="resume from --checkpoint-dir")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's arguments; ``--compile`` left unset means: compile when CUDA is available."""
    args = recipe_parser().parse_args(argv)
    if args.compile is None:
        args.compile = torch.cuda.is_available()
    return args


def main() -> int:
    args = parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    trainer, _ = run(args, samples_for(args))
    if trainer.grid.rank == 0:
        print(f"dp={trainer.grid.dp_size} cp={trainer.grid.cp_size}: at step {trainer.step}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
