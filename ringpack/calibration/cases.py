"""The rank shards ``ringpack calibrate`` times: the fitting grid and the held-out micro-batches.

A :class:`Case` is one CP rank of a micro-batch. The grid spans what plans produce (single
samples, packs, split long samples, zigzag splits, plan-shaped micro-batches); the held-out
cases are Pareto mixes with seeds the grid never sees, so the fit is judged on shapes it did not
fit. A report stores every micro-batch's geometry (:func:`microbatch_geometry`), so a stored
calibration can be refitted without a GPU (:func:`cases_from_geometry`).

numpy and the balancer only: no torch, so the cases can be built and inspected anywhere.

See docs/analysis.md, "`ringpack calibrate`".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringpack.cost import CostModel
from ringpack.planner.split import split_balanced, split_contiguous, split_zigzag
from ringpack.shard_plan import MicroBatch, Piece, microbatch_from_shards

GRIDS = ("full", "quick", "tiny")
EVAL_STRATEGIES = ("contiguous", "zigzag", "balanced")


@dataclass(frozen=True)
class Case:
    """One timed rank shard: CP rank ``rank`` of ``microbatch`` (sample ``s`` has ``lengths[s]`` tokens)."""

    family: str
    label: str
    microbatch: MicroBatch
    rank: int
    lengths: tuple[int, ...]

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return self.microbatch.shards[self.rank].pieces


def _whole(family: str, lengths: Sequence[int], label: str) -> list[Case]:
    lengths = tuple(int(x) for x in lengths)
    samples = list(range(len(lengths)))
    mb = microbatch_from_shards(samples, [[Piece(s, 0, n) for s, n in enumerate(lengths)]], lengths)
    return [Case(family, label, mb, 0, lengths)]


def rank_cases(family: str, mb: MicroBatch, lengths: Sequence[int], label: str) -> list[Case]:
    """One case per CP rank of ``mb`` that holds any piece, labelled ``"{label} r{rank}"``."""
    lengths = tuple(int(x) for x in lengths)
    return [Case(family, f"{label} r{r}", mb, r, lengths) for r in range(len(mb.shards)) if mb.shards[r].pieces]


def _cut(length: int, cut: int) -> list[Case]:
    mb = microbatch_from_shards([0], [[Piece(0, 0, cut)], [Piece(0, cut, length)]], [length])
    return rank_cases("split", mb, [length], f"L={length} cut={cut}")


def _uniform_pack(rng: np.random.Generator, total: int, low: int, high: int) -> list[int]:
    out, used = [], 0
    while used < total:
        n = min(int(rng.integers(low, high + 1)), total - used)
        out.append(n)
        used += n
    return out


def pareto_mix(total: int, seed: int, scale: int = 128, alpha: float = 1.1) -> list[int]:
    """Heavy-tailed lengths filling exactly ``total`` tokens (``benchmarks/attention.py``'s mix)."""
    rng = np.random.default_rng(seed)
    cap = max(total // 2, 1)
    out, used = [], 0
    while used < total:
        n = min(int(min(cap, scale * (1 + rng.pareto(alpha)))), total - used)
        out.append(n)
        used += n
    return out


_GRID_SPEC: dict[str, dict[str, Any]] = {
    "full": dict(
        singles=(128, 512, 1000, 2048, 3000, 4096, 6000, 8192, 12000, 16384, 24000, 32768, 49152, 65536),
        packs=((64, 128, 256, 512, 1024, 2048), (4096, 16384, 32768)),
        odd_packs=((100, 300, 700, 1500), 16384),
        random_packs=((8192, 16384, 32768), 2),
        long_short=((4096, 16384), 32768),
        splits=((4096, 16384, 32768), (0.25, 0.5, 0.75)),
        zigzag=(([8192], [32768], [12000, 3000, 700]), 2),
        zigzag4=[32768],
        plans=((16384, 32768, 65536), (1, 2), 2, 1.0),
        eval=((16384, 32768, 65536), (101, 102, 103), 2, 1.0),
    ),
    "quick": dict(
        singles=(128, 1000, 2048, 4096, 8192, 16384, 32768),
        packs=((64, 256, 1024, 2048), (4096, 16384)),
        odd_packs=((300,), 8192),
        random_packs=((8192, 16384), 1),
        long_short=((4096,), 16384),
        splits=((4096, 16384), (0.25, 0.5)),
        zigzag=(([8192], [4000, 3000, 700]), 2),
        zigzag4=[16384],
        plans=((16384, 32768), (1,), 2, 1.0),
        eval=((16384, 32768), (101,), 2, 1.0),
    ),
    "tiny": dict(  # CPU dry run with the reference backend: O(T^2) memory, so a few hundred tokens
        singles=(16, 256),
        packs=((8,), (128,)),
        odd_packs=((13,), 128),
        random_packs=((256,), 1),
        long_short=((96,), 256),
        splits=((256,), (0.5,)),
        zigzag=(([200],), 2),
        zigzag4=[],
        plans=((), (), 2, 1 / 16),
        eval=((256,), (101,), 2, 1 / 16),
    ),
}


def grid_cases(grid: str = "full", seed: int = 0) -> list[Case]:
    """The rank shards timed for the fit (see :mod:`ringpack.calibration.run`'s docstring)."""
    if grid not in _GRID_SPEC:
        raise ValueError(f"unknown grid {grid!r}; choose one of {GRIDS}")
    spec = _GRID_SPEC[grid]
    rng = np.random.default_rng(seed)
    cases: list[Case] = []
    for n in spec["singles"]:
        cases += _whole("single", [n], f"L={n}")
    sizes, totals = spec["packs"]
    for size in sizes:
        for total in totals:
            cases += _whole("pack", [size] * (total // size), f"{total // size}x{size}")
    sizes, total = spec["odd_packs"]
    for size in sizes:
        cases += _whole("pack", [size] * (total // size), f"{total // size}x{size}")
    totals, draws = spec["random_packs"]
    low, high = (64, 2048) if grid != "tiny" else (4, 64)
    for total in totals:
        for d in range(draws):
            lengths = _uniform_pack(rng, total, low, high)
            cases += _whole("pack", lengths, f"uniform {low}-{high} T={total} #{d}")
    longs, total = spec["long_short"]
    for long in longs:
        lengths = [long] + _uniform_pack(rng, total - long, low, high)
        cases += _whole("mix", lengths, f"{long}+{len(lengths) - 1} short")
    lengths_, fractions = spec["splits"]
    for length in lengths_:
        cuts = sorted({int(length * f) for f in fractions} | {length // 2 + max(1, length // 200)})
        for cut in cuts:
            cases += _cut(length, cut)
    mixes, cp = spec["zigzag"]
    for lengths in mixes:
        mb = split_zigzag(list(range(len(lengths))), lengths, cp)
        cases += rank_cases("zigzag", mb, lengths, f"zigzag cp={cp} {'+'.join(map(str, lengths))}")
    for length in spec["zigzag4"]:
        mb = split_zigzag([0], [length], 4)
        cases += rank_cases("zigzag", mb, [length], f"zigzag cp=4 L={length}")
    for case in _plan_cases(spec["plans"], CostModel.preset("llama3-8b")):
        cases.append(dataclasses.replace(case, family="plan", label=f"{case.family} {case.label}"))
    return cases


def eval_cases(grid: str, cost: CostModel) -> list[Case]:
    """Held-out rank shards: Pareto mixes split by every strategy over 2 CP ranks (``balanced`` with ``cost``).

    The grid holds the same kind of micro-batches (``plan`` family) with other seeds: what plans
    produce is what the fit must get right, and these seeds are never seen by it.
    """
    return _plan_cases(_GRID_SPEC[grid]["eval"], cost)


def _plan_cases(spec: tuple, cost: CostModel) -> list[Case]:
    totals, seeds, cp, scale = spec
    cases = []
    for total in totals:
        for seed in seeds:
            lengths = pareto_mix(total, seed, scale=max(1, int(128 * scale)))
            samples = list(range(len(lengths)))
            for strategy in EVAL_STRATEGIES:
                if strategy == "balanced":
                    budget = int(-(-total // cp) * 1.125)
                    mb = split_balanced(samples, lengths, cp, budget, cost)
                elif strategy == "zigzag":
                    mb = split_zigzag(samples, lengths, cp)
                else:
                    mb = split_contiguous(samples, lengths, cp)
                cases += rank_cases(strategy, mb, lengths, f"T={total} seed={seed}")
    return cases


def microbatch_geometry(case: Case) -> dict[str, Any]:
    """The case's micro-batch as JSON (sample lengths, each shard's ``[sample, start, stop]`` pieces)."""
    return dict(
        lengths=[int(x) for x in case.lengths],
        shards=[[[int(p.sample), int(p.start), int(p.stop)] for p in shard.pieces] for shard in case.microbatch.shards],
    )


def cases_from_geometry(mbs: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[Case]:
    """Rebuild the cases of stored ``rows`` (``row["microbatch"]`` indexes ``mbs``), one micro-batch object per index.

    Ranks of one micro-batch share its object, as when they were timed: the fit's slowest-rank
    statistics group rows by it.
    """
    built = {}
    out = []
    for row in rows:
        k = int(row["microbatch"])
        if k not in built:
            g = mbs[k]
            lengths = tuple(int(x) for x in g["lengths"])
            built[k] = (
                microbatch_from_shards(
                    list(range(len(lengths))), [[Piece(*p) for p in shard] for shard in g["shards"]], lengths
                ),
                lengths,
            )
        mb, lengths = built[k]
        out.append(Case(row["family"], row["label"], mb, int(row["rank"]), lengths))
    return out
