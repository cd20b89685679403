"""Public entry points: :func:`ring_attention` (shaped like ``flash_attn_varlen_func``) and :class:`RingAttention`.

They check their arguments, pick the backend and scale, and run the mode
(:mod:`ringpack.attention.dispatch`) eagerly or, under ``torch.compile``, as one custom op
(:mod:`ringpack.attention.traced`); the group check of :mod:`ringpack.attention.checks` runs first
either way. See docs/attention.md.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ringpack.attention import engine, traced
from ringpack.attention.checks import check_inputs, shape_problem
from ringpack.attention.dispatch import run_mode
from ringpack.attention.kernels import BACKENDS, resolve_backend
from ringpack.attention.mode_choice import AUTO, resolve_mode
from ringpack.attention.schedule import Schedule
from ringpack.errors import DataError
from ringpack.modes import MODES, check_mode

try:
    from torch.distributed.device_mesh import DeviceMesh
except ImportError:  # a torch build without distributed support
    DeviceMesh = None

__all__ = ["MODES", "RingAttention", "mesh_dimension", "process_group", "ring_attention"]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    mode: str = "ring",
    *,
    softmax_scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
) -> Tensor:
    """Causal attention of this CP rank's tokens to every earlier token of the same sample, wherever it lives.

    The result equals single-device causal attention over the whole micro-batch with a per-sample
    mask, restricted to this rank's tokens, and is differentiable w.r.t. ``q``, ``k`` and ``v``.
    Collective over ``group``: every rank calls it, each with its own schedule of the same
    micro-batch.

    Args:
        q: ``(T, H, D)``, this rank's queries: the pieces of its rank shard concatenated in
            canonical order (``T == schedule.num_tokens``); float16, bfloat16, float32 or float64.
            Any memory layout: strided views (head-major ``[H, T, D]`` transposed, slices of a fused
            QKV buffer) are copied to dense rows once.
        k: ``(T, H_kv, D)`` with ``H % H_kv == 0`` (GQA), the dtype and device of ``q``.
        v: ``(T, H_kv, D)``, like ``k``.
        schedule: :func:`~ringpack.attention.compile_schedule`'s result for this rank, on ``q``'s
            device (:meth:`Schedule.to`).
        group: the CP group: a ProcessGroup or a 1-D DeviceMesh (``mesh["cp"]``); default: the
            world when ``schedule.cp_size > 1`` (unused when it is 1).
        mode: ``"ring"`` (K/V pass around the group point to point, overlapping the kernels),
            ``"allgather"`` (one all-gather of K/V, dK/dV home by one reduce-scatter) or ``"p2p"``
            (the targeted exchange: each needed piece straight to the ranks that need it, in one
            batch of point-to-point transfers with this rank's partners, dK/dV back the same way)
            or ``"ulysses"`` (head-parallel: one all-to-all gives each rank ``H / cp`` query heads
            and their K/V heads of every token, whole samples; one causal kernel pass; one
            all-to-all home; ``H`` must be a multiple of the CP size) or the hybrids
            ``"ulysses+p2p"`` and ``"ulysses+ring"`` (Ulysses inside each node of the schedule's
            ``gpus_per_node`` ranks, the targeted exchange or the ring between nodes, for
            ``H / gpus_per_node`` heads; the CP size must be a multiple of ``gpus_per_node`` and
            ``H`` of ``gpus_per_node``; the in-node and cross-node groups are created on first use
            and cached, or given by :func:`~ringpack.attention.hybrid.node_groups`) or ``"auto"``
            (the mode picked for this micro-batch when its schedule was compiled with
            ``ScheduleOptions(mode_choice=ModeChoice(...))``: ``schedule.mode``; every rank picks
            the same, and the modes switch per call without new process groups beyond the
            hybrids' cached ones).
        softmax_scale: the scaling of ``QK^T`` before the softmax; default ``1 / sqrt(D)``.
        causal: must be True, the only mask there is.
        backend: the kernels. ``"auto"`` (the fastest available for ``q``'s device, dtype and
            head dim), ``"flash_attn"``, ``"torch_flash"``, ``"cudnn_hybrid"`` (segments marked
            by ``compile_schedule(..., dense_threshold=...)`` through cuDNN dense attention, the
            rest through ``torch_flash``), ``"reference"`` or ``"reference_hybrid"`` (plain
            PyTorch on any device, for tests).

    Returns:
        ``out``: ``(T, H, D)`` in ``q``'s dtype.

    Under ``torch.compile`` the engine is one custom op taking the schedule as an opaque runtime
    input (:mod:`ringpack.attention.traced`): ``fullgraph=True`` works, and a new micro-batch's
    schedule reuses the graph. The checks below then run when the op runs.

    Raises:
        NotImplementedError: ``causal=False``.
        DataError: (a ``ValueError``) ``q``, ``k``, ``v`` that are not tensors, a ``schedule`` that
            is not a :class:`Schedule`, a ``group`` that is neither a ProcessGroup, a 1-D
            DeviceMesh nor None, an unknown ``mode`` or ``backend``, a backend that cannot run
            these tensors, a ``softmax_scale`` that is not a finite positive number, a ``causal``
            that is not a bool; and (with ``cp_size == 1``) q/k/v that do not fit each other or the
            schedule: not ``[tokens, heads, head_dim]``, no heads or an empty head dim, a dtype
            other than float16, bfloat16, float32 or float64. Each message names the argument.
        DataError: (``mode="p2p"``) a schedule without its exchange map (not made by
            ``compile_schedule``); (``mode="ulysses"``) query heads not a multiple of the CP size
            (named) or a schedule without its head layout; (hybrid modes) a schedule compiled
            without ``gpus_per_node``, a CP size that is not a multiple of it (both named), or
            query heads not a multiple of it.
        ScheduleMismatchError: on every rank, before any transfer, when the ranks hold schedules of
            different micro-batches or CP ranks, disagree on mode, query or K/V heads, head dim, dtype or
            on whether this call needs gradients (only some ranks would run the backward), or
            some rank's q/k/v do not fit its schedule.
    """
    _check_arguments(q, k, v, schedule, softmax_scale, causal, backend)
    if not causal:
        raise NotImplementedError("ring_attention supports causal attention only")
    _check_mode(mode)
    group = process_group(group)
    # without gradients, remote blocks go in row chunks: the forward then holds small partial results
    training = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    part_rows = None if training else engine.FORWARD_ONLY_PART_ROWS
    # Strided views are copied once: K/V rows travel as views of k and v, and point-to-point
    # transfers and collectives read a tensor's storage as dense rows; kernels need dense rows too.
    q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
    if torch.compiler.is_compiling():  # the engine as one opaque op (transfers cannot live in a graph)
        # bad shapes or dtypes are reported when the op runs, by the group check (every rank raises);
        # until then the backend and scale of such inputs need only be placeholders
        backend, scale = ("reference", 1.0) if shape_problem(q, k, v) else _resolve(backend, softmax_scale, q)
        return traced.ring_attention_op(q, k, v, schedule, group, mode, scale, backend, part_rows, training)
    mode = resolve_mode(mode, schedule)
    check_inputs(q, k, v, schedule, group, mode, needs_grad=training)
    backend, scale = _resolve(backend, softmax_scale, q)
    return run_mode(q, k, v, schedule, group, mode, scale, backend, part_rows)


def process_group(group: dist.ProcessGroup | DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group behind ``group``: a ProcessGroup or None as it is, a 1-D DeviceMesh's group.

    Raises:
        DataError: a DeviceMesh of more than one dimension (pass its CP dimension, ``mesh["cp"]``),
            or anything that is neither a ProcessGroup, a DeviceMesh nor None.
    """
    if group is None or isinstance(group, dist.ProcessGroup):
        return group
    if DeviceMesh is not None and isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise DataError(
                f"group: the CP group must be a 1-D DeviceMesh, got one of dims {group.mesh_dim_names or group.ndim}; "
                "pass its CP dimension, e.g. mesh['cp']"
            )
        return group.get_group()
    raise DataError(f"group must be a ProcessGroup, a 1-D DeviceMesh or None, got {type(group).__name__}")


def mesh_dimension(mesh: DeviceMesh, dim: str, argument: str = "mesh") -> DeviceMesh:
    """The 1-D mesh of dimension ``dim``: ``mesh[dim]`` of a larger mesh, or ``mesh`` itself when it is
    1-D and of that dimension (or unnamed).

    Args:
        mesh: a ``torch.distributed.DeviceMesh``.
        dim: the dimension's name.
        argument: the caller's name for ``mesh``, for the error message.

    Raises:
        DataError: ``mesh`` not a DeviceMesh, ``dim`` not a string, a mesh without that dimension,
            or a 1-D mesh of another dimension (``mesh["dp"]`` given where the CP one belongs).
    """
    if DeviceMesh is None or not isinstance(mesh, DeviceMesh):
        raise DataError(f"{argument} must be a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if not isinstance(dim, str):
        raise DataError(f"the mesh dimension name must be a string, got {dim!r}")
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 1:
        if names and names[0] != dim:
            raise DataError(
                f"{argument} is the 1-D DeviceMesh of dimension {names[0]!r}, not {dim!r}: pass mesh[{dim!r}] "
                "(or name the dimension it is)"
            )
        return mesh
    if dim not in names:
        raise DataError(f"{argument}: the DeviceMesh has no dimension {dim!r} (its dimensions: {names})")
    return mesh[dim]


class RingAttention(nn.Module):
    """Module form of :func:`ring_attention` for model code: group, mode, scale and backend fixed once.

    Args:
        group: the CP group, a ProcessGroup or a 1-D DeviceMesh (default: the world when a
            schedule's ``cp_size > 1``).
        mode: one of :data:`MODES` (:func:`ring_attention`).
        softmax_scale: default ``1 / sqrt(D)``.
        backend: as in :func:`ring_attention`.

    ``forward(q, k, v, schedule)`` takes ``q (T, H, D)``, ``k``/``v (T, H_kv, D)`` and this rank's
    schedule and returns ``out (T, H, D)`` in ``q``'s dtype, raising as :func:`ring_attention` does.

    Raises:
        DataError: an unknown ``mode`` or ``backend``, a ``softmax_scale`` that is not a finite
            positive number, a DeviceMesh of more than one dimension, or a ``group`` that is
            neither a ProcessGroup, a DeviceMesh nor None.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | DeviceMesh | None = None,
        mode: str = "ring",
        softmax_scale: float | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        _check_mode(mode)
        _check_backend(backend)
        _check_scale(softmax_scale)
        group = process_group(group)
        self.group, self.mode, self.softmax_scale, self.backend = group, mode, softmax_scale, backend

    def forward(self, q: Tensor, k: Tensor, v: Tensor, schedule: Schedule) -> Tensor:
        return ring_attention(
            q, k, v, schedule, self.group, self.mode, softmax_scale=self.softmax_scale, backend=self.backend
        )

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, backend={self.backend!r}"


def _check_mode(mode: str) -> None:
    if mode != AUTO:
        check_mode(mode, (*MODES, AUTO), error=DataError)


def _check_backend(backend: str) -> None:
    if not isinstance(backend, str) or (backend != "auto" and backend not in BACKENDS):
        raise DataError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")


def _check_scale(scale: float | None) -> None:
    # comparisons rather than math.isfinite: under torch.compile the scale may be a symbolic float
    if scale is not None and (
        isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not 0 < scale < math.inf
    ):
        raise DataError(f"softmax_scale must be None or a finite number > 0, got {scale!r}")


def _check_arguments(q, k, v, schedule, softmax_scale, causal, backend) -> None:
    """Raise :class:`DataError` naming the argument unless each has the type :func:`ring_attention`
    takes. Local (no collective): without tensors or a schedule there is nothing to tell the group."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            raise DataError(f"{name} must be a torch.Tensor [tokens, heads, head_dim], got {type(x).__name__}")
    if not isinstance(schedule, Schedule):
        raise DataError(
            f"schedule must be a Schedule (compile_schedule(microbatch, cp_rank)), got {type(schedule).__name__}"
        )
    if not isinstance(causal, bool):
        raise DataError(f"causal must be True, got {causal!r}")
    _check_backend(backend)
    _check_scale(softmax_scale)


def _resolve(backend: str, softmax_scale: float | None, q: Tensor) -> tuple[str, float]:
    """The backend that runs ``q`` and the softmax scale (default ``1 / sqrt(D)``), after the input checks."""
    try:
        backend = resolve_backend(backend, q)
    except ValueError as exc:
        raise DataError(f"backend: {exc}") from exc
    return backend, q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
