"""``ringpack demo`` (= ``make demo``): the embedded default corpus through every strategy, with the report.

Runs anywhere Python runs (the corpus is the interpreter's own standard library):

1. corpus lengths (one document per ``.py`` file, regex token counts, or ``--tokenizer``);
2. plans for every CP strategy x packing with the balancer (``make_plan``), DP=4 x CP=4 by default;
3. the imbalance report: terminal table, ``report.json``, PNG plots, ``report.html`` / ``report.md``
   in the output folder (``demo-out/``);
4. on a machine without a GPU, a check that the ring runtime on 2 CPU processes (gloo) gives the
   same attention outputs and gradients as single-process attention on one planned micro-batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.analysis.report import DEFAULT_VARIANTS

__all__ = ["run"]

#: Progress-bar stages besides planning: corpus, report, the four plots.
_FIXED_STAGES = 1 + 1 + 4


def run(args: argparse.Namespace) -> int:
    """``ringpack demo``: exit 0, or 1 when the ring check finds a mismatch."""
    from ringpack.analysis import plots
    from ringpack.analysis.report import write_report
    from ringpack.data.corpus import stdlib_corpus

    t0 = time.perf_counter()
    check = not args.no_ring_check
    bar = _progress_bar(args, total=_FIXED_STAGES + len(DEFAULT_VARIANTS) + int(check))

    bar.set_description("corpus: tokenizing the stdlib")
    corpus = stdlib_corpus(tokenizer=args.tokenizer)
    lengths = corpus.lengths
    if args.quick:  # a seeded subset: same pipeline, a few seconds
        lengths = lengths[np.random.default_rng(args.seed).permutation(lengths.size)[:300]]
    bar.update(1)

    doc = _plan_and_report(args, lengths, corpus, bar)
    step = plots.default_rank_step(doc)
    bar.update(1)
    paths = write_report(doc, Path(args.out), rank_step=step, progress=_PlotProgress(bar))

    ring, ring_note = None, ""
    if check:
        bar.set_description("ring check: 2 CPU processes")
        ring, ring_note = _ring_check(corpus.lengths, args.seed)
        bar.update(1)
    bar.close()

    _print_results(args, doc, corpus, lengths.size, step)
    _print_ring_check(ring, ring_note)
    out = Path(args.out)
    print(f"\nwrote {out}/: " + ", ".join(p.name for p in paths.values()))
    print(f"open {out / 'report.html'} for the report with its plots; done in {time.perf_counter() - t0:.1f} s")
    return 0 if ring is None or ring.ok else 1


def _progress_bar(args: argparse.Namespace, total: int) -> Any:
    """The demo's stages: a bar on a terminal, a plain log line now and then elsewhere (:class:`Progress`)."""
    from ringpack.progress import Progress

    return Progress("demo", "stages", total, enabled=not args.quiet)


class _PlotProgress:
    """What ``write_report`` ticks once per plot: the demo's bar, described as the plotting stage."""

    def __init__(self, bar: Any) -> None:
        self.bar = bar

    def update(self, n: int) -> None:
        self.bar.set_description("plots: rendering PNGs")
        self.bar.update(n)


def _plan_and_report(args: argparse.Namespace, lengths: np.ndarray, corpus: Any, bar: Any) -> dict[str, Any]:
    """Plan ``lengths`` with every default variant and build the report document."""
    from ringpack.analysis.comm_model import CommModel
    from ringpack.analysis.report import build_report, result_of_plan
    from ringpack.cost import CostModel
    from ringpack.planner import make_plan
    from ringpack.shard_plan import PlanConfig

    model = dataclasses.replace(CostModel.preset(args.model), flops_per_second=args.tflops * 1e12)
    config = PlanConfig(
        dp=args.dp,
        cp=args.cp,
        tokens_per_rank=args.tokens_per_rank,
        samples_per_step=_samples_per_step(args, lengths),
        seed=args.seed,
        overflow="split",
        cost=model,
    )
    comm = CommModel.for_model(model, link=args.link)
    results = []
    for strategy, packing in DEFAULT_VARIANTS:
        bar.set_description(f"plan: {strategy}/{packing}")
        plan = make_plan(lengths, dataclasses.replace(config, strategy=strategy, packing=packing))
        results.append(result_of_plan(plan, comm))
        bar.update(1)

    bar.set_description("report: exact costs per rank")
    return build_report(
        results,
        lengths=lengths,
        title="ringpack demo: the standard-library corpus, every strategy",
        extra={"corpus": {"root": str(corpus.root), "counter": corpus.counter, "quick": bool(args.quick)}},
    )


def _samples_per_step(args: argparse.Namespace, lengths: np.ndarray) -> int:
    """``--samples-per-step``, or about one full micro-batch per DP rank of mean-length samples."""
    return args.samples_per_step or max(args.dp, int(args.dp * args.cp * args.tokens_per_rank / lengths.mean()))


def _print_results(args: argparse.Namespace, doc: dict[str, Any], corpus: Any, samples: int, step: int) -> None:
    """The corpus and planning lines, the summary table and the per-GPU grids of two plans."""
    from ringpack.analysis.report import format_ranks, format_table

    print(
        f"corpus: {samples} standard-library files under {corpus.root} ({corpus.counter})"
        + (" [--quick: a 300-file subset]" if args.quick else "")
    )
    per_step = doc["plans"][0]["config"]["samples_per_step"]
    print(
        f"plans: {len(doc['plans'])} (CP strategy/packing), DP={args.dp} x CP={args.cp}, {args.tokens_per_rank:,} "
        f"tokens per rank, {per_step} samples per step, cost model {doc['cost_model']['name']} at "
        f"{args.tflops:.0f} TFLOP/s\n"
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

    from ringpack.analysis import ringcheck

    if torch.cuda.is_available():
        return None, "skipped: a GPU is present (the GPU test suite checks the runtime there)"
    mb, sub = ringcheck.pick_microbatch(lengths, cp=2, seed=seed)
    return ringcheck.run_ring_check(mb, sub, seed=seed), ""
