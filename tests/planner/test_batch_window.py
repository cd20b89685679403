"""batch_window: costly samples gathered across neighbouring global batches, by swaps.

Every sample exactly once, none moved by more than the window or out of its block (so the last
block drains itself), batch sizes and the token caps kept, the same batches in any process, window
0 exactly the plans without the field, streamed steps equal to the whole-epoch plan.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
from hashlib import sha256

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringpack.cost import CostModel
from ringpack.planner import make_plan
from ringpack.planner.batch_window import BalancedWindows
from ringpack.planner.bounds import plan_costs
from ringpack.planner.epoch import _windows, global_batches, plan_step, shuffle_order
from ringpack.planner.stream import StepStream
from ringpack.shard_plan import Plan, PlanConfig, PlanError

#: Attention dominates (a pair costs a hundredth of a token): long samples are the outliers a window
#: gathers, as at 128K tokens with a real model, at test sizes.
HEAVY = CostModel(token=1.0, pair=0.01, unit="s", name="attention-heavy")


def heavy_tailed(n: int = 1500, seed: int = 5, cap: int = 4096) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(5.0, 1.3, n).astype(np.int64), 1, cap)


def config(**overrides) -> PlanConfig:
    base = dict(dp=4, cp=2, tokens_per_rank=2048, samples_per_step=80, seed=1, cost=HEAVY, batch_window=2)
    return PlanConfig(**{**base, **overrides})


def drawn_windows(lengths: np.ndarray, cfg: PlanConfig) -> list[np.ndarray]:
    """The shuffle's batches, as ``global_batches`` cuts them before any window."""
    return global_batches(lengths, dataclasses.replace(cfg, batch_window=0)).windows


def check_window(lengths: np.ndarray, cfg: PlanConfig) -> list[np.ndarray]:
    """Assert the window's invariants; return the balanced batches."""
    drawn = drawn_windows(lengths, cfg)
    batches = global_batches(lengths, cfg)
    windows = [batches.windows[s] for s in range(len(batches.windows))]
    assert [w.size for w in windows] == [w.size for w in drawn], "every batch keeps its size"
    drawn_step = np.full(lengths.size, -1)
    step = np.full(lengths.size, -1)
    for s, (old, new) in enumerate(zip(drawn, windows)):
        drawn_step[old] = s
        assert (step[new] == -1).all(), f"step {s} repeats a sample"
        step[new] = s
    assert np.array_equal(np.sort(np.concatenate(windows)), np.sort(np.concatenate(drawn))), "exactly once"
    planned = drawn_step >= 0
    assert (np.abs(step[planned] - drawn_step[planned]) <= cfg.batch_window).all(), "moved beyond the window"
    block = cfg.batch_window + 1
    assert (step[planned] // block == drawn_step[planned] // block).all(), "a sample left its block"
    moves = batches.moves()
    moved = np.flatnonzero(planned & (step != drawn_step))
    assert np.array_equal(moves.sample, moved)
    assert np.array_equal(moves.drawn, drawn_step[moved]) and np.array_equal(moves.step, step[moved])
    return windows


# ------------------------------------------------------------------------------- invariants
def test_the_window_moves_costly_samples_and_lowers_the_step_costs():
    lengths = heavy_tailed()
    costs = {}
    for w in (0, 1, 2, 3):
        plan = make_plan(lengths, config(batch_window=w)).validate()
        costs[w] = float(plan_costs(plan)["step_cost"].sum())
    assert costs[1] < 0.9 * costs[0] and costs[3] < costs[1], costs
    batches = global_batches(lengths, config(batch_window=3))
    check_window(lengths, config(batch_window=3))
    moves = batches.moves()
    assert 0 < moves.count < 0.1 * lengths.size and moves.distances.max() <= 3
    assert moves.predicted.sum() < moves.predicted_drawn.sum()
    # the moved samples are the costly ones: longer than the typical sample, on average
    into = moves.sample[moves.step == np.bincount(moves.step).argmax()]
    assert np.median(batches.lengths[into]) > 4 * np.median(lengths)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    n=st.integers(40, 900),
    sigma=st.floats(0.0, 2.5),
    window=st.integers(1, 6),
    per_step=st.integers(8, 120),
    fixed=st.sampled_from([0, 0, 2, 4]),
)
def test_exactly_once_and_the_bound_on_random_lengths(seed, n, sigma, window, per_step, fixed):
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(5.0, sigma, n).astype(np.int64), 1, 4096)
    cfg = config(batch_window=window, samples_per_step=per_step, microbatches_per_rank=fixed, seed=seed % 7)
    windows = check_window(lengths, cfg)
    check_token_caps(lengths, cfg, windows)


