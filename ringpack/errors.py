"""The exceptions ringpack raises for bad input; each is a ``ValueError`` naming what is wrong (docs/plan.md).

* :class:`PlanError` -- a plan or a planning request breaks the plan contract (a sample, step or
  rank is named);
* :class:`DataError` -- input data does not fit (a missing column, an empty sample, a corrupt
  shard, a manifest that disagrees with its files);
* :class:`~ringpack.attention.schedule.ScheduleMismatchError` -- CP ranks run different
  micro-batches (raised on every rank of the group).
"""

from __future__ import annotations

__all__ = ["DataError", "PlanError"]


class PlanError(ValueError):
    """A plan, or a request to make one, breaks the plan contract; the message names the step, rank or sample."""


class DataError(ValueError):
    """Bad input data (missing column, empty sample, corrupt shard, mismatched manifest, ...)."""
