"""A second import path of the cost learner, for code that imports it from here.

The learner lives in :mod:`ringpack.training.cost_learner`; import it as ``ringpack.CostLearner`` or
``from ringpack.training import CostLearner, LearnerConfig`` (docs/training.md).
"""

from ringpack.training.cost_learner import CostLearner, LearnerConfig

__all__ = ["CostLearner", "LearnerConfig"]
