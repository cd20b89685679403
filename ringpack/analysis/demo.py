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
import sys
import time
from pathlib import Path

import numpy as np

from ringpack.analysis.report import DEFAULT_VARIANTS

__all__ = ["run", "length_stats"]


def length_stats(lengths: np.ndarray) -> dict[str, float]:
    """Summary statistics of sample lengths (tokens)."""
    q = np.percentile(lengths, [50, 90, 99])
    return {
        "samples": int(lengths.size),
        "tokens": int(lengths.sum()),
        "min": int(lengths.min()),
        "median": float(q[0]),
        "mean": float(lengths.mean()),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(lengths.max()),
    }


def run(args: argparse.Namespace) -> int:
    import dataclasses

    from tqdm.auto import tqdm

    from ringpack.analysis import plots
    from ringpack.analysis.comm_model import CommModel
    from ringpack.analysis.report import build_report, format_ranks, format_table, result_of_plan, write_report
    from ringpack.cost import CostModel
    from ringpack.data.corpus import stdlib_corpus
    from ringpack.planner import make_plan
    from ringpack.shard_plan import PlanConfig

    t0 = time.perf_counter()
    out = Path(args.out)
    check = not args.no_ring_check
    stages = 1 + len(DEFAULT_VARIANTS) + 1 + 4 + int(check)
    bar = tqdm(
        total=stages,
        desc="demo",
        unit="stage",
        file=sys.stderr,
        disable=args.quiet,
        bar_format="{desc:<34} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
    )

    bar.set_description("corpus: tokenizing the stdlib")
    corpus = stdlib_corpus(tokenizer=args.tokenizer)
    lengths = corpus.lengths
    if args.quick:  # a seeded subset: same pipeline, a few seconds
        lengths = lengths[np.random.default_rng(args.seed).permutation(lengths.size)[:300]]
    bar.update(1)

    model = dataclasses.replace(CostModel.preset(args.model), flops_per_second=args.tflops * 1e12)
    per_step = args.samples_per_step or max(args.dp, int(args.dp * args.cp * args.tokens_per_rank / lengths.mean()))
    config = PlanConfig(
        dp=args.dp,
        cp=args.cp,
        tokens_per_rank=args.tokens_per_rank,
        samples_per_step=per_step,
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
    doc = build_report(
        results,
        lengths=lengths,
        title="ringpack demo: the standard-library corpus, every strategy",
        extra={"corpus": {"root": str(corpus.root), "counter": corpus.counter, "quick": bool(args.quick)}},
    )
    step = plots.default_rank_step(doc)
    bar.update(1)

    class _PlotProgress:  # write_report ticks once per plot
        def update(self, n: int) -> None:
            bar.set_description("plots: rendering PNGs")
            bar.update(n)

    paths = write_report(doc, out, rank_step=step, progress=_PlotProgress())

    ring = None
    ring_note = ""
    if check:
        bar.set_description("ring check: 2 CPU processes")
        ring, ring_note = _ring_check(corpus.lengths, args.seed)
        bar.update(1)
    bar.close()

    stats = length_stats(lengths)
    print(
        f"corpus: {stats['samples']} standard-library files under {corpus.root} ({corpus.counter})"
        + (" [--quick: a 300-file subset]" if args.quick else "")
    )
    print(
        f"plans: {len(results)} (CP strategy/packing), DP={args.dp} x CP={args.cp}, {args.tokens_per_rank:,} tokens per "
        f"rank, {per_step} samples per step, cost model {model.name} at {args.tflops:.0f} TFLOP/s\n"
    )
    print(format_table(doc))
    print()
    print(format_ranks(doc, doc["baseline"], step))
    print()
    print(format_ranks(doc, doc["plans"][0]["name"], step))
    print()
    if ring is not None:
        verdict = "matches" if ring.ok else "DOES NOT MATCH"
        print(
            f"ring check: ring_attention on 2 CPU processes (gloo, fp64) {verdict} single-process attention on one "
            f"planned micro-batch ({ring.samples} samples, {ring.tokens:,} tokens, {ring.split_samples} split across "
            f"ranks, {ring.kv_cross_tokens:,} K/V tokens crossing, {ring.ring_steps} ring step(s)): max |error| "
            f"{ring.max_error:.1e} over outputs and dq/dk/dv ({ring.seconds:.1f} s)"
        )
    elif ring_note:
        print(f"ring check: {ring_note}")
    print(f"\nwrote {out}/: " + ", ".join(p.name for p in paths.values()))
    print(f"open {out / 'report.html'} for the report with its plots; done in {time.perf_counter() - t0:.1f} s")
    return 0 if ring is None or ring.ok else 1


def _ring_check(lengths: np.ndarray, seed: int):
    """(result, note): the 2-process check, or why it did not run."""
    from ringpack.analysis import ringcheck

    try:
        import torch

        if torch.cuda.is_available():
            return None, "skipped: a GPU is present (the GPU test suite checks the runtime there)"
    except ImportError:
        return None, "skipped: torch is not installed"
    if not ringcheck.ring_runtime_available():
        return None, "pending: the ring runtime (ringpack.attention) is not in this build yet"
    mb, sub = ringcheck.pick_microbatch(lengths, cp=2, seed=seed)
    return ringcheck.run_ring_check(mb, sub, seed=seed), ""
