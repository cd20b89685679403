"""``ringpack.plan``: plan samples from their lengths or from where they live, in one call (docs/planner.md).

:func:`plan` reads the lengths of a dataset or file (:func:`ringpack.lengths.sample_lengths`),
builds the :class:`~ringpack.shard_plan.PlanConfig` from keywords and returns
:func:`~ringpack.planner.make_plan`'s plan: the entry point the package root exports.
"""

from __future__ import annotations

import os
from typing import Any

from ringpack.lengths import is_dataset, sample_lengths
from ringpack.planner.epoch import make_plan
from ringpack.shard_plan import Plan, PlanConfig

__all__ = ["plan"]


def plan(lengths: Any, *, column: str | None = None, **config: Any) -> Plan:
    """Plan samples into a :class:`Plan`: ``make_plan(lengths, PlanConfig(**config))``.

    The plan is valid by construction (``Plan.validate()`` checks every invariant).

    Args:
        lengths: one token count per sample, in dataset order: a sequence, numpy or torch array of
            integers >= 1; or where they come from: a ``datasets.Dataset`` / ``IterableDataset``
            (its ``input_ids`` or a length column), or the path of a saved ``datasets`` folder, a
            ``.parquet``, ``.arrow``/``.feather``, ``.json``/``.jsonl`` or ``.npy`` file
            (:func:`ringpack.lengths.sample_lengths`).
        column: the dataset or file column holding lengths or token lists (``None``: a dataset's
            ``input_ids``, else the column :mod:`ringpack.lengths` picks).
        **config: :class:`PlanConfig` fields: ``dp``, ``cp``, ``tokens_per_rank`` (required),
            ``strategy``, ``packing``, ``samples_per_step``, ``seed``, ``epoch``, ``cost``, ...

    Returns:
        The plan, a pure function of ``(lengths, config)``: every rank computes the same one.

    Raises:
        PlanError: a bad length (naming the sample), a sample longer than a CP group holds under
            ``overflow="error"``, or a step whose samples cannot fill its micro-batches.
        DataError: a dataset or file that cannot be read, a missing column, or a bad length in it.
        FileNotFoundError: a path that does not exist.
    """
    if is_dataset(lengths) or isinstance(lengths, (str, os.PathLike)):
        lengths = sample_lengths(lengths, column)
    elif column is not None:
        raise TypeError("column= applies to a dataset or a file, not to lengths given directly")
    return make_plan(lengths, PlanConfig(**config))
