"""What would help: a plan re-planned with each remedy, ranked by the tokens/s it predicts.

``ringpack report`` adds the result as ``doc["advice"]`` and shows it first. The remedies, each a
change of flags planned on the same samples as the current setting: ``--batch-window 2`` (samples
move up to two global batches), a CP group twice as large on the same GPUs, and twice the samples
per micro-batch (``--tokens-per-rank 2T``). The causes, measured on the current setting's global
batches: the share of steps their longest sample alone bounds, samples per DP rank per step, and
how full the micro-batches are. A large input is re-planned on the first :data:`ADVICE_STEPS`
global batches of the shuffled epoch (at most :data:`ADVICE_SAMPLES` samples), as ``basis`` says.

See docs/analysis.md, "What would help".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ringpack.analysis.report import _fmt_count as _count
from ringpack.analysis.simulate import measure_variants
from ringpack.comm_model import CommModel
from ringpack.errors import PlanError
from ringpack.planner.epoch import global_batches, shuffle_order
from ringpack.shard_plan import PlanConfig

__all__ = ["ADVICE_STEPS", "ADVICE_SAMPLES", "OWN_PLAN", "advise", "LONGEST_BOUND"]

#: The plan a report or simulation of lengths re-plans with each remedy: ringpack's own split and packing.
OWN_PLAN = {"strategy": "balanced", "packing": "balanced"}

#: Global batches re-planned per remedy (a multiple of 3: whole blocks of ``--batch-window 2``).
ADVICE_STEPS = 12
#: Most samples re-planned per remedy (a report of one global batch re-plans this many of it).
ADVICE_SAMPLES = 20_000
#: A step is bound by its longest sample when that sample's cost over its CP group is this much
#: above the step's mean work per GPU.
LONGEST_BOUND = 1.05
#: Fewer samples than this per DP rank per step leave the packer little to balance with.
FEW_SAMPLES = 8
#: Micro-batches fuller than this against the token budget leave the packer little room.
FULL = 0.85


def advise(lengths: Any, config: PlanConfig, comm: CommModel, *, jobs: int | None = 1) -> dict[str, Any]:
    """Re-plan ``config``'s plan of ``lengths`` with each remedy and rank them by predicted tokens/s.

    Args:
        lengths: every sample's tokens (int64 ``[N]``).
        config: the plan config to improve (its strategy and packing are kept).
        comm: the communication model the tokens/s are timed with.
        jobs: worker processes for the re-planning (``1``: in process).

    Returns:
        ``{"basis", "plan", "current", "remedies", "causes", "headline"}`` (``plan``: the
        strategy/packing re-planned): ``current`` and each remedy have
        ``tokens_per_second`` and ``idle_fraction`` (with communication); each remedy also ``flag``
        (the flags to change), ``what`` and ``gain`` (its tokens/s over the current); remedies are
        sorted by gain, highest first, and one that cannot plan the samples has ``gain: None`` and
        a ``note``. ``causes``: ``{"name", "value", "applies", "text"}`` each. ``headline``: one
        line naming the winning flag and its gain, or saying none helps.
    """
    L, basis = _sample(np.asarray(lengths, dtype=np.int64), config)
    variant = [(config.strategy, config.packing)]

    def measure(cfg: PlanConfig) -> dict[str, Any]:
        (result,), _ = measure_variants(L, cfg, variant, comm, jobs=jobs)
        s = result.summary()
        return {"tokens_per_second": s["tokens_per_second_comm"], "idle_fraction": s["idle_fraction_comm"]}

    current = measure(config)
    remedies = []
    for flag, what, cfg in _remedies(config, L):
        row: dict[str, Any] = {"flag": flag, "what": what}
        try:
            row.update(measure(cfg))
            row["gain"] = (
                row["tokens_per_second"] / current["tokens_per_second"] if current["tokens_per_second"] else None
            )
        except (PlanError, ValueError) as exc:
            row.update(tokens_per_second=None, idle_fraction=None, gain=None, note=str(exc).splitlines()[0])
        remedies.append(row)
    remedies.sort(key=lambda r: -(r["gain"] or 0.0))
    causes = _causes(L, config)
    return {
        "basis": basis,
        "plan": f"{config.strategy}/{config.packing}",
        "current": current,
        "remedies": remedies,
        "causes": causes,
        "headline": _headline(current, remedies, causes),
    }


def _sample(lengths: np.ndarray, config: PlanConfig) -> tuple[np.ndarray, str]:
    """The samples every remedy re-plans, in the epoch's shuffled order, and a line saying which."""
    n = lengths.size
    per_step = config.samples_per_step
    take = min(n, ADVICE_SAMPLES, per_step * ADVICE_STEPS if per_step else n)
    if take >= n:
        return lengths, f"every sample re-planned ({n:,}) per remedy"
    order = shuffle_order(n, config.seed, config.epoch)[:take]
    steps = f"the first {take // per_step} global batches" if per_step else "a random part of the one global batch"
    return lengths[np.sort(order)], f"{take:,} of {n:,} samples ({steps} of the shuffled epoch) re-planned per remedy"


