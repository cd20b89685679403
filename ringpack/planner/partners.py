"""The partner budget: every micro-batch's targeted exchange kept within ``PlanConfig.max_partners``.

A rank's partners are the ranks it sends K/V to or receives K/V from point to point in one
micro-batch's targeted exchange, relays included (:func:`~ringpack.traffic.exchange_partners`);
NCCL holds buffers for each. After the CP split, a micro-batch whose exchange gives some rank more
partners than the budget is split tighter, each sample's pieces on fewer, consecutive ranks: a pool
split's groups of several nodes over it are split contiguously
(:func:`~ringpack.planner.pool.split_over_nodes`), then a micro-batch still over it as a whole
(:func:`hold_partner_budget`); where that is still over the budget the first split stays, and
the micro-batch runs the ring under ``mode="p2p"`` (2 partners a rank), by the one rule
:func:`~ringpack.traffic.over_partner_budget` that the runtime and the communication model apply
too. See docs/planner.md, "The partner budget".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringpack.planner.split.baselines import split_contiguous
from ringpack.shard_plan import MicroBatch, PlanConfig
from ringpack.traffic import over_partner_budget, remember_over_budget, remembered_over_budget

__all__ = ["hold_partner_budget", "microbatches_over_budget"]


def microbatches_over_budget(mbs: Sequence[MicroBatch], config: PlanConfig) -> np.ndarray:
    """bool ``[len(mbs)]``: which micro-batches' targeted exchange (over nodes of ``config.gpus_per_node``)
    gives some rank more than ``config.max_partners`` partners; each outcome is also kept on its
    micro-batch (:func:`~ringpack.traffic.remember_over_budget`), for its schedules to read. A
    micro-batch whose outcome is kept already (the pool split decides it from its node groups) is
    not counted again."""
    if not mbs or not config.max_partners or config.cp - 1 <= config.max_partners:
        return np.zeros(len(mbs), dtype=bool)
    known = [remembered_over_budget(mb, config.gpus_per_node, config.max_partners) for mb in mbs]
    todo = [i for i, flag in enumerate(known) if flag is None]
    over = np.array([bool(flag) for flag in known], dtype=bool)
    if not todo:
        return over
    columns = [mbs[i].piece_columns for i in todo]
    group = np.repeat(np.arange(len(todo), dtype=np.int64), [len(c[0]) for c in columns])
    rank, sample, start, stop = (np.concatenate([c[k] for c in columns]) for k in range(4))
    counted = over_partner_budget(
        group, rank, sample, start, stop, len(todo), config.cp, config.gpus_per_node, config.max_partners
    )
    for i, flag in zip(todo, counted.tolist()):
        remember_over_budget(mbs[i], config.gpus_per_node, config.max_partners, flag)
        over[i] = flag
    return over


def hold_partner_budget(
    groups: Sequence[Sequence[int]], mbs: list[MicroBatch], lengths: Sequence[int], config: PlanConfig
) -> list[MicroBatch]:
    """``mbs`` (the CP splits of the micro-batches ``groups``, sample ids in micro-batch order) with
    each one over the partner budget split contiguously (every sample on the fewest consecutive
    ranks its tokens need, every rank within one token of the mean) where that brings it within
    the budget; the others as they are (the same objects). A micro-batch still over the budget
    keeps its first split (and runs the ring). A pool split has already split its groups of several
    nodes over the budget contiguously (:func:`~ringpack.planner.pool.split_over_nodes`); what is
    left over it here is a flat split, or a pool whose one-node groups alone exceed the budget.
    Deterministic: a micro-batch's outcome depends on its own samples alone.
    """
    over = np.flatnonzero(microbatches_over_budget(mbs, config)).tolist()
    if not over:
        return mbs
    tight = [split_contiguous(list(groups[i]), lengths, config.cp) for i in over]
    out = list(mbs)
    for i, mb, bad in zip(over, tight, microbatches_over_budget(tight, config).tolist()):
        if not bad:
            out[i] = mb
    return out
