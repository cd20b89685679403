"""``ringpack calibrate`` (the kernel scope): fit the cost model to measured GPU kernel times.

Times ringpack's own attention engine forward and backward (the chosen kernel backend) on a grid
of rank shards, one CP rank at a time on one GPU, plus the linear layers' GEMMs per token; fits the
planner's ``token``, ``pair`` and ``segment`` prices (and, as a diagnostic, a per-rank kernel model)
by non-negative least squares; and checks both on held-out micro-batches. The profile is a
:class:`CostModel` in seconds for one forward + backward of the whole model.

Entry points: :func:`calibrate_kernels` (from a :class:`KernelCalibrationConfig`),
:func:`calibrate`, :func:`refit_file` (``--refit``: the fit again from a stored report, no GPU)
and :func:`save_calibration`. The steps live in :mod:`~ringpack.calibration.cases` (grid
and held-out shards), :mod:`~ringpack.calibration.features`,
:mod:`~ringpack.calibration.timing` and :mod:`~ringpack.calibration.fit`.

See docs/analysis.md, "`ringpack calibrate`", and docs/cost-model.md, "Calibrated profiles".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._hints import option
from ringpack.attention.kernels import HYBRID_BACKENDS, resolve_backend
from ringpack.calibration.cases import (
    Case,
    cases_from_geometry,
    eval_cases,
    grid_cases,
)
from ringpack.calibration.config import (
    AttentionShape,
    CalibrationSettings,
    KernelCalibrationConfig,
    backend_field,
    device_field,
)
from ringpack.calibration.features import (
    EngineSettings,
    planner_features,
    rank_features,
)
from ringpack.calibration.fit import (
    REPORT_VERSION,
    Calibration,
    analyse,
    fit_profile,
    profile_model,
)
from ringpack.calibration.timing import (
    Clock,
    TimingSetup,
    device_name,
    time_case,
    time_linear,
)
from ringpack.cost import PRESETS, CostModel, ModelShape
from ringpack.errors import DataError

# the public surface of calibration, re-exported here

logger = logging.getLogger("ringpack.calibrate")
__all__ = [
    "CalibrationSettings",
    "DRY_RUN_NOTE",
    "KernelCalibrationConfig",
    "backend_field",
    "calibrate",
    "calibrate_kernels",
    "check_outputs",
    "device_field",
    "flop_rate",
    "format_summary",
    "quality_line",
    "refit",
    "refit_file",
    "report_path",
    "save_calibration",
    "with_fit_quality",
]


def _no_linear() -> dict[str, Any]:
    """The linear-layer timings of an attention-only profile."""
    return dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)


def calibrate(
    shape: AttentionShape,
    model: ModelShape | None = None,
    settings: CalibrationSettings = CalibrationSettings(),
    log: Callable[[str], None] = print,
) -> Calibration:
    """Time the grid, fit the per-layer attention model, time the linear layers, evaluate on held-out plans.

    Args:
        shape: the attention heads timed.
        model: the model whose linear layers are timed (needed with ``settings.mode == "linear"``).
        settings: what is timed and how.
        log: receives one progress line per stage.

    Returns:
        The :class:`Calibration`; its ``profile`` covers ``settings.layers`` layers' forward+backward.

    Raises:
        ValueError: ``mode="linear"`` without a model, or timings without signal.
    """
    if settings.mode == "linear" and model is None:
        raise ValueError("mode 'linear' needs a model shape for the linear layers' GEMMs")
    setup = _timing_setup(shape, settings)
    started = time.perf_counter()
    cases = grid_cases(settings.grid, settings.seed)
    if setup.clock.cuda:  # warm the GPU clocks and the kernels' first launches on a mid-size case
        warm = max(cases, key=lambda c: planner_features(c)[1] if planner_features(c)[1] <= 8192 else 0)
        time_case(warm, dataclasses.replace(setup, reps=3, warmup=2))
    log(
        f"calibrating {setup.backend} attention, {shape.heads} heads / {shape.kv_heads} kv / d={shape.head_dim}, "
        f"{setup.dtype}, on {device_name(setup.device)} (grid {settings.grid}, {len(cases)} shards, "
        f"timer {setup.clock.kind})"
    )
    grid_timed = _measure(cases, setup, "grid", log)
    hybrid = setup.backend in HYBRID_BACKENDS
    # the profile cuts the held-out micro-batches' balanced splits, so fit it first (the fit analyse makes)
    per_layer = fit_profile([rank_features(c, hybrid) for c, _ in grid_timed], np.array([t for _, t in grid_timed]))
    linear = _no_linear() if settings.mode != "linear" else _time_linear_layers(model, setup, log)
    cut_with = profile_model(per_layer, settings.layers, linear, settings.name)
    held = _measure(eval_cases(settings.grid, cut_with), setup, "held-out", log)
    meta = _run_meta(settings, setup, model, wall_s=time.perf_counter() - started)
    return analyse(
        grid_timed, held, hybrid=hybrid, layers=settings.layers, linear=linear, name=settings.name, meta=meta
    )


def _timing_setup(shape: AttentionShape, settings: CalibrationSettings) -> TimingSetup:
    """The device, dtype, resolved backend, clock and input generator ``settings`` ask for."""
    import torch

    device = torch.device(settings.device)
    dtype = settings.dtype
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    probe = torch.empty(1, shape.heads, shape.head_dim, device=device, dtype=dtype)
    return TimingSetup(
        shape=shape,
        backend=resolve_backend(settings.backend, probe),
        device=device,
        dtype=dtype,
        clock=settings.clock or Clock(device, queued=settings.timer == "gpu"),
        reps=settings.reps,
        warmup=settings.warmup,
        generator=torch.Generator(device=device).manual_seed(settings.seed),
    )


def _measure(cases: list[Case], setup: TimingSetup, what: str, log: Callable[[str], None]) -> list[tuple[Case, float]]:
    t0 = time.perf_counter()
    out = [(case, time_case(case, setup)) for case in cases]
    log(f"  timed {len(cases)} {what} rank shards in {time.perf_counter() - t0:.1f} s")
    return out


def _time_linear_layers(model: ModelShape, setup: TimingSetup, log: Callable[[str], None]) -> dict[str, Any]:
    linear = time_linear(model, 8192 if setup.device.type == "cuda" else 16, setup)
    log(
        f"  linear layers: {linear['layer_token_s'] * 1e9:.2f} ns/token/layer, "
        f"head {linear['head_token_s'] * 1e9:.2f} ns/token ({flop_rate(linear['gemm_tflops'] * 1e12)})"
    )
    return linear


def _run_meta(
    settings: CalibrationSettings, setup: TimingSetup, model: ModelShape | None, wall_s: float
) -> dict[str, Any]:
    """What a report records about its run: device, software, settings and the engine's schedule settings."""
    import torch

    return dict(
        device=device_name(setup.device),
        backend=setup.backend,
        dtype=str(setup.dtype).replace("torch.", ""),
        torch=torch.__version__,
        grid=settings.grid,
        reps=settings.reps,
        warmup=settings.warmup,
        seed=settings.seed,
        mode=settings.mode,
        timer=setup.clock.kind,
        shape=dataclasses.asdict(setup.shape),
        model=None if model is None else dataclasses.asdict(model),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_s=wall_s,
        **dataclasses.asdict(EngineSettings()),
    )