def _remedies(config: PlanConfig, L: np.ndarray) -> list[tuple[str, str, PlanConfig]]:
    """``(flags, what it changes, config)`` of every remedy that applies to ``config``."""
    out = []
    steps = -(-L.size // config.samples_per_step) if config.samples_per_step else 1
    if config.batch_window < 2 and steps > 1:
        out.append(
            ("--batch-window 2", "samples may move up to 2 global batches", dataclasses.replace(config, batch_window=2))
        )
    if config.dp % 2 == 0:
        cp = 2 * config.cp
        out.append(
            (
                f"--cp {cp} --dp {config.dp // 2}",
                f"a CP group of {cp} ranks on the same GPUs (or --cp auto --world {config.dp * config.cp})",
                dataclasses.replace(config, cp=cp, dp=config.dp // 2),
            )
        )
    tokens = 2 * config.tokens_per_rank
    more = dataclasses.replace(config, tokens_per_rank=tokens, samples_per_step=2 * config.samples_per_step)
    flag = f"--tokens-per-rank {tokens}" + (
        f" --samples-per-step {2 * config.samples_per_step}" if config.samples_per_step else ""
    )
    out.append((flag, "twice the samples per micro-batch (and per step: a larger global batch)", more))
    return out


def _causes(L: np.ndarray, config: PlanConfig) -> list[dict[str, Any]]:
    """Where the current plan's steps lose time, measured on the re-planned samples' global batches."""
    batches = global_batches(L, config)
    cost, dp, cp = config.cost, config.dp, config.cp
    bound_steps, per_rank, fill = 0, [], []
    windows = list(batches.windows)
    for ids in windows:
        docs = batches.lengths[ids]
        w = cost.sample_cost(docs)
        mean = float(w.sum()) / (dp * cp)
        # the longest sample's cost over its CP group: the least a DP rank holding it takes
        if float(w.max()) / cp > LONGEST_BOUND * mean:
            bound_steps += 1
        per_rank.append(docs.size / dp)
        room = dp * config.group_capacity  # tokens one micro-batch per DP rank holds
        tokens = int(docs.sum())
        fill.append(tokens / (room * max(config.microbatches_per_rank, -(-tokens // room), 1)))
    share = bound_steps / len(windows)
    few = float(np.median(per_rank))
    full = float(np.median(fill))
    return [
        {
            "name": "longest sample",
            "value": share,
            "applies": share > 0.25,
            "text": f"{share:.0%} of steps wait on their longest sample (its cost over its CP group exceeds the "
            "step's mean work per GPU): only moving samples between steps or a larger CP group helps those",
        },
        {
            "name": "few samples per step",
            "value": few,
            "applies": few < FEW_SAMPLES,
            "text": f"{few:.1f} samples per DP rank per step (median): "
            + ("too few to balance" if few < FEW_SAMPLES else "enough to balance"),
        },
        {
            "name": "token budget",
            "value": full,
            "applies": full > FULL,
            "text": f"micro-batches hold {full:.0%} of the token budget (median step): "
            + ("little room to move samples" if full > FULL else "room to move samples"),
        },
    ]


def _headline(current: dict[str, Any], remedies: list[dict[str, Any]], causes: list[dict[str, Any]]) -> str:
    """One line: the flag that wins and by how much (or that none helps), and the main cause."""
    cause = next((c["name"] for c in causes if c["applies"]), None)
    why = f" (cause: {cause})" if cause else ""
    best = remedies[0] if remedies and remedies[0]["gain"] else None
    if best is None or best["gain"] <= 1.0:
        return f"what would help: none of the remedies tried beats the current setting{why}"
    return (
        f"what would help: {best['flag']} predicts {best['gain']:.2f}x the tokens/s "
        f"({_count(best['tokens_per_second'])} against {_count(current['tokens_per_second'])}; idle "
        f"{current['idle_fraction']:.0%} -> {best['idle_fraction']:.0%}){why}"
    )
