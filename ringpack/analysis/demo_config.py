"""What ``ringpack demo`` plans and where it writes: :class:`DemoConfig` and :data:`DEMO_PLAN`, without torch.

The command line builds ``ringpack demo``'s flags from these fields; :mod:`~ringpack.analysis.demo`
runs them (its ring check needs torch).

See docs/analysis.md, "`ringpack demo`".
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any

import numpy as np

from ringpack.comm_model import LINKS
from ringpack.cost import CostModel
from ringpack.errors import PlanError
from ringpack.shard_plan import PlanConfig, field_doc, global_batch_samples

__all__ = ["DEMO_PLAN", "DemoConfig"]


#: The demo's plan: DP=4 x CP=4 at 32,768 tokens per rank, documents longer than a CP group split.
DEMO_PLAN = PlanConfig(dp=4, cp=4, tokens_per_rank=32768, overflow="split")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What :func:`run_demo` plans and where it writes; each field's ``help`` says what it sets.

    ``plan`` is the :class:`PlanConfig` every variant is planned with, whole (its ``strategy`` and
    ``packing`` are set per variant); where its ``samples_per_step`` is 0, ``global_batch_tokens``
    sizes the global batch.
    """

    out: str = field(default="demo-out", metadata=field_doc("folder for the report, JSON and plots", type=str))
    tokenizer: str | None = field(
        default=None,
        metadata=field_doc(
            "Hugging Face tokenizer.json (or its folder) for exact token counts",
            type=str,
            default_text="the regex tokenizer",
        ),
    )
    plan: PlanConfig = field(
        default=DEMO_PLAN,
        metadata=field_doc(
            "the plan config of every variant (its strategy and packing set per variant)", type=PlanConfig
        ),
    )
    global_batch_tokens: int | str = field(
        default="auto",
        metadata=field_doc(
            "global batch in tokens where samples_per_step is 0: samples per step = max(dp, tokens / mean length); "
            "auto: dp x cp x tokens_per_rank, one full micro-batch per DP rank; 0: all samples in one step",
            type=int,
        ),
    )
    tflops: float = field(
        default=400.0, metadata=field_doc("achieved fwd+bwd TFLOP/s per GPU of a FLOP cost model", type=float)
    )
    link: str = field(
        default="nvlink",
        metadata=field_doc("link preset of the CP traffic within a node", type=str, choices=tuple(sorted(LINKS))),
    )
    quick: bool = field(default=False, metadata=field_doc("a 300-file subset of the corpus (for tests)", type=bool))
    ring_check: bool = field(
        default=True,
        metadata=field_doc(
            "the 2-process ring runtime check (off with --no-ring-check)", type=bool, flag="--no-ring-check"
        ),
    )
    # The old spelling: plan fields one by one (a DeprecationWarning; they replace those of ``plan``).
    dp: InitVar[int | None] = None
    cp: InitVar[int | None] = None
    tokens_per_rank: InitVar[int | None] = None
    samples_per_step: InitVar[int | None] = None
    seed: InitVar[int | None] = None
    cost: InitVar[CostModel | None] = None

    def __post_init__(self, *old: Any) -> None:
        if not isinstance(self.plan, PlanConfig):
            raise PlanError(f"DemoConfig.plan must be a PlanConfig, got {type(self.plan).__name__}")
        given = {name: value for name, value in zip(_OLD_PLAN_FIELDS, old) if value is not None}
        if given:
            warnings.warn(
                f"DemoConfig({'=..., '.join(given)}=...) is deprecated: pass DemoConfig(plan=PlanConfig(...)), "
                "e.g. dataclasses.replace(DEMO_PLAN, dp=...)",
                DeprecationWarning,
                stacklevel=3,
            )
            object.__setattr__(self, "plan", dataclasses.replace(self.plan, **given))

    def cost_model(self) -> CostModel:
        """The plan's cost model, a FLOP model running at ``tflops``."""
        cost = self.plan.cost
        if cost.unit != "flop":
            return cost
        return dataclasses.replace(cost, flops_per_second=self.tflops * 1e12)

    def samples_per_step_of(self, lengths: np.ndarray) -> int:
        """The plan's ``samples_per_step``, or where it is 0 the batch of ``global_batch_tokens`` (0: one step)."""
        plan = self.plan
        if plan.samples_per_step or not self.global_batch_tokens:
            return plan.samples_per_step
        return global_batch_samples(
            lengths, self.global_batch_tokens, dp=plan.dp, cp=plan.cp, tokens_per_rank=plan.tokens_per_rank
        )


#: DemoConfig's old init-only plan fields, in order.
_OLD_PLAN_FIELDS = ("dp", "cp", "tokens_per_rank", "samples_per_step", "seed", "cost")