def refit(report: dict[str, Any]) -> Calibration:
    """Refit a stored calibration report from its measured rows, without a GPU.

    Args:
        report: a calibration report (:meth:`Calibration.to_dict`, as JSON) of the current format
            version, which stores every timed micro-batch's geometry.

    Returns:
        The :class:`Calibration` of today's fit on the stored measurements; ``meta["refit"]``
        records the source report's date and the refit's.

    Raises:
        ValueError: a report of another format version.
    """
    version = report.get("version", 1)
    if version != REPORT_VERSION:
        raise ValueError(
            f"calibration report version {version} cannot be refitted: only version {REPORT_VERSION} reports store "
            "the micro-batch geometry a refit needs (run ringpack calibrate again)"
        )
    if not report.get("microbatches"):
        raise ValueError("calibration report has no 'microbatches' (the geometry a refit needs): it is incomplete")
    meta = dict(report["meta"])
    rows_g, rows_e = report["grid_rows"], report["eval_rows"]
    grid = [(c, float(r["measured_s"])) for c, r in zip(cases_from_geometry(report["microbatches"], rows_g), rows_g)]
    held = [(c, float(r["measured_s"])) for c, r in zip(cases_from_geometry(report["microbatches"], rows_e), rows_e)]
    meta["refit"] = dict(source_date=meta.get("date"), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    meta.setdefault("timer", "wall")  # a report that records no timer was timed from the first launch
    return analyse(
        grid,
        held,
        hybrid=meta.get("backend") in HYBRID_BACKENDS,
        layers=int(meta.get("layers", 1)),
        linear=report.get("linear") or _no_linear(),
        name=report["profile"]["name"],
        meta=meta,
    )


# ------------------------------------------------------------------------------- from a config, to files


def calibrate_kernels(
    config: KernelCalibrationConfig, *, clock: Clock | None = None, log: Callable[[str], None] = print
) -> Calibration:
    """Time and fit the kernels of ``config``'s preset (:func:`calibrate` with the settings the config resolves to).

    Args:
        config: what is timed.
        clock: times the repetitions in place of the device's clock (:attr:`CalibrationSettings.clock`).
        log: receives one progress line per stage.

    Returns:
        The :class:`Calibration` (save it with :func:`save_calibration`).

    Raises:
        ValueError: timings without signal (see :func:`calibrate`).
    """
    return calibrate(config.attention_shape(), PRESETS[config.model], config.settings(clock), log=log)


def refit_file(path: str | Path) -> Calibration:
    """:func:`refit` of the calibration report stored at ``path``.

    Raises:
        DataError: not JSON, not a calibration report, or one that cannot be refitted (the file named).
        FileNotFoundError: no file at ``path``.
    """
    source = Path(path)
    try:
        report = json.loads(source.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise DataError(f"{option('refit')} {source} is not JSON: {exc}") from exc
    if not isinstance(report, dict) or report.get("format") != "ringpack-calibration":
        raise DataError(f"{source} is not a ringpack calibration report")
    try:
        return refit(report)
    except ValueError as exc:
        raise DataError(f"{source}: {exc}") from exc
    except (KeyError, TypeError, IndexError) as exc:  # a report of the right format with parts missing
        raise DataError(
            f"{source}: calibration report is incomplete or malformed ({type(exc).__name__}: {exc})"
        ) from exc


def report_path(out: str | Path, report: str | Path | None = None) -> Path:
    """Where a calibration's report goes: ``report``, or the profile ``out``'s name with ``.report.json``."""
    out = Path(out)
    return Path(report) if report else out.with_name(out.stem + ".report.json")


def with_fit_quality(result: Any, scope: str) -> CostModel:
    """``result``'s profile carrying how well it predicted its held-out shards (:func:`fit_quality`);
    ``scope``: ``"kernels"`` (a :class:`Calibration`) or ``"step"`` (a step calibration)."""
    h, device = result.held_out, result.meta.get("device", result.meta.get("config", {}).get("device"))
    if scope == "step":
        quality = fit_quality("step", device, h["shard_max"], h["shard_mean"], h["shards"])
    else:
        quality = fit_quality("kernels", device, h["max_rel_err"], h["mean_rel_err"], h["n"])
    return dataclasses.replace(result.profile, fit_quality=quality)


#: The first line of a CPU dry run's summary.
DRY_RUN_NOTE = "CPU dry run: the pipeline is checked, the timings say nothing about a GPU"


def fit_quality(scope: str, device: str | None, max_error: float, mean_error: float, shards: int) -> dict[str, Any]:
    """The ``fit_quality`` a profile carries (:class:`~ringpack.cost.CostModel`): the calibration's
    ``scope``, the ``device`` timed (``"cpu"`` for a dry run) and the held-out relative errors
    (``None`` where there were no held-out shards)."""

    def finite(x: float) -> float | None:
        return float(x) if np.isfinite(x) else None

    return dict(
        scope=scope,
        device=device,
        held_out_max_error=finite(max_error),
        held_out_mean_error=finite(mean_error),
        held_out_shards=int(shards),
    )


def quality_line(profile: CostModel) -> str:
    """One line on a profile's held-out errors and, when it has one, why it should not be trusted."""
    q = profile.fit_quality or {}
    worst, mean = q.get("held_out_max_error"), q.get("held_out_mean_error")
    errors = "no held-out shards" if worst is None else f"held-out error mean {mean:.1%}, largest {worst:.1%}"
    problem = profile.fit_problem()
    return f"profile {profile.name}: {errors} over {q.get('held_out_shards', 0)} shards" + (
        f"; {problem}" if problem else ""
    )


def flop_rate(flops_per_second: float) -> str:
    """``5.2e14`` -> ``"520 TFLOP/s"``, ``3.1e9`` -> ``"3.1 GFLOP/s"``: a rate readable on a GPU and on a CPU."""
    if not np.isfinite(flops_per_second) or flops_per_second <= 0:
        return "no FLOP rate"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if flops_per_second >= scale:
            value = flops_per_second / scale
            return f"{value:.0f} {prefix}FLOP/s" if value >= 10 else f"{value:.1f} {prefix}FLOP/s"
    return f"{flops_per_second:.0f} FLOP/s"


def check_outputs(out: str | Path, report: str | Path | None = None, refit: str | Path | None = None) -> None:
    """Refuse, before any timing or fit, a profile ``out`` / ``report`` that cannot be written, that are one file,
    or that would replace ``refit``'s report.

    Raises:
        ValueError: a directory, a missing folder, a path through a file, an unwritable file or
            folder, ``report`` equal to ``out``, or either equal to ``refit`` (the option is named).
    """
    out, report = Path(out), report_path(out, report)
    for name, path in (("out", out), ("report", report)):
        if path.is_dir():
            raise ValueError(f"{option(name)} {path} is a directory; give a file name")
        if path.exists():
            if not path.is_file() or not os.access(path, os.W_OK):
                raise ValueError(f"{option(name)} {path} cannot be written (not a writable file)")
            continue
        folder = nearest = path.parent
        while not nearest.exists():  # the nearest existing folder says why the path cannot be made
            nearest = nearest.parent
        if not nearest.is_dir():
            raise ValueError(f"{option(name)} {path}: {nearest} is a file, not a folder")
        if nearest != folder:
            raise ValueError(f"{option(name)} {path}: folder {folder} does not exist")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{option(name)} {path}: folder {folder} is not writable")
    if out.resolve() == report.resolve():
        raise ValueError(f"{option('report')} {report} is the {option('out')} profile; give the report its own file")
    if refit and Path(refit).resolve() in (out.resolve(), report.resolve()):
        raise ValueError(
            f"{option('refit')}: {option('out')}/{option('report')} must not overwrite the measured report"
        )


def save_calibration(
    result: Any, out: str | Path, report: str | Path | None = None, profile: CostModel | None = None
) -> tuple[Path, Path]:
    """Write a calibration's profile to ``out`` and its report beside it (:func:`report_path`).

    Args:
        result: a :class:`Calibration` or a step calibration (anything with ``profile`` and ``to_dict()``).
        out, report: the profile's path and the report's (``None``: beside the profile).
        profile: the profile to write instead of ``result.profile`` (:func:`with_fit_quality`'s).

    Returns:
        ``(profile path, report path)``; missing folders are made.
    """
    out, path = Path(out), report_path(out, report)
    for folder in (out.parent, path.parent):
        folder.mkdir(parents=True, exist_ok=True)
    (profile or result.profile).save(out)
    path.write_text(json.dumps(result.to_dict(), indent=1, default=_json_default) + "\n")
    return out, path


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _pair_rate(result: Calibration) -> str:
    pair_s = result.per_layer["pair_s"]
    return flop_rate(AttentionShape(**result.meta["shape"]).flops_per_pair() / pair_s if pair_s else float("nan"))


def _fit_line(label: str, q: dict[str, Any]) -> str:
    line = f"{label}r={q['r']:.4f}  max error {_pct(q['max_rel_err'])}  mean {_pct(q['mean_rel_err'])}"
    if "slowest_rank_hit" in q:
        line += (
            f"  | slowest rank right in {_pct(q['slowest_rank_hit']).strip()} of {q['microbatches']} micro-batches, "
            f"max/mean off by <= {q['imbalance_err']:.3f}"
        )
    return line


def format_summary(result: Calibration) -> str:
    """The held-out table (one row per CP rank) and the fit-quality lines; a CPU dry run says it is one first."""
    lines = [DRY_RUN_NOTE] if result.meta.get("device") == "cpu" else []
    return "\n".join(lines + _held_out_table(result) + _profile_lines(result) + _kernel_and_baseline_lines(result))


def _held_out_table(result: Calibration) -> list[str]:
    lines = [
        "held-out rank shards (cp=2), one attention layer forward+backward, compute only "
        f"(timer {result.meta.get('timer', 'wall')}); predicted: profile model, kernel model:",
        f"{'strategy':10s} {'micro-batch':22s} {'rank':>4s} {'tokens':>7s} {'pieces':>6s} {'pairs':>13s} "
        f"{'measured':>11s} {'profile':>11s} {'error':>7s} {'kernel':>11s} {'error':>7s}",
    ]
    for r in result.eval_rows:
        mb = r["label"].rsplit(" r", 1)[0]
        lines.append(
            f"{r['strategy']:10s} {mb:22s} {r['rank']:>4d} {r['tokens']:>7d} {r['pieces']:>6d} {r['pairs']:>13,d} "
            f"{r['measured_s'] * 1e3:>8.3f} ms {r['predicted_s'] * 1e3:>8.3f} ms {100 * r['rel_err']:>+6.1f}% "
            f"{r['kernel_predicted_s'] * 1e3:>8.3f} ms {100 * r['kernel_rel_err']:>+6.1f}%"
        )
    return lines


def _profile_lines(result: Calibration) -> list[str]:
    pl, t, h = result.per_layer, result.train, result.held_out
    return [
        f"profile model, per layer: {pl['token_s'] * 1e9:.3f} ns/token + {pl['pair_s'] * 1e12:.4f} ps/pair + "
        f"{pl['segment_s'] * 1e6:.2f} us/piece; pairs at {_pair_rate(result)}",
        "  + per micro-batch constants, the same on every rank (not in the profile: they never change which rank is "
        f"slowest): {pl['overhead_s'] * 1e6:.1f} us, + {pl['ring_overhead_s'] * 1e6:.1f} us "
        "when a sample is split (ring path)",
        _fit_line(f"  fit      (grid, n={t['n']:3d}):  ", t),
        _fit_line(f"  held-out (n={h['n']:3d}):        ", h),
        "  held-out by strategy: "
        + ", ".join(
            f"{g} max {_pct(q['max_rel_err']).strip()} mean {_pct(q['mean_rel_err']).strip()}"
            for g, q in h.get("by_strategy", {}).items()
        ),
    ]


def _kernel_and_baseline_lines(result: Calibration) -> list[str]:
    km, base, profile = result.kernel_model, result.baseline, result.profile
    kc = km["coef"]
    return [
        f"kernel model {km['block'][0]}x{km['block'][1]} tiles (diagnostic, per schedule; not expressible per piece): "
        f"{kc['calls'] * 1e6:.1f} us/call, {kc['tiles'] * 1e6:.3f} us/tile, "
        f"{kc['grid_q'] * 1e9:.0f}+{kc['grid_k'] * 1e9:.0f} ns per launched q/k tile-row, "
        f"{kc['dense_calls'] * 1e6:.1f} us/dense call, {kc['dense_tiles'] * 1e6:.3f} us/dense tile",
        _fit_line(f"  fit      (grid, n={km['train']['n']:3d}):  ", km["train"]),
        _fit_line(f"  held-out (n={km['held_out']['n']:3d}):        ", km["held_out"]),
        f"pairs-only baseline held-out:   r={base['held_out']['r']:.4f}  "
        f"max error {_pct(base['held_out']['max_rel_err'])}  mean {_pct(base['held_out']['mean_rel_err'])}",
        f"profile ({profile.name}, {result.meta['layers']} layers, mode {result.meta.get('mode')}): "
        f"token={profile.token:.4g} s, pair={profile.pair:.4g} s, segment={profile.segment:.4g} s; "
        f"wall {result.meta.get('wall_s', float('nan')):.1f} s",
    ]
