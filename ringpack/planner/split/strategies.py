"""One entry to every CP split strategy: the micro-batches of many groups of samples split by name.

The planner splits a step's micro-batches through :func:`split_groups`, and a CP group that spans
nodes splits each node's share through it too (:mod:`ringpack.planner.pool`), so every caller
applies the same rules: ``balanced`` splits all groups at once, ``zigzag`` falls back to its
token-even form where floor cuts would put a rank over its budget.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ringpack.planner.split.balanced import split_balanced_many
from ringpack.planner.split.baselines import split_contiguous, split_zigzag, split_zigzag_even
from ringpack.shard_plan import MicroBatch

if TYPE_CHECKING:
    from ringpack.cost import CostModel

__all__ = ["split_groups"]


def split_groups(
    groups: Sequence[Sequence[int]],
    lengths: Sequence[int],
    cp: int,
    tokens_per_rank: int,
    cost: CostModel,
    strategy: str,
    token_slack: float | None,
) -> list[MicroBatch]:
    """Each group of sample ids split over ``cp`` ranks by ``strategy``, in order.

    Args:
        groups: the micro-batches' sample ids, each in micro-batch order.
        lengths: tokens of every sample, indexed by id (a sequence or a 1-D integer array).
        cp: CP ranks of every micro-batch.
        tokens_per_rank: every rank's token budget.
        cost: the cost model ``balanced`` splits by.
        strategy: ``"balanced"``, ``"zigzag"`` or ``"contiguous"`` (``PlanConfig.strategy``).
        token_slack: ``balanced``'s token guard (``PlanConfig.token_slack``).

    Returns:
        One :class:`MicroBatch` with ``cp`` rank shards per group.

    Raises:
        ValueError: (``balanced``) a group holds more than ``cp * tokens_per_rank`` tokens.
    """
    if strategy == "balanced":  # all micro-batches at once (the same splits, faster)
        return split_balanced_many(groups, lengths, cp, tokens_per_rank, cost, token_slack=token_slack)
    if strategy == "zigzag":
        out = []
        for members in groups:
            mb = split_zigzag(members, lengths, cp)
            if max(shard.num_tokens for shard in mb.shards) > tokens_per_rank:
                # floor cuts can leave a rank one token per sample over a tight budget; the token-even
                # zigzag keeps the same front/back chunk pairing and always fits a micro-batch that fits
                mb = split_zigzag_even(members, lengths, cp)
            out.append(mb)
        return out
    return [split_contiguous(members, lengths, cp) for members in groups]
