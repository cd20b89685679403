"""The checks every engine call runs: do this rank's q/k/v fit its schedule, and does the CP group agree.

:func:`check_inputs` runs before the first transfer of an eager call and when the traced engine op
runs. With ``cp_size > 1`` it is collective: the ranks all-gather one small row (schedule
fingerprint, CP rank and size, mode, K/V shape and dtype, whether gradients are needed, whether
the inputs fit) and every rank raises the same :class:`ScheduleMismatchError` naming the ranks
that disagree, so a mismatch fails fast instead of hanging in a transfer. See
docs/attention.md, "Safety checks".
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ringpack.attention.allgather import all_gather_flat
from ringpack.attention.mode_choice import AUTO
from ringpack.attention.schedule import Schedule, ScheduleMismatchError
from ringpack.errors import DataError
from ringpack.modes import MODES
from ringpack.traffic import partner_budget_problem

#: The modes as the group check sends them (``AUTO`` last: a schedule without a pick).
_MODE_CODES = (*MODES, AUTO)

__all__ = ["DTYPES", "check_inputs", "shape_problem", "verify_schedule"]

#: The dtypes the engine runs.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# The group check's row. "grad" (whether this rank will run the backward) rides in the all-gather
# that a schedule's first use makes anyway: one more int64 in the message, no extra collective or
# host synchronisation, and nothing on calls that find the schedule checked. Measured on 2 gloo CPU
# processes: the all-gather takes 0.2-0.4 ms with 8 or 9 ints alike (latency, not bytes); the host
# checks of every call (argument types, shapes) take about 3.5 us.
_ROW = (
    "fingerprint",
    "cp_rank",
    "cp_size",
    "mode",
    "gpus_per_node",
    "max_partners",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "grad",
    "bad_input",
)


def check_inputs(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    schedule: Schedule,
    group: dist.ProcessGroup | None,
    mode: str,
    *,
    needs_grad: bool,
) -> None:
    """Raise unless this rank's q/k/v fit ``schedule`` and the group agrees on it (collective when ``cp_size > 1``).

    ``needs_grad``: whether this call will run a backward on this rank (its output requires grad).

    Raises:
        DataError: (with ``cp_size == 1``) q/k/v that do not fit each other or the schedule.
        ScheduleMismatchError: as :func:`~ringpack.attention.ring_attention` says, on every rank of the group.
    """
    problem = _input_problem(q, k, v, schedule)
    if mode == "p2p" and not problem and schedule.exchange is not None:
        problem = partner_budget_problem(schedule.cp_rank, schedule.exchange.partners, schedule.max_partners)
    if mode == AUTO and not problem:  # resolve_mode found no pick on this schedule
        problem = (
            "mode='auto' runs the mode picked when the schedule was compiled, and this schedule has none: "
            "compile it with ScheduleOptions(mode_choice=ModeChoice(...))"
        )
    if schedule.cp_size > 1:
        verify_schedule(
            schedule,
            group if group is not None else dist.group.WORLD,
            mode,
            k,
            problem,
            needs_grad=needs_grad,
            heads=q.shape[1] if q.dim() == 3 else -1,
        )
    if problem:
        raise DataError(problem)


def shape_problem(q: Tensor, k: Tensor, v: Tensor) -> str | None:
    """Why q, k, v cannot be attention inputs at all (None if they can): their metadata only."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        return f"q, k, v must be [tokens, heads, head_dim]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit together"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}"
    if q.dtype not in DTYPES:
        return f"q, k, v must be float16, bfloat16, float32 or float64, got {q.dtype}"
    if q.shape[1] < 1:
        return f"q has no heads: {tuple(q.shape)}"
    if k.shape[1] < 1:
        return f"k and v have no key/value heads: {tuple(k.shape)}"
    if q.shape[2] < 1:
        return f"q, k, v have head_dim 0: {tuple(q.shape)}"
    if q.shape[1] % k.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})"
    return None


def _input_problem(q: Tensor, k: Tensor, v: Tensor, schedule: Schedule) -> str | None:
    """Why this rank's inputs cannot run ``schedule`` (None if they can)."""
    problem = shape_problem(q, k, v)
    if problem:
        return problem
    if q.shape[0] != schedule.num_tokens:
        return (
            f"cp rank {schedule.cp_rank}: q has {q.shape[0]} tokens "
            f"but the schedule's rank shard has {schedule.num_tokens}"
        )
    if schedule.device != q.device:
        return f"schedule is on {schedule.device} but q is on {q.device}; call schedule.to(device) once per micro-batch"
    return None


