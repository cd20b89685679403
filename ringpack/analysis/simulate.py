"""``ringpack simulate``: plan an epoch for a cluster this machine is not, and predict its speed (docs/analysis.md).

For a cluster shape (``dp x cp`` GPUs), a length distribution and a model, every strategy plans the
full epoch with :func:`~ringpack.planner.make_plan`; every step is priced with the planner's cost
code (:mod:`ringpack.analysis.metrics`) and timed under the communication model
(:mod:`ringpack.analysis.comm_model`, ring and all-gather), with the peers of
:mod:`ringpack.analysis.peer_runner` on the same chunks. Output: the report document ``ringpack
report`` writes (predicted tokens/s, epoch time, idle fraction, K/V bytes and padding per strategy).

Scale: the epoch is planned in chunks of ``chunk_steps`` global batches (the planner's shuffle
first, so chunks are random windows of the epoch, exactly as ``make_plan`` would cut them), chunks
run in ``jobs`` worker processes, and each worker returns only its dense per-rank arrays, so memory
stays flat and a 1M-sample epoch is minutes on 2 cores.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import numpy as np

from ringpack._checks import is_finite, is_int
from ringpack._hints import option
from ringpack.analysis.comm_model import CommModel
from ringpack.analysis.metrics import PlanMetrics, concat_metrics, evaluate_plan
from ringpack.analysis.peer_runner import PeerJob, join_peer_parts, time_peer, try_measure_peer
from ringpack.analysis.report import StrategyResult, _fmt_count, _fmt_seconds, build_report, text_table, timed
from ringpack.data.corpus import stdlib_corpus
from ringpack.lengths import check_lengths
from ringpack.planner import make_plan
from ringpack.planner.epoch import expand_overflow, shuffle_order
from ringpack.progress import Progress
from ringpack.shard_plan import PlanConfig

__all__ = ["simulate", "synthetic_lengths", "SIM_VARIANTS", "MAX_LENGTH"]

#: Longest sample :func:`synthetic_lengths` draws: far beyond any context, exact in int64 pair counts.
MAX_LENGTH = 1 << 40

#: What ``simulate`` compares by default: ringpack, zigzag with ringpack's DP packing, the status
#: quo (token first-fit + zigzag) and the naive contiguous split.
SIM_VARIANTS: tuple[tuple[str, str], ...] = (
    ("balanced", "balanced"),
    ("zigzag", "balanced"),
    ("zigzag", "first_fit"),
    ("contiguous", "first_fit"),
)


def synthetic_lengths(
    n: int, source: str = "stdlib", seed: int = 0, median: float = 2048, sigma: float = 1.3, max_len: int | None = None
) -> np.ndarray:
    """``n`` sample lengths: resampled from the standard-library corpus, or log-normal.

    ``source="stdlib"`` draws with replacement from the embedded corpus (a real heavy tail);
    ``"lognormal"`` draws ``median * exp(sigma * N(0, 1))`` tokens, clipped to ``[1, max_len]``.

    Args:
        n: samples to draw, ``>= 0``.
        source: ``"stdlib"`` or ``"lognormal"``.
        seed: the generator's seed.
        median, sigma: the log-normal's median (a finite number ``> 0``) and spread (finite, ``>= 0``).
        max_len: cap on a length (``None``: no cap).

    Returns:
        int64 ``[n]``, every entry in ``[1, max_len]``.

    Raises:
        ValueError: an unknown source, a parameter out of range, or log-normal draws beyond
            :data:`MAX_LENGTH` tokens (lower ``median`` or ``sigma``).
    """
    _check_draw(n, median, sigma, max_len)
    rng = np.random.default_rng(seed)
    if source == "stdlib":
        pool = stdlib_corpus().lengths
        out = rng.choice(pool, size=n)
    elif source == "lognormal":
        with np.errstate(over="ignore"):  # an overflow to inf is refused just below
            draws = np.round(median * np.exp(sigma * rng.standard_normal(n)))
        if draws.size and not draws.max() <= MAX_LENGTH:
            raise ValueError(
                f"log-normal lengths (median {median:g}, sigma {sigma:g}) reach {draws.max():.3g} tokens, "
                f"beyond {MAX_LENGTH}; lower median or sigma"
            )
        out = draws.astype(np.int64)
    else:
        raise ValueError(f"unknown length source {source!r}; use 'stdlib', 'lognormal' or a lengths file")
    out = np.maximum(out, 1)
    if max_len:
        out = np.minimum(out, max_len)
    return out.astype(np.int64)


def _check_draw(n: int, median: float, sigma: float, max_len: int | None) -> None:
    """Refuse (``ValueError``) a sample count, median, sigma or cap of :func:`synthetic_lengths` out of range."""
    if not is_int(n) or not 0 <= n < 2**63:
        raise ValueError(f"samples must be an integer in [0, 2**63), got {n!r}")
    if not (is_finite(median) and median > 0):
        raise ValueError(f"median must be a finite number > 0, got {median!r}")
    if not (is_finite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    if max_len is not None and (not is_int(max_len) or max_len < 1):
        raise ValueError(f"max_len must be None or an integer >= 1, got {max_len!r}")


def _plan_chunk(task: tuple[int, int, np.ndarray, Any]) -> tuple[int, int, Any, list, float]:
    """Worker: plan one chunk of the epoch for one variant or peer; return its metrics and lower bounds.

    A variant's task carries its :class:`PlanConfig`, a peer's a :class:`~ringpack.analysis.peer_runner.PeerJob`;
    a peer's metrics are its :class:`~ringpack.analysis.peer_runner.PeerPart` (``None`` if it cannot plan the chunk).
    """
    variant, chunk, lengths, config = task
    t0 = time.process_time()
    if isinstance(config, PeerJob):
        part = try_measure_peer(config.name, lengths, config.config)
        return variant, chunk, part, [], time.process_time() - t0
    plan = make_plan(lengths, config)
    metrics = evaluate_plan(plan)
    return variant, chunk, metrics, [s.lower_bound for s in plan.steps], time.process_time() - t0


def _chunks(order: np.ndarray, per_step: int, chunk_steps: int, min_samples: int) -> list[np.ndarray]:
    size = per_step * chunk_steps
    chunks = [order[i : i + size] for i in range(0, len(order), size)]
    if len(chunks) > 1 and len(chunks[-1]) < max(per_step, min_samples):
        tail = chunks.pop()
        chunks[-1] = np.concatenate([chunks[-1], tail])
    return chunks


def simulate(
    lengths: np.ndarray,
    config: PlanConfig,
    variants: Sequence[tuple[str, str]] = SIM_VARIANTS,
    comms: Sequence[CommModel] | None = None,
    *,
    chunk_steps: int = 8,
    jobs: int | None = None,
    progress: bool = True,
    baseline: str | None = None,
    peers: Sequence[str] = (),
) -> dict[str, Any]:
    """Plan an epoch of ``lengths`` for every variant of ``config`` and return the report document.

    Args:
        lengths: int64 ``[N]`` sample lengths of the epoch.
        config: the plan config; ``samples_per_step`` must be set (a global batch). Each variant
            replaces its ``strategy`` and ``packing``.
        variants: ``(strategy, packing)`` pairs to plan.
        comms: communication models; the first is the headline (its times fill each plan's
            summary), every model's totals land in ``plan["modes"]`` (default: ring and
            all-gather for ``config.cost``).
        chunk_steps: global batches planned per worker task.
        jobs: worker processes (``None``: one per core, at most one per task; ``1``: in process).
        progress: show a progress bar.
        baseline: the plan the others are compared with (default: the report's).
        peers: other systems to run on the same chunks (:data:`ringpack.analysis.peer_runner.PEERS`),
            reported in ``doc["peers"]``; a peer's delay queues span one chunk.

    Returns:
        The report document (:func:`~ringpack.analysis.report.build_report`, ``detail=False``)
        with ``format: "ringpack-simulation"`` and a ``planning`` entry (wall and CPU seconds).

    Raises:
        ValueError: no global batch, no samples or a bad length (:class:`~ringpack.errors.DataError`,
            naming the sample), ``chunk_steps`` or ``jobs`` below 1, no variants, or samples
            longer than a CP group with ``overflow="error"``.
    """
    lengths = _apply_overflow(_checked_lengths(lengths, config, variants, chunk_steps, jobs), config)
    comms = list(
        comms or [CommModel.for_model(config.cost, mode="ring"), CommModel.for_model(config.cost, mode="allgather")]
    )
    chunks = _epoch_chunks(lengths, config, chunk_steps)
    tasks = []
    for v, (strategy, packing) in enumerate(variants):
        cfg = dataclasses.replace(config, strategy=strategy, packing=packing)
        for c, ids in enumerate(chunks):
            # make_plan re-shuffles within the chunk: still a uniformly random window of the epoch
            tasks.append((v, c, lengths[ids], cfg))
    tasks += _peer_tasks(peers, config, chunks, lengths, first=len(variants))
    jobs = min(jobs or os.cpu_count() or 1, len(tasks))
    desc = f"planning {len(lengths):,} samples x {len(variants) + len(peers)} strategies"
    t0 = time.perf_counter()
    parts, busy = _plan_tasks(tasks, jobs, desc if progress else None)
    wall = time.perf_counter() - t0
    results_by_mode = _timed_results(parts, variants, config, comms, len(chunks))
    peers_by_mode = _timed_peers(parts, len(peers), comms, len(chunks), first=len(variants))
    doc = build_report(
        results_by_mode[comms[0].mode],
        peers=peers_by_mode[comms[0].mode],
        lengths=lengths,
        baseline=baseline,
        detail=False,
        title=f"ringpack simulation: DP={config.dp} x CP={config.cp} ({config.dp * config.cp:,} GPUs), "
        f"{len(lengths):,} samples",
        extra={
            "format": "ringpack-simulation",
            "planning": {
                "wall_seconds": wall,
                "worker_cpu_seconds": busy,
                "jobs": jobs,
                "chunks": len(chunks),
                "chunk_steps": chunk_steps,
            },
        },
    )
    _add_modes(doc, results_by_mode, peers_by_mode)
    return doc


def _peer_tasks(
    peers: Sequence[str], config: PlanConfig, chunks: list[np.ndarray], lengths: np.ndarray, first: int
) -> list[tuple[int, int, np.ndarray, Any]]:
    """One task per peer and chunk, numbered from ``first`` (after the variants)."""
    return [
        (first + k, c, lengths[ids], PeerJob(name, config))
        for k, name in enumerate(peers)
        for c, ids in enumerate(chunks)
    ]


def _timed_peers(
    parts: dict[int, dict[int, tuple[Any, list]]], count: int, comms: Sequence[CommModel], num_chunks: int, first: int
) -> dict[str, list]:
    """Per communication mode, every peer's chunks joined into one report row (in peer order)."""
    peers_by_mode: dict[str, list] = {comm.mode: [] for comm in comms}
    for v in range(first, first + count):
        joined = join_peer_parts([parts[v][c][0] for c in range(num_chunks)])
        for comm in comms if joined is not None else ():  # a chunk the peer cannot plan leaves it out
            peers_by_mode[comm.mode].append(time_peer(joined, comm))
    return peers_by_mode


def _checked_lengths(
    lengths: Any, config: PlanConfig, variants: Sequence[tuple[str, str]], chunk_steps: Any, jobs: Any
) -> np.ndarray:
    """:func:`simulate`'s arguments checked (``ValueError`` naming the bad one); the lengths as int64."""
    if config.samples_per_step <= 0:
        raise ValueError("simulate needs a global batch: set samples_per_step (or --global-batch-tokens)")
    if not is_int(chunk_steps) or chunk_steps < 1 or (jobs is not None and (not is_int(jobs) or jobs < 1)):
        raise ValueError(f"chunk_steps and jobs must be integers >= 1, got {chunk_steps!r} and {jobs!r}")
    if not variants:
        raise ValueError("simulate needs at least one (strategy, packing) variant")
    lengths = check_lengths(lengths, what="simulated lengths")
    if not lengths.size:
        raise ValueError("simulate needs at least one sample")
    return lengths


def _apply_overflow(lengths: np.ndarray, config: PlanConfig) -> np.ndarray:
    """The epoch's samples after ``config.overflow``: over-long ones dropped, cut into documents, or an error."""
    capacity = config.group_capacity
    if not (lengths > capacity).any():
        return lengths
    if config.overflow == "error":
        raise ValueError(
            f"{int((lengths > capacity).sum())} samples exceed one CP group ({capacity} tokens); "
            f"use {option('overflow', 'split')} or {option('overflow', 'drop')}"
        )
    if config.overflow == "drop":
        return lengths[lengths <= capacity]
    return expand_overflow(lengths, capacity)[0]


def _epoch_chunks(lengths: np.ndarray, config: PlanConfig, chunk_steps: int) -> list[np.ndarray]:
    """The epoch's shuffled sample ids cut into chunks of ``chunk_steps`` global batches."""
    order = shuffle_order(len(lengths), config.seed, config.epoch)
    return _chunks(order, config.samples_per_step, chunk_steps, config.dp * max(config.microbatches_per_rank, 1))


def _plan_tasks(
    tasks: list[tuple[int, int, np.ndarray, PlanConfig]], jobs: int, desc: str | None
) -> tuple[dict[int, dict[int, tuple[PlanMetrics, list]]], float]:
    """Run :func:`_plan_chunk` on every task (``jobs`` processes); ``parts[variant][chunk]`` and CPU seconds.

    ``desc``: the progress label (samples planned, over all variants), ``None`` for no progress.
    """
    samples = {(v, c): len(lengths) for v, c, lengths, _ in tasks}
    bar = Progress(desc or "", "samples", sum(samples.values()), enabled=desc is not None)
    parts: dict[int, dict[int, tuple[PlanMetrics, list]]] = {v: {} for v, *_ in tasks}
    busy = 0.0

    def collect(result: tuple[int, int, PlanMetrics, list, float]) -> None:
        nonlocal busy
        v, c, metrics, bounds, seconds = result
        parts[v][c] = (metrics, bounds)
        busy += seconds
        bar.update(samples[v, c])

    if jobs <= 1:
        for task in tasks:
            collect(_plan_chunk(task))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for future in as_completed([pool.submit(_plan_chunk, t) for t in tasks]):
                collect(future.result())
    bar.close()
    return parts, busy


def _timed_results(
    parts: dict[int, dict[int, tuple[PlanMetrics, list]]],
    variants: Sequence[tuple[str, str]],
    config: PlanConfig,
    comms: Sequence[CommModel],
    num_chunks: int,
) -> dict[str, list[StrategyResult]]:
    """Per communication mode, every variant's chunks joined into one result (in variant order)."""
    results_by_mode: dict[str, list[StrategyResult]] = {comm.mode: [] for comm in comms}
    for v, (strategy, packing) in enumerate(variants):
        ordered = [parts[v][c] for c in range(num_chunks)]
        metrics = concat_metrics([m for m, _ in ordered], f"{strategy}/{packing}")
        bounds = [b for _, lb in ordered for b in lb]
        cfg = dataclasses.replace(config, strategy=strategy, packing=packing).to_dict()
        for comm in comms:
            results_by_mode[comm.mode].append(timed(metrics, comm, bounds, config=cfg))
    return results_by_mode


def _add_modes(
    doc: dict[str, Any], results_by_mode: dict[str, list[StrategyResult]], peers_by_mode: dict[str, list]
) -> None:
    """Each plan's and peer's headline figures under every communication mode, as ``plan["modes"][mode]``."""
    for mode, results in results_by_mode.items():
        other = build_report(results, baseline=doc["baseline"], detail=False, peers=peers_by_mode.get(mode, ()))
        for plan, again in zip([*doc["plans"], *doc["peers"]], [*other["plans"], *other["peers"]]):
            s = again["summary"]
            plan.setdefault("modes", {})[mode] = {
                "comm_model": other["comm_model"]["description"],
                "predicted_seconds": s["predicted_seconds_comm"],
                "tokens_per_second": s["tokens_per_second_comm"],
                "idle_fraction": s["idle_fraction_comm"],
                "exposed_comm_seconds": s["exposed_comm_seconds"],
                "speedup_vs_baseline": s["speedup_vs_baseline"],
            }


def format_modes(doc: dict[str, Any]) -> str:
    """Per strategy and communication mode: predicted tokens/s, epoch time and idle share."""
    modes = list(doc["plans"][0].get("modes", {}))
    header = ["plan"]
    for mode in modes:
        header += [f"{mode} tok/s", f"{mode} epoch", f"{mode} idle", f"{mode} speedup"]
    rows = []
    for p in [*doc["plans"], *doc.get("peers", [])]:
        row = [p["name"] + (" (peer)" if "description" in p else "") + (" *" if p["name"] == doc["baseline"] else "")]
        for mode in modes:
            m = p["modes"][mode]
            sp = m["speedup_vs_baseline"]
            row += [
                _fmt_count(m["tokens_per_second"]),
                _fmt_seconds(m["predicted_seconds"]),
                f"{100 * m['idle_fraction']:.1f}%",
                "-" if sp is None else f"{sp:.2f}x",
            ]
        rows.append(row)
    return text_table(header, rows)


__all__ += ["format_modes"]
