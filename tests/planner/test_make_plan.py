"""make_plan's rules: errors, overflow policies, shuffled windows, determinism across processes, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ringpack
from ringpack.cost import PRESETS, CostModel
from ringpack.planner import make_plan
from ringpack.planner.epoch import expand_overflow, shuffle_order
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, PlanError, microbatch_from_shards
from ringpack.traffic import kv_bytes_per_token, kv_traffic, needed_pieces, plan_kv_traffic

ROOT = Path(__file__).resolve().parents[2]


def cfg(**kw):
    base = dict(dp=2, cp=2, tokens_per_rank=1000)
    base.update(kw)
    return PlanConfig(**base)


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "lengths, match",
    [
        ([], "empty"),
        ([5, 0, 3], "sample 1 has length 0"),
        ([5, -2], "sample 1 has length -2"),
        ([5, 2.5], "sample 1 has length 2.5"),
        ([[1, 2], [3, 4]], "1-D"),
        (["a", "b"], "sample 0 holds text, not a length"),
    ],
)
def test_bad_lengths_raise(lengths, match):
    with pytest.raises(PlanError, match=match):
        make_plan(lengths, cfg())


def test_overflow_error_names_the_sample():
    with pytest.raises(
        PlanError,
        match=r"sample 2 has 2001 tokens, more than one CP group holds \(cp=2 x tokens_per_rank=1000 = 2000\)",
    ):
        make_plan([10, 20, 2001, 30], cfg())


def test_overflow_drop_lists_dropped_samples():
    plan = make_plan([10, 20, 2001, 30, 5000], cfg(overflow="drop")).validate()
    assert plan.dropped == (2, 4)
    with pytest.raises(PlanError, match="all 1 are longer"):
        make_plan([5000], cfg(overflow="drop"))


def test_overflow_split_plans_independent_documents():
    plan = make_plan([10, 20, 4500, 30], cfg(overflow="split")).validate()
    # 4500 > 2000 tokens: three documents of 1500; the plan's samples are documents
    assert plan.lengths == (10, 20, 1500, 1500, 1500, 30)
    doc_lengths, doc_sample, doc_offset = expand_overflow(np.array([10, 20, 4500, 30]), 2000)
    assert doc_lengths.tolist() == list(plan.lengths)
    assert doc_sample.tolist() == [0, 1, 2, 2, 2, 3] and doc_offset.tolist() == [0, 0, 0, 1500, 3000, 0]
    # the plan itself records where each document came from
    assert plan.origins == ((0, 0), (1, 0), (2, 0), (2, 1500), (2, 3000), (3, 0))
    assert make_plan([10, 20, 30], cfg()).origins == ()


def test_too_few_samples_for_the_bins():
    with pytest.raises(PlanError, match=r"step 0: 3 samples cannot fill dp=4 x 1 micro-batches"):
        make_plan([5, 6, 7], cfg(dp=4))
    with pytest.raises(PlanError, match="cannot fill dp=2 x 3"):
        make_plan([5, 6, 7, 8], cfg(microbatches_per_rank=3))


def test_budget_too_small_for_fixed_microbatches():
    with pytest.raises(PlanError, match=r"do not fit dp=2 x 1 micro-batches"):
        make_plan([1500] * 8, cfg(microbatches_per_rank=1))


def test_config_errors_are_plan_errors():
    with pytest.raises(PlanError, match="tokens_per_rank"):
        cfg(tokens_per_rank=0)
    with pytest.raises(PlanError, match="strategy"):
        cfg(strategy="ring")


# ------------------------------------------------------------------------- windows, shuffling
def test_shuffle_is_a_permutation_that_depends_on_seed_and_epoch():
    a = shuffle_order(1000, 0, 0)
    assert sorted(a.tolist()) == list(range(1000))
    assert not np.array_equal(a, shuffle_order(1000, 0, 1))
    assert not np.array_equal(a, shuffle_order(1000, 1, 0))
    assert np.array_equal(a, shuffle_order(1000, 0, 0))


def test_global_batches_are_random_windows_not_length_sorted():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 4000, size=400)
    plan = make_plan(lengths, cfg(dp=2, cp=2, tokens_per_rank=8000, samples_per_step=100))
    assert plan.num_steps == 4
    means = [np.mean([lengths[s] for r in step.microbatches for mb in r for s in mb.samples]) for step in plan.steps]
    order = shuffle_order(400, 0, 0)
    for k, step in enumerate(plan.steps):  # step k holds exactly window k of the shuffled order
        got = sorted(s for r in step.microbatches for mb in r for s in mb.samples)
        assert got == sorted(order[k * 100 : (k + 1) * 100].tolist())
    assert max(means) / min(means) < 1.5  # no length sorting across steps


def test_small_tail_joins_the_previous_step():
    plan = make_plan(list(range(1, 22)), cfg(dp=4, tokens_per_rank=100, samples_per_step=10)).validate()
    assert plan.num_steps == 2  # 10 + 11: the last single sample cannot feed 4 DP ranks


def test_fixed_microbatch_count_is_respected():
    plan = make_plan([100] * 24, cfg(dp=2, microbatches_per_rank=3, samples_per_step=12)).validate()
    assert all(len(rank) == 3 for step in plan.steps for rank in step.microbatches)


# ------------------------------------------------------------------------------- determinism
SNIPPET = """
import json, sys, numpy as np
from ringpack.planner import make_plan
from ringpack.shard_plan import PlanConfig
lengths = np.random.default_rng(42).integers(1, 20000, size=700)
out = {}
for strategy in ("balanced", "zigzag", "contiguous"):
    config = PlanConfig(dp=4, cp=4, tokens_per_rank=16384, strategy=strategy, samples_per_step=300, seed=7, epoch=3)
    out[strategy] = make_plan(lengths, config).content_hash
