"""The host time of compiling a micro-batch's attention schedule, as a loader worker would (needs torch).

``ringpack plan`` prints it for the plan's largest micro-batch and the layout table of ``--cp auto``
for each layout's (:func:`compile_milliseconds`); the command line reads it through the
:mod:`ringpack.analysis` package face, and only with ``--host-time``, so planning imports no torch.
See docs/planner.md, "The partner budget".
"""

from __future__ import annotations

import time

import numpy as np

from ringpack.attention import ScheduleOptions, compile_schedule
from ringpack.shard_plan import MicroBatch

__all__ = ["compile_milliseconds"]


def compile_milliseconds(microbatch: MicroBatch, gpus_per_node: int | None, max_partners: int, ranks: int = 3) -> float:
    """The host time of compiling ``microbatch``'s schedule for one rank, in ms: the slowest of
    ``ranks`` ranks (the first, the middle and the one with the most pieces), each compiled once
    on a fresh copy of the micro-batch (its piece columns read anew, as a loader worker would).

    A measurement of this machine, not a prediction; it varies with the machine's load.
    """
    cp = len(microbatch.shards)
    busiest = int(np.argmax([len(shard.pieces) for shard in microbatch.shards]))
    chosen = list(dict.fromkeys([0, cp // 2, busiest]))[:ranks]
    options = ScheduleOptions(gpus_per_node=gpus_per_node, max_partners=max_partners)
    worst = 0.0
    for rank in chosen:
        fresh = MicroBatch(samples=microbatch.samples, shards=microbatch.shards, loss_tokens=microbatch.loss_tokens)
        start = time.perf_counter()
        compile_schedule(fresh, rank, options=options)
        worst = max(worst, time.perf_counter() - start)
    return worst * 1e3
