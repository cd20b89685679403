"""ringpack: long-context training on packed data, with no slow rank.

The planner packs variable-length samples into micro-batches and splits them across data-parallel
(DP) and context-parallel (CP) ranks by a cost model of causal attention; the attention runtime
executes any such plan exactly; the data loaders feed it to a training loop.

The public API, importable from here::

    plan, Plan, PlanConfig, PlanError, DataError, CostModel       # the plan contract and the planner
    compile_schedule, ring_attention, RingAttention             # the attention runtime (torch)
    BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader   # data loading (torch)
    CostLearner                                                 # the cost model learned from the run

Names load on first use, so ``import ringpack`` is quick and needs neither torch, ortools nor
datasets. Where transformers is installed, ``attn_implementation="ringpack"`` works once ringpack is
imported (:mod:`ringpack.integrations.autoregister`), without importing transformers here.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ringpack.integrations import autoregister as _autoregister

__version__ = "0.1.0"

_EXPORTS = {
    "Plan": "ringpack.shard_plan",
    "PlanConfig": "ringpack.shard_plan",
    "PlanError": "ringpack.errors",
    "DataError": "ringpack.errors",
    "CostModel": "ringpack.cost",
    "make_plan": "ringpack.planner",
    "compile_schedule": "ringpack.attention",
    "ring_attention": "ringpack.attention",
    "RingAttention": "ringpack.attention",
    "BalancedBatchSampler": "ringpack.data",
    "PackedCollator": "ringpack.data",
    "PackedDataset": "ringpack.data",
    "ShardReader": "ringpack.data",
    "CostLearner": "ringpack.analysis.calibration.online",
}
__all__ = ["__version__", "plan", *_EXPORTS]

if TYPE_CHECKING:
    from ringpack.analysis.calibration.online import CostLearner  # noqa: F401
    from ringpack.attention import RingAttention, compile_schedule, ring_attention  # noqa: F401
    from ringpack.cost import CostModel  # noqa: F401
    from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader  # noqa: F401
    from ringpack.errors import DataError, PlanError  # noqa: F401
    from ringpack.planner import make_plan  # noqa: F401
    from ringpack.shard_plan import Plan, PlanConfig  # noqa: F401


_autoregister.install()


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
    import os

    from ringpack.lengths import is_dataset, sample_lengths
    from ringpack.planner import make_plan
    from ringpack.shard_plan import PlanConfig

    if is_dataset(lengths) or isinstance(lengths, (str, os.PathLike)):
        lengths = sample_lengths(lengths, column)
    elif column is not None:
        raise TypeError("column= applies to a dataset or a file, not to lengths given directly")
    return make_plan(lengths, PlanConfig(**config))


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringpack' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
