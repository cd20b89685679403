r"""Train a Llama-style model with DP x CP on packed data planned by ringpack.

    torchrun --nproc_per_node=4 examples/train.py --cp 2 --model tiny --steps 5          # CPU (gloo) or GPU
    torchrun --nproc_per_node=2 examples/train.py --cp 2 --model llama-1b --tokens-per-rank 65536 \
        --dtype bf16 --steps 6 --strategy balanced                                        # 2 GPUs as CP=2
    torchrun --nproc_per_node=2 examples/train.py --cp 2 --dataset my.jsonl --text-column text \
        --tokenizer tokenizer.json --overflow split                                       # your own data

What each part does:

* the data is synthetic (random token ids with heavy-tailed lengths, ``--data``) or a real dataset
  (``--dataset``: a local file or folder that :func:`ringpack.data.load_source` reads, or a Hub
  name), its ``--column`` of token ids used as is or tokenized from ``--text-column`` with the
  regex tokenizer (ids hashed into the model's vocabulary) or a ``--tokenizer`` tokenizer.json
  (the model's vocabulary then is the tokenizer's);
* ranks form a DP x CP grid (CP groups are consecutive ranks); every rank builds the same plan
  from (lengths, config, seed, epoch) through :class:`BalancedBatchSampler` for its DP rank;
* :class:`PackedCollator` cuts each micro-batch into this CP rank's tokens, already-shifted labels,
  positions within each sample, and the compiled attention schedule;
* the model is a randomly initialised transformers ``LlamaForCausalLM`` with
  ``attn_implementation="ringpack"``: every layer's attention runs through ringpack's runtime;
* the loss is a *sum* of token losses divided by the global batch's loss tokens
  (``step_loss_tokens``), and gradients are summed over all ranks (DP x CP), which makes each
  step exactly the single-device per-token mean over the global batch, however the samples were
  packed, split or distributed.

The functions here are imported by ``tests/integrations/test_train_exact.py``, which checks losses
and gradients against single-process training, so the example is the tested code path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringpack.attention import MODES, ScheduleOptions, warm_up_kernels
from ringpack.cost import PRESETS, CostModel, ModelShape
from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset, lengths_from_dataset
from ringpack.integrations.transformers import (
    causal_lm_loss_sum,
)  # importing it registers attn_implementation='ringpack'
from ringpack.modes import HYBRID_MODES
from ringpack.shard_plan import OVERFLOW_POLICIES, PACKINGS, STRATEGIES, PlanConfig
from ringpack.training import CostLearner

MODELS = {
    # name: (hidden, layers, heads, kv_heads, ffn, vocab); llama-1b is the cost model's preset
    "tiny": (32, 2, 4, 2, 64, 97),
    "small": (256, 4, 8, 2, 688, 4096),
    "llama-1b": tuple(
        getattr(PRESETS["llama-1b"], f) for f in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")
    ),
}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Grid:
    """This process's place in the DP x CP grid and its process groups."""

    rank: int
    world: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def make_grid(cp: int) -> Grid:
    """CP groups of ``cp`` consecutive ranks (they share NVLink on one host); DP across them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % cp:
        raise ValueError(f"world size {world} is not a multiple of cp={cp}")
    groups = [dist.new_group(list(range(start, start + cp))) for start in range(0, world, cp)]
    device = torch.device("cpu")
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    return Grid(rank, world, rank // cp, world // cp, rank % cp, cp, groups[rank // cp], device)


def heavy_tailed_samples(n: int, max_len: int, vocab: int, seed: int, scale: int = 16) -> list[np.ndarray]:
    """Random token ids with Pareto lengths (many short samples, a few up to ``max_len``)."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(max_len, (scale * (1 + rng.pareto(1.2, n))).astype(np.int64))
    return [rng.integers(0, vocab, int(length)) for length in lengths]


