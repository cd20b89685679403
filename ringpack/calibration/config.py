"""What a calibration times: the configs of both scopes and the settings they resolve to, without torch.

:class:`KernelCalibrationConfig` (``ringpack calibrate``, the kernel scope) and
:class:`StepCalibrationConfig` (``--scope step``) are plain dataclasses whose fields carry their
flags' help, so the command line builds its parser from them without importing torch or the
timing code; :mod:`~ringpack.calibration.run` and :mod:`~ringpack.calibration.step` run them.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringpack._checks import is_int
from ringpack._hints import option
from ringpack.calibration.cases import GRIDS
from ringpack.cost import MAX_SAMPLE_TOKENS, PRESETS
from ringpack.errors import PlanError
from ringpack.shard_plan import MAX_CP, field_doc

__all__ = [
    "CPU_MODEL",
    "DEFAULT_EFFORT",
    "DEFAULT_TOKENS_PER_RANK",
    "GPU_MODEL",
    "TIMERS",
    "AttentionShape",
    "CalibrationSettings",
    "KernelCalibrationConfig",
    "StepCalibrationConfig",
    "backend_field",
    "device_field",
]

TIMERS = ("gpu", "wall")


@dataclass(frozen=True)
class AttentionShape:
    """Heads of one attention layer: ``heads`` query heads, ``kv_heads`` key/value heads of ``head_dim``."""

    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.heads, self.kv_heads, self.head_dim) < 1 or self.heads % self.kv_heads:
            raise ValueError(f"attention shape {self}: need positive sizes and heads a multiple of kv_heads")

    def flops_per_pair(self) -> float:
        """Forward+backward FLOPs of one (query, key) pair over all heads (docs/cost-model.md)."""
        return 4.0 * self.head_dim * self.heads * 3.5


def backend_field() -> Any:
    """The ``backend`` field of both calibration configs: the attention kernels timed."""
    return field(
        default="auto",
        metadata=field_doc(
            "attention kernel backend timed: auto (what training picks), or one of ringpack.attention.BACKENDS",
            type=str,
        ),
    )


def device_field() -> Any:
    """The ``device`` field of both calibration configs."""
    return field(
        default="cuda",
        metadata=field_doc("cuda, or cpu for a dry run with the reference backend", type=str, choices=("cuda", "cpu")),
    )


@dataclass(frozen=True)
class CalibrationSettings:
    """What :func:`calibrate` times and how.

    Attributes:
        layers: attention layers the profile covers (its coefficients are ``layers`` x one layer's).
        mode: ``"linear"`` adds the timed per-token cost of the model's linear layers to the
            profile's token term; ``"attention"`` makes an attention-only profile.
        backend: the attention kernel backend timed (``"auto"``: what training picks).
        device: ``"cuda"``, or ``"cpu"`` for a dry run with the reference backend.
        dtype: the inputs' torch dtype (``None``: bfloat16 on a GPU, float32 on the CPU).
        grid: the shape grid (:data:`GRIDS`).
        reps, warmup: timed and untimed repetitions per shard (the median is taken).
        seed: the inputs' and the grid's random seed.
        name: the profile's name (the communication model looks the K/V shape up by it).
        timer: ``"gpu"`` queues each shard's repetitions behind a GPU sleep, so the host's launch
            time is hidden and the GPU's execution is measured (what a training step that keeps
            the GPU busy sees); ``"wall"`` times from the first launch, host overhead included.
        clock: the :class:`Clock` that times every repetition, in place of the one ``device`` and
            ``timer`` pick (CUDA events, or ``perf_counter`` on the CPU); a deterministic clock
            makes a dry run reproducible.

    Raises:
        ValueError: an unknown ``mode`` or ``timer``.
    """

    layers: int = 1
    mode: str = "linear"
    backend: str = "auto"
    device: str = "cuda"
    dtype: Any = None
    grid: str = "full"
    reps: int = 5
    warmup: int = 1
    seed: int = 0
    name: str = "calibrated"
    timer: str = "gpu"
    clock: Any = None

    def __post_init__(self) -> None:
        if self.mode not in ("linear", "attention"):
            raise ValueError(f"mode must be 'linear' or 'attention', got {self.mode!r}")
        if self.timer not in TIMERS:
            raise ValueError(f"timer must be one of {TIMERS}, got {self.timer!r}")


#: The preset the kernel scope times unless ``model`` is given: on a GPU, and on the CPU (a dry run).
GPU_MODEL, CPU_MODEL = "llama3-8b", "tiny"


@dataclass(frozen=True, kw_only=True)
class KernelCalibrationConfig:
    """What ``ringpack calibrate`` (the kernel scope) times: a model preset's attention and linear layers.

    Each field's ``help`` says what it sets; :func:`calibrate_kernels` resolves the ``None`` ones.

    Raises:
        ValueError: a model that is not a preset, or a field out of range (named).
    """

    model: str | None = field(
        default=None,
        metadata=field_doc(
            f"model preset timed: its heads, layers and linear layers ({', '.join(PRESETS)})",
            type=str,
            default_text=f"{GPU_MODEL}; {CPU_MODEL} on the cpu",
        ),
    )
    heads: int | None = field(default=None, metadata=field_doc("query heads (default: the preset's)", type=int, low=1))
    kv_heads: int | None = field(
        default=None, metadata=field_doc("key/value heads (default: the preset's)", type=int, low=1)
    )
    head_dim: int | None = field(default=None, metadata=field_doc("head dim (default: the preset's)", type=int, low=1))
    layers: int | None = field(
        default=None, metadata=field_doc("layers the profile covers (default: the preset's)", type=int, low=1)
    )
    mode: str = field(
        default="linear",
        metadata=field_doc(
            "linear: also time the linear layers' GEMMs per token; attention: an attention-only profile",
            type=str,
            choices=("linear", "attention"),
        ),
    )
    backend: str = backend_field()
    device: str = device_field()
    grid: str | None = field(
        default=None,
        metadata=field_doc(
            "shape grid", type=str, choices=GRIDS, default_text="full; quick with quick; tiny on the cpu"
        ),
    )
    quick: bool = field(default=False, metadata=field_doc("a smaller grid (about a third of the time)", type=bool))
    reps: int = field(default=5, metadata=field_doc("timed repetitions per shard, the median taken", type=int, low=1))
    warmup: int = field(default=1, metadata=field_doc("untimed runs per shard first", type=int, low=0))
    seed: int = field(default=0, metadata=field_doc("seed of the shards timed and of their inputs", type=int, low=0))
    timer: str = field(
        default="gpu",
        metadata=field_doc(
            "gpu: each shard's GPU execution, host launch time hidden; wall: from the first launch, host overhead "
            "included",
            type=str,
            choices=TIMERS,
        ),
    )

    def __post_init__(self) -> None:
        if self.model is None:  # a CPU dry run checks the pipeline: a small model's shapes time in minutes
            object.__setattr__(self, "model", CPU_MODEL if self.device == "cpu" else GPU_MODEL)
        if self.model not in PRESETS:
            raise ValueError(f"{option('model')} {self.model!r} is not a preset ({', '.join(PRESETS)})")
        CalibrationSettings(mode=self.mode, timer=self.timer)  # the same checks as the settings it resolves to

    def attention_shape(self) -> AttentionShape:
        """The heads timed: the preset's, with ``heads`` / ``kv_heads`` / ``head_dim`` where given."""
        preset = PRESETS[self.model]
        return AttentionShape(
            self.heads or preset.heads, self.kv_heads or preset.kv_heads, self.head_dim or preset.head_dim
        )

    def settings(self, clock: Any = None) -> CalibrationSettings:
        """The :class:`CalibrationSettings` of this config (the profile named for the preset and any changed heads)."""
        preset, shape = PRESETS[self.model], self.attention_shape()
        same = (shape.heads, shape.kv_heads, shape.head_dim) == (preset.heads, preset.kv_heads, preset.head_dim)
        name = preset.name if same else f"{preset.name}-h{shape.heads}kv{shape.kv_heads}d{shape.head_dim}"
        grid = self.grid or ("tiny" if self.device == "cpu" else "quick" if self.quick else "full")
        return CalibrationSettings(
            layers=self.layers or preset.layers,
            mode=self.mode,
            backend=self.backend,
            device=self.device,
            grid=grid,
            reps=self.reps,
            warmup=self.warmup,
            seed=self.seed,
            name=name,
            timer=self.timer,
            clock=clock,
        )