def verify_schedule(
    schedule: Schedule,
    group: dist.ProcessGroup,
    mode: str,
    k: Tensor,
    problem: str | None = None,
    *,
    needs_grad: bool = False,
    heads: int = -1,
    inputs: str = "q/k/v",
) -> None:
    """Check once per (schedule, group, mode, K/V shape) that every rank runs the same plan; raise otherwise.

    Collective over ``group``: every rank must call it (``ring_attention`` does). Raises
    :class:`ScheduleMismatchError` on every rank, before any point-to-point transfer. ``needs_grad``:
    whether this rank will run the call's backward; the backward moves K/V and dK/dV between ranks,
    so either every rank of the group runs it or none. ``heads``: the query heads (``-1``: none,
    as for a relayout of channels); head-parallel CP splits them over the group, so ranks must agree.
    ``inputs``: what the messages call the inputs that ``problem`` is about.

    A schedule object is checked on its first use only, so one schedule object must serve one
    micro-batch (the collator compiles one per micro-batch). With ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    every call is checked, at the price of one small all-gather and a host synchronisation per call:
    that also catches a rank that reuses an old schedule object for a new micro-batch, or that
    changes whether it needs gradients after the first layer.
    """
    key = (id(group), mode, heads, tuple(k.shape[1:]), k.dtype)
    if key in schedule.verified and problem is None and dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return
    row = torch.tensor(
        [
            schedule.fingerprint,
            schedule.cp_rank,
            schedule.cp_size,
            _MODE_CODES.index(mode),
            schedule.gpus_per_node or 0,
            schedule.max_partners,
            heads,
            k.shape[1] if k.dim() == 3 else -1,
            k.shape[-1] if k.dim() else -1,
            DTYPES.index(k.dtype) if k.dtype in DTYPES else -1,
            int(bool(needs_grad)),
            int(problem is not None),
        ],
        dtype=torch.int64,
        device=k.device,
    )
    size = dist.get_world_size(group)
    table = row.new_empty(size * row.numel())
    all_gather_flat(table, row, group)
    message = _disagreement(table.view(size, -1).tolist(), dist.get_rank(group), problem, inputs)
    if message:
        raise ScheduleMismatchError(message)
    schedule.verified.add(key)


def _disagreement(rows: list[list[int]], me: int, problem: str | None, inputs: str = "q/k/v") -> str | None:
    cols = {name: [row[j] for row in rows] for j, name in enumerate(_ROW)}
    size = len(rows)
    if cols["cp_size"][me] != size:
        return (
            f"rank {me}: schedule was compiled for cp_size={cols['cp_size'][me]} but the process group has {size} ranks"
        )
    wrong = [g for g in range(size) if cols["cp_rank"][g] != g]
    if wrong:
        pairs = ", ".join(f"group rank {g} holds cp rank {cols['cp_rank'][g]}" for g in wrong)
        return f"ranks run the schedules of other cp ranks ({pairs}); compile_schedule(mb, cp_rank=group rank)"
    for name, what in (
        ("fingerprint", "micro-batches (plan fingerprints)"),
        ("cp_size", "CP sizes"),
        ("mode", "modes"),
        ("gpus_per_node", "the node size the schedules were compiled for (compile_schedule's gpus_per_node)"),
        ("max_partners", "the partner budget the schedules were compiled for (ScheduleOptions.max_partners)"),
        ("heads", "numbers of query heads"),
        ("kv_heads", "numbers of key/value heads"),
        ("head_dim", "head dims"),
        ("dtype", "dtypes"),
        ("grad", "whether the call needs gradients"),
    ):
        values = cols[name]
        if len(set(values)) > 1:
            groups: dict[int, list[int]] = {}
            for g, value in enumerate(values):
                groups.setdefault(value, []).append(g)
            shown = "; ".join(f"ranks {ranks}: {_show(name, value)}" for value, ranks in groups.items())
            hint = _HINTS.get(name, "")
            return f"CP ranks disagree on {what}: {shown}{hint}"
    bad = [g for g in range(size) if cols["bad_input"][g]]
    if bad:
        mine = f" (this rank: {problem})" if problem else ""
        return f"ranks {bad} got {inputs} that do not match their schedule{mine}"
    return None


_HINTS = {
    "grad": (
        " (the backward moves K/V and their gradients between all CP ranks: give every rank the same "
        "torch.is_grad_enabled() and requires_grad on q/k/v)"
    ),
}


def _show(name: str, value: int) -> str:
    if name == "fingerprint":
        return f"{value & 0xFFFFFFFFFFFFFFFF:016x}"
    if name == "mode":
        return _MODE_CODES[value]
    if name == "dtype":
        return str(DTYPES[value]) if 0 <= value < len(DTYPES) else "other"
    if name == "grad":
        return "with gradients" if value else "without gradients"
    if name == "gpus_per_node":
        return str(value) if value else "None"
    return str(value)
