"""A DeviceMesh's CP dimension is a CP group: ring attention over ``mesh["cp"]`` equals the process-group path.

4 gloo processes form a ``("dp", "cp") = (2, 2)`` mesh; each DP group runs its own micro-batch.
The same attention runs with the CP ProcessGroup, ``mesh["cp"]``, :class:`RingAttention` built on
the mesh, :func:`cp_group` of the whole mesh, and a tiny Llama's ``ringpack_group=mesh["cp"]``;
outputs and gradients must be bit-identical to the ProcessGroup path.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringpack._spawn import run_ranks
from ringpack.modes import SEQUENCE_MODES

WORLD, DP, CP = 4, 2, 2


def _inputs(schedule, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(schedule.num_tokens, 4, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(schedule.num_tokens, 2, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    return [x.requires_grad_() for x in (q, k, v)]


def _attention_and_grads(fn, schedule, seed: int):
    q, k, v = _inputs(schedule, seed)
    out = fn(q, k, v)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return [out.detach(), q.grad, k.grad, v.grad]


def _llama_logits(mesh_group, pg, microbatch, cp_rank: int):
    from ringpack.data import PackedCollator
    from tests.helpers.training import build_model

    tokens = [np.arange(3 + s, 3 + s + n) % 97 for s, n in enumerate((11, 5, 8))]
    batch = PackedCollator(cp_rank, CP).collate(microbatch, tokens)
    model = build_model("tiny", torch.float64, seed=3)
    results = []
    for group in (pg, mesh_group):
        model.zero_grad()
        logits = model(
            input_ids=batch["input_ids"][None],
            position_ids=batch["position_ids"][None],
            ringpack_schedule=batch["schedule"],
            ringpack_group=group,
            ringpack_backend="reference",
            use_cache=False,
        ).logits
        logits.square().mean().backward()
        results.append([logits.detach(), *(p.grad.clone() for p in model.parameters())])
    return results


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ringpack.attention import RingAttention, compile_schedule, ring_attention
    from ringpack.integrations.distributed import cp_group, mesh_coordinates
    from ringpack.planner.split import split_zigzag

    mesh = init_device_mesh("cpu", (DP, CP), mesh_dim_names=("dp", "cp"))
    groups = [dist.new_group([start, start + 1]) for start in range(0, world, CP)]
    coords = mesh_coordinates(mesh)
    pg = groups[coords.dp_rank]
    microbatch = split_zigzag([0, 1, 2], [11, 5, 8], CP) if coords.dp_rank == 0 else split_zigzag([0, 1], [9, 14], CP)
    schedule = compile_schedule(microbatch, coords.cp_rank)
    results = {"coords": (coords.dp_rank, coords.dp_size, coords.cp_rank, coords.cp_size)}
    for mode in SEQUENCE_MODES:
        forms = {
            "process group": lambda q, k, v: ring_attention(q, k, v, schedule, pg, mode, backend="reference"),
            "mesh['cp']": lambda q, k, v: ring_attention(q, k, v, schedule, mesh["cp"], mode, backend="reference"),
            "RingAttention(mesh['cp'])": lambda q, k, v: RingAttention(mesh["cp"], mode, backend="reference")(
                q, k, v, schedule
            ),
            "cp_group(mesh)": lambda q, k, v: ring_attention(
                q, k, v, schedule, cp_group(mesh), mode, backend="reference"
            ),
        }
        results[mode] = {name: _attention_and_grads(fn, schedule, seed=rank) for name, fn in forms.items()}
    results["llama"] = _llama_logits(mesh["cp"], pg, split_zigzag([0, 1, 2], [11, 5, 8], CP), coords.cp_rank)
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        ring_attention(*_inputs(schedule, 0), schedule, group=mesh, backend="reference")
    with pytest.raises(ValueError, match="no dimension 'tp'"):
        cp_group(mesh, dim="tp")
    results["same group"] = cp_group(mesh["cp"]) is mesh["cp"].get_group()
    results["data"] = _data_from_mesh(mesh, coords)
    return results


def _data_from_mesh(mesh, coords) -> dict:
    """The sampler, collator and shard reader built from the mesh equal those built from coordinates."""
    import tempfile

    from ringpack.data import BalancedBatchSampler, PackedCollator, ShardReader, write_shards
    from ringpack.shard_plan import PlanConfig

    lengths = [(7 * i) % 97 + 1 for i in range(120)]
    options = dict(samples_per_step=24, seed=1)
    by_mesh = BalancedBatchSampler.from_mesh(lengths, mesh, 128, **options)
    by_hand = BalancedBatchSampler(lengths, coords.dp_rank, DP, CP, 128, **options)
    collator = PackedCollator.from_mesh(mesh)
    out = {
        "sampler": [list(t) for t in by_mesh] == [list(t) for t in by_hand] and by_mesh.plan_hash == by_hand.plan_hash,
        "collator": (collator.cp_rank, collator.cp_size) == (coords.cp_rank, CP),
        "collator 1-D": PackedCollator.from_mesh(mesh["cp"]).cp_rank == coords.cp_rank,
    }
    with tempfile.TemporaryDirectory() as folder:
        if dist_rank() == 0:
            import datasets

            rows = datasets.Dataset.from_dict({"input_ids": [list(range(n)) for n in lengths]})
            write_shards(
                rows, folder, PlanConfig(dp=DP, cp=CP, tokens_per_rank=128, samples_per_step=24), progress=False
            )
        import torch.distributed as dist

        shared = [folder if dist_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        reader = ShardReader.from_mesh(shared[0], mesh)
        out["reader"] = (reader.dp_rank, reader.cp_rank) == (coords.dp_rank, coords.cp_rank)
        dist.barrier()
    return out


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.fixture(scope="module")
def mesh_results():
    return run_ranks(worker, WORLD, timeout_s=60.0, join_s=240.0, name="device mesh")


@pytest.mark.slow
@pytest.mark.parametrize("mode", SEQUENCE_MODES)
def test_mesh_cp_dimension_equals_process_group(mesh_results, mode):
    for rank, results in enumerate(mesh_results):
        want = results[mode]["process group"]
        for name, got in results[mode].items():
            for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), f"rank {rank} {mode} {name}: {what} differs from the process-group path"


@pytest.mark.slow
def test_llama_takes_the_mesh_as_ringpack_group(mesh_results):
    for rank, results in enumerate(mesh_results):
        with_group, with_mesh = results["llama"]
        assert len(with_group) == len(with_mesh) > 1
        for a, b in zip(with_group, with_mesh):
            assert torch.equal(a, b), f"rank {rank}: ringpack_group=mesh['cp'] differs from the process group"


@pytest.mark.slow
def test_mesh_coordinates_put_cp_innermost(mesh_results):
    assert [r["coords"] for r in mesh_results] == [(r // CP, DP, r % CP, CP) for r in range(WORLD)]
    assert all(r["same group"] for r in mesh_results)


def test_process_group_rejects_other_objects():
    from ringpack.attention.api import process_group
    from ringpack.errors import DataError

    assert process_group(None) is None
    with pytest.raises(DataError, match="group must be a ProcessGroup, a 1-D DeviceMesh or None"):
        process_group("cp")


@pytest.mark.slow
def test_sampler_collator_and_reader_take_the_mesh(mesh_results):
    for rank, results in enumerate(mesh_results):
        assert results["data"] == {"sampler": True, "collator": True, "collator 1-D": True, "reader": True}, rank