def corpus_samples(n: int, max_len: int, vocab: int, seed: int, scale: float) -> list[np.ndarray]:
    """Random token ids with the lengths of the standard-library corpus (``ringpack demo``'s data),
    ``n`` of them drawn with a seed, scaled by ``scale`` and capped at ``max_len``."""
    from ringpack.data.corpus import stdlib_corpus

    rng = np.random.default_rng(seed)
    lengths = rng.choice(stdlib_corpus().lengths, size=n)
    lengths = np.clip((lengths * scale).astype(np.int64), 1, max_len)
    return [rng.integers(0, vocab, int(length)) for length in lengths]


def samples_for(args: argparse.Namespace) -> Any:
    """The run's data: ``--dataset`` (:func:`dataset_samples`), else synthetic heavy-tailed lengths up
    to one CP group's capacity (``--data``), a list of int64 token-id arrays."""
    if args.dataset:
        return dataset_samples(args)
    vocab = MODELS[args.model][5]
    max_len = args.max_len or args.cp * args.tokens_per_rank
    if args.data == "stdlib":
        return corpus_samples(args.samples, max_len, vocab, args.seed, args.len_scale / 16)
    return heavy_tailed_samples(args.samples, max_len, vocab, args.seed, args.len_scale)


def dataset_samples(args: argparse.Namespace) -> Any:
    """``--dataset`` as a ``datasets.Dataset`` whose ``--column`` holds every row's token ids.

    A dataset without that column is tokenized from ``--text-column`` (regex ids hashed into
    :func:`data_vocab`, or ``--tokenizer``'s ids). Rank 0 loads and tokenizes first, filling the
    ``datasets`` cache, and the other ranks then read the cache instead of writing it at once.
    """
    from ringpack.data import load_source, tokenize_dataset

    distributed = dist.is_available() and dist.is_initialized()
    first = not distributed or dist.get_rank() == 0
    if not first:
        dist.barrier()
    ds = load_source(args.dataset, split=args.split, cache_dir=args.cache_dir)
    if args.column not in ds.column_names:
        ds = tokenize_dataset(ds, args.text_column, args.tokenizer, column=args.column, vocab_size=data_vocab(args))
    if first and distributed:
        dist.barrier()
    _check_ids(ds, args.column, data_vocab(args))
    return ds


def data_vocab(args: argparse.Namespace) -> int:
    """The vocabulary the run's token ids index: a ``--tokenizer``'s, else the ``--model``'s."""
    if getattr(args, "tokenizer", None):
        from tokenizers import Tokenizer

        path = Path(args.tokenizer)
        return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path)).get_vocab_size()
    return MODELS[args.model][5]


def _check_ids(ds: Any, column: str, vocab: int) -> None:
    """Refuse token ids the model's embedding cannot look up (naming the largest and the vocabulary)."""
    import pyarrow.compute as pc

    table = ds.with_format("arrow")[:]
    largest = pc.max(pc.list_flatten(table.column(column))).as_py()
    if largest is not None and largest >= vocab:
        raise ValueError(
            f"{column!r} holds token id {largest}, beyond the model's vocabulary of {vocab}: "
            "pass the --tokenizer that made them (the model then takes its vocabulary)"
        )


def build_model(
    name: str,
    dtype: torch.dtype,
    seed: int,
    attn: str = "ringpack",
    device: torch.device | None = None,
    vocab: int | None = None,
):
    """A randomly initialised Llama of a named size (no weight download); ``vocab`` overrides its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, ffn, default_vocab = MODELS[name]
    config = LlamaConfig(
        vocab_size=vocab or default_vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1 << 20,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(config, attn_implementation=attn, dtype=dtype)
    return model.to(device or torch.device("cpu"))


def microbatch_loss(model, batch: dict[str, Any], grid: Grid, mode: str, backend: str) -> torch.Tensor:
    """Sum of this CP rank's token losses for one micro-batch (the caller divides and backprops)."""
    device = grid.device
    logits = model(
        input_ids=batch["input_ids"].to(device)[None],
        position_ids=batch["position_ids"].to(device)[None],
        ringpack_schedule=batch["schedule"].to(device),
        ringpack_group=grid.cp_group,
        ringpack_mode=mode,
        ringpack_backend=backend,
        use_cache=False,
    ).logits
    return causal_lm_loss_sum(logits[0], batch["labels"].to(device))


