"""The planner's fast paths against straightforward references, and the price-robust bound's proofs.

* the swap search, the zigzag back chunk and the short-sample placement give exactly what plain
  loops give; skipping the fallbacks that repeat the first pass changes no split;
* the price-robust packing is as good as the two-pass packing it replaced (each end of the price
  range packed alone, then both relative to that), measured on what a plan is judged by: ahead on
  average, behind on a few small cases by at most a quarter of a percent;
* the robust bound holds for every packing of small cases (all of them tried), and the price
  points hold a plan's worst ratio to the bound over the whole range.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest

import ringpack.planner.split.fallbacks as fallbacks
from ringpack.cost import CostModel
from ringpack.planner import epoch, make_plan
from ringpack.planner.bounds import plan_costs, price_profile, step_lower_bound
from ringpack.planner.packing import PackingProblem, _LocalSearch, fill_empty_bins, improve, pack_greedy
from ringpack.planner.split import split_balanced_many
from ringpack.planner.split.problem import SplitProblem
from ringpack.shard_plan import PlanConfig

FLOPS = CostModel.preset("llama3-8b")


def random_lengths(rng: np.random.Generator, n: int, kind: int) -> np.ndarray:
    if kind == 0:
        return np.clip(rng.lognormal(7, 1.3, n), 1, 60_000).astype(np.int64)
    if kind == 1:
        return np.clip(rng.pareto(1.1, n) * 500 + 1, 1, 60_000).astype(np.int64)
    return np.where(rng.random(n) < 0.9, rng.integers(50, 800, n), rng.integers(6_000, 30_000, n))


# ---------------------------------------------------------------------------- local search
def brute_force_swap(state: _LocalSearch, h: int, A: np.ndarray, B: np.ndarray):
    """Every (a, b) pair in order, the same arithmetic as the vectorised search."""
    top = float(state.loads[h].max())
    best = None
    for a in A.tolist():
        for b in B.tolist():
            ba, bb = state.bins[a], state.bins[b]
            dt = state.t[a] - state.t[b]
            if state.bin_tok[bb] + dt > state.capacity or state.bin_tok[ba] - dt > state.capacity:
                continue
            delta = state.w[a] - state.w[b]
            new = max((state.loads[h] - delta).max(), (state.loads[bb // state.m] + delta).max())
            if best is None or new < best[0]:
                best = (float(new), a, b)
    if best is None or not best[0] < top - state.tol:
        return None
    return best


@pytest.mark.parametrize("scenarios", [1, 2, 3])
def test_the_swap_search_finds_what_every_pair_tried_finds(scenarios):
    rng = np.random.default_rng(scenarios)
    for _ in range(40):
        dp, m = int(rng.integers(2, 6)), int(rng.integers(1, 3))
        n = int(rng.integers(dp * m, 40))
        tokens = rng.integers(1, 50, n)
        weights = rng.random((n, scenarios)) if scenarios > 1 else rng.random(n)
        weights[rng.random(n) < 0.2] = 0.5  # ties
        capacity = int(tokens.sum() // (dp * m) * rng.uniform(1.2, 3))
        problem = PackingProblem(weights, tokens, dp, m, capacity)
        bins = rng.integers(0, dp * m, n)
        bins[: dp * m] = np.arange(dp * m)
        state = _LocalSearch(problem, bins.copy())
        h = int(np.argmax(state.heights))
        A = np.flatnonzero(bins // m == h)
        B = np.flatnonzero(bins // m != h)
        if A.size and B.size:
            assert state.best_swap(h, A, B) == brute_force_swap(state, h, A, B)


# --------------------------------------------------------------------------- split fallbacks
def plain_back_chunk(problem: SplitProblem, lo: int, hi: int, t: int, share: float) -> int:
    """The binary search over the chunk costs, one cost evaluation per halving."""
    a, b, seg = problem.token, problem.pair, problem.segment

    def cost(start: int, stop: int) -> float:
        return a * (stop - start) + b * 0.5 * (stop * (stop + 1) - start * (start + 1)) + seg

    glo, ghi = 0, t
    while glo < ghi:
        g = (glo + ghi + 1) // 2
        c = (cost(lo, lo + t - g) if t - g else 0.0) + (cost(hi - g, hi) if g else 0.0)
        glo, ghi = (g, ghi) if c <= share else (glo, g - 1)
    return glo


@pytest.mark.parametrize("segment", [0.0, 1e6, 5e12])
def test_the_zigzag_back_chunk_is_the_binary_searchs(segment):
    rng = np.random.default_rng(int(segment) % 97)
    for _ in range(3000):
        length = int(rng.integers(2, 200_000))
        lo = int(rng.integers(0, length - 1))
        hi = int(rng.integers(lo + 1, length + 1))
        t = int(rng.integers(1, hi - lo + 1))
        problem = SplitProblem([length], [1.0], [0], 2, length, FLOPS.token, FLOPS.pair, segment, 1e-3)
        whole = plain_back_chunk(problem, lo, hi, t, math.inf)
        exact = (problem.token * t + problem.pair * 0.5 * t * t) * rng.uniform(0.5, 1.5)
        for share in (exact, exact * (1 + 1e-15), 0.0, math.inf, rng.uniform(0, 2) * exact):
            assert fallbacks._longest_back_chunk(problem, lo, hi, t, share) == plain_back_chunk(
                problem, lo, hi, t, share
            ), (lo, hi, t, share, whole)


def plain_place_short_whole(problem, is_long, held):
    """Every rank tried for every sample: the cheapest one within both rooms."""
    even = -(-sum(problem.lens) // problem.cp)
    unplaced = []
    for k in problem.order:
        if k in is_long:
            continue
        best = -1
        for limit in (even, problem.tokens_per_rank):
            for r in range(problem.cp):
                fits = held.tokens[r] + problem.lens[k] <= limit and held.cost[r] + problem.costs[k] <= problem.cap
                if fits and (best < 0 or held.cost[r] < held.cost[best]):
                    best = r
            if best >= 0:
                break
        if best < 0:
            unplaced.append(k)
            continue
        held.shards[best].append((k, 0, problem.lens[k]))
        held.cost[best] += problem.costs[k]
        held.tokens[best] += problem.lens[k]
    return unplaced


def test_short_samples_go_where_every_rank_tried_puts_them():
    rng = np.random.default_rng(5)
    for _ in range(2000):
        cp = int(rng.choice([2, 3, 4, 8]))
        lens = rng.integers(1, 60, int(rng.integers(1, 14))).tolist()
        costs = [x + 0.02 * x * x for x in lens]
        order = sorted(range(len(lens)), key=lambda k: (-costs[k], k))
        budget = max(1, int(sum(lens) / cp * rng.uniform(1.0, 1.3)))
        problem = SplitProblem(lens, costs, order, cp, budget, 1.0, 0.04, 0.0, 1e-3)
        is_long = set(rng.choice(len(lens), int(rng.integers(0, len(lens) + 1)), replace=False).tolist())
        start_cost = [float(rng.choice([0.0, rng.uniform(0, problem.cap)])) for _ in range(cp)]
        start_tokens = [int(rng.choice([0, rng.integers(0, budget + 1)])) for _ in range(cp)]
        ours = fallbacks._Held(list(start_cost), list(start_tokens), [[] for _ in range(cp)])
        plain = fallbacks._Held(list(start_cost), list(start_tokens), [[] for _ in range(cp)])
        assert fallbacks._place_short_whole(problem, is_long, ours) == plain_place_short_whole(problem, is_long, plain)
        assert ours == plain


def every_fallback(problem):
    """The fallbacks without skipping the ones that repeat the first pass."""
    yield fallbacks._balanced_shards(problem, 2.0 * problem.ideal)
    yield fallbacks._balanced_shards(problem, problem.ideal)
    for theta in (0.5, 0.1, 0.0):
        yield fallbacks._hybrid_shards(problem, theta)
    yield fallbacks.zigzag_even_shards(problem.lens, problem.cp, problem.token, problem.pair, problem.segment)


@pytest.mark.parametrize("slack", [None, 0.0, 0.01])
def test_skipping_fallbacks_that_repeat_the_first_pass_changes_no_split(slack, monkeypatch):
    rng = np.random.default_rng(7)
    lengths = random_lengths(rng, 3000, 0)
    groups, start = [], 0
    while start < len(lengths) - 40:
        size = int(rng.integers(1, 40))
        groups.append(list(range(start, start + size)))
        start += size
    cp = 8
    budget = int(max(lengths[g].sum() for g in groups) / cp * 1.02) + 1
    ours = split_balanced_many(groups, lengths, cp, budget, FLOPS, token_slack=slack)
    monkeypatch.setattr(fallbacks, "_candidates", every_fallback)
    assert ours == split_balanced_many(groups, lengths, cp, budget, FLOPS, token_slack=slack)


# ------------------------------------------------------------------------ price-robust packing
def worst_ratio(L: np.ndarray, config: PlanConfig, bins: np.ndarray, m: int) -> float:
    """What a price-robust packing is judged by: its heaviest DP rank over the bound, worst price."""
    profile = price_profile(L, config.dp, config.cp, config.cost, config.price_range)
    worst = 0.0
    for factor, bound in zip(profile.prices, profile.bounds):
        w = dataclasses.replace(config.cost, pair=config.cost.pair * factor).sample_cost(L)
        worst = max(worst, np.bincount(bins // m, weights=w, minlength=config.dp).max() / (config.cp * bound))
    return worst


def two_pass_packing(L: np.ndarray, config: PlanConfig, m: int) -> np.ndarray | None:
    """The packing the price-robust one replaced: each end of the range packed alone (greedy and
    local search), then both ends together, each relative to what it reached alone."""
    reached, columns = [], []
    for factor in config.price_range:
        priced = dataclasses.replace(config.cost, pair=config.cost.pair * factor)
        w = priced.sample_cost(L)
        bound = step_lower_bound(w, L, config.dp, config.cp, priced) * config.cp
        alone = PackingProblem(w, L, config.dp, m, config.group_capacity)
        bins = pack_greedy(alone)
        if bins is None:
            return None
        bins = improve(alone, fill_empty_bins(alone, bins), bound)
        reached.append(max(float(alone.heights(bins).max()), bound))
        columns.append(w / reached[-1])
    joint = PackingProblem(np.column_stack(columns), L, config.dp, m, config.group_capacity)
    return improve(joint, fill_empty_bins(joint, pack_greedy(joint)), 1.0)


@pytest.mark.slow  # seconds of plans, both packings
def test_the_robust_packing_is_at_least_as_good_as_the_two_pass_one():
    rng = np.random.default_rng(0)
    ratios = []
    for trial in range(120):
        dp, cp = int(rng.choice([2, 4, 8, 16])), int(rng.choice([1, 2, 8]))
        L = random_lengths(rng, int(dp * rng.integers(4, 40)), trial % 3)
        budget = int(max(L.max() / cp, L.sum() / (dp * cp)) * rng.uniform(1.05, 3))
        config = PlanConfig(dp=dp, cp=cp, tokens_per_rank=budget)
        W = config.cost.sample_cost(L)
        bound = step_lower_bound(W, L, dp, cp, config.cost) * cp
        m = epoch._microbatch_range(0, L, config)[0]
        scenarios, robust = epoch._price_scenarios(L, W, bound, config)
        ours = epoch._pack_robust(L, m, scenarios, robust, config)
        reference = two_pass_packing(L, config, m)
        if ours is None or reference is None:
            continue
        ratios.append(worst_ratio(L, config, ours[0], m) / worst_ratio(L, config, reference, m))
    ratios = np.array(ratios)
    assert len(ratios) > 80
    # two heuristics for a hard problem: the new one is behind on a few small cases, never by more
    # than a quarter of a percent, ahead by up to 7% and on average (the middle of the range, where
    # the two-pass packing never looked, is where it gains)
    assert ratios.max() <= 1.0025, ratios.max()
    assert (ratios > 1 + 1e-9).mean() < 0.1 and ratios.mean() < 0.999 and ratios.min() < 0.95


# ----------------------------------------------------------------------------- robust bound
def all_packings_best(L: np.ndarray, dp: int, cp: int, cost: CostModel, prices, bounds) -> float:
    """The least worst ratio over every assignment of the samples to DP ranks (no token limits)."""
    a = cost.token * L + cost.segment
    b = cost.pair * 0.5 * L * (L + 1.0)
    best = math.inf
    for assign in itertools.product(range(dp), repeat=len(L)):
        assign = np.array(assign)
        A = np.bincount(assign, weights=a, minlength=dp)
        B = np.bincount(assign, weights=b, minlength=dp)
        best = min(best, max(((A + f * B).max() / (cp * lb)) for f, lb in zip(prices, bounds)))
    return best


@pytest.mark.slow  # seconds of plans for every packing
def test_the_robust_bound_holds_for_every_packing():
    rng = np.random.default_rng(3)
    above_one = 0
    for trial in range(150):
        dp, cp = int(rng.choice([2, 2, 3])), int(rng.choice([1, 4]))
        n = int(rng.integers(dp + 2, 12 if dp == 2 else 8))
        big = int(rng.integers(1, dp))  # long samples, one or two ranks' worth at the high price
        L = np.concatenate([rng.integers(50, 3_000, n - big), rng.integers(6_000, 30_000, big)])
        rng.shuffle(L)
        profile = price_profile(L, dp, cp, FLOPS, (0.25, 2.0))
        optimum = all_packings_best(L.astype(np.float64), dp, cp, FLOPS, profile.prices, profile.bounds)
        assert profile.robust >= 1.0
        assert profile.robust <= optimum * (1 + 1e-9), (trial, L, profile.robust, optimum)
        above_one += profile.robust > 1.0 + 1e-6
    assert above_one > 5, "the bound is above the per-price bounds where one plan cannot meet them all"


@pytest.mark.slow  # seconds of plans over the whole price range
def test_the_price_points_hold_the_worst_ratio_over_the_range():
    rng = np.random.default_rng(4)
    grid = np.linspace(0.25, 2.0, 701)
    for _ in range(60):
        dp, cp = int(rng.integers(2, 9)), int(rng.choice([1, 2, 8]))
        L = random_lengths(rng, int(dp * rng.integers(2, 20)), int(rng.integers(0, 3)))
        assign = rng.integers(0, dp, len(L))
        profile = price_profile(L, dp, cp, FLOPS, (0.25, 2.0))

        def ratio(f: float) -> float:
            priced = dataclasses.replace(FLOPS, pair=FLOPS.pair * f)
            w = priced.sample_cost(L)
            return np.bincount(assign, weights=w, minlength=dp).max() / (cp * step_lower_bound(w, L, dp, cp, priced))

        at_points = max(ratio(f) for f in profile.prices)
        assert max(ratio(f) for f in grid) <= at_points * (1 + 1e-9)
        assert profile.prices[0] == 0.25 and profile.prices[-1] == 2.0


def test_plan_gaps_are_measured_against_the_robust_bound():
    rng = np.random.default_rng(9)
    lengths = random_lengths(rng, 1500, 1)
    robust = make_plan(lengths, PlanConfig(dp=8, cp=4, tokens_per_rank=16384, samples_per_step=256))
    costs = plan_costs(robust)
    assert (costs["robust_gap"] >= -1e-9).all() and (costs["robust_bound"] >= 1).all()
    assert np.isin(costs["worst_price"], [0.25, 2.0]).any() or (costs["worst_price"] > 0.25).all()
    exact = make_plan(lengths, PlanConfig(dp=8, cp=4, tokens_per_rank=16384, samples_per_step=256,
                                          pair_price_range=(1, 1)))  # fmt: skip
    costs = plan_costs(exact)
    assert np.array_equal(costs["robust_gap"], costs["gap"]) and (costs["robust_bound"] == 1).all()
