"""``ringpack simulate``: plan an epoch for a cluster this machine is not, and predict its speed (docs/analysis.md).

For a cluster shape (``dp x cp`` GPUs), a length distribution and a model, every strategy plans the
full epoch as :func:`~ringpack.planner.make_plan` would; every step is priced with the planner's
cost code (:mod:`ringpack.analysis.metrics`) and timed under the communication model
(:mod:`ringpack.comm_model`, ring and all-gather), with the peers of
:mod:`ringpack.analysis.peers` on the same chunks. Output: the report document ``ringpack
report`` writes (predicted tokens/s, epoch time, idle fraction, K/V bytes and padding per strategy).

Scale: the epoch is planned in chunks of ``chunk_steps`` global batches (the planner's shuffle
first, so chunks are random windows of the epoch, exactly as ``make_plan`` would cut them); a
chunk's steps are packed once per packing for every strategy that uses it, zigzag and contiguous
are measured from the packing without plan objects, and workers return only per-rank arrays, so
memory does not grow with the CP size and a 1M-sample epoch for 8,192 GPUs takes about a minute.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack._checks import is_finite, is_int
from ringpack._hints import option
from ringpack._spawn import run_tasks
from ringpack.analysis.metrics import PlanMetrics, concat_metrics, plan_label
from ringpack.analysis.packed import PackedSteps, evaluate_packed
from ringpack.analysis.peers import join_peer_parts, time_peer, try_measure_peer
from ringpack.analysis.report import StrategyResult, _fmt_count, _fmt_seconds, build_report, text_table, timed
from ringpack.comm_model import CommModel, ExchangeInputs, exchange_inputs, needs_piece_table
from ringpack.data.corpus import stdlib_corpus
from ringpack.errors import PlanError
from ringpack.lengths import check_lengths
from ringpack.planner.epoch import (
    as_lengths,
    global_batches,
    overflow_documents,
    pack_step,
    shuffle_order,
    split_microbatches,
)
from ringpack.planner.limits import check_split_size
from ringpack.progress import Progress, clock
from ringpack.shard_plan import PlanConfig, plan_content_hash

logger = logging.getLogger("ringpack.progress")

__all__ = ["simulate", "measure_variants", "synthetic_lengths", "window_chunk_steps", "SIM_VARIANTS", "MAX_LENGTH"]

#: :func:`measure_variants` plans fewer samples than this in process by default: they take less
#: time than starting workers and sending them the lengths.
PARALLEL_MIN_SAMPLES = 20_000

#: CPU seconds planning and measuring one sample for one strategy takes on one core at CP 8; it
#: grows as ``cp ** 1.5`` (the balanced split's fallbacks): docs/analysis.md's table of 1M samples
#: for 8,192 GPUs, 66 CPU s at CP 8 and 1,570 at CP 64. What :func:`simulate` says up front.
SECONDS_PER_SAMPLE_ROW = 8e-6
#: A run expected to plan longer than this says so, with the estimate, before it starts.
ANNOUNCE_S = 30.0

#: Longest sample :func:`synthetic_lengths` draws: far beyond any context, exact in int64 pair counts.
MAX_LENGTH = 1 << 40

#: What :func:`~ringpack.analysis.packed.evaluate_packed` is told for a CP group over several nodes:
#: no strategy it cuts itself, so every strategy is measured through the planner's node-by-node split.
NODE_SPLIT = "node by node"

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


@dataclass(frozen=True)
class _Task:
    """One worker task: a chunk of the epoch planned with one packing for the variants that share it, or a peer.

    ``rows`` are the report rows it fills: ``(row, strategy)`` of every variant with
    ``config.packing``, or ``((row, peer),)`` for a peer.
    """

    chunk: int
    where: str  # what the samples are, in messages ("" for all of them)
    lengths: np.ndarray
    config: PlanConfig
    rows: tuple[tuple[int, str], ...]
    peer: bool = False
    hashes: bool = False  # also each plan's content hash (report)
    exchanges: tuple[CommModel, ...] = ()  # also each plan's exchange inputs for these models (by mode)

    @property
    def weight(self) -> float:
        """Rough work, to start the longest tasks first: the balanced split dominates, a peer is light."""
        if self.peer:
            return 0.3 * self.lengths.size
        strategies = {strategy for _, strategy in self.rows}
        return self.lengths.size * (1.0 + 3.0 * ("balanced" in strategies) + 0.5 * len(strategies))

    def describe(self) -> str:
        what = self.rows[0][1] if self.peer else f"{self.config.packing} packing"
        return f"planning {self.where or 'the samples'} ({self.lengths.size:,} samples) for {what}"

    @property
    def work(self) -> int:
        """What the progress bar counts for the task: samples, once per row."""
        return self.lengths.size * len(self.rows)


def _plan_chunk(task: _Task) -> tuple[list[tuple[int, Any, list, str | None, Any]], float]:
    """Worker: one task's ``(row, metrics, lower bounds, plan hash, exchange inputs)`` per row, and its CPU seconds.

    The plan hash is ``None`` unless ``task.hashes``; the exchange inputs are a dict, by mode, of
    :func:`~ringpack.comm_model.exchange_inputs` under each of ``task.exchanges``. A variant's metrics are its
    :class:`PlanMetrics`, a peer's its
    :class:`~ringpack.analysis.peers.PeerPart` (``None`` if it cannot plan the chunk). The
    variants of a task share one packing of every step (:func:`~ringpack.planner.epoch.pack_step`,
    which the strategy plays no part in); ``zigzag`` and ``contiguous`` are measured from it
    directly (:func:`~ringpack.analysis.packed.evaluate_packed`), ``balanced`` is split by the
    planner. Every figure is the one :func:`make_plan` and :func:`evaluate_plan` give.
    """
    t0 = time.process_time()
    if task.peer:
        ((row, name),) = task.rows
        return [(row, try_measure_peer(name, task.lengths, task.config), [], None, None)], time.process_time() - t0
    config = task.config
    try:
        batches = global_batches(task.lengths, config)
        docs = batches.lengths
        steps = [(ids, *pack_step(s, ids, docs, config)) for s, ids in enumerate(batches.windows)]
    except PlanError as exc:
        if not task.where:
            raise
        raise PlanError(f"{task.where}: {exc}") from None
    bounds = [bound for _, _, _, bound in steps]
    packed = PackedSteps.of([(ids, bins, m) for ids, bins, m, _ in steps], docs, config.dp)
    # a group over several nodes is split node by node, which only the planner's split does
    over_nodes = config.nodes_per_group > 1
    length_list: list[int] = docs.tolist() if over_nodes else []  # read by per-micro-batch splits only
    out = []
    for row, strategy in task.rows:
        cfg = dataclasses.replace(config, strategy=strategy)
        metrics, table = evaluate_packed(
            packed,
            NODE_SPLIT if over_nodes else strategy,
            cp=cfg.cp,
            tokens_per_rank=cfg.tokens_per_rank,
            model=cfg.cost,
            name=plan_label(cfg),
            split=lambda groups, cfg=cfg: split_microbatches(groups, docs, cfg, length_list),
            with_table=task.hashes or bool(task.exchanges),
        )
        digest = None if not task.hashes else plan_content_hash(cfg, docs, batches.dropped, batches.origins, table)
        inputs = {comm.mode: exchange_inputs(table, cfg.cp, packed.grid, comm) for comm in task.exchanges}
        out.append((row, metrics, bounds, digest, inputs))
    return out, time.process_time() - t0


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
    sample_steps: int = 0,
) -> dict[str, Any]:
    """Plan an epoch of ``lengths`` for every variant of ``config`` and return the report document.

    Args:
        lengths: int64 ``[N]`` sample lengths of the epoch.
        config: the plan config; ``samples_per_step`` must be set (a global batch). Each variant
            replaces its ``strategy`` and ``packing``.
        variants: ``(strategy, packing)`` pairs to plan.
        comms: communication models; the first is the headline (its times fill each plan's
            summary), every model's totals land in ``plan["modes"]`` (default: ring and
            all-gather for ``config.cost``). A ``"p2p"`` or hybrid model is timed from each chunk's
            exchange inputs (:func:`~ringpack.comm_model.exchange_inputs`), the peers under it
            with the ring they run.
        chunk_steps: global batches planned per worker task; with ``config.batch_window``, a
            multiple of ``batch_window + 1`` (the window moves samples within blocks of that many
            steps, so a chunk holds whole blocks; :func:`window_chunk_steps` rounds up to one).
        jobs: worker processes (``None``: one per core, at most one per task; ``1``: in process).
        progress: show a progress bar.
        baseline: the plan the others are compared with (default: the report's).
        peers: other systems to run on the same chunks (:data:`ringpack.analysis.peers.PEERS`),
            reported in ``doc["peers"]``; a peer's delay queues span one chunk.
        sample_steps: ``0`` plans the whole epoch; ``N > 0`` plans about ``N`` of its global
            batches, whole chunks drawn at random (:func:`sample_chunks`: the same ones for the same
            lengths, config and ``chunk_steps``), and the epoch's times are estimated from them.

    Returns:
        The report document (:func:`~ringpack.analysis.report.build_report`, ``detail=False``)
        with ``format: "ringpack-simulation"``, a ``planning`` entry (wall and CPU seconds) and a
        ``sample`` entry: the global batches planned of the epoch's, the share of its tokens they
        hold, and whether the epoch's times are an estimate from them (``plan["modes"][mode]
        ["epoch_seconds"]`` is the planned steps' time over that share).

    Raises:
        ValueError: no global batch, no samples or a bad length (:class:`~ringpack.errors.DataError`,
            naming the sample), every sample dropped by ``overflow="drop"``, ``chunk_steps`` or
            ``jobs`` below 1, ``chunk_steps`` not a multiple of ``batch_window + 1``, no variants,
            or samples longer than a CP group with ``overflow="error"``.
        PlanError: a step whose tokens a fixed ``microbatches_per_rank`` cannot hold (before any
            planning, naming the step), or a chunk the planner cannot plan (naming the chunk).
        WorkerDied: a worker process died (killed, out of memory): one line naming its task, with
            what to change (an ``OSError``).
    """
    given = _checked_lengths(lengths, config, variants, chunk_steps, jobs)
    lengths = overflow_documents(given, config)
    if not lengths.size:  # overflow="drop" left nothing
        raise ValueError(
            f"all {given.size} samples are longer than a CP group holds (cp * tokens_per_rank = "
            f"{config.group_capacity} tokens) and overflow='drop' leaves them out: nothing to simulate "
            "(split them with overflow='split', or give a larger cp or tokens_per_rank)"
        )
    comms = list(
        comms or [CommModel.for_model(config.cost, mode="ring"), CommModel.for_model(config.cost, mode="allgather")]
    )
    # the plans' partner budget: a micro-batch over it runs (and is timed as) the ring under p2p
    comms = [dataclasses.replace(c, max_partners=config.max_partners) for c in comms]
    every = _epoch_chunks(lengths, config, chunk_steps)
    _check_budget(lengths, every, config, chunk_steps)
    partial = every[-1].size != config.samples_per_step * chunk_steps
    picked = sample_chunks(len(every), chunk_steps, sample_steps, config.seed, config.epoch, last_partial=partial)
    chunks = [every[c] for c in picked]
    tasks = _tasks(lengths, chunks, config, variants, peers, chunk_steps, numbers=picked)
    # the targeted exchange and the hybrids are timed from each chunk's piece table
    exchanges = tuple(comm for comm in comms if needs_piece_table(comm))
    tasks = [t if t.peer else dataclasses.replace(t, exchanges=exchanges) for t in tasks]
    jobs = min(jobs or os.cpu_count() or 1, len(tasks))
    planned = int(sum(c.size for c in chunks))
    desc = f"planning {planned:,} samples x {len(variants) + len(peers)} strategies"
    hint = (
        f"run with fewer {option('jobs')} (now {jobs}) or a smaller {option('chunk_steps')} (now {chunk_steps}), "
        "or on a machine with more memory"
    )
    expected = expected_seconds(tasks, jobs)
    if progress and expected > ANNOUNCE_S:
        logger.info(
            "%s in %d tasks on %d worker%s: about %s; fewer samples or more %s finish sooner",
            desc,
            len(tasks),
            jobs,
            "s" if jobs > 1 else "",
            clock(expected),
            option("jobs"),
        )
    t0 = time.perf_counter()
    with Progress(desc, "samples", sum(t.work for t in tasks), enabled=progress) as bar:
        parts, busy = _plan_tasks(tasks, jobs, bar, hint)
    wall = time.perf_counter() - t0
    results_by_mode = _timed_results(parts, variants, config, comms, len(chunks))
    peers_by_mode = _timed_peers(parts, len(peers), comms, len(chunks), first=len(variants))
    sample = _sample_entry(lengths, every, picked, results_by_mode[comms[0].mode][0].metrics.num_steps, config)
    doc = build_report(
        results_by_mode[comms[0].mode],
        peers=peers_by_mode[comms[0].mode],
        lengths=lengths,
        baseline=baseline,
        detail=False,
        title=f"ringpack simulation: DP={config.dp} x CP={config.cp} ({config.dp * config.cp:,} GPUs), "
        f"{len(lengths):,} samples"
        + (
            f" (estimate from {sample['global_batches']} of {sample['epoch_global_batches']} global batches)"
            if sample["estimate"]
            else ""
        ),
        extra={
            "sample": sample,
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


def sample_chunks(
    num_chunks: int, chunk_steps: int, sample_steps: int, seed: int, epoch: int, last_partial: bool = False
) -> list[int]:
    """The chunks :func:`simulate` plans: all of them for ``sample_steps=0`` (or when the sample
    would be the whole epoch), else ``ceil(sample_steps / chunk_steps)`` of them drawn at random.

    The draw is :func:`~ringpack.planner.epoch.shuffle_order` of the chunk count keyed with
    ``seed`` and ``epoch``: the same chunks on every run and platform. The epoch's order is shuffled
    already, so every chunk holds random global batches; drawing chunks across the epoch keeps the
    sample from leaning on its first steps. ``last_partial``: the last chunk holds other than
    ``chunk_steps`` global batches (the epoch's tail), and is drawn only when the others are too few.
    Returns the chunk numbers in increasing order.
    """
    if sample_steps < 0:
        raise ValueError(f"sample_steps must be >= 0, got {sample_steps!r}")
    wanted = -(-sample_steps // chunk_steps) if sample_steps else num_chunks
    if wanted >= num_chunks:
        return list(range(num_chunks))
    pool = num_chunks - 1 if last_partial and wanted < num_chunks - 1 else num_chunks
    return sorted(int(c) for c in shuffle_order(pool, seed, epoch)[:wanted])


def _sample_entry(
    lengths: np.ndarray, chunks: list[np.ndarray], picked: list[int], planned_steps: int, config: PlanConfig
) -> dict[str, Any]:
    """``doc["sample"]``: the global batches planned of the epoch's and the share of its tokens they hold."""
    tokens = int(lengths.sum())
    planned_tokens = int(sum(int(lengths[chunks[c]].sum()) for c in picked))
    per_step = config.samples_per_step
    epoch_steps = sum(len(c) // per_step + (len(c) % per_step > 0) for c in chunks) if per_step else 1
    estimate = len(picked) < len(chunks)
    return {
        "estimate": estimate,
        "global_batches": planned_steps,
        "epoch_global_batches": planned_steps if not estimate else epoch_steps,
        "chunks": len(picked),
        "epoch_chunks": len(chunks),
        "samples": int(sum(chunks[c].size for c in picked)),
        "tokens_fraction": planned_tokens / tokens if tokens else 1.0,
        "basis": (
            f"{planned_steps} of about {epoch_steps} global batches planned ({len(picked)} of {len(chunks)} chunks "
            f"drawn at random with seed {config.seed}); epoch times are the planned steps' times over the "
            f"{planned_tokens / tokens:.1%} of the epoch's tokens they hold: an estimate"
            if estimate
            else f"every global batch of the epoch planned ({planned_steps})"
        ),
    }


def sample_line(doc: dict[str, Any]) -> str:
    """One line on what was planned: the whole epoch, or the sample the epoch's times are estimated from."""
    sample = doc.get("sample")
    if not sample:
        return ""
    return ("estimate: " if sample["estimate"] else "") + sample["basis"]


def expected_seconds(tasks: Sequence[_Task], jobs: int) -> float:
    """Rough wall seconds :func:`_plan_tasks` takes: the work shared by ``jobs`` workers, at least the largest task."""
    work = [t.work * SECONDS_PER_SAMPLE_ROW * max(1.0, t.config.cp / 8) ** 1.5 for t in tasks]
    return max(sum(work) / max(jobs, 1), max(work, default=0.0))


def _tasks(
    lengths: np.ndarray,
    chunks: list[np.ndarray],
    config: PlanConfig,
    variants: Sequence[tuple[str, str]],
    peers: Sequence[str],
    chunk_steps: int,
    numbers: Sequence[int] | None = None,
) -> list[_Task]:
    """Per chunk: one task per packing (its variants share the packing), one per peer; the heaviest first.

    Rows number the variants in order, then the peers. ``make_plan`` re-shuffles within a chunk,
    so each chunk's steps are still uniformly random windows of the epoch. ``chunk_steps=0``: the
    chunks are no part of an epoch (messages do not name them). ``numbers``: each chunk's number in
    the epoch, for messages (default its position).
    """
    by_packing: dict[str, list[tuple[int, str]]] = {}
    for row, (strategy, packing) in enumerate(variants):
        by_packing.setdefault(packing, []).append((row, strategy))
    tasks = []
    for c, ids in enumerate(chunks):
        part = lengths[ids]
        n = c if numbers is None else numbers[c]
        where = f"chunk {n} (epoch steps from {n * chunk_steps})" if chunk_steps else ""
        for packing, rows in by_packing.items():
            tasks.append(_Task(c, where, part, dataclasses.replace(config, packing=packing), tuple(rows)))
        for k, name in enumerate(peers):
            tasks.append(_Task(c, where, part, config, ((len(variants) + k, name),), peer=True))
    return sorted(tasks, key=lambda t: -t.weight)


def _check_budget(lengths: np.ndarray, chunks: list[np.ndarray], config: PlanConfig, chunk_steps: int) -> None:
    """Refuse at once a step whose tokens no packing fits in a fixed ``microbatches_per_rank``.

    Planning would fail on it only once its chunk is reached, minutes into a large run.

    Raises:
        PlanError: naming the step of the epoch, its samples and tokens, and what to change.
    """
    m = config.microbatches_per_rank
    if not m:
        return
    room = config.dp * m * config.group_capacity
    for c, ids in enumerate(chunks):
        batches = global_batches(lengths[ids], config)
        for s, window in enumerate(batches.windows):
            tokens = int(batches.lengths[window].sum())
            if tokens > room:
                raise PlanError(
                    f"step {c * chunk_steps + s}: {window.size} samples ({tokens:,} tokens) "
                    f"are more than dp={config.dp} x {m} micro-batches of {config.group_capacity:,} tokens hold; "
                    f"lower the global batch ({option('global_batch_tokens')} or {option('samples_per_step')}) or "
                    f"raise {option('microbatches_per_rank')} or {option('tokens_per_rank')}"
                )


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
    block = config.batch_window + 1
    if config.batch_window and chunk_steps % block:
        raise ValueError(
            f"{option('batch_window', config.batch_window)} moves samples within blocks of {block} global batches, "
            f"and {option('chunk_steps', chunk_steps)} cuts the epoch into chunks that do not hold whole blocks: "
            f"give {option('chunk_steps')} a multiple of {block} (e.g. {window_chunk_steps(chunk_steps, block)})"
        )
    if not variants:
        raise ValueError("simulate needs at least one (strategy, packing) variant")
    for strategy, _ in variants:
        check_split_size(dataclasses.replace(config, strategy=strategy))
    lengths = check_lengths(lengths, what="simulated lengths")
    if not lengths.size:
        raise ValueError("simulate needs at least one sample")
    return lengths


def window_chunk_steps(chunk_steps: int, block: int) -> int:
    """The multiple of ``block`` (a batch window's ``batch_window + 1`` steps) nearest above ``chunk_steps``."""
    return -(-chunk_steps // block) * block


def _epoch_chunks(lengths: np.ndarray, config: PlanConfig, chunk_steps: int) -> list[np.ndarray]:
    """The epoch's shuffled sample ids cut into chunks of ``chunk_steps`` global batches."""
    order = shuffle_order(len(lengths), config.seed, config.epoch)
    return _chunks(order, config.samples_per_step, chunk_steps, config.dp * max(config.microbatches_per_rank, 1))


def _plan_tasks(
    tasks: list[_Task], jobs: int, bar: Progress, hint: str
) -> tuple[dict[int, dict[int, tuple[Any, list, str | None]]], float]:
    """Run :func:`_plan_chunk` on every task (``jobs`` processes); ``parts[row][chunk]`` and CPU seconds.

    ``bar`` counts :attr:`_Task.work`; ``hint`` says what to change when a worker dies.

    Raises:
        WorkerDied: a worker process died (killed, out of memory): one line naming its task and ``hint``.
    """
    parts: dict[int, dict[int, tuple[Any, list, str | None, Any]]] = {}
    busy = 0.0

    def collect(index: int, result: tuple[list[tuple[int, Any, list, str | None, Any]], float]) -> None:
        nonlocal busy
        rows, seconds = result
        task = tasks[index]
        for row, metrics, bounds, digest, inputs in rows:
            parts.setdefault(row, {})[task.chunk] = (metrics, bounds, digest, inputs)
        busy += seconds
        bar.update(task.work)

    run_tasks(_plan_chunk, tasks, jobs, collect, describe=_Task.describe, hint=hint, name="worker")
    return parts, busy


def measure_variants(
    lengths: np.ndarray,
    config: PlanConfig,
    variants: Sequence[tuple[str, str]],
    comm: CommModel,
    *,
    names: Sequence[str] | None = None,
    peers: Sequence[str] = (),
    jobs: int | None = None,
    progress: Progress | None = None,
) -> tuple[list[StrategyResult], list[Any]]:
    """``ringpack report``'s rows of ``lengths``: every variant's plan, exactly :func:`make_plan`'s, and the peers.

    The variants that share a packing share it (one task each, in ``jobs`` worker processes);
    each plan is measured without its objects where its split allows
    (:func:`~ringpack.analysis.packed.evaluate_packed`), with its content hash.

    Args:
        lengths: int64 ``[N]`` sample lengths.
        config: the plan config; each variant replaces its ``strategy`` and ``packing``.
        variants: ``(strategy, packing)`` pairs.
        comm: the communication model of the rows' times.
        names: each variant's row name (default ``strategy/packing``).
        peers: peers of :data:`ringpack.analysis.peers.PEERS`; one that cannot plan the
            data is left out with a warning.
        jobs: worker processes (``None``: one per core, at most one per task, from
            :data:`PARALLEL_MIN_SAMPLES` samples on; ``1``: in process).
        progress: counts samples planned, once per row.

    Returns:
        ``(results, peer rows)``: :class:`~ringpack.analysis.report.StrategyResult` per variant
        (``config`` and ``plan_hash`` set), :class:`~ringpack.analysis.peers.Peer` per peer.

    Raises:
        PlanError: as :func:`make_plan`.
        WorkerDied: a worker process died (killed, out of memory).
    """
    for strategy, _ in variants:
        check_split_size(dataclasses.replace(config, strategy=strategy))
    lengths = as_lengths(lengths)
    # one chunk of every sample in the order given, with no steps before it: make_plan's own steps
    whole = _tasks(lengths, [np.arange(lengths.size)], config, variants, peers, chunk_steps=0)
    planned = dataclasses.replace(comm, max_partners=config.max_partners)  # the plans' partner budget
    exchanges = (planned,) if needs_piece_table(comm) else ()  # timed from each plan's piece table
    tasks = [dataclasses.replace(t, hashes=True, exchanges=() if t.peer else exchanges) for t in whole]
    if jobs is None and lengths.size < PARALLEL_MIN_SAMPLES:
        jobs = 1
    jobs = min(jobs or os.cpu_count() or 1, len(tasks))
    bar = progress if progress is not None else Progress("", "samples", enabled=False)
    bar.advance_to(0, sum(t.work for t in tasks))
    hint = "run on a machine with more memory or plan fewer samples" + (
        f", or run with fewer {option('jobs')} (now {jobs})" if jobs > 1 else ""
    )
    parts, _ = _plan_tasks(tasks, jobs, bar, hint)
    results = []
    for row, (strategy, packing) in enumerate(variants):
        metrics, bounds, digest, inputs = parts[row][0]
        if names is not None:
            metrics = dataclasses.replace(metrics, name=names[row])
        cfg = dataclasses.replace(config, strategy=strategy, packing=packing)
        results.append(timed(metrics, planned, bounds, inputs.get(comm.mode), config=cfg.to_dict(), plan_hash=digest))
    measured = [parts[len(variants) + k][0][0] for k in range(len(peers))]
    return results, [time_peer(part, comm) for part in measured if part is not None]


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
        metrics = concat_metrics([m for m, *_ in ordered], f"{strategy}/{packing}")
        bounds = [b for _, lb, *_ in ordered for b in lb]
        cfg = dataclasses.replace(config, strategy=strategy, packing=packing).to_dict()
        for comm in comms:
            chunks = [inputs.get(comm.mode) for *_, inputs in ordered]
            joined = ExchangeInputs.concat(chunks) if all(c is not None for c in chunks) else None
            results_by_mode[comm.mode].append(timed(metrics, comm, bounds, joined, config=cfg))
    return results_by_mode


def _add_modes(
    doc: dict[str, Any], results_by_mode: dict[str, list[StrategyResult]], peers_by_mode: dict[str, list]
) -> None:
    """Each plan's and peer's headline figures under every communication mode, as ``plan["modes"][mode]``;
    ``epoch_seconds`` is the whole epoch's time (the planned steps' over their share of its tokens)."""
    share = doc.get("sample", {}).get("tokens_fraction", 1.0) or 1.0
    for mode, results in results_by_mode.items():
        other = build_report(results, baseline=doc["baseline"], detail=False, peers=peers_by_mode.get(mode, ()))
        for plan, again in zip([*doc["plans"], *doc["peers"]], [*other["plans"], *other["peers"]]):
            s = again["summary"]
            plan.setdefault("modes", {})[mode] = {
                "comm_model": other["comm_model"]["description"],
                "predicted_seconds": s["predicted_seconds_comm"],
                "epoch_seconds": s["predicted_seconds_comm"] / share,
                "tokens_per_second": s["tokens_per_second_comm"],
                "idle_fraction": s["idle_fraction_comm"],
                "exposed_comm_seconds": s["exposed_comm_seconds"],
                "speedup_vs_baseline": s["speedup_vs_baseline"],
            }


def format_modes(doc: dict[str, Any]) -> str:
    """Per strategy and communication mode: predicted tokens/s, epoch time and idle share.

    The headline mode (the document's communication model) comes first; an epoch estimated from a
    sample of its global batches is marked ``epoch (est.)``.
    """
    modes = list(doc["plans"][0].get("modes", {}))
    estimate = doc.get("sample", {}).get("estimate", False)
    header = ["plan"]
    for mode in modes:
        epoch = "epoch (est.)" if estimate else "epoch"
        header += [f"{mode} tok/s", f"{mode} {epoch}", f"{mode} idle", f"{mode} speedup"]
    rows = []
    for p in [*doc["plans"], *doc.get("peers", [])]:
        row = [p["name"] + (" (peer)" if "description" in p else "") + (" *" if p["name"] == doc["baseline"] else "")]
        for mode in modes:
            m = p["modes"][mode]
            sp = m["speedup_vs_baseline"]
            row += [
                _fmt_count(m["tokens_per_second"]),
                _fmt_seconds(m.get("epoch_seconds", m["predicted_seconds"])),
                f"{100 * m['idle_fraction']:.1f}%",
                "-" if sp is None else f"{sp:.2f}x",
            ]
        rows.append(row)
    return text_table(header, rows)


__all__ += ["format_modes", "sample_chunks", "sample_line"]
