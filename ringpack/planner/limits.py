"""How large a CP group the planner takes on: the balanced split's work grows with the square of the CP size.

The balanced CP split of one micro-batch compares every rank with every other as it fills them,
so its time grows as ``cp**2`` (about :data:`SPLIT_SECONDS_PER_CP2` seconds per squared rank on one
core: a second at 256 ranks, about 13 s at 1,024, about 14 hours at 65,536), and a progress bar
cannot show it, since it counts steps. Past :data:`MAX_BALANCED_CP` ranks in one node the plan is
refused before any work, naming the CP size, the estimate and what to change; zigzag and contiguous
splits, and groups split node by node, grow linearly and are not limited.

See docs/planner.md, "CP split strategies".
"""

from __future__ import annotations

import logging

from ringpack._hints import option
from ringpack.errors import PlanError
from ringpack.shard_plan import PlanConfig

__all__ = ["MAX_BALANCED_CP", "SPLIT_SECONDS_PER_CP2", "balanced_split_seconds", "check_split_size"]

#: Seconds the balanced split of one micro-batch takes per squared CP rank (one core, measured at 256-1,024 ranks).
SPLIT_SECONDS_PER_CP2 = 1.2e-5
#: Largest CP group within one node the balanced split takes on: about 3 minutes per micro-batch.
MAX_BALANCED_CP = 4096
#: A split expected to take longer than this per micro-batch is announced (progress counts steps only).
ANNOUNCE_S = 10.0
log = logging.getLogger("ringpack.progress")


def balanced_split_seconds(cp: int) -> float:
    """Rough seconds the balanced split of one micro-batch over ``cp`` ranks takes on one core."""
    return SPLIT_SECONDS_PER_CP2 * cp * cp


def check_split_size(config: PlanConfig) -> None:
    """Refuse, before any work, a balanced split no machine finishes in reasonable time; announce a slow one.

    Args:
        config: the plan config; only ``strategy="balanced"`` with a CP group in one node
            (``nodes_per_group == 1``) is limited, to :data:`MAX_BALANCED_CP` ranks; one
            above :data:`ANNOUNCE_S` seconds per micro-batch is logged (``ringpack.progress``, INFO).

    Raises:
        PlanError: one line naming the CP size, the estimated time per micro-batch and what to change.
    """
    if config.strategy != "balanced" or config.nodes_per_group > 1:
        return
    seconds = balanced_split_seconds(config.cp)
    if config.cp <= MAX_BALANCED_CP:
        if seconds > ANNOUNCE_S:
            log.info("the balanced split over %d CP ranks takes about %.0f s per micro-batch", config.cp, seconds)
        return
    hours = seconds / 3600
    raise PlanError(
        f"{option('cp')} {config.cp:,} with the balanced split: its work grows with the square of the CP size, "
        f"about {hours:,.1f} hours per micro-batch over {config.cp:,} ranks (up to {MAX_BALANCED_CP:,} ranks: "
        f"minutes); plan a smaller CP group, split it node by node ({option('gpus_per_node')}) or use "
        f"{option('strategy', 'zigzag')}"
    )
