"""The partner budget: every micro-batch's targeted exchange kept within ``PlanConfig.max_partners``.

A rank's partners are the ranks it sends K/V to or receives K/V from point to point in one
micro-batch's targeted exchange, relays included (:func:`~ringpack.traffic.exchange_partners`);
NCCL holds buffers for each. After the CP split, a micro-batch whose exchange gives some rank more
partners than the budget is split tighter (:func:`hold_partner_budget`: each sample's pieces on
fewer, consecutive ranks); where that is still over the budget the first split stays, and
the micro-batch runs the ring under ``mode="p2p"`` (2 partners a rank), by the one rule
:func:`~ringpack.traffic.over_partner_budget` that the runtime and the communication model apply
too. See docs/planner.md, "The partner budget".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ringpack.planner.pool import split_over_nodes
from ringpack.planner.split.baselines import split_contiguous
from ringpack.shard_plan import MicroBatch, PlanConfig
from ringpack.traffic import over_partner_budget

__all__ = ["hold_partner_budget", "microbatches_over_budget"]


def microbatches_over_budget(mbs: Sequence[MicroBatch], config: PlanConfig) -> np.ndarray:
    """bool ``[len(mbs)]``: which micro-batches' targeted exchange (over nodes of ``config.gpus_per_node``)
    gives some rank more than ``config.max_partners`` partners."""
    if not mbs or not config.max_partners or config.cp - 1 <= config.max_partners:
        return np.zeros(len(mbs), dtype=bool)
    columns = [mb.piece_columns for mb in mbs]
    group = np.repeat(np.arange(len(mbs), dtype=np.int64), [len(c[0]) for c in columns])
    rank, sample, start, stop = (np.concatenate([c[k] for c in columns]) for k in range(4))
    return over_partner_budget(
        group, rank, sample, start, stop, len(mbs), config.cp, config.gpus_per_node, config.max_partners
    )


def hold_partner_budget(
    groups: Sequence[Sequence[int]], mbs: list[MicroBatch], lengths: Sequence[int], config: PlanConfig
) -> list[MicroBatch]:
    """``mbs`` (the CP splits of the micro-batches ``groups``, sample ids in micro-batch order) with
    each one over the partner budget split tighter where that brings it within the budget; the
    others as they are (the same objects).

    The tighter splits, tried in order: for a CP group over several nodes, the pool split with its
    groups of several nodes split contiguously (:func:`~ringpack.planner.pool.split_over_nodes`,
    ``tight=True``; the node packing and the one-node splits unchanged); then the whole
    micro-batch split contiguously. Each holds every rank within its token budget. A micro-batch
    still over the budget keeps its first split (and runs the ring). Deterministic: a
    micro-batch's outcome depends on its own samples alone.
    """
    over = np.flatnonzero(microbatches_over_budget(mbs, config)).tolist()
    out = list(mbs)
    tighter = [lambda ids: split_contiguous(ids, lengths, config.cp)]
    if config.nodes_per_group > 1:
        tighter.insert(0, lambda ids: split_over_nodes([ids], lengths, config, tight=True)[0])
    for split in tighter:
        if not over:
            break
        tight = [split(list(groups[i])) for i in over]
        still = microbatches_over_budget(tight, config)
        for i, mb, bad in zip(over, tight, still.tolist()):
            if not bad:
                out[i] = mb
        over = [i for i, bad in zip(over, still.tolist()) if bad]
    return out
