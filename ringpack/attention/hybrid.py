"""Hybrid head-parallel CP: Ulysses inside each node, the targeted exchange or the ring between nodes.

``mode="ulysses+p2p"`` (or ``"ulysses+ring"``) on a CP group in nodes of ``g`` consecutive ranks
(the schedule's ``gpus_per_node``): an all-to-all within the node gives each of its ranks
``H / g`` heads of every token of the node, in node order
(:class:`~ringpack.attention.schedule.NodeLayout`); the ranks of one local index, one per node,
run the engine over the node-level micro-batch with that transport between them; the output goes
home by the reverse all-to-all. Exact for any plan. :func:`head_parallel_attention` runs
``"ulysses"`` too. A hybrid is a row of the mode table (:mod:`ringpack.modes`) naming the
sequence mode it runs between nodes. The in-node and cross-node groups (:func:`node_groups`) are
created on first use, collectively over the world, and cached, or given once by the caller (e.g.
from a DeviceMesh). See docs/attention.md, "Hybrid head-parallel attention".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from ringpack.attention.engine import PassConfig
from ringpack.attention.relayout import head_layout
from ringpack.attention.schedule import HeadLayout, NodeLayout, Schedule
from ringpack.attention.transports import transport_factory
from ringpack.attention.ulysses import HeadSplit, UlyssesAttention
from ringpack.errors import DataError
from ringpack.modes import HEAD_PARALLEL_MODES, HYBRID_MODES, MODE_TABLE

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # a torch build without distributed support
    DeviceMesh = None

__all__ = [
    "HEAD_PARALLEL_MODES",
    "HYBRID_MODES",
    "NodeGroups",
    "head_parallel_attention",
    "head_parallel_parts",
    "node_groups",
    "node_layout",
]


@dataclass(frozen=True)
class NodeGroups:
    """The two sub-groups of a CP group in nodes: ``within`` (this rank's node, ``gpus_per_node``
    ranks, in CP order) and ``across`` (the ranks of this rank's local index, one per node, in node
    order). None stands for a group of this rank alone (one GPU per node, or one node)."""

    within: dist.ProcessGroup | None
    across: dist.ProcessGroup | None


_GROUPS: dict[tuple[str, int], NodeGroups] = {}


def node_groups(
    group: dist.ProcessGroup | None,
    gpus_per_node: int,
    *,
    within: dist.ProcessGroup | DeviceMesh | None = None,
    across: dist.ProcessGroup | DeviceMesh | None = None,
) -> NodeGroups:
    """The in-node and cross-node groups of the CP ``group`` in nodes of ``gpus_per_node`` ranks, cached.

    Without ``within``/``across`` the first call for a ``(group, gpus_per_node)`` creates them:
    collective over the *world* (``dist.new_group`` is), so every process makes its first such call
    together, each with its own CP group, as SPMD training does when every DP replica runs the
    same layers (``ring_attention`` calls it on its first hybrid call); the processes exchange
    their CP groups once and all create every named group's sub-groups in one order. Given
    (ProcessGroups or 1-D DeviceMeshes, e.g. ``mesh["cp_gpu"]`` and ``mesh["cp_node"]`` of a
    ``(dp, cp_node, cp_gpu)`` mesh), they are checked against the CP group and cached instead,
    with no collective: call this once per process before the first hybrid call.

    Args:
        group: the CP process group (None: the world).
        gpus_per_node: the node size; the CP size must be a multiple of it.
        within, across: the sub-groups to use, both or neither.

    Returns:
        :class:`NodeGroups`.

    Raises:
        DataError: a CP size that is not a multiple of ``gpus_per_node`` (both named), only one of
            ``within``/``across``, or given groups whose ranks are not this rank's node and local
            index column in CP order.
    """
    size = dist.get_world_size(group)
    if size % gpus_per_node:
        raise DataError(_not_in_nodes(size, gpus_per_node))
    key = ("" if group is None else group.group_name, gpus_per_node)
    if within is None and across is None:
        if key not in _GROUPS:
            _GROUPS[key] = _create(group, gpus_per_node)
        return _GROUPS[key]
    if within is None or across is None:
        raise DataError("node_groups: give both within (the node's group) and across (the cross-node one), or neither")
    given = NodeGroups(_process_group(within), _process_group(across))
    want = _members(group, gpus_per_node)
    for name, sub, ranks in (("within", given.within, want[0]), ("across", given.across, want[1])):
        got = dist.get_process_group_ranks(sub)
        if got != ranks:
            raise DataError(f"node_groups: {name} holds global ranks {got}, but this rank's {name} group is {ranks}")
    _GROUPS[key] = given
    return given


def _process_group(group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    """A ProcessGroup as it is, a 1-D DeviceMesh's group."""
    return group.get_group() if DeviceMesh is not None and isinstance(group, DeviceMesh) else group


def _members(group: dist.ProcessGroup | None, gpus_per_node: int) -> tuple[list[int], list[int]]:
    """The global ranks of this rank's node and of its local index column, in CP order."""
    ranks = _cp_ranks(group)
    me = dist.get_rank(group)
    node, local = divmod(me, gpus_per_node)
    return ranks[node * gpus_per_node : (node + 1) * gpus_per_node], ranks[local::gpus_per_node]


