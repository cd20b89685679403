"""``ringpack demo`` (= ``make demo``): the embedded default corpus through every strategy, with the report.

Runs anywhere Python runs (the corpus is the interpreter's own standard library):

1. corpus lengths (one document per ``.py`` file, regex token counts, or ``--tokenizer``);
2. plans for every CP strategy x packing with the balancer (``make_plan``), DP=4 x CP=4 by default;
3. the imbalance report: terminal table, ``report.json``, PNG plots, ``report.html`` / ``report.md``
   in the output folder (``demo-out/``);
4. on a machine without a GPU, a check that the ring runtime on 2 CPU processes (gloo) gives the
   same attention outputs and gradients as single-process attention on one planned micro-batch.

See docs/analysis.md, "`ringpack demo`".
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.analysis import plots, ringcheck
from ringpack.analysis.demo_config import DEMO_PLAN, DemoConfig
from ringpack.analysis.report import (
    DEFAULT_VARIANTS,
    build_report,
    format_ranks,
    format_table,
    result_of_plan,
    write_report,
)
from ringpack.comm_model import CommModel
from ringpack.data.corpus import stdlib_corpus
from ringpack.planner import make_plan
from ringpack.progress import Progress

__all__ = ["DEMO_PLAN", "DemoConfig", "run_demo"]

#: Progress-bar stages besides planning: corpus, report, the four plots.
_FIXED_STAGES = 1 + 1 + 4


def run_demo(config: DemoConfig = DemoConfig(), *, progress: bool = True) -> int:
    """The demo: plan the corpus with every variant, write the report, run the ring check, print it all.

    Args:
        config: what is planned and where the report goes.
        progress: a bar of the demo's stages on stderr.

    Returns:
        0, or 1 when the ring check finds a mismatch.

    Raises:
        PlanError: a config the planner refuses (named).
    """

    t0 = time.perf_counter()
    check = config.ring_check
    bar = _progress_bar(progress, total=_FIXED_STAGES + len(DEFAULT_VARIANTS) + int(check))

    bar.set_description("corpus: tokenizing the stdlib")
    corpus = stdlib_corpus(tokenizer=config.tokenizer)
    lengths = corpus.lengths
    if config.quick:  # a seeded subset: same pipeline, a few seconds
        lengths = lengths[np.random.default_rng(config.plan.seed).permutation(lengths.size)[:300]]
    bar.update(1)

    doc = _plan_and_report(config, lengths, corpus, bar)
    step = plots.default_rank_step(doc)
    bar.update(1)
    paths = write_report(doc, Path(config.out), rank_step=step, progress=_PlotProgress(bar))

    ring, ring_note = None, ""
    if check:
        bar.set_description("ring check: 2 CPU processes")
        ring, ring_note = _ring_check(corpus.lengths, config.plan.seed)
        bar.update(1)
    bar.close()

    _print_results(config, doc, corpus, lengths.size, step)
    _print_ring_check(ring, ring_note)
    out = Path(config.out)
    print(f"\nwrote {out}/: " + ", ".join(p.name for p in paths.values()))
    print(f"open {out / 'report.html'} for the report with its plots; done in {time.perf_counter() - t0:.1f} s")
    return 0 if ring is None or ring.ok else 1


def _progress_bar(show: bool, total: int) -> Any:
    """The demo's stages: a bar on a terminal, a plain log line now and then elsewhere (:class:`Progress`)."""
    return Progress("demo", "stages", total, enabled=show)


class _PlotProgress:
    """What ``write_report`` ticks once per plot: the demo's bar, described as the plotting stage."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int) -> None:
        self.bar.set_description("plots: rendering PNGs")
        self.bar.update(n)


def _plan_and_report(config: DemoConfig, lengths: np.ndarray, corpus: Any, bar: Any) -> dict[str, Any]:
    """Plan ``lengths`` with every default variant and build the report document."""

    model = config.cost_model()
    plan_config = dataclasses.replace(config.plan, samples_per_step=config.samples_per_step_of(lengths), cost=model)
    comm = CommModel.for_model(model, link=config.link)
    results = []
    for strategy, packing in DEFAULT_VARIANTS:
        bar.set_description(f"plan: {strategy}/{packing}")
        plan = make_plan(lengths, dataclasses.replace(plan_config, strategy=strategy, packing=packing))
        results.append(result_of_plan(plan, comm))
        bar.update(1)

    bar.set_description("report: exact costs per rank")
    return build_report(
        results,
        lengths=lengths,
        title="ringpack demo: the standard-library corpus, every strategy",
        extra={"corpus": {"root": str(corpus.root), "counter": corpus.counter, "quick": bool(config.quick)}},
    )


def _print_results(config: DemoConfig, doc: dict[str, Any], corpus: Any, samples: int, step: int) -> None:
    """The corpus and planning lines, the summary table and the per-GPU grids of two plans."""
    print(
        f"corpus: {samples} standard-library files under {corpus.root} ({corpus.counter})"
        + (" [--quick: a 300-file subset]" if config.quick else "")
    )
    per_step = doc["plans"][0]["config"]["samples_per_step"]
    model = config.cost_model()
    speed = f" at {model.flops_per_second / 1e12:.0f} TFLOP/s" if model.unit == "flop" else ""
    print(
        f"plans: {len(doc['plans'])} (CP strategy/packing), DP={config.plan.dp} x CP={config.plan.cp}, "
        f"{config.plan.tokens_per_rank:,} tokens per rank, {per_step} samples per step, cost model "
        f"{doc['cost_model']['name']}{speed}\n"
    )
    print(format_table(doc))
    print()
    print(format_ranks(doc, doc["baseline"], step))
    print()
    print(format_ranks(doc, doc["plans"][0]["name"], step))
    print()


def _print_ring_check(ring: Any, note: str) -> None:
    if ring is not None:
        verdict = "matches" if ring.ok else "DOES NOT MATCH"
        print(
            f"ring check: ring_attention on 2 CPU processes (gloo, fp64) {verdict} single-process attention on one "
            f"planned micro-batch ({ring.samples} samples, {ring.tokens:,} tokens, {ring.split_samples} split across "
            f"ranks, {ring.kv_cross_tokens:,} K/V tokens crossing, {ring.ring_steps} ring step(s)): max |error| "
            f"{ring.max_error:.1e} over outputs and dq/dk/dv ({ring.seconds:.1f} s)"
        )
    elif note:
        print(f"ring check: {note}")


def _ring_check(lengths: np.ndarray, seed: int) -> tuple[Any, str]:
    """(result, note): the 2-process check, or why it did not run."""
    import torch

    if torch.cuda.is_available():
        return None, "skipped: a GPU is present (the GPU test suite checks the runtime there)"
    mb, sub = ringcheck.pick_microbatch(lengths, cp=2, seed=seed)
    return ringcheck.run_ring_check(mb, sub, seed=seed), ""
