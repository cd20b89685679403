"""The smallest complete DP x CP training loop on ringpack's plan: process groups, the sampler and collator,
ring attention, the loss scaling, the gradient all-reduce and the optimizer step.

    torchrun --nproc_per_node=4 examples/minimal_loop.py     # DP=2 x CP=2: CPU over gloo, GPUs over NCCL

The model is one embedding, one attention layer and a head, so nothing but ringpack and torch is
needed. README.md and docs/training.md quote it; tests/test_docs.py runs it on 4 CPU processes.
"""

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ringpack

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
rank, world, cp_size = dist.get_rank(), dist.get_world_size(), 2
dp_rank, cp_rank, dp_size = rank // cp_size, rank % cp_size, world // cp_size  # CP groups: consecutive ranks
groups = [dist.new_group(list(range(start, start + cp_size))) for start in range(0, world, cp_size)]  # on every rank
cp_group = groups[dp_rank]

rng = np.random.default_rng(0)
samples = [rng.integers(0, 1000, n) for n in rng.integers(1, 1500, 256)]  # token-id sequences

config = ringpack.PlanConfig(dp=dp_size, cp=cp_size, tokens_per_rank=1024, samples_per_step=64)
sampler = ringpack.BalancedBatchSampler([len(s) for s in samples], config, dp_rank)
loader = DataLoader(
    ringpack.PackedDataset(samples),  # samples: token-id sequences, or a datasets.Dataset with input_ids
    batch_sampler=sampler,
    collate_fn=ringpack.PackedCollator(cp_rank, cp_size),  # num_workers=N compiles schedules in N workers
)

torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.ModuleDict(
    {"embed": torch.nn.Embedding(1000, 64), "qkv": torch.nn.Linear(64, 3 * 64), "head": torch.nn.Linear(64, 1000)}
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step_loss = torch.zeros((), device=device)
for batch in loader:  # this CP rank's pieces of one micro-batch
    schedule = batch["schedule"].to(device)  # one copy, reused by every layer, forward and backward
    x = model["embed"](batch["input_ids"].to(device))  # [T, 64]: this CP rank's tokens
    q, k, v = model["qkv"](x).view(-1, 3, 4, 16).unbind(1)  # [T, heads, head_dim] each
    out = ringpack.ring_attention(q, k, v, schedule, group=cp_group)  # also mode="allgather", "p2p", "ulysses"
    logits = model["head"](out.reshape(-1, 64))
    # labels are already shifted per sample; divide the loss *sum* by the global batch's loss tokens
    loss = torch.nn.functional.cross_entropy(logits, batch["labels"].to(device), reduction="sum")
    loss = loss / batch["step_loss_tokens"]
    loss.backward()
    step_loss += loss.detach()
    if batch["microbatch_index"] + 1 == batch["microbatches_in_step"]:  # the step's last micro-batch
        for p in model.parameters():
            dist.all_reduce(p.grad)  # sum over every rank, DP and CP alike
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(step_loss)  # the ranks' shares sum to the step's per-token mean
        if rank == 0:
            print(f"step {batch['step']}: loss {step_loss.item():.4f}", flush=True)
        step_loss.zero_()
dist.barrier()  # every rank done communicating before the groups are torn down
dist.destroy_process_group()
