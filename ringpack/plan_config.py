"""The plan config: everything that decides a plan besides the sample lengths, and its limits.

:class:`PlanConfig` (keyword-only, one documented field per setting, validated on construction),
the values its choice fields take (:data:`STRATEGIES`, :data:`PACKINGS`,
:data:`OVERFLOW_POLICIES`, as ``Literal`` types), its size limits and price defaults, and
:func:`global_batch_samples`. :mod:`ringpack.shard_plan` re-exports every name here.

See docs/plan.md ("The objects") and docs/planner.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

import numpy as np

from ringpack._checks import is_finite, is_int
from ringpack._hints import option
from ringpack.cost import MAX_SAMPLE_TOKENS, CostModel
from ringpack.errors import PlanError

__all__ = [
    "DEFAULT_MAX_PARTNERS",
    "FLOP_PRICE_RANGE",
    "MAX_CP",
    "MAX_DP",
    "NO_TOKEN_GUARD",
    "OVERFLOW_POLICIES",
    "PACKINGS",
    "ROBUST_TOKEN_SLACK",
    "STRATEGIES",
    "OverflowPolicy",
    "Packing",
    "PlanConfig",
    "Strategy",
    "check_keys",
    "field_doc",
    "global_batch_samples",
]

#: CP split strategies, packings and overflow policies a :class:`PlanConfig` accepts: the types
#: of its fields and, as tuples, the values they take.
Strategy = Literal["balanced", "zigzag", "contiguous"]
Packing = Literal["balanced", "first_fit"]
OverflowPolicy = Literal["error", "split", "drop"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
PACKINGS: tuple[str, ...] = get_args(Packing)
OVERFLOW_POLICIES: tuple[str, ...] = get_args(OverflowPolicy)
#: Largest DP and CP sizes a :class:`PlanConfig` accepts: far beyond any cluster (a CP group may be
#: the whole pool), small enough that a plan's rank lists and every micro-batch's ``cp`` rank shards
#: stay cheap to build and check.
MAX_DP = 1 << 20
MAX_CP = 1 << 16
#: Integers a config or plan file may hold (int64).
INT64_LIMIT = 2**63


def check_keys(data: Any, where: str, required: Sequence[str], optional: Sequence[str] = ()) -> None:
    """Refuse a non-mapping ``data``, a missing ``required`` key or a key in neither list."""
    if not isinstance(data, dict):
        raise PlanError(f"{where} must be an object, got {type(data).__name__}")
    missing = [key for key in required if key not in data]
    if missing:
        raise PlanError(f"{where} lacks {', '.join(repr(k) for k in missing)}")
    unknown = sorted(str(key) for key in set(data) - set(required) - set(optional))
    if unknown:
        raise PlanError(f"{where} has unknown keys {unknown}")


#: The default pair-price range of plans made with a FLOP cost model (:attr:`PlanConfig.price_range`):
#: on GPUs attention kernels run at roughly half the FLOP rate of the linear layers, and how far
#: depends on the kernel, the head shape and the lengths.
FLOP_PRICE_RANGE: tuple[float, float] = (0.25, 2.0)
#: The ``balanced`` split's default token guard. CP ranks synchronise inside every layer, phase by
#: phase (linear layers sized by a rank's tokens, then attention sized by its pairs), so a split that
#: trades one rank's tokens for another's pairs is slower than its summed cost says. With every CP
#: rank's tokens within 1% of the mean and its cost within 0.1% at the model's price, its pairs are
#: balanced too: each phase is balanced, and the split stays within about 1% of balance at any
#: pair price from a quarter to twice the model's, for about 10% more K/V crossing ranks than a 2%
#: guard leaves.
ROBUST_TOKEN_SLACK = 0.01
#: A ``cp_token_slack`` that turns the token guard off: the token budget alone bounds a rank, and the
#: ``balanced`` split trades tokens for pairs as the cost model says.
NO_TOKEN_GUARD = 1e9


#: The default partner budget (:attr:`PlanConfig.max_partners`): the most ranks one rank exchanges
#: with point to point in one micro-batch's targeted exchange, relays included. NCCL holds buffers
#: for every partner: ``NCCL_BUFFSIZE`` (4 MiB) per channel and direction for the simple protocol
#: plus the low-latency protocols', about 12 MiB a channel, on 2 channels per partner by default,
#: so about 24 MiB a partner (:data:`~ringpack.comm_model.PARTNER_BUFFER_BYTES`). 64 partners hold
#: about 1.5 GiB, 2% of an 80 GB GPU (Megatron-LM measured 23.6 GiB for an all-to-all over 64 ranks
#: on 32 channels). Pool plans of 1M log-normal lengths at a full token budget reached at most 64
#: partners in a micro-batch from 64 to 8,192 GPUs (64 at 1,024), and a tighter budget there costs
#: the pool's throughput (BENCHMARKS.md, "Pool plans and the chosen layout against the peers").
DEFAULT_MAX_PARTNERS = 64


def _price_range(value: Any) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in value)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"PlanConfig.pair_price_range must be a pair (low, high), got {value!r}") from exc
    if not (0 < low <= 1.0 <= high < float("inf")):
        raise PlanError(f"PlanConfig.pair_price_range must satisfy 0 < low <= 1 <= high < inf, got {value!r}")
    return low, high


def field_doc(help: str, **command_line: Any) -> dict[str, Any]:
    """A config field's metadata: its one-line ``help`` and how a command line reads it.

    ``command_line`` holds ``type`` (``int``, ``float``, ``str``, ``bool``, or the field's own
    class), ``choices``, inclusive bounds ``low`` / ``high``, ``metavar``, ``default_text`` (the
    default as a user types it, where the field's is ``None``), ``flag`` (where the flag is not
    the field's name with dashes), ``spellings`` (more names of that flag) and ``aliases`` (old
    flag names, accepted and not shown). ``ringpack.cli`` builds every flag of a config from these.
    """
    return {"help": help, **command_line}


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Everything that decides a plan besides the sample lengths (a plan is a pure function of both).

    Every field is keyword-only and documented by its ``help`` (``dataclasses.fields(PlanConfig)``;
    ``ringpack plan --help`` shows the same text).

    Price robustness: ``pair_price_range = (low, high)`` says how far the true price of an
    attention pair may lie from the cost model's, as factors (``(0.25, 2.0)``: a quarter to twice
    the model's price). Packing balances every DP rank at both ends of the range, and the
    ``balanced`` split holds every CP rank's tokens within ``1 + cp_token_slack`` of the
    micro-batch's mean, so the plan stays balanced whatever the true price within the range. The
    default (``None``) is :data:`FLOP_PRICE_RANGE` for a FLOP model (``cost.unit == "flop"``),
    whose price of a pair is only an estimate, and exact prices ``(1.0, 1.0)`` for a measured
    model (``"s"``: a calibrated profile or one learned from the run). ``cp_token_slack=None``
    means :data:`ROBUST_TOKEN_SLACK` whatever the prices: CP ranks meet at every layer's attention,
    and each reaches it after linear layers sized by its own tokens, so a rank with more tokens holds
    the others up in every layer even when its total cost matches theirs (``cp_token_slack=``
    :data:`NO_TOKEN_GUARD` lets the split trade tokens for pairs freely).
    """

    dp: int = field(
        metadata=field_doc(
            "data-parallel size: DP ranks, each running its share of every step", type=int, low=1, high=MAX_DP
        )
    )
    cp: int = field(
        metadata=field_doc("context-parallel size: CP ranks that split every micro-batch", type=int, low=1, high=MAX_CP)
    )
    tokens_per_rank: int = field(
        metadata=field_doc("token budget of one CP rank per micro-batch", type=int, low=1, high=MAX_SAMPLE_TOKENS)
    )
    strategy: Strategy = field(
        default="balanced",
        metadata=field_doc(
            "CP split of each micro-batch: balanced (by cost), zigzag or contiguous", type=str, choices=STRATEGIES
        ),
    )
    packing: Packing = field(
        default="balanced",
        metadata=field_doc(
            "packing and DP balance: balanced (by cost) or first_fit (token-count first fit, the common baseline)",
            type=str,
            choices=PACKINGS,
        ),
    )
    samples_per_step: int = field(
        default=0, metadata=field_doc("global batch in samples (0: all samples in one step)", type=int, low=0)
    )
    batch_window: int = field(
        default=0,
        metadata=field_doc(
            "global batches within which costly samples may swap places to balance steps, each moving at most this "
            "many steps (0: every step plans its global batch as drawn)",
            type=int,
            low=0,
        ),
    )
    microbatches_per_rank: int = field(
        default=0,
        metadata=field_doc(
            "micro-batches per DP rank and step (0: the fewest that hold the tokens, plus one where the token "
            "budget would otherwise keep the step more than 1% above its lower bound)",
            type=int,
            low=0,
        ),
    )
    seed: int = field(default=0, metadata=field_doc("shuffle seed", type=int, low=0))
    epoch: int = field(
        default=0, metadata=field_doc("epoch whose plan is made (with the seed, the shuffle key)", type=int, low=0)
    )
    overflow: OverflowPolicy = field(
        default="error",
        metadata=field_doc(
            "samples longer than cp x tokens per rank: error (name the first), split (into documents of at most "
            "that many tokens) or drop",
            type=str,
            choices=OVERFLOW_POLICIES,
        ),
    )
    solver_time_limit_s: float = field(
        default=0.0,
        metadata=field_doc(
            "CP-SAT refinement of each step, in deterministic seconds (0: heuristics only)",
            type=float,
            low=0.0,
            aliases=("--solver-time-limit",),
        ),
    )
    cp_token_slack: float | None = field(
        default=None,
        metadata=field_doc(
            "balanced CP split: hold every rank within 1 + slack of the micro-batch's mean tokens (a large value "
            "turns the guard off)",
            type=float,
            low=0.0,
            default_text=str(ROBUST_TOKEN_SLACK),
        ),
    )
    cost: CostModel = field(
        default_factory=lambda: CostModel.preset("llama3-8b"),
        metadata=field_doc(
            "cost model of a rank's tokens, attention pairs and pieces: a preset (llama3-8b, llama-1b, tiny) or a "
            "calibrated profile JSON",
            type=CostModel,
            flag="--model",
            spellings=("--cost-profile",),
            metavar="MODEL",
        ),
    )
    pair_price_range: tuple[float, float] | None = field(
        default=None,
        metadata=field_doc(
            "stay balanced while the true price of an attention pair is LOW..HIGH times the cost model's (1,1 "
            "balances the model's prices alone)",
            type=tuple,
            metavar="LOW,HIGH",
            default_text="0.25,2 for FLOP models, 1,1 for measured profiles",
        ),
    )
    gpus_per_node: int | None = field(
        default=None,
        metadata=field_doc(
            "GPUs of one node, when a CP group spans nodes: each node's share of a micro-batch is split alone, and "
            "only samples bigger than a node take several (whole) nodes (default: one flat group)",
            type=int,
            low=1,
            high=MAX_CP,
            default_text="none",
        ),
    )

    max_partners: int = field(
        default=DEFAULT_MAX_PARTNERS,
        metadata=field_doc(
            "partner budget: the most ranks a rank exchanges with point to point in one micro-batch's targeted "
            "exchange, relays included; a micro-batch over it is split tighter, else runs the ring (0: no budget)",
            type=int,
            low=0,
            high=MAX_CP,
        ),
    )

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tokens_per_rank"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value < INT64_LIMIT:
                raise PlanError(f"PlanConfig.{name} must be a positive integer below 2**63, got {value!r}")
        for name, most in (("dp", MAX_DP), ("cp", MAX_CP)):
            if getattr(self, name) > most:
                raise PlanError(
                    f"{option(name)} {getattr(self, name)} is more than {most:,} ranks, the most a plan holds"
                )
        for name in ("samples_per_step", "batch_window", "microbatches_per_rank", "seed", "epoch"):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value < INT64_LIMIT:
                raise PlanError(f"PlanConfig.{name} must be a non-negative integer below 2**63, got {value!r}")
        if self.group_capacity > MAX_SAMPLE_TOKENS:
            raise PlanError(
                f"{option('cp')} x {option('tokens_per_rank')} = {self.cp} x {self.tokens_per_rank} = "
                f"{self.group_capacity:,} tokens per CP group, more than {MAX_SAMPLE_TOKENS:,} (2**31): a group's "
                "micro-batch holds samples of up to that many tokens, the longest with exact pair counts"
            )
        if self.strategy not in STRATEGIES:
            raise PlanError(f"PlanConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.packing not in PACKINGS:
            raise PlanError(f"PlanConfig.packing must be one of {PACKINGS}, got {self.packing!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise PlanError(f"PlanConfig.overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if not is_finite(self.solver_time_limit_s) or self.solver_time_limit_s < 0:
            raise PlanError(
                f"PlanConfig.solver_time_limit_s must be a finite number >= 0, got {self.solver_time_limit_s!r}"
            )
        if self.cp_token_slack is not None and not (is_finite(self.cp_token_slack) and self.cp_token_slack >= 0):
            raise PlanError(
                f"PlanConfig.cp_token_slack must be None or a finite number >= 0, got {self.cp_token_slack!r}"
            )
        if not is_int(self.max_partners) or not (self.max_partners == 0 or 2 <= self.max_partners <= MAX_CP):
            raise PlanError(
                f"{option('max_partners')} must be 0 (no budget) or an integer in [2, {MAX_CP:,}] (the ring a "
                f"micro-batch over the budget falls back to needs 2 partners), got {self.max_partners!r}"
            )
        object.__setattr__(self, "max_partners", int(self.max_partners))
        if not isinstance(self.cost, CostModel):
            raise PlanError(f"PlanConfig.cost must be a CostModel, got {type(self.cost).__name__}")
        if self.pair_price_range is not None:
            object.__setattr__(self, "pair_price_range", _price_range(self.pair_price_range))
        self._check_nodes()

    def _check_nodes(self) -> None:
        """``gpus_per_node``: ``None``, or a size that a CP group fills whole nodes of or fits inside one."""
        node = self.gpus_per_node
        if node is None:
            return
        if not is_int(node) or not 1 <= node <= MAX_CP:
            raise PlanError(f"{option('gpus_per_node')} must be None or an integer in [1, {MAX_CP:,}], got {node!r}")
        if self.cp % node and node % self.cp:
            raise PlanError(
                f"{option('gpus_per_node')} {node} and {option('cp')} {self.cp}: a CP group must fill whole nodes "
                "or fit inside one (one must divide the other)"
            )

    @property
    def price_range(self) -> tuple[float, float]:
        """The pair-price range the plan is balanced for (``pair_price_range`` with its default resolved)."""
        if self.pair_price_range is not None:
            return self.pair_price_range
        return FLOP_PRICE_RANGE if self.cost.unit == "flop" else (1.0, 1.0)

    @property
    def token_slack(self) -> float:
        """The ``balanced`` split's token guard (``cp_token_slack`` with its default resolved)."""
        if self.cp_token_slack is not None:
            return float(self.cp_token_slack)
        return ROBUST_TOKEN_SLACK

    @property
    def group_capacity(self) -> int:
        """Tokens one CP group can hold in one micro-batch."""
        return self.cp * self.tokens_per_rank

    @property
    def sample_token_limit(self) -> int | None:
        """The most tokens a sample may have: :attr:`group_capacity` under ``overflow="error"`` (a longer
        one is refused), else None (a longer one is split or dropped)."""
        return self.group_capacity if self.overflow == "error" else None

    @property
    def nodes_per_group(self) -> int:
        """Nodes a CP group spans: ``cp / gpus_per_node`` when it spans several, else 1 (flat, or inside one node)."""
        if self.gpus_per_node is None or self.cp <= self.gpus_per_node:
            return 1
        return self.cp // self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["cost"] = self.cost.to_dict()
        if self.pair_price_range is None:
            del out["pair_price_range"]  # the default: plan files and hashes carry set fields only
        else:
            out["pair_price_range"] = list(self.pair_price_range)
        if self.gpus_per_node is None:
            del out["gpus_per_node"]  # flat: plans without a topology keep their files and hashes
        if not self.batch_window:
            del out["batch_window"]  # likewise: plans without a window keep the hashes they always had
        if self.max_partners == DEFAULT_MAX_PARTNERS:
            del out["max_partners"]  # likewise: plans under the default budget keep their files and hashes
        return {k: (int(v) if isinstance(v, np.integer) else v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanConfig:
        """The config of :meth:`to_dict`'s fields (``dp``, ``cp`` and ``tokens_per_rank`` required).

        Raises:
            PlanError: not a mapping, a missing or unknown field, or an invalid value (named).
        """
        check_keys(data, "config", required=("dp", "cp", "tokens_per_rank"), optional=[f.name for f in fields(cls)])
        data = dict(data)
        if "cost" in data:
            try:
                data["cost"] = CostModel.from_dict(data["cost"])
            except ValueError as exc:
                raise PlanError(f"config.cost: {exc}") from exc
        return cls(**data)


def global_batch_samples(lengths: Any, tokens: int | str, *, dp: int, cp: int, tokens_per_rank: int) -> int:
    """``samples_per_step`` of a global batch stated in tokens: about ``tokens`` tokens of mean-length samples.

    Args:
        lengths: the sample lengths (their mean sizes the batch).
        tokens: tokens per optimizer step, or ``"auto"``: ``dp * cp * tokens_per_rank``, one full
            micro-batch per DP rank.
        dp, cp, tokens_per_rank: the mesh and budget of the plan.

    Returns:
        ``max(dp, int(tokens / mean length))``: at least one sample per DP rank.

    Raises:
        PlanError: ``tokens`` neither ``"auto"`` nor an integer >= 1, or no lengths.
    """
    if tokens == "auto":
        tokens = dp * cp * tokens_per_rank
    if not is_int(tokens) or tokens < 1:
        raise PlanError(f"{option('global_batch_tokens')} must be 'auto' or an integer >= 1, got {tokens!r}")
    mean = float(np.mean(lengths)) if len(lengths) else 0.0
    if not mean > 0:
        raise PlanError(f"{option('global_batch_tokens')} needs sample lengths to size the batch; there are none")
    return max(dp, int(tokens / mean))