ADVERSARIAL = {
    "all equal": np.full(700, 1000),
    "one giant per batch": np.where(np.arange(800) % 80 == 0, 4096, 40),
    "every giant drawn together": np.concatenate([np.full(60, 4096), np.full(740, 30)]),
    "only giants": np.full(400, 4096),
    "sorted ascending": np.sort(heavy_tailed(800)),
    "two lengths": np.where(np.arange(900) % 3 == 0, 4000, 1),
}


@pytest.mark.parametrize("name", ADVERSARIAL)
@pytest.mark.parametrize("window", [1, 3, 50])
def test_exactly_once_and_the_bound_on_adversarial_lengths(name, window):
    lengths = ADVERSARIAL[name].astype(np.int64)
    for fixed in (0, 3):
        cfg = config(batch_window=window, microbatches_per_rank=fixed)
        windows = check_window(lengths, cfg)
        check_token_caps(lengths, cfg, windows)
    if name == "all equal":
        assert global_batches(lengths, config(batch_window=window)).moves().count == 0, "nothing to balance"


def check_token_caps(lengths: np.ndarray, cfg: PlanConfig, windows: list[np.ndarray]) -> None:
    """With fixed micro-batches no batch exceeds its block's fullest drawn batch (nor dp * m micro-batches);
    without, a batch that received samples stays within half its most micro-batches."""
    drawn = drawn_windows(lengths, cfg)
    block = cfg.batch_window + 1
    for s, (old, new) in enumerate(zip(drawn, windows)):
        tokens = int(lengths[new].sum())
        if tokens <= int(lengths[old].sum()):
            continue
        if cfg.microbatches_per_rank:
            first = s - s % block
            fullest = max(int(lengths[w].sum()) for w in drawn[first : first + block])
            assert tokens <= min(fullest, cfg.dp * cfg.microbatches_per_rank * cfg.group_capacity), f"step {s}"
        else:
            assert tokens <= (new.size // cfg.dp) * cfg.dp * cfg.group_capacity // 2, f"step {s}"


def test_the_last_steps_drain_what_the_window_moved():
    lengths = heavy_tailed(1500)
    cfg = config(batch_window=4)  # 18 full steps and the merged tail: blocks of 5, the last of 4 steps
    drawn = drawn_windows(lengths, cfg)
    num = len(drawn)
    assert num % 5, "the epoch does not end on a block boundary"
    windows = check_window(lengths, cfg)
    last = num - num % 5
    assert set(np.concatenate(drawn[last:]).tolist()) == set(np.concatenate(windows[last:]).tolist())
    assert global_batches(lengths, cfg).moves().step.max() < num
    plan = make_plan(lengths, cfg).validate()  # every sample planned exactly once
    assert plan.num_steps == num


def test_a_window_longer_than_the_epoch_keeps_every_sample_in_it():
    lengths = heavy_tailed(400)
    cfg = config(batch_window=100)
    windows = check_window(lengths, cfg)
    assert len(windows) == 5 and make_plan(lengths, cfg).validate().num_steps == 5


def test_fixed_micro_batches_still_plan():
    lengths = heavy_tailed(1500)
    for w in (0, 2):
        make_plan(lengths, config(batch_window=w, microbatches_per_rank=3)).validate()


def test_the_moves_summary():
    lengths = heavy_tailed()
    cfg = config(batch_window=3)
    moves = global_batches(lengths, cfg).moves()
    summary = moves.summary(cfg, lengths.size, int(lengths.sum()))
    assert summary["moved"] == moves.count and summary["max_distance"] == int(moves.distances.max()) <= 3
    assert summary["mean_distance"] == pytest.approx(float(moves.distances.mean()))
    assert summary["predicted_seconds"] < summary["predicted_seconds_without"]
    assert summary["tokens_per_second"] * summary["predicted_seconds"] == pytest.approx(lengths.sum())
    assert global_batches(lengths, config(batch_window=0)).moves() is None


# ------------------------------------------------------------------------- window 0 and config
PLAIN = {
    "robust default": dict(dp=4, cp=4, tokens_per_rank=2048, samples_per_step=96),
    "heavy, zigzag": dict(dp=4, cp=2, tokens_per_rank=2048, samples_per_step=80, cost=HEAVY, strategy="zigzag"),
    "split, first fit": dict(dp=3, cp=2, tokens_per_rank=1024, samples_per_step=80, overflow="split",
                             packing="first_fit", seed=4, epoch=2),
}  # fmt: skip


@pytest.mark.parametrize("name", PLAIN)
def test_window_zero_is_the_plan_without_the_field(name):
    """Window 0: the config serialises without the field (the hash's config bytes are those of a
    config that has none) and every step plans the shuffle's batch as drawn."""
    lengths = heavy_tailed(1200)
    cfg = PlanConfig(**PLAIN[name])
    assert cfg.batch_window == 0 and "batch_window" not in cfg.to_dict()
    assert PlanConfig.from_dict(cfg.to_dict()) == cfg
    batches = global_batches(lengths, cfg)
    assert isinstance(batches.windows, list) and batches.moves() is None
    order = shuffle_order(len(batches.lengths), cfg.seed, cfg.epoch)
    drawn = _windows(order[np.isin(order, batches.dropped, invert=True)], cfg.samples_per_step, cfg.dp)
    assert len(drawn) == len(batches.windows)
    assert all(np.array_equal(a, b) for a, b in zip(drawn, batches.windows))
    plan = make_plan(lengths, cfg)
    again = Plan(
        cfg,
        tuple(batches.lengths.tolist()),
        tuple(plan_step(batches, s, cfg) for s in range(len(drawn))),
        batches.dropped,
        batches.origins,
    )
    assert again.content_hash == plan.content_hash
    windowed = dataclasses.replace(cfg, batch_window=3)
    assert windowed.to_dict()["batch_window"] == 3 and PlanConfig.from_dict(windowed.to_dict()) == windowed
    assert make_plan(lengths, windowed).content_hash != plan.content_hash, "the window is part of the plan's identity"


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True, 2**63])
def test_a_bad_window_names_the_field(bad):
    with pytest.raises(PlanError, match=r"PlanConfig\.batch_window must be a non-negative integer"):
        config(batch_window=bad)


