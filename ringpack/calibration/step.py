"""``ringpack calibrate --scope step``: a cost profile of the whole training step, timed on one GPU.

Where the kernel scope (:mod:`ringpack.calibration.run`) times attention and the GEMMs,
this scope times what a rank runs per micro-batch: a ``transformers`` causal LM's forward, summed
next-token loss and backward (embedding, norms, RoPE, the vocabulary loss, activation
checkpointing's recompute and the host's launches included), with ringpack attention and remote
K/V served from memory. The shards are the rank shards of ringpack plans of heavy-tailed mixes;
the fit is :func:`~ringpack.cost_fit.fit_rank_times` (``token*tokens + pair*pairs +
segment*pieces + microbatch``), checked on held-out mixes.

Entry points: :func:`calibrate_step` (from a :class:`StepCalibrationConfig`) and
:func:`predicted_busy` (each GPU's forward + backward time for a plan step under a profile).

See docs/cost-model.md, "The training step (`--scope step`)", and docs/analysis.md,
"`ringpack calibrate`".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.attention.engine import ContextParallelAttention
from ringpack.attention.kernels import resolve_backend
from ringpack.calibration.cases import Case, microbatch_geometry, rank_cases
from ringpack.calibration.config import DEFAULT_TOKENS_PER_RANK, StepCalibrationConfig
from ringpack.calibration.features import compiled_schedule
from ringpack.calibration.run import DRY_RUN_NOTE
from ringpack.calibration.timing import AttentionShape, Clock, compute_only_transport, device_name
from ringpack.cost import PRESETS, CostModel, ModelShape
from ringpack.cost_fit import ROW, FitResult, fit_problem, fit_rank_times, microbatch_features, usable_rows
from ringpack.errors import DataError, PlanError
from ringpack.integrations.transformers import causal_lm_loss_sum
from ringpack.planner import make_plan
from ringpack.progress import Progress
from ringpack.shard_plan import PlanConfig, Step
from ringpack.training.cost_learner import LearnerConfig

__all__ = [
    "StepCalibrationConfig",
    "StepCalibration",
    "calibrate_step",
    "predicted_busy",
    "step_cases",
    "model_config",
    "check_cpu_budget",
    "reference_attention_bytes",
    "format_step_summary",
]

log = logging.getLogger("ringpack.calibrate")

ATTENTION_NAME = "ringpack_compute_only"
#: (label, CP size or 0 for the calibrated ``cp``, plan options, fraction of the token budget)
PLAN_SHAPES = (
    ("cp1", 1, dict(), 1.0),
    ("balanced", 0, dict(), 1.0),
    ("zigzag", 0, dict(strategy="zigzag"), 1.0),
    ("first-fit+contiguous", 0, dict(packing="first_fit", strategy="contiguous"), 0.25),
)
_HELD_OUT_SEED = 1000
#: the largest relative RMS error of a usable fit (the learner's :class:`LearnerConfig` default)
MAX_FIT_ERROR = LearnerConfig().max_error


#: the most memory a CPU dry run lets one reference-attention call take (:func:`reference_attention_bytes`)
CPU_ATTENTION_BYTES = 4 << 30
#: the most memory a CPU dry run lets the model's float32 weights and gradients take
CPU_MODEL_BYTES = 16 << 30


def reference_attention_bytes(tokens: int, heads: int) -> int:
    """About the peak memory of one reference-attention backward over ``tokens`` queries and keys.

    The reference kernel materialises the scores, probabilities and their gradients as float32
    ``[heads, tokens, tokens]`` tensors (four at the peak) and a boolean mask of ``[tokens, tokens]``.
    """
    return (16 * heads + 1) * tokens**2


def check_cpu_budget(config: StepCalibrationConfig, shape: ModelShape) -> None:
    """Refuse a CPU dry run that would not fit a CPU: the reference attention within
    :data:`CPU_ATTENTION_BYTES`, the model's float32 weights and gradients within :data:`CPU_MODEL_BYTES`.

    Raises:
        PlanError: ``tokens_per_rank`` too large for ``shape``'s heads, or a model too large, on
            the CPU (one line naming the flag and what fits).
    """
    if config.device != "cpu":
        return
    weights = 8 * shape.params
    if weights > CPU_MODEL_BYTES:
        raise PlanError(
            f"--device cpu: {shape.name} has {shape.params / 1e9:.1f}B parameters, about {weights / 2**30:.0f} GiB "
            "of float32 weights and gradients; a CPU dry run needs a small model (--model tiny)"
        )
    need = reference_attention_bytes(config.tokens_per_rank, shape.heads)
    if need > CPU_ATTENTION_BYTES:
        most = math.isqrt(CPU_ATTENTION_BYTES // (16 * shape.heads + 1))
        raise PlanError(
            f"--device cpu: at {config.tokens_per_rank} tokens per rank the reference attention of {shape.name} "
            f"({shape.heads} heads) needs about {need / 2**30:.0f} GiB; a CPU dry run takes --tokens-per-rank "
            f"of at most {most} for this model (default {DEFAULT_TOKENS_PER_RANK['cpu']} on the CPU)"
        )


@dataclass(frozen=True)
class StepCalibration:
    """A step calibration's result.

    Attributes:
        profile: the fitted :class:`CostModel` in seconds (``microbatch`` is the fitted constant).
        fit: the fit and its error on the observations it was fitted on.
        held_out: relative errors on the held-out shards (``shard_*``) and micro-batches
            (``microbatch_*``, the slowest rank's time): mean absolute, largest absolute, count.
        rows: one dict per timed shard (its plan, rank, features, seconds and ``set``: fit or
            held-out).
        microbatches: the geometry of every timed micro-batch (``rows[i]["microbatch"]`` indexes it).
        meta: device, software, model shape and settings.
    """

    profile: CostModel
    fit: FitResult
    held_out: dict[str, float]
    rows: list[dict[str, Any]]
    microbatches: list[dict[str, Any]]
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``format: "ringpack-step-calibration"``)."""
        fit = dataclasses.asdict(self.fit)
        fit["model"] = self.fit.model.to_dict()
        return dict(
            format="ringpack-step-calibration",
            version=1,
            profile=self.profile.to_dict(),
            fit=fit,
            held_out=self.held_out,
            meta=self.meta,
            rows=self.rows,
            microbatches=self.microbatches,
        )


# ------------------------------------------------------------------------------------- the shards


def length_mix(seed: int, total: int, max_len: int) -> np.ndarray:
    """Sample lengths summing to at least ``total``: Pareto (even seeds) or log-normal (odd), in ``[16, max_len]``."""
    rng = np.random.default_rng(seed)
    scale = max(16, max_len // 64)
    out: list[int] = []
    while sum(out) < total:
        if seed % 2 == 0:
            draw = scale * (1 + rng.pareto(1.1, 64))
        else:
            draw = rng.lognormal(np.log(scale * 2), 1.3, 64)
        out += np.clip(draw.astype(np.int64), 16, max_len).tolist()
    return np.asarray(out, dtype=np.int64)


def step_cases(config: StepCalibrationConfig, seed: int, cost: CostModel) -> list[Case]:
    """Every rank shard timed for one length mix: the first micro-batches of each :data:`PLAN_SHAPES` plan."""
    max_len = config.max_len or config.tokens_per_rank
    cases: list[Case] = []
    for label, cp, options, fraction in PLAN_SHAPES:
        cp = cp or config.cp
        if label in ("balanced", "zigzag") and cp == 1:  # the same whole samples as "cp1"
            continue
        budget = max(1, int(config.tokens_per_rank * fraction))
        lengths = length_mix(seed, config.microbatches * cp * budget, min(max_len, cp * budget))
        plan = make_plan(lengths, PlanConfig(dp=1, cp=cp, tokens_per_rank=budget, cost=cost, **options))
        for k, mb in enumerate(plan.steps[0].microbatches[0][: config.microbatches]):
            cases += rank_cases(label, mb, lengths, f"mix {seed} {label} mb{k}")
    return cases


# ------------------------------------------------------------------------------------- the model


def model_config(model: str) -> tuple[Any, ModelShape]:
    """The ``transformers`` config of ``model`` (a preset or a config path) and its :class:`ModelShape`.

    A config file must name its architecture (``model_type``); nothing is guessed.

    Raises:
        DataError: neither a preset nor an existing config file or folder, a folder without a
            ``config.json``, a file that is not a JSON object, no ``model_type`` or one
            ``transformers`` does not know, a config ``transformers`` refuses, or one without the
            fields of a decoder (:func:`shape_of`); one line naming the file.
    """
    from transformers import CONFIG_MAPPING, AutoConfig, LlamaConfig

    if model in PRESETS:
        s = PRESETS[model]
        config = LlamaConfig(
            vocab_size=s.vocab or 32000,
            hidden_size=s.hidden,
            intermediate_size=s.ffn,
            num_hidden_layers=s.layers,
            num_attention_heads=s.heads,
            num_key_value_heads=s.kv_heads,
            head_dim=s.head_dim,
            max_position_embeddings=1 << 20,
            tie_word_embeddings=False,
        )
        return config, s
    path = Path(model)
    file = path / "config.json" if path.is_dir() else path
    if path.is_dir() and not file.is_file():
        raise DataError(f"--model {model}: the folder holds no config.json")
    if not file.is_file():
        raise DataError(f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config file or folder")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"model config {file} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"model config {file} is not a JSON object but a {type(data).__name__}")
    kind = data.pop("model_type", None)
    if kind is None:
        raise DataError(
            f'model config {file} has no model_type (e.g. "model_type": "llama"): '
            "step calibration times the architecture the config names and does not guess one"
        )
    if not isinstance(kind, str) or kind not in CONFIG_MAPPING:
        raise DataError(f"model config {file}: model_type {kind!r} is not an architecture transformers knows")
    try:
        config = AutoConfig.for_model(kind, **data)
    except Exception as exc:  # transformers' config errors share no base class (ValueError, TypeError, its own)
        raise DataError(f"model config {file}: transformers refuses it: {_one_line(exc)}") from None
    name = path.parent.resolve().name if path.name == "config.json" else path.stem if path.is_file() else path.name
    return config, shape_of(config, name or "custom")


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line, at most 300 characters."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def shape_of(config: Any, name: str = "custom") -> ModelShape:
    """The :class:`ModelShape` of a decoder-only ``transformers`` config (Llama-like field names).

    Raises:
        DataError: a config without one of the fields (named), e.g. ``intermediate_size``.
    """
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [f for f in fields if getattr(config, f, None) is None]
    if missing:
        raise DataError(
            f"model config {name!r} ({type(config).__name__}) lacks {', '.join(missing)}: "
            "step calibration needs a Llama-like decoder config"
        )
    heads = config.num_attention_heads
    return ModelShape(
        name=name,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        ffn=config.intermediate_size,
        vocab=config.vocab_size,
        head_dim=getattr(config, "head_dim", None) or 0,
    )


def _compute_only_attention(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    ringpack_schedule: Any = None,
    ringpack_transport: Any = None,
    ringpack_backend: str = "auto",
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers' attention function of the timed model: ringpack's engine, remote K/V from memory."""
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    scale = q.shape[-1] ** -0.5 if scaling is None else float(scaling)
    out = ContextParallelAttention.apply(
        q, k, v, ringpack_schedule, lambda _: ringpack_transport, scale, ringpack_backend, None
    )
    return out.unsqueeze(0), None


class ModelStepTimer:
    """Times one rank shard's forward + loss + backward through a randomly initialised causal LM."""

    def __init__(self, config: StepCalibrationConfig) -> None:
        import torch
        from transformers import AttentionInterface, AutoModelForCausalLM

        self.device = torch.device(config.device)
        dtype = config.dtype or ("bf16" if self.device.type == "cuda" else "fp32")
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        hf_config, self.shape = model_config(config.model)
        s = self.shape
        check_cpu_budget(config, s)  # before the model is built: its weights, then the attention's memory
        self.heads = AttentionShape(s.heads, s.kv_heads, s.head_dim)
        probe = torch.empty(1, s.heads, s.head_dim, device=self.device, dtype=self.dtype)
        self.backend = resolve_backend(config.backend, probe)
        hf_config.attention_dropout = 0.0
        AttentionInterface.register(ATTENTION_NAME, _compute_only_attention)
        torch.manual_seed(config.seed)
        try:
            model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=ATTENTION_NAME, dtype=self.dtype)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # not a causal LM transformers can build
            raise DataError(
                f"--model {config.model}: transformers cannot build a causal LM of it: {_one_line(exc)}"
            ) from None
        self.model = model.to(self.device)
        if config.grad_ckpt:
            self.model.gradient_checkpointing_enable()
        self.model.train()
        self.clock = Clock(self.device, queued=False)
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.reps, self.warmup = config.reps, config.warmup

    def __call__(self, case: Case) -> float:
        """Median seconds of the shard's forward + summed loss + backward."""
        import torch

        schedule = compiled_schedule(case).to(self.device)
        transport = compute_only_transport(schedule, self.heads, self.dtype, self.generator)
        positions = torch.cat([torch.arange(p.start, p.stop) for p in case.pieces]).to(self.device)
        vocab = self.model.config.vocab_size
        ids = torch.randint(0, vocab, (2, positions.numel()), device=self.device, generator=self.generator)

        def step() -> None:
            logits = self.model(
                input_ids=ids[0][None],
                position_ids=positions[None],
                ringpack_schedule=schedule,
                ringpack_transport=transport,
                ringpack_backend=self.backend,
                use_cache=False,
            ).logits
            (causal_lm_loss_sum(logits[0], ids[1]) / positions.numel()).backward()

        return float(np.median(self.clock.measure(step, self.warmup, self.reps)))


# ------------------------------------------------------------------------------------- the fit


def calibrate_step(
    config: StepCalibrationConfig,
    time_shard: Callable[[Case], float] | None = None,
    *,
    progress: Progress | None = None,
) -> StepCalibration:
    """Time the training step on rank shards of planned micro-batches, fit the profile, check it held out.

    Args:
        config: what is timed.
        time_shard: seconds of one rank shard's forward+backward (default: :class:`ModelStepTimer`
            of ``config``; tests pass a deterministic one).
        progress: counts the shards timed, fit and held out, of a total known before the first
            (a bar, or log lines with the time left).

    Returns:
        The :class:`StepCalibration`; ``profile.name`` is the model preset's (or the config's name).

    Raises:
        ValueError: a bad config, or (on a GPU) timings the fit cannot use: fewer than five usable
            shards, a token or pair price of zero (the shards did not tell them apart), or a fit
            error above 20% RMS. A CPU dry run logs a warning instead and returns the fit.
    """
    started = time.perf_counter()
    timer = time_shard or ModelStepTimer(config)
    shape = getattr(timer, "shape", None) or (PRESETS.get(config.model) or model_config(config.model)[1])
    log.info("timing %s on %s at %d tokens per rank", shape.name, config.device, config.tokens_per_rank)
    prior = CostModel.from_shape(shape)
    seeds = [config.seed + k for k in range(config.fit_mixes)]
    held_seeds = [config.seed + _HELD_OUT_SEED + k for k in range(config.held_out_mixes)]
    if time_shard is None and config.device == "cuda":  # first launches, autotuning and GPU clocks
        timer(step_cases(config, seeds[0], prior)[0])
    rows, geometry = [], []
    sets = [
        (which, [c for seed in mix_seeds for c in step_cases(config, seed, prior)])
        for which, mix_seeds in (("fit", seeds), ("held-out", held_seeds))
    ]
    bar = progress if progress is not None else Progress("", "shards", enabled=False)
    bar.advance_to(0, sum(len(cases) for _, cases in sets))
    for which, cases in sets:
        t0 = time.perf_counter()
        rows += _time_cases(cases, timer, which, geometry, bar)
        log.info("timed %d %s rank shards in %.1f s", len(cases), which, time.perf_counter() - t0)
    unusable = int((~usable_rows(_fit_rows(rows))).sum())
    if unusable:
        log.warning(
            "%d of %d shard timings are not a usable time (0, negative or not finite): the fit and the held-out "
            "check leave them out",
            unusable,
            len(rows),
        )
    fit = fit_rank_times(_fit_rows([r for r in rows if r["set"] == "fit"]), prior)
    _check_fit(fit, config)
    profile = dataclasses.replace(fit.model, name=shape.name)
    held = held_out_errors(profile, [r for r in rows if r["set"] == "held-out"])
    meta = _meta(config, timer, shape, time.perf_counter() - started)
    return StepCalibration(profile, fit, held, rows, geometry, meta)


def _check_fit(fit: FitResult | None, config: StepCalibrationConfig) -> None:
    """Refuse (warn, on a CPU dry run) a fit the planner must not use; see :func:`calibrate_step`."""
    if fit is None:
        raise ValueError("the step timings cannot be fitted: fewer than five usable shards, or no token or pair signal")
    problem = fit_problem(fit, MAX_FIT_ERROR)
    if problem is None:
        return
    advice = "time larger shards (--tokens-per-rank), more mixes (--fit-mixes) or more repetitions (--reps)"
    if config.device == "cpu":
        log.warning("%s; a dry run keeps it, a GPU run would refuse it: %s", problem, advice)
        return
    raise ValueError(f"{problem}: {advice}")


def _time_cases(
    cases: Sequence[Case], timer: Callable[[Case], float], which: str, geometry: list[dict[str, Any]], bar: Progress
) -> list[dict[str, Any]]:
    """One row per case; ranks of one micro-batch share its ``microbatch`` index into ``geometry``."""
    index: dict[int, int] = {}
    rows = []
    for case in cases:
        if id(case.microbatch) not in index:
            index[id(case.microbatch)] = len(geometry)
            geometry.append(microbatch_geometry(case))
        feats, _ = microbatch_features(case.microbatch)
        tokens, pairs, pieces = (int(x) for x in feats[case.rank])
        rows.append(
            dict(
                set=which,
                label=case.label,
                family=case.family,
                microbatch=index[id(case.microbatch)],
                rank=case.rank,
                tokens=tokens,
                pairs=pairs,
                pieces=pieces,
                seconds=float(timer(case)),
            )
        )
        bar.update()
    return rows


def _fit_rows(rows: Sequence[dict[str, Any]]) -> np.ndarray:
    """The learner's observation rows (:data:`~ringpack.cost_fit.ROW`): each shard alone."""
    out = np.zeros((len(rows), len(ROW)))
    for i, r in enumerate(rows):
        out[i] = (0, 0, r["microbatch"], r["rank"], r["tokens"], r["pairs"], r["pieces"], 0, r["seconds"])
    return out


def held_out_errors(profile: CostModel, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Relative errors of ``profile`` on timed rows: per shard, and per micro-batch (its slowest rank).

    Rows of a micro-batch with a time a fit could not use (:func:`usable_rows`: 0, negative, not
    finite) are left out, as the fit leaves them out.

    Returns:
        ``shard_mean``, ``shard_max``, ``microbatch_mean``, ``microbatch_max`` (absolute relative
        errors) and ``shards``, ``microbatches`` (counts); NaN errors without rows.
    """
    bad = {r["microbatch"] for r, ok in zip(rows, usable_rows(_fit_rows(rows))) if not ok}
    rows = [r for r in rows if r["microbatch"] not in bad]
    if not rows:
        nan = float("nan")
        return dict(shard_mean=nan, shard_max=nan, microbatch_mean=nan, microbatch_max=nan, shards=0, microbatches=0)
    feats = np.array([(r["tokens"], r["pairs"], r["pieces"]) for r in rows], dtype=np.float64)
    measured = np.array([r["seconds"] for r in rows])
    predicted = profile.cost(*feats.T) + profile.microbatch
    groups = np.array([r["microbatch"] for r in rows])
    keys = np.unique(groups)
    mb_measured = np.array([measured[groups == k].max() for k in keys])
    mb_predicted = np.array([predicted[groups == k].max() for k in keys])
    shard = np.abs(predicted / measured - 1)
    micro = np.abs(mb_predicted / mb_measured - 1)
    return dict(
        shard_mean=float(shard.mean()),
        shard_max=float(shard.max()),
        microbatch_mean=float(micro.mean()),
        microbatch_max=float(micro.max()),
        shards=len(rows),
        microbatches=len(keys),
    )


def _meta(config: StepCalibrationConfig, timer: Any, shape: ModelShape, wall_s: float) -> dict[str, Any]:
    meta = dict(
        config=dataclasses.asdict(config),
        shape=dataclasses.asdict(shape),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_s=wall_s,
    )
    if isinstance(timer, ModelStepTimer):
        import torch

        meta.update(
            device=device_name(timer.device),
            backend=timer.backend,
            dtype=str(timer.dtype).replace("torch.", ""),
            torch=torch.__version__,
        )
    return meta


# ------------------------------------------------------------------------------------- predictions


def predicted_busy(step: Step, model: CostModel) -> np.ndarray:
    """Each GPU's forward+backward seconds (or cost units) for one plan step, as a training loop measures it.

    A micro-batch whose samples all stay on their ranks runs each rank at its own pace; one with a
    sample split over ranks runs every rank at its slowest rank's pace (they exchange K/V every
    layer). Every rank pays ``model.microbatch`` per micro-batch.

    Args:
        step: a plan step (``step.microbatches[d]`` are DP rank ``d``'s micro-batches).
        model: the cost model (a profile in seconds, for times).

    Returns:
        float64 ``[dp, cp]``: DP rank ``d``, CP rank ``c``'s busy time in the step.
    """
    dp = len(step.microbatches)
    cp = max((len(mb.shards) for rank in step.microbatches for mb in rank), default=1)
    busy = np.zeros((dp, cp))
    for d, microbatches in enumerate(step.microbatches):
        for mb in microbatches:
            feats, coupled = microbatch_features(mb)
            cost = model.cost(*feats.T)
            busy[d, : len(cost)] += (np.full_like(cost, cost.max()) if coupled else cost) + model.microbatch
    return busy


# ------------------------------------------------------------------------------------- summary


def format_step_summary(result: StepCalibration) -> str:
    """A few lines: the fitted prices, the fit's error and the held-out errors."""
    p, f, h = result.profile, result.fit, result.held_out
    ratio = p.token / p.pair if p.pair else float("inf")
    dry_run = result.meta.get("device", result.meta.get("config", {}).get("device")) == "cpu"
    return "\n".join(
        ([DRY_RUN_NOTE] if dry_run else [])
        + [
            f"step profile of {p.name}: {p.token * 1e6:.3f} us/token, {p.pair * 1e12:.3f} ps/pair "
            f"(a token costs {ratio:,.0f} pairs), {p.segment * 1e6:.1f} us/piece, "
            f"{p.microbatch * 1e3:.2f} ms/micro-batch",
            f"fit on {f.used} shards ({f.dropped} outliers dropped): rms error {f.rms_error:.1%}, "
            f"largest {f.max_error:.1%}",
            f"held out: {h['shards']} shards, mean error {h['shard_mean']:.1%}, largest {h['shard_max']:.1%}; "
            f"{h['microbatches']} micro-batches (slowest rank), mean {h['microbatch_mean']:.1%}, "
            f"largest {h['microbatch_max']:.1%}",
        ]
    )