def all_reduce_grads(model, group=None) -> None:
    """Sum gradients over every rank (DP and CP alike): each rank's loss is its share of one mean."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def steps_of(loader) -> Iterator[list[dict[str, Any]]]:
    """Group the loader's micro-batches into optimizer steps (the plan says where a step ends)."""
    current: list[dict[str, Any]] = []
    for batch in loader:
        current.append(batch)
        if batch["microbatch_index"] + 1 == batch["microbatches_in_step"]:
            yield current
            current = []
    assert not current, "the last step ended early"


def planned_steps(loader, steps: int, log=None, *, done: int = 0) -> Iterator[list[dict[str, Any]]]:
    """The run's optimizer steps: the rest of the sampler's epoch (``steps=0``), or up to ``steps`` of them,
    continuing into the next epochs (each with its own plan) when an epoch has fewer.

    Args:
        loader: a DataLoader whose ``batch_sampler`` is a :class:`BalancedBatchSampler`.
        steps: the run's steps in all (``--steps``); 0 for the rest of the current epoch.
        log: called with one line each time the run continues into another epoch.
        done: steps the run finished before this call (a resumed run): ``steps - done`` are yielded,
            and the log counts the run's steps, not this call's.
    """
    sampler, fresh = loader.batch_sampler, False
    if steps and done >= steps:
        return
    while True:
        in_epoch = 0
        for batches in steps_of(loader):
            yield batches
            done, in_epoch = done + 1, in_epoch + 1
            if steps and done >= steps:
                return
        if not steps or (fresh and in_epoch == 0):  # a sampler resumed at its epoch's end yields none first
            return
        fresh = True
        sampler.set_epoch(sampler.epoch + 1)  # the loader's next iter() plans the next epoch
        if log is not None:
            log(
                f"epoch {sampler.epoch - 1} ended after {in_epoch} steps; continuing with epoch {sampler.epoch} "
                f"({done} of --steps {steps} done)"
            )


