"""``ringpack.plan``: plan samples from their lengths or from where they live, in one call (docs/planner.md).

:func:`plan` reads the lengths of a dataset or file (:func:`ringpack.lengths.sample_lengths`),
builds the :class:`~ringpack.shard_plan.PlanConfig` from keywords and returns
:func:`~ringpack.planner.make_plan`'s plan: the entry point the package root exports. ``world=N``
plans over the whole pool: ``dp=1, cp=N`` (docs/planner.md, "Pool plans").
"""

from __future__ import annotations

import os
from typing import Any

from ringpack._checks import is_int
from ringpack.errors import PlanError
from ringpack.lengths import is_dataset, sample_lengths
from ringpack.planner.epoch import make_plan
from ringpack.shard_plan import Plan, PlanConfig

__all__ = ["plan"]


def plan(lengths: Any, *, column: str | None = None, world: int | None = None, **config: Any) -> Plan:
    """Plan samples into a :class:`Plan`: ``make_plan(lengths, PlanConfig(**config))``.

    The plan is valid by construction (``Plan.validate()`` checks every invariant).
    ``world=N`` is ``dp=1, cp=N``: one CP group over the whole pool, each sample on the ranks its
    cost and memory need (give ``gpus_per_node`` so a split sample stays in one node and the plan
    is made node by node). It is a spelling, not a config field: the plan, its files and its hash
    are those of ``dp=1, cp=N``, which the runtime, the sampler and shard files read as they are.

    Args:
        lengths: one token count per sample, in dataset order: a sequence, numpy or torch array of
            integers >= 1; or where they come from: a ``datasets.Dataset`` / ``IterableDataset``
            (its ``input_ids`` or a length column), or the path of a saved ``datasets`` folder, a
            ``.parquet``, ``.arrow``/``.feather``, ``.json``/``.jsonl`` or ``.npy`` file
            (:func:`ringpack.lengths.sample_lengths`).
        column: the dataset or file column holding lengths or token lists (``None``: a dataset's
            ``input_ids``, else the column :mod:`ringpack.lengths` picks).
        world: GPUs of the pool, planned as ``dp=1, cp=world`` (with neither ``dp`` nor ``cp``).
        **config: :class:`PlanConfig` fields: ``dp``, ``cp``, ``tokens_per_rank`` (required),
            ``strategy``, ``packing``, ``samples_per_step``, ``seed``, ``epoch``, ``cost``,
            ``gpus_per_node``, ...

    Returns:
        The plan, a pure function of ``(lengths, config)``: every rank computes the same one.

    Raises:
        PlanError: a bad length (naming the sample), a sample longer than a CP group holds under
            ``overflow="error"``, a step whose samples cannot fill its micro-batches, or ``world``
            that is not an integer >= 1 or comes with ``dp`` or ``cp``.
        DataError: a dataset or file that cannot be read, a missing column, or a bad length in it.
        FileNotFoundError: a path that does not exist.
    """
    if is_dataset(lengths) or isinstance(lengths, (str, os.PathLike)):
        lengths = sample_lengths(lengths, column)
    elif column is not None:
        raise TypeError("column= applies to a dataset or a file, not to lengths given directly")
    if world is not None:
        given = [name for name in ("dp", "cp") if name in config]
        if given:
            raise PlanError(f"world={world!r} is dp=1, cp=world: give world or {' and '.join(given)}, not both")
        if not is_int(world) or world < 1:
            raise PlanError(f"world must be an integer >= 1 (the pool's GPUs), got {world!r}")
        config = {**config, "dp": 1, "cp": int(world)}
    return make_plan(lengths, PlanConfig(**config))
