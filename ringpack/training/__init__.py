"""ringpack.training: what a training loop runs beside its loaders (docs/training.md).

:class:`CostLearner` times the run's micro-batches and re-plans with the cost model it fits. This
layer sits above the data loaders (it steers a sampler) and below the integrations (their
checkpoints store its state).
"""

from ringpack.training.cost_learner import CostLearner, LearnerConfig

__all__ = ["CostLearner", "LearnerConfig"]