def _create(group: dist.ProcessGroup | None, gpus_per_node: int) -> NodeGroups:
    """This rank's sub-groups, made collectively over the world: every process names its CP group
    and node size, then all create every named group's sub-groups in one sorted order."""
    spec = (tuple(_cp_ranks(group)), gpus_per_node)
    specs: list = [None] * dist.get_world_size()
    dist.all_gather_object(specs, spec)
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for ranks, size in sorted(set(specs)):
        for sub in (*(ranks[i : i + size] for i in range(0, len(ranks), size)), *(ranks[j::size] for j in range(size))):
            if len(sub) > 1 and sub not in made:
                made[sub] = dist.new_group(list(sub))
    within, across = _members(group, gpus_per_node)
    return NodeGroups(made.get(tuple(within)), made.get(tuple(across)))


def _cp_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """The global ranks of the CP group, in group order."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def _not_in_nodes(cp: int, gpus_per_node: int) -> str:
    return (
        f"the hybrid modes need a CP size that is a multiple of gpus_per_node: CP size {cp}, "
        f"gpus_per_node {gpus_per_node} (use mode='ulysses', 'p2p' or 'ring')"
    )


def node_layout(schedule: Schedule, mode: str) -> NodeLayout:
    """``schedule.node_layout`` for the hybrid ``mode``.

    Raises:
        DataError: a schedule compiled without ``gpus_per_node``, with one that does not divide
            its CP size (named), or without ``hybrid_layout``.
    """
    if schedule.node_layout is not None:
        return schedule.node_layout
    if schedule.gpus_per_node is None:
        raise DataError(
            f"cp rank {schedule.cp_rank}: mode={mode!r} needs the node size: compile the schedule with "
            "compile_schedule(microbatch, cp_rank, gpus_per_node=..., hybrid_layout=True)"
        )
    if schedule.cp_size % schedule.gpus_per_node:
        raise DataError(_not_in_nodes(schedule.cp_size, schedule.gpus_per_node))
    raise DataError(
        f"cp rank {schedule.cp_rank}: mode={mode!r} runs on the node layout, which this schedule was compiled "
        "without: compile it with ScheduleOptions(hybrid_layout=True) (compile_schedule(..., hybrid_layout=True))"
    )


def head_parallel_parts(
    q: Tensor,
    k: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    scale: float,
    backend: str,
    part_rows: int | None = None,
) -> tuple[HeadLayout | NodeLayout, HeadSplit, dist.ProcessGroup | None, PassConfig]:
    """What a head-parallel ``mode`` runs for this rank: ``(layout, split, all-to-all group, pass config)``,
    the arguments after ``q, k, v`` of :class:`~ringpack.attention.ulysses.UlyssesAttention`.

    ``"ulysses"``: the group's all-to-all and a one-rank pass over whole samples;
    ``"ulysses+p2p"``/``"ulysses+ring"``: the node's all-to-all and the engine's pass over the
    node-level schedule with that transport between nodes.

    Args:
        q: ``(T, H, D)``; k: ``(T, H_kv, D)`` (their head counts are what is split).
        schedule: this rank's schedule; group: the CP group (None: the world).
        mode: one of :data:`~ringpack.modes.HEAD_PARALLEL_MODES`.
        scale, backend: the softmax scale and a resolved backend.
        part_rows: the forward's row chunks without gradients (see ``attention_forward``).

    Raises:
        DataError: query heads not a multiple of the all-to-all's ranks (named), a schedule without
            its head layout, or (hybrid) as :func:`node_layout`.
    """
    across_nodes = MODE_TABLE[mode].across_nodes
    if across_nodes is None:  # Ulysses over the whole group
        layout = head_layout(schedule)
        split = HeadSplit(heads=q.shape[1], kv_heads=k.shape[1], cp=layout.cp_size)
        return layout, split, group, PassConfig(scale, backend, None, part_rows)
    layout = node_layout(schedule, mode)
    split = HeadSplit(heads=q.shape[1], kv_heads=k.shape[1], cp=layout.gpus_per_node, mode=mode)
    groups = node_groups(group, layout.gpus_per_node) if schedule.cp_size > 1 else NodeGroups(None, None)
    make_transport = transport_factory(across_nodes, groups.across) if layout.nodes > 1 else None
    return layout, split, groups.within, PassConfig(scale, backend, make_transport, part_rows)


def head_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    scale: float,
    backend: str,
    part_rows: int | None = None,
) -> Tensor:
    """Head-parallel causal per-sample attention of this rank's tokens (``ring_attention`` with
    ``mode="ulysses"``, ``"ulysses+p2p"`` or ``"ulysses+ring"``).

    Args:
        q: ``(T, H, D)``, k/v: ``(T, H_kv, D)``, contiguous, fitting ``schedule`` (checked by the
            caller, with the group).
        schedule, group, mode, scale, backend, part_rows: as :func:`head_parallel_parts`.

    Returns:
        ``out (T, H, D)`` in ``q``'s dtype, differentiable w.r.t. ``q``, ``k``, ``v``.

    Raises:
        DataError: as :func:`head_parallel_parts`.
    """
    return UlyssesAttention.apply(q, k, v, *head_parallel_parts(q, k, schedule, group, mode, scale, backend, part_rows))
