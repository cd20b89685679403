"""A DeviceMesh, FSDP2 and a Hugging Face causal LM with ``attn_implementation="ringpack"`` on ringpack's plan.

    torchrun --nproc_per_node=4 examples/fsdp_mesh.py     # DP=2 x CP=2: CPU over gloo, GPUs over NCCL

A randomly initialised two-layer Llama (no download) on random token ids; every piece is the one a
large run uses. README.md quotes it; tests/test_docs.py runs it on 4 CPU processes.
``examples/train_fsdp.py`` is the tested-exact version with options, ``examples/recipe.py`` adds
``torch.compile`` and checkpoints.
"""

import os

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, LlamaConfig

import ringpack  # with transformers installed, this registers attn_implementation="ringpack"
from ringpack.integrations.distributed import data_parallel_mesh, gradient_sync, sum_gradients
from ringpack.integrations.transformers import causal_lm_loss_sum

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
if cuda:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
device = "cuda" if cuda else "cpu"
dp, cp = dist.get_world_size() // 2, 2
mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))  # CP innermost: one host's ranks

rng = np.random.default_rng(0)
samples = [rng.integers(0, 1000, n) for n in rng.integers(1, 1500, 128)]  # token-id sequences
lengths = [len(s) for s in samples]
sampler = ringpack.BalancedBatchSampler.from_mesh(lengths, mesh, tokens_per_rank=1024, samples_per_step=32)
collate = ringpack.PackedCollator.from_mesh(mesh)  # ring_attention(..., group=mesh["cp"]) works too
loader = torch.utils.data.DataLoader(ringpack.PackedDataset(samples), batch_sampler=sampler, collate_fn=collate)

torch.manual_seed(0)  # the same initial weights on every rank
config = LlamaConfig(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_dropout=0.0,
)
model = AutoModelForCausalLM.from_config(config, attn_implementation="ringpack").to(device)
for layer in model.model.layers:
    fully_shard(layer, mesh=data_parallel_mesh(mesh))  # FSDP2 over all dp x cp ranks
sum_gradients(fully_shard(model, mesh=data_parallel_mesh(mesh)))  # sum, not average: the step is exact
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
step_loss = torch.zeros((), device=device)
for batch in loader:  # this CP rank's pieces of one micro-batch
    last = batch["microbatch_index"] + 1 == batch["microbatches_in_step"]
    with gradient_sync(model, enabled=last):  # reduce gradients once, on the step's last micro-batch
        logits = model(
            input_ids=batch["input_ids"].to(device)[None],
            position_ids=batch["position_ids"].to(device)[None],  # positions within each sample
            ringpack_schedule=batch["schedule"].to(device),
            ringpack_group=mesh["cp"],
        ).logits
        loss = causal_lm_loss_sum(logits[0], batch["labels"].to(device)) / batch["step_loss_tokens"]
        loss.backward()
    step_loss += loss.detach()
    if last:
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(step_loss)  # the ranks' shares sum to the step's per-token mean
        if dist.get_rank() == 0:
            print(f"step {batch['step']}: loss {step_loss.item():.4f}", flush=True)
        step_loss.zero_()
dist.destroy_process_group()