#: ``tokens_per_rank`` when none is given: the run's usual budget on a GPU; on the CPU (a dry run on
#: the reference attention, whose memory grows with the square of a rank's tokens) a small one
DEFAULT_TOKENS_PER_RANK = {"cuda": 65536, "cpu": 1024}
#: ``microbatches``, ``reps`` and ``warmup`` when not given: on the CPU a dry run checks the pipeline,
#: so it times each shard once and half the micro-batches (about a sixth of the passes: minutes)
DEFAULT_EFFORT = {
    "cuda": {"microbatches": 2, "reps": 2, "warmup": 1},
    "cpu": {"microbatches": 1, "reps": 1, "warmup": 0},
}


def _effort_text(name: str) -> str:
    return f"{DEFAULT_EFFORT['cuda'][name]}; {DEFAULT_EFFORT['cpu'][name]} on the cpu"


@dataclass(frozen=True, kw_only=True)
class StepCalibrationConfig:
    """What :func:`calibrate_step` times (``ringpack calibrate --scope step``); each field's ``help`` says what it sets.

    Raises:
        PlanError: a field of the wrong kind or out of range (the message names it).
    """

    model: str = field(
        default="llama-1b",
        metadata=field_doc(
            "a preset of ringpack.cost.PRESETS (its Llama) or a transformers config (config.json or its folder)",
            type=str,
        ),
    )
    backend: str = backend_field()
    device: str = device_field()
    dtype: str | None = field(
        default=None,
        metadata=field_doc(
            "dtype of the model and inputs",
            type=str,
            choices=("bf16", "fp32"),
            default_text="bf16 on a GPU, fp32 on the cpu",
        ),
    )
    grad_ckpt: bool = field(
        default=False, metadata=field_doc("time with activation checkpointing (as training runs)", type=bool)
    )
    tokens_per_rank: int | None = field(
        default=None,
        metadata=field_doc(
            "token budget of a CP rank in the plans timed (use the run's)",
            type=int,
            low=1,
            high=MAX_SAMPLE_TOKENS,
            default_text=f"{DEFAULT_TOKENS_PER_RANK['cuda']}; {DEFAULT_TOKENS_PER_RANK['cpu']} on the cpu",
        ),
    )
    cp: int = field(
        default=2,
        metadata=field_doc("CP size of the split shards timed (1: whole samples only)", type=int, low=1, high=MAX_CP),
    )
    max_len: int = field(
        default=0, metadata=field_doc("longest sample of the length mixes (0: the token budget)", type=int, low=0)
    )
    fit_mixes: int = field(default=3, metadata=field_doc("length mixes timed for the fit", type=int, low=1))
    held_out_mixes: int = field(default=2, metadata=field_doc("length mixes held out of the fit", type=int, low=1))
    microbatches: int | None = field(
        default=None,
        metadata=field_doc(
            "micro-batches timed per plan (the first ones of its first step)",
            type=int,
            low=1,
            default_text=_effort_text("microbatches"),
        ),
    )
    reps: int | None = field(
        default=None,
        metadata=field_doc(
            "timed repetitions per shard, the median taken", type=int, low=1, default_text=_effort_text("reps")
        ),
    )
    warmup: int | None = field(
        default=None,
        metadata=field_doc("untimed runs per shard first", type=int, low=0, default_text=_effort_text("warmup")),
    )
    seed: int = field(default=0, metadata=field_doc("seed of the shards timed and of their inputs", type=int, low=0))

    def __post_init__(self) -> None:
        for name in ("model", "backend", "device"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise PlanError(f"StepCalibrationConfig.{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.device not in DEFAULT_TOKENS_PER_RANK:
            raise PlanError(f"StepCalibrationConfig.device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.tokens_per_rank is None:
            object.__setattr__(self, "tokens_per_rank", DEFAULT_TOKENS_PER_RANK[self.device])
        for name, value in DEFAULT_EFFORT[self.device].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        for name in ("tokens_per_rank", "cp", "fit_mixes", "held_out_mixes", "microbatches", "reps"):
            value = getattr(self, name)
            if not is_int(value) or not 1 <= value < 2**63:
                raise PlanError(f"StepCalibrationConfig.{name} must be a whole number >= 1, got {value!r}")
        for name in ("max_len", "warmup", "seed"):
            value = getattr(self, name)
            if not is_int(value) or not 0 <= value < 2**63:
                raise PlanError(f"StepCalibrationConfig.{name} must be a whole number >= 0, got {value!r}")
        if self.dtype not in (None, "bf16", "fp32"):
            raise PlanError(f"StepCalibrationConfig.dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if not isinstance(self.grad_ckpt, bool):
            raise PlanError(f"StepCalibrationConfig.grad_ckpt must be True or False, got {self.grad_ckpt!r}")
