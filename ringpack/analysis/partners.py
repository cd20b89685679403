"""A plan's point-to-point partners, the NCCL buffers they imply and the host time of its schedules.

What ``ringpack plan`` prints and the layout table lists beside tokens/s: under the targeted exchange
(``p2p``), each GPU's partners in one micro-batch (median and max over every rank of every
micro-batch: what the partner budget bounds), the micro-batches over the budget (they run the
ring), the partners a GPU gathers over the plan (NCCL keeps a connection once made) and the buffer
memory those take (:func:`plan_partners`); the host time of compiling one micro-batch's schedule is
:func:`~ringpack.analysis.host_time.compile_milliseconds`. See docs/planner.md, "The partner budget".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ringpack.comm_model import CommModel, microbatch_partners, partner_fallback, rank_partners
from ringpack.shard_plan import Plan

__all__ = ["partner_line", "plan_partners"]


def plan_partners(plan: Plan, comm: CommModel | None = None) -> dict[str, Any]:
    """A plan's partners under the targeted exchange with its partner budget.

    Args:
        plan: the plan.
        comm: the links (default :class:`CommModel` defaults); its mode becomes ``"p2p"``, its
            ``gpus_per_node`` and ``max_partners`` the plan's.

    Returns:
        ``max_partners`` (the budget, 0: none), ``per_microbatch_median`` / ``per_microbatch_max``
        (a GPU's partners in one micro-batch), ``ring_fallback`` (micro-batches over the budget) of
        ``microbatches``, ``per_gpu_max`` (a GPU's partners over the plan, the union) and
        ``nccl_bytes`` / ``nccl_bytes_run`` (those counts times ``comm.partner_buffer_bytes``).
    """
    cfg = plan.config
    comm = dataclasses.replace(
        comm or CommModel(), mode="p2p", gpus_per_node=cfg.gpus_per_node, max_partners=cfg.max_partners
    )
    a = plan.piece_arrays
    M = max((len(step.microbatches[0]) for step in plan.steps), default=0)
    shape = (plan.num_steps, cfg.dp, M)
    exists = np.zeros(shape, dtype=bool)
    for s, step in enumerate(plan.steps):
        for d, mbs in enumerate(step.microbatches):
            exists[s, d, : len(mbs)] = True
    per_mb = microbatch_partners(a, cfg.cp, shape, comm)[exists]
    union = rank_partners(a, cfg.cp, shape, comm)
    most = int(per_mb.max()) if per_mb.size else 0
    return {
        "max_partners": cfg.max_partners,
        "per_microbatch_median": float(np.median(per_mb)) if per_mb.size else 0.0,
        "per_microbatch_max": most,
        "ring_fallback": int(partner_fallback(a, cfg.cp, shape, comm).sum()),
        "microbatches": int(exists.sum()),
        "per_gpu_max": int(union.max()) if union.size else 0,
        "nccl_bytes": most * comm.partner_buffer_bytes,
        "nccl_bytes_run": float(union.max() if union.size else 0) * comm.partner_buffer_bytes,
    }


def partner_line(p: dict[str, Any]) -> str:
    """:func:`plan_partners`' figures as one line."""
    budget = f"max_partners {p['max_partners']}" if p["max_partners"] else "no partner budget"
    return (
        f"targeted exchange (p2p), {budget}: partners per GPU and micro-batch median {p['per_microbatch_median']:.0f}, "
        f"max {p['per_microbatch_max']} (NCCL buffers about {p['nccl_bytes'] / 2**30:.2f} GiB); "
        f"{p['ring_fallback']} of {p['microbatches']} micro-batches over the budget run the ring; "
        f"over the plan a GPU's partners reach {p['per_gpu_max']} ({p['nccl_bytes_run'] / 2**30:.2f} GiB kept)"
    )
