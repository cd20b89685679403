"""Calibration: time rank shards on a GPU and fit the cost model the planner loads.

* :mod:`~ringpack.analysis.calibration.cases` -- the grid of rank shards timed and the held-out plans;
* :mod:`~ringpack.analysis.calibration.timing` -- GPU clocks and the timed calls;
* :mod:`~ringpack.analysis.calibration.features` -- what each shard costs in the model's terms;
* :mod:`~ringpack.analysis.calibration.fit` -- the fitted models and their held-out quality (NNLS:
  :mod:`ringpack.cost_fit`);
* :mod:`~ringpack.analysis.calibration.run` -- ``calibrate`` and ``refit``, end to end.

See docs/analysis.md, "`ringpack calibrate`".
"""
