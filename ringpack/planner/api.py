"""``ringpack.plan``: plan samples from their lengths or from where they live, in one call (docs/planner.md).

:func:`plan` reads the lengths of a dataset or file (:func:`ringpack.lengths.sample_lengths`),
builds the :class:`~ringpack.shard_plan.PlanConfig` from keywords and returns
:func:`~ringpack.planner.make_plan`'s plan: the entry point the package root exports. ``world=N``
is the cluster's GPUs: the pool (``dp=1, cp=N``), ``N / cp`` DP ranks, or with ``cp="auto"`` the
layout predicted fastest (docs/planner.md, "Pool plans" and "Choosing the layout").
"""

from __future__ import annotations

import os
from typing import Any

from ringpack._checks import is_int
from ringpack.errors import PlanError
from ringpack.lengths import is_dataset, sample_lengths
from ringpack.planner.epoch import make_plan
from ringpack.planner.layout import AUTO, DEFAULT_GPUS_PER_NODE, choose_layout
from ringpack.shard_plan import Plan, PlanConfig

__all__ = ["plan"]


def plan(lengths: Any, *, column: str | None = None, world: int | None = None, **config: Any) -> Plan:
    """Plan samples into a :class:`Plan`: ``make_plan(lengths, PlanConfig(**config))``.

    The plan is valid by construction (``Plan.validate()`` checks every invariant). ``world=N`` is
    the cluster's GPUs, as ``--world`` is on the command line: with ``cp=C``, ``dp = N / C``; with
    ``cp="auto"``, the layout :func:`~ringpack.planner.layout.choose_layout` predicts fastest (a
    fixed CP size or the pool, on ``gpus_per_node`` GPUs per node, default
    :data:`~ringpack.planner.layout.DEFAULT_GPUS_PER_NODE`); with neither ``cp`` nor ``dp``, the
    pool: ``dp=1, cp=N``, one CP group of every GPU, each sample on the ranks its cost and memory
    need (give ``gpus_per_node`` so a split sample stays in one node and the plan is made node by
    node). The plan, its files and its hash are those of the ``dp`` and ``cp`` it resolves to.

    Args:
        lengths: one token count per sample, in dataset order: a sequence, numpy or torch array of
            integers >= 1; or where they come from: a ``datasets.Dataset`` / ``IterableDataset``
            (its ``input_ids`` or a length column), or the path of a saved ``datasets`` folder, a
            ``.parquet``, ``.arrow``/``.feather``, ``.json``/``.jsonl`` or ``.npy`` file
            (:func:`ringpack.lengths.sample_lengths`).
        column: the dataset or file column holding lengths or token lists (``None``: a dataset's
            ``input_ids``, else the column :mod:`ringpack.lengths` picks).
        world: GPUs of the cluster (with ``cp``, ``cp="auto"`` or alone for the pool; never with ``dp``).
        **config: :class:`PlanConfig` fields: ``dp``, ``cp`` (or ``"auto"`` with ``world``),
            ``tokens_per_rank`` (required), ``strategy``, ``packing``, ``samples_per_step``,
            ``seed``, ``epoch``, ``cost``, ``gpus_per_node``, ...

    Returns:
        The plan, a pure function of ``(lengths, config)``: every rank computes the same one.

    Raises:
        PlanError: a bad length (naming the sample), a sample longer than a CP group holds under
            ``overflow="error"``, a step whose samples cannot fill its micro-batches, ``world``
            that is not an integer >= 1, comes with ``dp`` or is not a multiple of ``cp``,
            ``cp="auto"`` without ``world``, or no layout that plans the lengths.
        DataError: a dataset or file that cannot be read, a missing column, or a bad length in it.
        FileNotFoundError: a path that does not exist.
    """
    if is_dataset(lengths) or isinstance(lengths, (str, os.PathLike)):
        lengths = sample_lengths(lengths, column)
    elif column is not None:
        raise TypeError("column= applies to a dataset or a file, not to lengths given directly")
    if config.get("cp") == AUTO:
        return _plan_auto(lengths, world, config)
    if world is not None:
        config = {**config, **_mesh_of_world(world, config)}
    return make_plan(lengths, PlanConfig(**config))


def _mesh_of_world(world: Any, config: dict[str, Any]) -> dict[str, int]:
    """``dp`` and ``cp`` of ``world`` GPUs: the pool without ``cp``, ``world / cp`` DP ranks with it."""
    if "dp" in config:
        raise PlanError(f"world={world!r} sets dp (world / cp): give world or dp, not both")
    if not is_int(world) or world < 1:
        raise PlanError(f"world must be an integer >= 1 (the cluster's GPUs), got {world!r}")
    cp = config.get("cp", world)
    if not is_int(cp) or cp < 1 or world % cp:
        raise PlanError(f"world={world} is not a multiple of cp={cp!r}")
    return {"dp": int(world) // int(cp), "cp": int(cp)}


def _plan_auto(lengths: Any, world: Any, config: dict[str, Any]) -> Plan:
    """The plan of the layout :func:`choose_layout` ranks first for ``world`` GPUs."""
    if world is None:
        raise PlanError("cp='auto' needs world=N (the cluster's GPUs) to choose the layout for")
    if "dp" in config:
        raise PlanError("cp='auto' sets dp itself (world / cp): leave dp out")
    if not is_int(world) or world < 1:
        raise PlanError(f"world must be an integer >= 1 (the cluster's GPUs), got {world!r}")
    rest = {k: v for k, v in config.items() if k not in ("cp", "gpus_per_node", "tokens_per_rank", "cost")}
    if "tokens_per_rank" not in config:
        raise PlanError("cp='auto' needs tokens_per_rank")
    node = config.get("gpus_per_node") or min(DEFAULT_GPUS_PER_NODE, int(world))
    rest["samples_per_step"] = rest.get("samples_per_step") or None
    best = choose_layout(lengths, int(world), node, config["tokens_per_rank"], config.get("cost"), **rest).best
    chosen = {**config, "dp": best.dp, "cp": best.cp, "gpus_per_node": best.gpus_per_node}
    return make_plan(lengths, PlanConfig(**chosen))
