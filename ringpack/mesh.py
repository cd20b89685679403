"""This rank's place in a DP x CP ``DeviceMesh``: what the samplers, readers and collators take (docs/integrations.md).

:func:`mesh_coordinates` reads a mesh with a DP and a CP dimension (``("dp", "cp")``, CP
innermost) and returns this rank's DP and CP coordinates and sizes and its CP process group. It
checks the mesh first and names the argument and the dimensions in one :class:`DataError`. The
module imports torch only when it is handed a mesh, so the loaders that take one stay importable
without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ringpack.errors import DataError

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["MeshCoordinates", "is_device_mesh", "mesh_coordinates"]


@dataclass(frozen=True)
class MeshCoordinates:
    """This rank's place in a DP x CP grid: what ``BalancedBatchSampler`` and ``PackedCollator`` take."""

    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int
    cp_group: dist.ProcessGroup | None


def is_device_mesh(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.DeviceMesh`` (``False`` on a torch without distributed support)."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # a torch build without distributed support
        return False
    return isinstance(obj, DeviceMesh)


def mesh_coordinates(mesh: Any, dp_dim: str = "dp", cp_dim: str = "cp") -> MeshCoordinates:
    """This rank's DP and CP coordinates in a DeviceMesh with dimensions ``dp_dim`` and ``cp_dim``.

    ``BalancedBatchSampler(lengths, PlanConfig(dp=c.dp_size, cp=c.cp_size, ...), c.dp_rank)`` and
    ``PackedCollator(c.cp_rank, c.cp_size)`` then feed the rank its share of the plan.

    Raises:
        DataError: ``mesh`` not a DeviceMesh, ``dp_dim`` and ``cp_dim`` not two different names,
            or a mesh without one of the two dimensions (a 1-D mesh has one of them at most).
    """
    if not is_device_mesh(mesh):
        raise DataError(
            f"mesh must be a torch.distributed DeviceMesh with dimensions {dp_dim!r} and {cp_dim!r}, "
            f"got {type(mesh).__name__}"
        )
    for name, value in (("dp_dim", dp_dim), ("cp_dim", cp_dim)):
        if not isinstance(value, str):
            raise DataError(f"{name} must be the name of a mesh dimension, got {value!r}")
    if dp_dim == cp_dim:
        raise DataError(f"dp_dim and cp_dim must name two different mesh dimensions, both are {dp_dim!r}")
    names = mesh.mesh_dim_names or ()
    for argument, name in (("dp_dim", dp_dim), ("cp_dim", cp_dim)):
        if name not in names:
            raise DataError(f"mesh: the DeviceMesh has no dimension {name!r} ({argument}; its dimensions: {names})")
    dp, cp = mesh[dp_dim], mesh[cp_dim]
    return MeshCoordinates(dp.get_local_rank(), dp.size(), cp.get_local_rank(), cp.size(), cp.get_group())
