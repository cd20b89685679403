"""The planner: sample lengths + :class:`~ringpack.shard_plan.PlanConfig` ->
:class:`~ringpack.shard_plan.Plan`.

* :mod:`~ringpack.planner.epoch` -- shuffled windows, overflow handling, one step at a time;
* :mod:`~ringpack.planner.packing` and :mod:`~ringpack.planner.solver` -- packing and DP balance;
* :mod:`~ringpack.planner.split` -- CP split strategies of one micro-batch;
* :mod:`~ringpack.planner.bounds` -- plan costs and lower bounds.

Importing the planner needs neither ortools nor datasets (the solver loads ortools when used).

See docs/planner.md.
"""

from ringpack.planner.epoch import make_plan, split_microbatch

__all__ = ["make_plan", "split_microbatch"]
