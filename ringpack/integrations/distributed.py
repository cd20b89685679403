"""ringpack under PyTorch's distributed tools: DeviceMesh, FSDP2 (``fully_shard``) and DDP.

ringpack's loss rule: every rank's loss is the *sum* of its token losses over the global batch's
loss tokens (``batch["step_loss_tokens"]``), and gradients are *summed* over all ranks, DP and CP
alike, so a step is exactly the single-device per-token mean. FSDP2 and DDP average instead;
:func:`sum_gradients` makes them sum (FSDP2: divide factor 1 with forced SUM reductions, sharded
over the whole grid, :func:`data_parallel_mesh`; DDP: a SUM communication hook, with the
micro-batches before a step's last one under :func:`gradient_sync`). Nothing scales the loss, so
both are exact in any dtype. Meshes are ``("dp", "cp")`` with CP innermost.

:class:`SamplerState` puts the sampler's position and cost-model switches (and a
:class:`~ringpack.training.cost_learner.CostLearner`'s observations) into a DCP checkpoint, so a
resumed run plans exactly as the uninterrupted one.

See docs/integrations.md ("DeviceMesh", "FSDP2", "DDP") and docs/training.md, "Loss scaling".
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from ringpack._checks import is_bool, is_int
from ringpack.attention.api import DeviceMesh, mesh_dimension, process_group
from ringpack.data.sampler import BalancedBatchSampler
from ringpack.errors import DataError
from ringpack.mesh import MeshCoordinates, mesh_coordinates

__all__ = [
    "MeshCoordinates",
    "SamplerState",
    "cp_group",
    "data_parallel_mesh",
    "gradient_sync",
    "mesh_coordinates",
    "sum_gradients",
]


def cp_group(group: Any, dim: str = "cp") -> dist.ProcessGroup | None:
    """The CP process group of a ProcessGroup, a 1-D DeviceMesh, or the ``dim`` dimension of a larger mesh.

    Args:
        group: a ProcessGroup (returned as it is), None (the world, as ``ring_attention`` reads it),
            a 1-D DeviceMesh (``mesh["cp"]``), or an N-D DeviceMesh with a dimension named ``dim``.
        dim: the CP dimension's name in an N-D mesh.

    Returns:
        The process group to pass as ``ring_attention(..., group=)`` or ``ringpack_group=``.

    Raises:
        DataError: a mesh without a dimension named ``dim``, a 1-D mesh of another dimension
            (``mesh["dp"]``), or anything that is neither a ProcessGroup, a DeviceMesh nor None.
    """
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        group = mesh_dimension(group, dim, "group")
    return process_group(group)


def data_parallel_mesh(mesh: Any, dims: tuple[str, ...] = ("dp", "cp")) -> Any:
    """The 1-D mesh of all ranks of ``dims`` (every rank whose gradients are summed), for
    ``fully_shard(..., mesh=)`` or DDP's ``process_group=mesh.get_group()``.

    Raises:
        DataError: ``mesh`` not a DeviceMesh, or ``dims`` not a non-empty tuple of distinct
            dimension names of it.
    """
    if DeviceMesh is None or not isinstance(mesh, DeviceMesh):
        raise DataError(f"mesh must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    names = mesh.mesh_dim_names or ()
    if (
        not isinstance(dims, (tuple, list))
        or not dims
        or len(set(dims)) != len(dims)
        or not all(isinstance(d, str) and d in names for d in dims)
    ):
        raise DataError(f"dims must be distinct dimension names of the mesh (its dimensions: {names}), got {dims!r}")
    dims = tuple(dims)
    return mesh[dims]._flatten("_".join(dims)) if len(dims) > 1 else mesh[dims[0]]


def sum_gradients(model: nn.Module) -> nn.Module:
    """Make FSDP2 and DDP sum gradients over their ranks instead of averaging them; returns ``model``.

    Call after wrapping (``fully_shard`` on the modules, or ``DistributedDataParallel``) and before
    the first backward. A model with neither (one process, or the hand-written all-reduce of
    ``examples/train.py``) is returned unchanged.

    Args:
        model: an ``nn.Module`` containing ``FSDPModule`` s, or a ``DistributedDataParallel``.

    Raises:
        DataError: ``model`` is not an ``nn.Module``.
        NotImplementedError: FSDP2 modules in a torch without ``set_gradient_divide_factor``.
    """
    _check_module(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.register_comm_hook(model.process_group, _sum_hook)
        return model
    for module in _fsdp_modules(model):
        if not hasattr(module, "set_gradient_divide_factor"):
            raise NotImplementedError(
                "this torch's FSDP2 has no set_gradient_divide_factor; multiply the loss by the shard group's size"
            )
        module.set_gradient_divide_factor(1.0)
        if hasattr(module, "set_force_sum_reduction_for_comms"):
            module.set_force_sum_reduction_for_comms(True)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Backward passes inside reduce gradients across ranks only if ``enabled`` (the step's last micro-batch).

    DDP: ``model.no_sync()`` when not enabled (required with :func:`sum_gradients`, see the module
    docstring). FSDP2: ``set_requires_gradient_sync(enabled)`` on every FSDP module, restored on exit
    (not required, as FSDP2 reduces each backward's own gradients, but it skips a reduce-scatter per
    micro-batch at the price of holding unsharded gradients). Anything else: no effect.

    Raises:
        DataError: ``model`` is not an ``nn.Module`` or ``enabled`` not a bool (on entering).
    """
    _check_module(model)
    if not is_bool(enabled):
        raise DataError(f"enabled must be True or False, got {enabled!r}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        with contextlib.nullcontext() if enabled else model.no_sync():
            yield
        return
    modules = _fsdp_modules(model)
    for module in modules:
        module.set_requires_gradient_sync(enabled, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


class SamplerState:
    """A :class:`~ringpack.data.BalancedBatchSampler` (and its cost learner) as a DCP ``Stateful``.

    ``dcp.save({"model": ..., "data": SamplerState(sampler, learner)}, checkpoint_id=...)`` stores,
    under this rank's key (``"rank<r>"``), one JSON text: the sampler's :meth:`state_dict` (epoch,
    cursor, plan hash, cost-model switches) and the learner's (its observations differ per rank).
    ``dcp.load`` with a fresh ``SamplerState`` over a sampler built with the same options seeks it
    (the loader's next ``iter()`` resumes after the last consumed micro-batch) and restores the
    switches and the learner, so the resumed run plans every later step as the first run would.

    The cursor saved is the sampler's own (exact with ``num_workers=0``) until :meth:`mark_consumed`
    is called; loader workers run the sampler ahead of the training loop, so with workers call
    ``mark_consumed(batch)`` for the batches the loop consumes. The loop moving to a new epoch
    (``sampler.set_epoch``) has consumed none of it yet.

    Args:
        sampler: this rank's ``BalancedBatchSampler``.
        learner: the ``CostLearner`` switching its cost model, if the run uses one.

    Raises:
        DataError: ``sampler`` is not a ``BalancedBatchSampler``, or ``learner`` neither None nor an
            object with ``state_dict`` and ``load_state_dict``.
    """

    def __init__(self, sampler: Any, learner: Any = None) -> None:
        if not isinstance(sampler, BalancedBatchSampler):
            raise DataError(f"sampler must be a ringpack BalancedBatchSampler, got {type(sampler).__name__}")
        if learner is not None and not (hasattr(learner, "state_dict") and hasattr(learner, "load_state_dict")):
            raise DataError(f"learner must be None or a CostLearner, got {type(learner).__name__}")
        self.sampler = sampler
        self.learner = learner
        self._consumed: tuple[int, int] | None = None  # (epoch, cursor) of the last consumed batch

    def mark_consumed(self, batch: dict[str, Any]) -> None:
        """The training loop has consumed ``batch`` (a ``PackedCollator`` output).

        Raises:
            DataError: ``batch`` is not a mapping with integer ``"epoch"`` and ``"cursor"``.
        """
        if not isinstance(batch, Mapping) or not all(is_int(batch.get(key)) for key in ("epoch", "cursor")):
            got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise DataError(f"batch must be a PackedCollator batch with integer 'epoch' and 'cursor', got {got}")
        self._consumed = (int(batch["epoch"]), int(batch["cursor"]))

    def state_dict(self) -> dict[str, str]:
        """``{"rank<r>": JSON text}`` (DCP also calls this for the template of a load)."""
        state: dict[str, Any] = {"sampler": self.sampler.state_dict(cursor=self._cursor())}
        if self.learner is not None:
            state["cost_learner"] = self.learner.state_dict()
        return {_rank_key(): json.dumps(state, sort_keys=True)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Seek the sampler and restore the learner from what :meth:`state_dict` saved for this rank.

        Raises:
            DataError: ``state_dict`` not a mapping, no state for this rank (saved by another world
                size), a rank state that is not the JSON object :meth:`state_dict` writes, a learner
                state missing where this run has a learner, or a sampler state made for other sizes,
                options, data or planner version.
        """
        if not isinstance(state_dict, Mapping):
            raise DataError(
                f"state_dict must be the mapping SamplerState.state_dict() made, got {type(state_dict).__name__}"
            )
        key = _rank_key()
        if key not in state_dict:
            raise DataError(f"the checkpoint has no sampler state for {key} (it holds {sorted(map(str, state_dict))})")
        try:
            state = json.loads(state_dict[key])
        except (TypeError, ValueError, RecursionError) as exc:
            raise DataError(f"the checkpoint's sampler state for {key} is not JSON text: {exc}") from exc
        if not isinstance(state, dict) or not isinstance(state.get("sampler"), dict):
            raise DataError(f"the checkpoint's sampler state for {key} holds no 'sampler' object: {str(state)[:100]}")
        self.sampler.load_state_dict(state["sampler"])
        if self.learner is not None:
            if "cost_learner" not in state:
                raise DataError("the checkpoint was saved without a cost learner, but this run has one")
            self.learner.load_state_dict(state["cost_learner"])
        self._consumed = (self.sampler.epoch, int(state["sampler"]["cursor"]))

    def _cursor(self) -> int | None:
        if self._consumed is None:
            return None
        epoch, cursor = self._consumed
        return cursor if epoch == self.sampler.epoch else 0


def _check_module(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise DataError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _rank_key() -> str:
    return f"rank{dist.get_rank() if dist.is_initialized() else 0}"


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _sum_hook(group, bucket):  # no annotations: DDP compares them to dist.GradBucket, not to a string
    """DDP communication hook: the bucket's gradients summed over ``group`` (no division); a future of them."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])