print(json.dumps(out))
"""


@pytest.mark.slow
def test_plans_are_identical_across_processes():
    runs = [
        subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True, cwd=ROOT, check=True)
        for _ in range(2)
    ]
    hashes = [json.loads(r.stdout) for r in runs]
    assert hashes[0] == hashes[1]
    namespace: dict = {}
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(SNIPPET, namespace)
    assert json.loads(buf.getvalue()) == hashes[0]
    assert len(set(hashes[0].values())) == 3


def test_public_api_matches_make_plan():
    lengths = [5, 300, 20, 1000, 7, 64]
    assert (
        ringpack.plan(lengths, dp=2, cp=2, tokens_per_rank=600).content_hash
        == make_plan(lengths, cfg(tokens_per_rank=600)).content_hash
    )


# -------------------------------------------------------------------------------- K/V traffic
def naive_needed(mb: MicroBatch) -> list[int]:
    out = []
    for c, shard in enumerate(mb.shards):
        for p in shard.pieces:
            out.append(
                sum(
                    1
                    for c2, other in enumerate(mb.shards)
                    if c2 != c and any(q.sample == p.sample and q.start >= p.stop for q in other.pieces)
                )
            )
    return out


@st.composite
def scattered_microbatch(draw):
    cp = draw(st.integers(1, 4))
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    shards = [[] for _ in range(cp)]
    for s, length in enumerate(lengths):
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, length - 1)), max_size=4)))) if length > 1 else []
        bounds = [0, *[c for c in cuts if 0 < c < length], length]
        for a, b in zip(bounds, bounds[1:]):
            shards[draw(st.integers(0, cp - 1))].append(Piece(s, a, b))
    return microbatch_from_shards(list(range(n)), shards, lengths)


@settings(max_examples=150, deadline=None)
@given(scattered_microbatch())
def test_needed_pieces_matches_the_definition(mb):
    rows = [(c, p.sample, p.start, p.stop) for c, sh in enumerate(mb.shards) for p in sh.pieces]
    arr = np.array(rows, dtype=np.int64)
    got = needed_pieces(np.zeros(len(arr), dtype=np.int64), arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])
    assert got.tolist() == naive_needed(mb)
    traffic = kv_traffic(mb, bytes_per_token=3)
    sizes = [p.stop - p.start for sh in mb.shards for p in sh.pieces]
    assert traffic.unique == 3 * sum(s for s, k in zip(sizes, got) if k)
    assert traffic.p2p == 3 * sum(s * k for s, k in zip(sizes, got))
    assert traffic.ring == (len(mb.shards) - 1) * traffic.unique


def test_plan_kv_traffic_agrees_with_per_microbatch():
    plan = make_plan(
        np.random.default_rng(1).integers(1, 3000, size=120),
        cfg(dp=3, cp=4, tokens_per_rank=4000, strategy="zigzag", samples_per_step=60),
    )
    table = plan_kv_traffic(plan, bytes_per_token=2)
    for k, (s, d, i, mb) in enumerate(plan.iter_microbatches()):
        assert (table["step"][k], table["dp"][k], table["microbatch"][k]) == (s, d, i)
        assert table["unique"][k] == kv_traffic(mb, 2).unique


def test_kv_bytes_per_token_counts_k_and_v_of_every_layer():
    shape = PRESETS["llama3-8b"]
    assert kv_bytes_per_token(shape) == 2 * 8 * 128 * 2 * 32


# ----------------------------------------------------------------------------------------- CLI
def test_cli_plans_a_lengths_file(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ringpack.cli import main

    lengths = np.random.default_rng(3).integers(1, 5000, size=300)
    pq.write_table(pa.table({"length": lengths}), tmp_path / "lengths.parquet")
    out = tmp_path / "plan.parquet"
    code = main(
        [
            "plan",
            "--lengths",
            str(tmp_path / "lengths.parquet"),
            "--dp",
            "2",
            "--cp",
            "2",
            "--tokens-per-rank",
            "8192",
            "--samples-per-step",
            "100",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    plan = Plan.load(out).validate()
    assert plan.num_steps == 3
    assert "gap to lower bound" in capsys.readouterr().out
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=8192, samples_per_step=100)
    assert plan.content_hash == make_plan(lengths, config).content_hash


def test_cli_reports_overflow_as_an_error(tmp_path, capsys):
    from ringpack.cli import main

    np.save(tmp_path / "l.npy", np.array([10, 99999, 20]))
    argv = ["plan", "--lengths", str(tmp_path / "l.npy"), "--dp", "1", "--cp", "2", "--tokens-per-rank", "100"]
    argv += ["--out", str(tmp_path / "p.json")]
    assert main(argv) == 1
    assert "sample 1 has 99999 tokens" in capsys.readouterr().err
    code = main([*argv, "--overflow", "drop"])
    assert code == 0 and Plan.load(tmp_path / "p.json").dropped == (1,)


def test_zigzag_fits_a_tight_budget_that_floor_cuts_overflow():
    """Floor cuts of two 14-token samples over cp=4 put 8 tokens on rank 1; the budget is 7."""
    from ringpack.planner.split import split_zigzag

    assert max(s.num_tokens for s in split_zigzag([0, 1], [14, 14], 4).shards) == 8
    plan = make_plan(
        [14, 14], PlanConfig(dp=1, cp=4, tokens_per_rank=7, strategy="zigzag", microbatches_per_rank=1)
    ).validate()
    assert [s.num_tokens for s in plan.steps[0].microbatches[0][0].shards] == [7, 7, 7, 7]


def test_first_fit_with_too_few_samples_for_its_micro_batches_is_a_plan_error():
    """Four samples that need four micro-batches cannot fill dp=3 x 2 lockstep slots."""
    with pytest.raises(PlanError, match=r"step 0: 4 samples .* do not fit dp=3 x 2 micro-batches"):
        make_plan([2, 40, 40, 40], PlanConfig(dp=3, cp=1, tokens_per_rank=41, packing="first_fit"))


def test_one_more_microbatch_per_rank_must_pay_for_its_fixed_cost():
    """A measured per-micro-batch constant keeps the planner from adding a micro-batch that balance alone would take."""
    lengths = np.clip(np.random.default_rng(102).lognormal(7.6, 1.1, 1500).astype(int), 1, 8 * 16384)
    per_step = int(0.95 * 4 * 8 * 16384 / lengths.mean())

    def counts(microbatch: float) -> list[int]:
        cost = CostModel(token=2e-7, pair=1e-11, unit="s", microbatch=microbatch)
        plan = ringpack.plan(
            lengths, dp=4, cp=8, tokens_per_rank=16384, samples_per_step=per_step, overflow="split", cost=cost
        )
        return [len(step.microbatches[0]) for step in plan.steps]

    free, charged = np.array(counts(0.0)), np.array(counts(0.01))
    assert (charged <= free).all() and (charged < free).any()
