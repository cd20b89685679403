"""``ringpack calibrate``: fit the cost model to measured GPU kernel times (DESIGN.md sections 2 and 6).

The planner balances ``token*tokens + pair*pairs + segment*pieces`` per rank. Calibration replaces
the FLOP-derived coefficients by seconds measured on the GPU that will train, in four steps:

1. **Grid.** Rank shards built to span what plans produce: single samples of 128 to 64K tokens,
   packs of many short samples (64 to 2K, round and odd lengths), long samples split at several
   offsets over 2 CP ranks (so ranks hold suffix pieces: a causal diagonal *plus* full blocks), and
   zigzag splits over 2 and 4 ranks (several pieces per sample, several remote steps), and
   plan-shaped micro-batches (heavy-tailed mixes split by every strategy, seeds 1-2).
2. **Timer.** Each shard runs ringpack's own attention engine (:class:`ContextParallelAttention`
   on its compiled schedule, the chosen kernel backend) forward and backward, timed with CUDA
   events, median of a few repetitions; with ``timer="gpu"`` (default) the repetitions are queued
   behind a GPU sleep, so the events see the GPU's execution and not the host's launch pace. CP ranks are timed one at a time on one GPU: a transport
   without communication serves the remote K/V buffers from memory, so a rank's time is its
   compute (kernels, gathers, log-sum-exp merges); communication is the comm model's business.
   With ``mode="linear"`` (the default) the model's linear layers are timed too: the GEMMs of one
   decoder layer (q/k/v, o, gate/up, down) and the output head, forward (``x @ W``) and backward
   (``dY @ W^T``, ``X^T @ dY``), per token. Norms, activations and RoPE are not timed (they are
   memory-bound and small next to the GEMMs).
3. **Fit.** Non-negative least squares (Lawson-Hanson, numpy only), weighted by ``1 / measured`` so
   every shard counts by its *relative* error, of two models of the per-layer attention time:

   * the **profile model**, ``overhead + ring*[a sample of the micro-batch is split] + token*tokens
     + pair*pairs + segment*pieces``: the planner's three terms plus two constants that are equal
     on every rank of a micro-batch (the engine's fixed cost, and the ring path every rank runs
     once any sample is split), so they never change which rank is slowest. The constants are
     reported (``per_layer``), not put in the profile; ``predicted_s`` includes them.
   * the **kernel model** (:func:`rank_features`), a diagnostic on what the schedule launches:
     varlen calls, ``Bq x Bk`` tiles computed, the varlen *launch grid* (flash kernels launch
     ``ceil(max_seqlen / block)`` tiles for every segment of a call, so a call of many short
     segments and one long one pays ``segments x longest``), remote query rows and K/V rows (gather,
     merge, dK/dV accumulation) and, for hybrid backends, dense (cuDNN) calls and tiles at their own
     rate. The block size is chosen from 64/128 by fit. Its terms are per rank, not per piece,
     so the planner's additive cost cannot hold them; the gap between the two models' held-out
     errors is what per-piece pricing leaves on the table (on the first H200 runs: mostly zigzag
     ranks of many short pieces next to a long one, whose empty launched tiles cost milliseconds).

4. **Evaluation.** Held-out micro-batches (heavy-tailed Pareto mixes, split by ``contiguous``,
   ``zigzag`` and ``balanced`` over 2 CP ranks, with lengths and seeds the grid never saw): every
   rank's measured time against both models' predictions; Pearson correlation, largest and mean
   relative error and how often the slowest rank is predicted right, as a table and in the JSON
   report. ``ringpack calibrate --refit REPORT.json`` redoes steps 3-4 from a stored report's
   measurements without a GPU (the report stores every micro-batch's geometry).

The profile is a :class:`CostModel` in seconds for one forward+backward of the *whole model*
(attention coefficients x layers, plus the linear layers' per-token time in ``token``), saved with
:meth:`CostModel.save`; ``ringpack plan --cost-profile PATH``, ``--model PATH`` of
``report``/``simulate``/``shard`` and ``PlanConfig(cost=CostModel.load(PATH))`` use it. Its name is
the model preset's, because the communication model looks the K/V shape up by that name.

This module is the entry point (:func:`calibrate`, :func:`refit`, the CLI); the steps live in
:mod:`~ringpack.analysis.calibration.cases` (the grid and held-out shards),
:mod:`~ringpack.analysis.calibration.features` (what the models see of a shard),
:mod:`~ringpack.analysis.calibration.timing` (step 2) and :mod:`~ringpack.analysis.calibration.fit`
(steps 3-4). They import only numpy, torch (lazily), the balancer's cost/plan/split and the
attention runtime, so they run on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.analysis.calibration.cases import (
    EVAL_STRATEGIES,
    GRIDS,
    Case,
    cases_from_geometry,
    eval_cases,
    grid_cases,
    rank_cases,
)
from ringpack.analysis.calibration.features import (
    DENSE_BATCHES,
    DENSE_BUCKETS,
    DENSE_THRESHOLD,
    KERNEL_FEATURES,
    LOCAL_REST,
    PROFILE_FEATURES,
    compiled_schedule,
    feature_matrix,
    kernel_features,
    planner_features,
    rank_features,
    schedule_calls,
    segment_pairs,
    segment_tiles,
)
from ringpack.analysis.calibration.fit import Calibration, analyse, fit_nnls, nnls, pearson, quality
from ringpack.analysis.calibration.timing import (
    TIMERS,
    AttentionShape,
    Clock,
    device_name,
    estimate_seconds,
    time_case,
    time_linear,
)
from ringpack.cost import PRESETS, CostModel, ModelShape

# the public surface of calibration, re-exported here
__all__ = [
    "AttentionShape",
    "Case",
    "Calibration",
    "Clock",
    "EVAL_STRATEGIES",
    "GRIDS",
    "KERNEL_FEATURES",
    "analyse",
    "calibrate",
    "compiled_schedule",
    "estimate_seconds",
    "eval_cases",
    "fit_nnls",
    "format_summary",
    "grid_cases",
    "kernel_features",
    "main",
    "nnls",
    "pearson",
    "planner_features",
    "quality",
    "rank_cases",
    "rank_features",
    "refit",
    "run",
    "schedule_calls",
    "segment_pairs",
    "segment_tiles",
    "time_case",
]


def calibrate(
    shape: AttentionShape,
    model: ModelShape | None = None,
    *,
    layers: int = 1,
    mode: str = "linear",
    backend: str = "auto",
    device: str = "cuda",
    dtype=None,
    grid: str = "full",
    reps: int = 5,
    warmup: int = 1,
    seed: int = 0,
    name: str = "calibrated",
    timer: str = "gpu",
    log: Callable[[str], None] = print,
) -> Calibration:
    """Time the grid, fit the per-layer attention model, time the linear layers, evaluate on held-out plans.

    ``mode="linear"`` adds the timed per-token cost of ``model``'s linear layers to the profile's
    token term; ``mode="attention"`` makes an attention-only profile. Returns a :class:`Calibration`
    whose ``profile`` covers ``layers`` layers' forward+backward. ``timer``: ``"gpu"`` (default)
    queues each shard's repetitions behind a GPU sleep so the host's launch time is hidden and
    the GPU's execution time is measured (what a training step that keeps the GPU busy sees);
    ``"wall"`` times from the first launch, host overhead included (the first reports' timer).
    """
    import torch

    from ringpack.attention.kernels import HYBRID_BACKENDS, resolve_backend

    if mode not in ("linear", "attention"):
        raise ValueError(f"mode must be 'linear' or 'attention', got {mode!r}")
    if mode == "linear" and model is None:
        raise ValueError("mode 'linear' needs a model shape for the linear layers' GEMMs")
    if timer not in TIMERS:
        raise ValueError(f"timer must be one of {TIMERS}, got {timer!r}")
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = resolve_backend(backend, torch.empty(1, shape.heads, shape.head_dim, device=device, dtype=dtype))
    clock = Clock(device, queued=timer == "gpu")
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(seed)

    def measure(cases: list[Case], what: str) -> list[tuple[Case, float]]:
        out = []
        t0 = time.perf_counter()
        for case in cases:
            out.append((case, time_case(case, shape, backend, device, dtype, clock, reps, warmup, gen)))
        log(f"  timed {len(cases)} {what} rank shards in {time.perf_counter() - t0:.1f} s")
        return out

    # warm the GPU clocks and the kernels' first launches on a mid-size case
    cases = grid_cases(grid, seed)
    if clock.cuda:
        warm = max(cases, key=lambda c: planner_features(c)[1] if planner_features(c)[1] <= 8192 else 0)
        time_case(warm, shape, backend, device, dtype, clock, reps=3, warmup=2, generator=gen)
    log(
        f"calibrating {backend} attention, {shape.heads} heads / {shape.kv_heads} kv / d={shape.head_dim}, "
        f"{dtype}, on {device_name(device)} (grid {grid}, {len(cases)} shards, timer {clock.kind})"
    )
    grid_timed = measure(cases, "grid")
    hybrid = backend in HYBRID_BACKENDS
    # the profile cuts the held-out micro-batches' balanced splits, so fit it first (same fit as analyse)
    times = np.array([t for _, t in grid_timed])
    coef = fit_nnls(feature_matrix([rank_features(c, hybrid) for c, _ in grid_timed], PROFILE_FEATURES), times)

    linear = dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)
    if mode == "linear":
        gemm_tokens = 8192 if device.type == "cuda" else 16
        linear = time_linear(model, gemm_tokens, device, dtype, clock, reps, warmup)
        log(
            f"  linear layers: {linear['layer_token_s'] * 1e9:.2f} ns/token/layer, head {linear['head_token_s'] * 1e9:.2f} "
            f"ns/token ({linear['gemm_tflops']:.0f} TFLOP/s)"
        )
    cut_with = CostModel(
        token=layers * (coef[2] + linear["layer_token_s"]) + linear["head_token_s"],
        pair=layers * coef[3],
        segment=layers * coef[4],
        unit="s",
        name=name,
    )
    held = measure(eval_cases(grid, cut_with), "held-out")
    meta = dict(
        device=device_name(device),
        backend=backend,
        dtype=str(dtype).replace("torch.", ""),
        torch=torch.__version__,
        grid=grid,
        reps=reps,
        warmup=warmup,
        seed=seed,
        mode=mode,
        timer=clock.kind,
        shape=dataclasses.asdict(shape),
        model=None if model is None else dataclasses.asdict(model),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        wall_s=time.perf_counter() - started,
        local_rest=LOCAL_REST,
        dense_buckets=DENSE_BUCKETS,
        dense_batches=DENSE_BATCHES,
        dense_threshold=DENSE_THRESHOLD,
    )
    return analyse(grid_timed, held, hybrid=hybrid, layers=layers, linear=linear, name=name, meta=meta)


def refit(report: dict[str, Any], log: Callable[[str], None] = print) -> Calibration:
    """Refit a stored calibration report from its measured rows, without a GPU.

    Reports from this version carry the geometry of every micro-batch (``microbatches``). Older
    reports (``tile_model`` instead of ``kernel_model``) do not: their grid and held-out shards are
    rebuilt from ``meta`` (grid, seed; the held-out balanced splits with the report's profile,
    which cut them) and matched to the rows by label, tokens, pairs and pieces; a row without a
    match (the planner changed since) is dropped and listed in ``meta["refit"]["dropped"]``.
    """
    from ringpack.attention.kernels import HYBRID_BACKENDS

    meta = dict(report["meta"])
    rows_g, rows_e = report["grid_rows"], report["eval_rows"]
    dropped: list[str] = []
    if report.get("microbatches"):
        cg = cases_from_geometry(report["microbatches"], rows_g)
        ce = cases_from_geometry(report["microbatches"], rows_e)
        grid = [(c, float(r["measured_s"])) for c, r in zip(cg, rows_g)]
        held = [(c, float(r["measured_s"])) for c, r in zip(ce, rows_e)]
    else:
        grid = _match(rows_g, grid_cases(meta["grid"], int(meta.get("seed", 0))), dropped)
        held = _match(rows_e, eval_cases(meta["grid"], CostModel.from_dict(report["profile"])), dropped)
        if dropped:
            log(
                f"refit: {len(dropped)} stored rows have no matching shard in this version's grid and were dropped: "
                + ", ".join(dropped)
            )
    meta["refit"] = dict(
        source_date=meta.get("date"),
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        dropped=dropped,
        source_format=report.get("version", 1),
    )
    meta.setdefault("timer", "wall")  # reports before version 2 were timed from the first launch
    layers = int(meta.get("layers", 1))
    linear = report.get("linear") or dict(layer_token_s=0.0, head_token_s=0.0, gemm_tflops=0.0, tokens=0)
    name = report["profile"]["name"]
    return analyse(
        grid, held, hybrid=meta.get("backend") in HYBRID_BACKENDS, layers=layers, linear=linear, name=name, meta=meta
    )


def _match(rows: Sequence[dict[str, Any]], cases: Sequence[Case], dropped: list[str]) -> list[tuple[Case, float]]:
    """Pair stored rows with rebuilt shards: same micro-batch label, tokens, pairs and pieces (ranks may be permuted)."""
    pool: dict[tuple, list[Case]] = {}
    for c in cases:
        f = planner_features(c)
        pool.setdefault((c.label.rsplit(" r", 1)[0], int(f[1]), int(f[2]), int(f[3])), []).append(c)
    out = []
    for r in rows:
        hit = pool.get((r["label"].rsplit(" r", 1)[0], int(r["tokens"]), int(r["pairs"]), int(r["pieces"])))
        if hit:
            out.append((hit.pop(0), float(r["measured_s"])))
        else:
            dropped.append(f"{r.get('strategy', r['family'])} {r['label']}")
    return out


# ----------------------------------------------------------------------------------------------- CLI


def run(args: argparse.Namespace) -> int:
    """``ringpack calibrate``: exit 0 with the profile written, 2 when no usable device."""
    import torch

    if getattr(args, "refit", None):
        return _run_refit(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "ringpack calibrate: error: calibration times GPU kernels and needs a CUDA device, and none is visible. "
            "Run it on the training GPU (or `--device cpu --backend reference` for a tiny dry run).",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu" and args.backend not in ("reference", "reference_hybrid", "auto"):
        print(
            f"ringpack calibrate: error: --device cpu runs only --backend reference (a dry run), not {args.backend!r}",
            file=sys.stderr,
        )
        return 2
    if args.model not in PRESETS:
        raise ValueError(f"--model {args.model!r} is not a preset ({', '.join(PRESETS)})")
    preset = PRESETS[args.model]
    shape = AttentionShape(
        args.heads or preset.heads, args.kv_heads or preset.kv_heads, args.head_dim or preset.head_dim
    )
    layers = args.layers or preset.layers
    same = (shape.heads, shape.kv_heads, shape.head_dim) == (preset.heads, preset.kv_heads, preset.head_dim)
    name = preset.name if same else f"{preset.name}-h{shape.heads}kv{shape.kv_heads}d{shape.head_dim}"
    grid = args.grid or ("tiny" if args.device == "cpu" else "quick" if args.quick else "full")
    log = (lambda _: None) if args.quiet else (lambda s: print(s, flush=True))
    result = calibrate(
        shape,
        preset,
        layers=layers,
        mode=args.mode,
        backend=args.backend,
        device=args.device,
        grid=grid,
        reps=args.reps,
        warmup=args.warmup,
        seed=args.seed,
        name=name,
        timer=args.timer,
        log=log,
    )
    _write(result, args)
    return 0


def _run_refit(args: argparse.Namespace) -> int:
    """``ringpack calibrate --refit REPORT``: the fit and the report again from stored measurements (CPU only)."""
    source = Path(args.refit)
    report = json.loads(source.read_text())
    if report.get("format") != "ringpack-calibration":
        raise ValueError(f"{source} is not a ringpack calibration report")
    result = refit(report, log=(lambda _: None) if args.quiet else print)
    out = Path(args.out)
    written = {
        out.resolve(),
        (Path(args.report) if args.report else out.with_name(out.stem + ".report.json")).resolve(),
    }
    if source.resolve() in written:
        raise ValueError("--refit: --out/--report must not overwrite the measured report")
    _write(result, args)
    return 0


def _write(result: Calibration, args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.profile.save(out)
    report = Path(args.report) if args.report else out.with_name(out.stem + ".report.json")
    report.write_text(json.dumps(result.to_dict(), indent=1, default=_json_default) + "\n")
    print(format_summary(result, verbose=not args.quiet))
    print(f"wrote {out} (load with CostModel.load / `ringpack plan --cost-profile {out}`) and {report}")


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}%"


def _pair_tflops(result: Calibration) -> float:
    pair_s = result.per_layer["pair_s"]
    return AttentionShape(**result.meta["shape"]).flops_per_pair() / pair_s / 1e12 if pair_s else float("nan")


def _fit_line(label: str, q: dict[str, Any]) -> str:
    line = f"{label}r={q['r']:.4f}  max error {_pct(q['max_rel_err'])}  mean {_pct(q['mean_rel_err'])}"
    if "slowest_rank_hit" in q:
        line += (
            f"  | slowest rank right in {_pct(q['slowest_rank_hit']).strip()} of {q['microbatches']} micro-batches, "
            f"max/mean off by <= {q['imbalance_err']:.3f}"
        )
    return line


def format_summary(result: Calibration, verbose: bool = True) -> str:
    """The held-out table (one row per CP rank) and the fit-quality lines."""
    lines = []
    if verbose:
        lines.append(
            "held-out rank shards (cp=2), one attention layer forward+backward, compute only "
            f"(timer {result.meta.get('timer', 'wall')}); predicted: profile model, kernel model:"
        )
        lines.append(
            f"{'strategy':10s} {'micro-batch':22s} {'rank':>4s} {'tokens':>7s} {'pieces':>6s} {'pairs':>13s} "
            f"{'measured':>11s} {'profile':>11s} {'error':>7s} {'kernel':>11s} {'error':>7s}"
        )
        for r in result.eval_rows:
            mb = r["label"].rsplit(" r", 1)[0]
            lines.append(
                f"{r['strategy']:10s} {mb:22s} {r['rank']:>4d} {r['tokens']:>7d} {r['pieces']:>6d} {r['pairs']:>13,d} "
                f"{r['measured_s'] * 1e3:>8.3f} ms {r['predicted_s'] * 1e3:>8.3f} ms {100 * r['rel_err']:>+6.1f}% "
                f"{r['kernel_predicted_s'] * 1e3:>8.3f} ms {100 * r['kernel_rel_err']:>+6.1f}%"
            )
    pl, t, h = result.per_layer, result.train, result.held_out
    km, base = result.kernel_model, result.baseline
    kc = km["coef"]
    lines += [
        f"profile model, per layer: {pl['token_s'] * 1e9:.3f} ns/token + {pl['pair_s'] * 1e12:.4f} ps/pair + "
        f"{pl['segment_s'] * 1e6:.2f} us/piece; pairs at {_pair_tflops(result):.0f} TFLOP/s",
        f"  + per micro-batch constants, the same on every rank (not in the profile: they never change which rank is "
        f"slowest): {pl['overhead_s'] * 1e6:.1f} us, + {pl['ring_overhead_s'] * 1e6:.1f} us when a sample is split (ring path)",
        _fit_line(f"  fit      (grid, n={t['n']:3d}):  ", t),
        _fit_line(f"  held-out (n={h['n']:3d}):        ", h),
        "  held-out by strategy: "
        + ", ".join(
            f"{g} max {_pct(q['max_rel_err']).strip()} mean {_pct(q['mean_rel_err']).strip()}"
            for g, q in h.get("by_strategy", {}).items()
        ),
        f"kernel model {km['block'][0]}x{km['block'][1]} tiles (diagnostic, per schedule; not expressible per piece): "
        f"{kc['calls'] * 1e6:.1f} us/call, {kc['tiles'] * 1e6:.3f} us/tile, {kc['grid_q'] * 1e9:.0f}+{kc['grid_k'] * 1e9:.0f} ns "
        f"per launched q/k tile-row, {kc['dense_calls'] * 1e6:.1f} us/dense call, {kc['dense_tiles'] * 1e6:.3f} us/dense tile",
        _fit_line(f"  fit      (grid, n={km['train']['n']:3d}):  ", km["train"]),
        _fit_line(f"  held-out (n={km['held_out']['n']:3d}):        ", km["held_out"]),
        f"pairs-only baseline held-out:   r={base['held_out']['r']:.4f}  max error {_pct(base['held_out']['max_rel_err'])}  "
        f"mean {_pct(base['held_out']['mean_rel_err'])}",
        f"profile ({result.profile.name}, {result.meta['layers']} layers, mode {result.meta.get('mode')}): "
        f"token={result.profile.token:.4g} s, pair={result.profile.pair:.4g} s, segment={result.profile.segment:.4g} s; "
        f"wall {result.meta.get('wall_s', float('nan')):.1f} s",
    ]
    dropped = result.meta.get("refit", {}).get("dropped")
    if dropped:
        lines.append(f"refit: {len(dropped)} stored rows dropped (no matching shard in this version's grid)")
    return "\n".join(lines)