def train(args: argparse.Namespace, grid: Grid, samples: list[np.ndarray], on_step=None) -> list[dict[str, Any]]:
    """The training loop; returns per-step records (loss, tokens, times). ``on_step(step, model)``
    lets tests inspect gradients before the optimizer runs."""
    vocab = data_vocab(args) if args.dataset else None
    model = build_model(args.model, DTYPES[args.dtype], args.seed, device=grid.device, vocab=vocab)
    if grid.device.type == "cuda":  # flash-attn-4 compiles its kernels here, not in the first steps
        c = model.config
        warm_up_kernels(
            c.num_attention_heads, c.num_key_value_heads, c.head_dim, DTYPES[args.dtype], grid.device, args.backend
        )
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    loader = make_loader(args, grid, samples)
    learner = None
    if args.learn_cost:  # time every micro-batch and re-plan with the measured prices
        learner = CostLearner(loader.batch_sampler, grid.cp_rank, device=grid.device)
    records = []
    for step, batches in enumerate(planned_steps(loader, args.steps, _log_line(grid, args))):
        _sync(grid)
        start = time.perf_counter()
        loss, tokens = forward_backward(model, batches, grid, args, learner)
        _sync(grid)
        busy = time.perf_counter() - start
        all_reduce_grads(model)
        dist.all_reduce(loss)
        _sync(grid)
        step_time = time.perf_counter() - start
        if on_step is not None:
            on_step(step, model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fit = learner.end_step() if learner is not None else None
        records.append(_step_record(step, float(loss), tokens, busy, step_time, grid))
        records[-1].update(epoch=batches[0]["epoch"], cost_model=loader.batch_sampler.config.cost.name)
        if fit is not None and grid.rank == 0 and args.verbose:
            print(
                f"step {step}: planning with measured prices from step {_switch_step(loader)} "
                f"(a token costs as much as {fit.model.token / fit.model.pair:,.0f} attention pairs; "
                f"fit error {fit.rms_error:.1%})",
                flush=True,
            )
        if grid.rank == 0 and args.verbose:
            _print_record(records[-1])
    return records


def make_loader(args: argparse.Namespace, grid: Grid, samples: Any) -> torch.utils.data.DataLoader:
    """This rank's loader: the planned micro-batches of its DP rank, cut for its CP rank.

    ``samples``: a list of token-id arrays, or a ``datasets.Dataset`` with ``--column`` (read
    through its Arrow offsets and rows, never as Python lists).
    """
    column = getattr(args, "column", "input_ids")
    real = hasattr(samples, "column_names")
    lengths = lengths_from_dataset(samples, column) if real else [len(s) for s in samples]
    sampler = make_sampler(args, lengths, grid.dp_rank, grid.dp_size, grid.cp_size)
    return torch.utils.data.DataLoader(
        PackedDataset(samples, column=column),
        batch_sampler=sampler,
        # the hybrid modes run on the node layout, compiled only when asked for
        collate_fn=PackedCollator(
            grid.cp_rank, grid.cp_size, schedule_options=ScheduleOptions(hybrid_layout=args.mode in HYBRID_MODES)
        ),
        num_workers=args.workers,
    )


def make_sampler(args: argparse.Namespace, lengths: Any, dp_rank: int, dp_size: int, cp_size: int):
    """The sampler of DP rank ``dp_rank``: the plan options of ``args`` over ``lengths``."""
    config = PlanConfig(
        dp=dp_size,
        cp=cp_size,
        tokens_per_rank=args.tokens_per_rank,
        strategy=args.strategy,
        packing=args.packing,
        samples_per_step=args.samples_per_step,
        seed=args.seed,
        cost=_cost_model(args.model, args.cost_profile),
        cp_token_slack=args.cp_token_slack,
        pair_price_range=args.pair_price_range,
        overflow=getattr(args, "overflow", "error"),
        gpus_per_node=getattr(args, "gpus_per_node", None),
    )
    return BalancedBatchSampler(lengths, config, dp_rank)


def forward_backward(
    model, batches: list[dict[str, Any]], grid: Grid, args: argparse.Namespace, learner: CostLearner | None = None
) -> tuple[torch.Tensor, int]:
    """Backpropagate one step's micro-batches; this rank's share of the step loss (float64) and its tokens.
    ``learner`` (if any) times each micro-batch's forward + backward."""
    total = torch.zeros((), dtype=torch.float64, device=grid.device)
    tokens = 0
    for batch in batches:
        with learner.measure(batch) if learner is not None else contextlib.nullcontext():
            loss = microbatch_loss(model, batch, grid, args.mode, args.backend) / batch["step_loss_tokens"]
            loss.backward()
        total += loss.detach().double()
        tokens += int(batch["input_ids"].numel())
    return total, tokens


def _step_record(step: int, loss: float, tokens: int, busy: float, step_time: float, grid: Grid) -> dict[str, Any]:
    """The step's record; gathers every rank's tokens and busy time (a collective: every rank calls it)."""
    per_rank = [None] * grid.world
    dist.all_gather_object(per_rank, (tokens, busy))
    global_tokens = sum(t for t, _ in per_rank)
    return dict(
        step=step,
        loss=loss,
        local_tokens=tokens,
        global_tokens=global_tokens,
        busy_s=[b for _, b in per_rank],  # forward+backward of each rank, before the gradient all-reduce
        step_s=step_time,
        tokens_per_s=global_tokens / step_time,
    )


def _print_record(record: dict[str, Any]) -> None:
    busy_ms = " ".join(f"{b * 1e3:.0f}" for b in record["busy_s"])
    print(
        f"step {record['step']:3d}  loss {record['loss']:.6f}  step {record['step_s'] * 1e3:8.1f} ms  "
        f"{record['tokens_per_s']:,.0f} tok/s  busy/rank [{busy_ms}] ms",
        flush=True,
    )


def _cost_model(name: str, profile: str | None = None) -> CostModel:
    """The planner's cost model: a calibrated profile if given, else FLOPs of the model's shape."""
    if profile:
        return CostModel.load(profile)
    hidden, layers, heads, kv_heads, ffn, vocab = MODELS[name]
    return CostModel.from_shape(ModelShape(name, hidden, layers, heads, kv_heads, ffn, vocab))


def _switch_step(loader) -> int:
    """The step from which the sampler plans with its latest cost model."""
    switches = loader.batch_sampler.state_dict()["cost_switches"]
    return switches[-1][1] if switches else 0


def _log_line(grid: Grid, args: argparse.Namespace):
    """What prints one line of the run on rank 0 (``None`` elsewhere and with ``--quiet``)."""
    return (lambda line: print(line, flush=True)) if grid.rank == 0 and args.verbose else None


def _sync(grid: Grid) -> None:
    if grid.device.type == "cuda":
        torch.cuda.synchronize(grid.device)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (DP = world / cp)")
    p.add_argument("--model", choices=sorted(MODELS), default="tiny")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--strategy", choices=STRATEGIES, default="balanced")
    p.add_argument("--packing", choices=PACKINGS, default="balanced")
    p.add_argument("--mode", choices=MODES, default="ring")
    p.add_argument(
        "--gpus-per-node",
        type=int,
        help="plan split samples node by node and relay the p2p exchange across nodes (pool plans: --cp = world)",
    )
    p.add_argument("--backend", default="auto", help="ringpack kernel backend")
    p.add_argument("--cost-profile", help="calibrated cost profile for the planner (ringpack calibrate)")
    p.add_argument(
        "--cp-token-slack", type=float, default=None, help="balanced split: token guard (PlanConfig.cp_token_slack)"
    )
    p.add_argument(
        "--pair-price-range",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=None,
        metavar="LOW,HIGH",
        help="planner: stay balanced for pair prices LOW..HIGH x the model's (PlanConfig.pair_price_range)",
    )
    p.add_argument("--tokens-per-rank", type=int, default=512)
    p.add_argument("--samples", type=int, default=256, help="synthetic heavy-tailed samples")
    p.add_argument(
        "--data",
        choices=["pareto", "stdlib"],
        default="pareto",
        help="sample lengths: Pareto (default) or the standard-library corpus's (random token ids either way)",
    )
    p.add_argument(
        "--learn-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time every micro-batch and plan with the measured prices once fitted (default: on)",
    )
    p.add_argument(
        "--dataset",
        metavar="PATH|HUB_NAME",
        help="train on this dataset instead of synthetic samples: a saved `datasets` folder, .parquet, "
        ".arrow/.feather, .json/.jsonl or .csv file, a folder of such files, or a Hub name",
    )
    p.add_argument("--split", help="split of a saved DatasetDict or a Hub dataset (default: train; files have none)")
    p.add_argument("--column", default="input_ids", help="token-id column of --dataset (default: input_ids)")
    p.add_argument("--text-column", default="text", help="tokenized when --dataset has no --column (default: text)")
    p.add_argument(
        "--tokenizer",
        help="Hugging Face tokenizer.json (or its folder) for --text-column; default: the regex tokenizer, "
        "ids hashed into the model's vocabulary",
    )
    p.add_argument("--cache-dir", help="datasets cache folder for --dataset")
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="error",
        help="samples longer than cp * tokens-per-rank: error (default), split into documents, or drop",
    )
    p.add_argument("--max-len", type=int, default=0, help="longest sample (default: cp * tokens-per-rank)")
    p.add_argument("--len-scale", type=int, default=16, help="Pareto scale of sample lengths (tokens)")
    p.add_argument("--samples-per-step", type=int, default=64)
    p.add_argument(
        "--steps",
        type=int,
        default=0,
        help="optimizer steps, continuing into the next epochs if need be (0: one epoch)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing per layer")
    p.add_argument("--json", help="write per-step records here (rank 0)")
    p.add_argument("--quiet", dest="verbose", action="store_false")
    return p


def main() -> int:
    args = parser().parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    grid = make_grid(args.cp)
    records = train(args, grid, samples_for(args))
    if grid.rank == 0:
        print(f"dp={grid.dp_size} cp={grid.cp_size} {args.strategy}/{args.packing}: {len(records)} steps", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(args=vars(args), records=records), indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