# ------------------------------------------------------------------------ streaming, processes
def test_blocks_are_balanced_on_first_use():
    lengths = heavy_tailed(3000)
    cfg = config(batch_window=3)
    batches = global_batches(lengths, cfg)
    assert isinstance(batches.windows, BalancedWindows) and not batches.windows._blocks
    plan_step(batches, 0, cfg)
    assert list(batches.windows._blocks) == [0], "step 0 needs its own block only"
    plan_step(batches, 9, cfg)
    assert sorted(batches.windows._blocks) == [0, 8]


def test_streamed_steps_equal_the_whole_epoch_plan_with_a_window():
    lengths = heavy_tailed()
    cfg = config(batch_window=3, epoch=2)
    whole = make_plan(lengths, cfg)
    stream = StepStream(lengths, cfg, lookahead=1)
    assert stream.num_steps == whole.num_steps
    assert [stream.get(s) for s in range(stream.num_steps)] == list(whole.steps)
    assert stream.peek(5) == whole.steps[5], "a step behind the stream, planned again alone"
    assert global_batches(lengths, cfg).moves().count > 0


def test_a_cost_switch_keeps_the_batches():
    """The window prices samples with the epoch's first cost model; a later model plans the same batches."""
    lengths = heavy_tailed()
    cfg = config(batch_window=3)
    other = CostModel(token=1.0, pair=0.0001, unit="s", name="linear")
    stream = StepStream(lengths, cfg, [(4, other)])
    steps = [stream.get(s) for s in range(stream.num_steps)]
    batches = global_batches(lengths, cfg)
    for s, step in enumerate(steps):
        assert sorted(x for rank in step.microbatches for mb in rank for x in mb.samples) == sorted(
            batches.windows[s].tolist()
        ), f"step {s}"


def _digest(args: tuple) -> str:
    lengths, cfg_dict = args
    cfg = PlanConfig.from_dict(cfg_dict)
    batches = global_batches(lengths, cfg)
    h = sha256()
    for s in range(len(batches.windows)):
        h.update(np.asarray(batches.windows[s], dtype="<i8").tobytes() + b"|")
    return h.hexdigest()


@pytest.mark.slow
def test_a_spawned_process_draws_the_same_batches():
    lengths = heavy_tailed(2000, seed=9)
    cfgs = [config(batch_window=w, seed=s).to_dict() for w, s in ((2, 1), (5, 3))]
    json.dumps(cfgs)  # plain data crosses the process boundary
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        remote = pool.map(_digest, [(lengths, c) for c in cfgs])
    assert remote == [_digest((lengths, c)) for c in cfgs]
    assert remote[0] != _digest((lengths, config(batch_window=0, seed=1).to_dict())), "the window moved samples"
