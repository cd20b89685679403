"""Lower bounds on a step's cost, and the costs of a plan, vectorised over its piece table: what the
planner balances and the benchmark reports.

Per GPU ``(d, c)`` of step ``s``: ``mb_rank_cost[s, d, i, c]`` (CP rank ``c`` in micro-batch ``i``),
``rank_cost[s, d, c]`` (its sum over micro-batches), ``dp_cost[s, d]`` (the sum over micro-batches
of the max over CP ranks) and ``step_cost[s]`` (the max over DP ranks: the critical path), all in
the plan's cost unit. ``imbalance = step_cost / mean(rank_cost)`` and ``gap = step_cost /
lower_bound - 1``.

:func:`step_lower_bound` bounds a step's cost at one price; for a pair-price range,
:func:`bound_lines` (the bound as an envelope of lines in the price factor), :func:`price_points`
(where the worst ratio lies) and :func:`robust_bound` (a proven bound on that ratio, giving
``robust_gap``) judge a price-robust plan.

See docs/planner.md, "The lower bound".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from itertools import combinations
from typing import TYPE_CHECKING

import numpy as np

from ringpack.cost import CostModel, piece_pairs

if TYPE_CHECKING:
    from ringpack.shard_plan import Plan

__all__ = [
    "plan_costs",
    "cell_index",
    "rank_grid",
    "critical_path",
    "step_lower_bound",
    "bound_lines",
    "price_points",
    "robust_bound",
    "PriceProfile",
    "price_profile",
]

#: Facets per chain of the polygon that holds the small samples' zonotope in :func:`robust_bound`
#: (an outer approximation: fewer facets give a weaker bound, never a wrong one).
ZONOTOPE_FACETS = 32


# ------------------------------------------------------------------------------------ one price
def step_lower_bound(weights: np.ndarray, lengths: np.ndarray, dp: int, cp: int, cost: CostModel) -> float:
    """A proven lower bound on the step cost (the slowest DP rank's sum of micro-batch costs).

    ``weights`` are whole-sample costs (``CostModel.sample_cost``). A micro-batch costs at least
    the mean of its CP ranks, and the CP ranks of a micro-batch together hold exactly its
    samples' tokens and pairs and at least one segment per sample, so a DP rank costs at least
    ``sum(weights of its samples) / cp``. Hence the step costs at least

    * ``sum(weights) / (dp * cp)`` (some DP rank has at least the mean);
    * ``(w[k*dp-k] + ... + w[k*dp]) / cp`` for every ``k >= 0`` with ``w`` sorted descending
      (pigeonhole: some DP rank holds ``k+1`` of the ``k*dp+1`` costliest samples);
    * ``token + pair*L + segment`` for every sample (the piece holding its last token).
    """
    w = np.sort(np.asarray(weights, dtype=np.float64))[::-1]
    n = len(w)
    bound = math.fsum(w.tolist()) / (dp * cp)  # exactly rounded: identical on every CPU and NumPy build
    cs = np.concatenate([[0.0], np.cumsum(w)])
    k = np.arange(0, (n - 1) // dp + 1)
    if k.size:
        bound = max(bound, float((cs[k * dp + 1] - cs[k * dp - k]).max()) / cp)
    last_token = cost.token + cost.pair * float(np.max(lengths)) + cost.segment
    return max(bound, last_token)


# ----------------------------------------------------------------------------- a range of prices
def _split_costs(lengths: np.ndarray, cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Each whole sample's cost as ``a + f * b`` at pair-price factor ``f``: ``(a, b)``, float64."""
    L = np.asarray(lengths, dtype=np.float64)
    return cost.token * L + cost.segment, cost.pair * (0.5 * L * (L + 1.0))


def bound_lines(lengths: np.ndarray, dp: int, cp: int, cost: CostModel) -> np.ndarray:
    """The terms of :func:`step_lower_bound` as lines in the pair-price factor ``f``.

    At factor ``f`` (the cost model with ``pair * f``) every term is ``alpha + f * beta``: the
    mean, each pigeonhole sum (the samples sorted by length are sorted by cost at every price) and
    the last token of the longest sample. Returns ``float64[J, 2]`` rows ``(alpha, beta)``; the
    bound at ``f`` is the largest ``alpha + f * beta``.
    """
    L = np.asarray(lengths, dtype=np.int64)
    a, b = _split_costs(np.sort(L)[::-1], cost)
    n = len(L)
    ca = np.concatenate([[0.0], np.cumsum(a)])
    cb = np.concatenate([[0.0], np.cumsum(b)])
    k = np.arange(0, (n - 1) // dp + 1)
    hi, lo = k * dp + 1, k * dp - k
    lines = np.empty((k.size + 2, 2))
    lines[0] = ca[-1] / (dp * cp), cb[-1] / (dp * cp)
    lines[1:-1, 0] = (ca[hi] - ca[lo]) / cp
    lines[1:-1, 1] = (cb[hi] - cb[lo]) / cp
    lines[-1] = cost.token + cost.segment, cost.pair * float(L.max())
    return lines


def price_points(lines: np.ndarray, price_range: tuple[float, float]) -> np.ndarray:
    """The ends of ``price_range`` and the kinks of the upper envelope of ``lines`` between them.

    A step's cost is convex in the price factor and its bound (the envelope) is linear between
    kinks, so their ratio is largest at one of these points: a plan within ``g`` of the bound at
    each of them is within ``g`` at every price of the range. Returns ``float64[P]``, ascending.
    """
    low, high = (float(x) for x in price_range)
    if low == high:
        return np.array([low])
    alpha, beta = lines[:, 0], lines[:, 1]
    points, f = [low], low
    for _ in range(len(lines)):  # each kink moves to a steeper line
        values = alpha + f * beta
        top = values.max()
        on = values >= top - 1e-12 * abs(top)
        slope = beta[on].max()
        steeper = beta > slope * (1 + 1e-12)
        if not steeper.any():
            break
        i = np.flatnonzero(on)[np.argmax(beta[on])]
        cross = (alpha[i] - alpha[steeper]) / (beta[steeper] - beta[i])
        cross = cross[cross > f * (1 + 1e-12)]
        if not cross.size or cross.min() >= high * (1 - 1e-12):
            break
        f = float(cross.min())
        points.append(f)
    points.append(high)
    return np.array(points)


def robust_bound(
    lengths: np.ndarray, dp: int, cp: int, cost: CostModel, prices: np.ndarray, bounds: np.ndarray
) -> float:
    """A proven lower bound on ``max over prices of (step cost / bound)``, over all plans: >= 1.

    Args:
        lengths: int64 ``[n]``, the step's samples.
        dp, cp: the mesh.
        cost: the cost model (price factor 1).
        prices: ``float64[P]`` price factors (:func:`price_points`).
        bounds: ``float64[P]``, the step's lower bound at each price (cost units, > 0).

    Returns:
        ``R >= 1`` such that every plan of these samples has ``step cost > (R - tiny) * bound`` at
        some price: the best a price-robust plan can do.

    Why it can exceed 1: take the ``c`` longest samples. If two of them share a DP rank, that rank
    costs at least their sum at every price. Otherwise ``c`` ranks hold one each and the other
    ``dp - c`` none; split the remaining (small) samples fractionally between the two groups (a
    relaxation: the group of ``c`` ranks gets a vector ``x`` of the small samples' summed
    ``(token + segment, pair)`` costs, any point of their zonotope) and bound each group's mean
    rank at every price. The bound is the smaller of the two cases, largest over the ``c`` tried;
    the group LP is solved exactly in two dimensions over an outer polygon of the zonotope
    (:data:`ZONOTOPE_FACETS` facets a chain), which can only weaken it.
    """
    L = np.asarray(lengths, dtype=np.int64)
    n = len(L)
    top_c = min(dp - 1, n - 1)
    prices = np.asarray(prices, dtype=np.float64)
    scale = cp * np.asarray(bounds, dtype=np.float64)  # a DP rank's load at each price is >= this
    if top_c < 1 or cost.pair == 0 or prices.size < 2:
        return 1.0
    a, b = _split_costs(L, cost)
    desc = np.argsort(-L, kind="stable")
    a, b, L = a[desc], b[desc], L[desc]
    # the samples ascending by length (= by pair share of cost), grouped by length: one zonotope
    # edge per length, and the zonotope's lower chain (the edges added in that order from 0)
    lengths_up, first_up = np.unique(L[::-1], return_index=True)
    edges = np.stack([np.add.reduceat(a[::-1], first_up), np.add.reduceat(b[::-1], first_up)], axis=1)
    chain = np.concatenate([[[0.0, 0.0]], np.cumsum(edges, axis=0)])
    unit = np.stack([a[::-1][first_up], b[::-1][first_up]], axis=1)  # one sample of each length
    ca, cb = np.cumsum(a), np.cumsum(b)
    best = 1.0
    tried = {*range(1, min(top_c, 16) + 1), *np.geomspace(16, max(top_c, 16), 16).round().astype(int).tolist()}
    for c in sorted(c for c in tried if c <= top_c):
        shared = math.inf
        if c >= 2:  # two of the c longest on one rank: at least the two shortest of them
            shared = float((((a[c - 2] + a[c - 1]) + prices * (b[c - 2] + b[c - 1])) / scale).max())
        if shared <= best:
            continue
        # the small samples: all but the c longest (a length tied with the c-th keeps its other samples)
        keep = int(np.searchsorted(lengths_up, L[c - 1]))  # lengths below the c-th longest
        tied_left = int(np.searchsorted(-L, -L[c - 1], side="right")) - c
        polygon = _zonotope_outer(chain, edges, keep, unit[keep] * tied_left if tied_left else None)
        if polygon is None:
            continue
        big = np.array([ca[c - 1], cb[c - 1]])
        best = max(best, min(shared, _split_lp(big, polygon, c, dp - c, prices, scale)))
    return best


def _split_lp(big: np.ndarray, polygon: np.ndarray, c: int, rest: int, prices: np.ndarray, scale: np.ndarray) -> float:
    """``min over x in Z of max over prices of max(G(x), H(x))`` (see :func:`robust_bound`).

    ``G = (big + x) / (c * scale)`` is the mean of the ``c`` ranks holding the long samples,
    ``H = (S - x) / (rest * scale)`` the mean of the others, both at each price; ``polygon``
    holds the zonotope ``Z`` of the small samples: its vertex 0 is the origin, the last of its
    lower chain (the middle vertex) their sum ``S`` (:func:`_zonotope_outer`).
    """
    total = polygon[(len(polygon) + 1) // 2]
    unit = np.where(total > 0, total, 1.0)  # x in units of the small samples' totals: well conditioned
    direction = np.stack([np.ones_like(prices), prices], axis=1) * unit
    slopes = np.concatenate([direction / (c * scale)[:, None], -direction / (rest * scale)[:, None]])
    offsets = np.concatenate(
        [(big[0] + prices * big[1]) / (c * scale), (total[0] + prices * total[1]) / (rest * scale)]
    )
    return _min_max_affine(polygon / unit, slopes, offsets)


def _zonotope_outer(chain: np.ndarray, edges: np.ndarray, keep: int, tied: np.ndarray | None) -> np.ndarray | None:
    """A convex polygon (counter-clockwise vertices) holding the zonotope of ``edges[:keep]`` and ``tied``.

    The edges are in the positive quadrant, ascending in angle, ``chain`` their running sums from
    0; ``tied`` (or ``None``) is one more edge, the last. The zonotope's lower chain adds the
    edges in order from 0 to their sum ``S``, its upper chain is that chain reflected through
    ``S / 2``. With more than ``2 * ZONOTOPE_FACETS`` edges the chain keeps every few vertices and,
    between two kept ones, the meeting point of the first and last edge's lines (outside the
    chain). ``None`` without edges.
    """
    k = keep + (tied is not None)
    if k == 0:
        return None

    def vertex(i: np.ndarray) -> np.ndarray:
        if tied is None:
            return chain[i]
        return np.where((i > keep)[:, None], chain[keep] + tied, chain[np.minimum(i, keep)])

    def edge(i: np.ndarray) -> np.ndarray:
        return edges[i] if tied is None else np.where((i == keep)[:, None], tied, edges[np.minimum(i, len(edges) - 1)])

    if k <= 2 * ZONOTOPE_FACETS:
        points = vertex(np.arange(k + 1))
    else:
        cut = np.unique(np.linspace(0, k, ZONOTOPE_FACETS + 1).round().astype(np.int64))
        start, stop = cut[:-1], cut[1:]
        p0, p1, d1, d2 = vertex(start), vertex(stop), edge(start), edge(stop - 1)
        gap = p1 - p0
        det = d1[:, 0] * d2[:, 1] - d1[:, 1] * d2[:, 0]  # >= 0: the chain turns left
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (gap[:, 0] * d2[:, 1] - gap[:, 1] * d2[:, 0]) / det
        corner = p0 + np.where(det > 0, t, 0.0)[:, None] * d1
        points = np.empty((2 * len(start) + 1, 2))
        points[0:-1:2], points[1::2], points[-1] = p0, corner, p1[-1]
    return np.concatenate([points, points[-1] - points[1:-1]])


_COMBINATIONS: dict[tuple[int, int], np.ndarray] = {}


def _combinations(n: int, k: int) -> np.ndarray:
    """``int64[C(n, k), k]``: every ``k``-subset of ``range(n)`` (cached)."""
    if (n, k) not in _COMBINATIONS:
        _COMBINATIONS[n, k] = np.array(list(combinations(range(n), k)), dtype=np.int64).reshape(-1, k)
    return _COMBINATIONS[n, k]


def _min_max_affine(polygon: np.ndarray, slopes: np.ndarray, offsets: np.ndarray) -> float:
    """``min over x in polygon of max_j slopes[j] . x + offsets[j]``, exactly (a 2-D LP).

    The minimum is at a vertex of the polygon cut by the lines where two pieces are equal: a
    polygon vertex, a point where such a line crosses an edge, or a point inside where three
    pieces are equal. All are candidates; the smallest maximum among them is the answer.
    """
    nxt = np.roll(polygon, -1, axis=0)
    candidates = [polygon]
    pairs = _combinations(len(offsets), 2)
    du, da = slopes[pairs[:, 0]] - slopes[pairs[:, 1]], offsets[pairs[:, 0]] - offsets[pairs[:, 1]]
    sp, sq = polygon @ du.T + da, nxt @ du.T + da
    e, p = np.nonzero((sp * sq <= 0) & (sp != sq))
    t = sp[e, p] / (sp[e, p] - sq[e, p])
    candidates.append(polygon[e] + t[:, None] * (nxt[e] - polygon[e]))
    if len(offsets) >= 3:
        tri = _combinations(len(offsets), 3)
        r1, r2 = slopes[tri[:, 0]] - slopes[tri[:, 1]], slopes[tri[:, 0]] - slopes[tri[:, 2]]
        c1, c2 = offsets[tri[:, 1]] - offsets[tri[:, 0]], offsets[tri[:, 2]] - offsets[tri[:, 0]]
        det = r1[:, 0] * r2[:, 1] - r1[:, 1] * r2[:, 0]
        ok = det != 0
        x = np.stack([(c1 * r2[:, 1] - r1[:, 1] * c2)[ok], (r1[:, 0] * c2 - c1 * r2[:, 0])[ok]], axis=1) / det[ok, None]
        edge = nxt - polygon
        cross = edge[None, :, 0] * (x[:, None, 1] - polygon[None, :, 1]) - edge[None, :, 1] * (
            x[:, None, 0] - polygon[None, :, 0]
        )
        candidates.append(x[(cross >= -1e-9).all(axis=1)])
    points = np.concatenate(candidates)
    return float((points @ slopes.T + offsets).max(axis=1).min())


@dataclasses.dataclass(frozen=True)
class PriceProfile:
    """What a step is balanced for and judged against over a pair-price range.

    Attributes:
        prices: ``float64[P]``, the price factors (:func:`price_points`; ``[1.0]`` for exact prices).
        bounds: ``float64[P]``, the step's lower bound at each (:func:`step_lower_bound`).
        robust: :func:`robust_bound` (1.0 for exact prices).
    """

    prices: np.ndarray
    bounds: np.ndarray
    robust: float


def price_profile(
    lengths: np.ndarray, dp: int, cp: int, cost: CostModel, price_range: tuple[float, float]
) -> PriceProfile:
    """:class:`PriceProfile` of a step's samples ``lengths`` over ``price_range`` (factors of ``cost.pair``)."""
    L = np.asarray(lengths, dtype=np.int64)
    if tuple(price_range) == (1.0, 1.0) or cost.pair == 0:
        return PriceProfile(np.array([1.0]), np.array([step_lower_bound(cost.sample_cost(L), L, dp, cp, cost)]), 1.0)
    lines = bound_lines(L, dp, cp, cost)
    prices = price_points(lines, price_range)
    bounds = np.array([(lines[:, 0] + f * lines[:, 1]).max() for f in prices])
    return PriceProfile(prices, bounds, robust_bound(L, dp, cp, cost, prices, bounds))


def cell_index(
    arrays: Mapping[str, np.ndarray], dp: int, shape: tuple[int, int, int] | None = None
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Map each piece row to its (step, dp, micro-batch) cell of a dense ``(S, D, M)`` grid.

    ``arrays``: the plan's piece table (``step``, ``dp``, ``microbatch`` columns, one row per
    piece); ``shape``: the grid, by default just large enough. Returns ``(int64 cell per row,
    shape)``. Raises ``ValueError`` when a row names a DP rank outside ``[0, dp)``.
    """
    step, d, mb = (np.asarray(arrays[k], dtype=np.int64) for k in ("step", "dp", "microbatch"))
    if shape is None:
        shape = (int(step.max()) + 1, dp, int(mb.max()) + 1) if step.size else (0, dp, 0)
    if d.size and (d.min() < 0 or d.max() >= dp):
        raise ValueError(f"plan names DP rank {int(d.max())}, config has dp={dp}")
    return (step * shape[1] + d) * shape[2] + mb, shape


def rank_grid(
    arrays: Mapping[str, np.ndarray], dp: int, cp: int, shape: tuple[int, int, int] | None = None
) -> tuple[Callable[[np.ndarray | None], np.ndarray], np.ndarray, tuple[int, int, int]]:
    """Sum per-piece quantities into ``(S, D, M, C)`` rank cells, exactly (int64 when given ints).

    Returns ``(per_rank, cell, shape)``: ``per_rank(values)`` sums one value per piece row into its
    rank's cell (``None`` counts pieces); ``cell`` is each row's (step, dp, micro-batch) cell.
    Raises ``ValueError`` when a row names a DP or CP rank outside the config's.
    """
    cell, (S, D, M) = cell_index(arrays, dp, shape)
    c = np.asarray(arrays["cp"], dtype=np.int64)
    if c.size and (c.min() < 0 or c.max() >= cp):
        raise ValueError(f"plan names CP rank {int(c.max())}, config has cp={cp}")
    flat = cell * cp + c

    def per_rank(values: np.ndarray | None) -> np.ndarray:
        """``values`` (one per piece row; ``None``: 1 each) summed into ``(S, D, M, C)`` rank cells."""
        values = np.ones(flat.size, dtype=np.int64) if values is None else np.asarray(values)
        out = np.zeros(S * D * M * cp, dtype=values.dtype)
        np.add.at(out, flat, values)
        return out.reshape(S, D, M, cp)

    return per_rank, cell, (S, D, M)


def critical_path(rank_cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dp_cost[S, D], step_cost[S])`` of ``(S, D, M, C)`` rank costs: the definitions above."""
    dp_cost = rank_cost.max(axis=3).sum(axis=2)
    return dp_cost, dp_cost.max(axis=1)


def plan_costs(plan: Plan) -> dict[str, np.ndarray]:
    """Per-step cost arrays of ``plan`` (see the module docstring), plus ``imbalance`` and the gaps.

    Returns a dict of arrays: ``mb_rank_cost[S, D, M, C]``, ``rank_cost[S, D, C]``, ``dp_cost[S, D]``,
    ``step_cost[S]``, ``mean_rank_cost[S]``, ``lower_bound[S]`` (``Step.lower_bound``, at the model's
    prices; NaN where unknown), ``imbalance[S]``, ``gap[S]`` (``step_cost / lower_bound - 1``), and
    over the plan's pair-price range (``config.price_range``; only the model's prices when it is
    ``(1, 1)``): ``robust_bound[S]`` (:func:`robust_bound`, 1 for exact prices), ``robust_gap[S]``
    (the largest over the step's :func:`price_points` of ``step cost / (robust_bound * bound) - 1``;
    ``gap`` for exact prices) and ``worst_price[S]`` (the price factor where it is largest).
    """
    cfg = plan.config
    a = plan.piece_arrays
    m = max((len(step.microbatches[0]) for step in plan.steps), default=0)
    per_rank, _, _ = rank_grid(a, cfg.dp, cfg.cp, shape=(plan.num_steps, cfg.dp, max(m, 1)))
    tokens, pairs, pieces = (
        per_rank(a["stop"] - a["start"]),
        per_rank(piece_pairs(a["start"], a["stop"])),
        per_rank(None),
    )
    mb_rank = cfg.cost.cost(tokens, pairs, pieces)
    rank_cost = mb_rank.sum(axis=2)
    dp_cost, step_cost = critical_path(mb_rank)
    mean = rank_cost.reshape(plan.num_steps, -1).mean(axis=1)
    bounds = np.array([np.nan if s.lower_bound is None else s.lower_bound for s in plan.steps], dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        imbalance = step_cost / mean
        gap = step_cost / bounds - 1.0
    robust = np.ones(plan.num_steps)
    robust_gap, worst = gap.copy(), np.ones(plan.num_steps)
    if cfg.price_range != (1.0, 1.0) and cfg.cost.pair > 0 and plan.num_steps:
        robust, robust_gap, worst = _robust_gaps(plan, a, tokens, pairs, pieces)
    return {
        "mb_rank_cost": mb_rank,
        "rank_cost": rank_cost,
        "dp_cost": dp_cost,
        "step_cost": step_cost,
        "mean_rank_cost": mean,
        "lower_bound": bounds,
        "imbalance": imbalance,
        "gap": gap,
        "robust_bound": robust,
        "robust_gap": robust_gap,
        "worst_price": worst,
    }


def _robust_gaps(
    plan: Plan, arrays: Mapping[str, np.ndarray], tokens: np.ndarray, pairs: np.ndarray, pieces: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(robust_bound, robust_gap, worst_price)`` per step of a plan balanced for a pair-price range."""
    cfg, S = plan.config, plan.num_steps
    lengths = np.asarray(plan.lengths, dtype=np.int64)
    first = np.asarray(arrays["start"]) == 0  # every planned sample has one piece starting at 0
    step_of, sample_of = np.asarray(arrays["step"])[first], np.asarray(arrays["sample"])[first]
    order = np.argsort(step_of, kind="stable")
    edges = np.searchsorted(step_of[order], np.arange(S + 1))
    profiles = [
        price_profile(lengths[sample_of[order[edges[s] : edges[s + 1]]]], cfg.dp, cfg.cp, cfg.cost, cfg.price_range)
        for s in range(S)
    ]
    width = max(p.prices.size for p in profiles)
    prices = np.array([np.resize(p.prices, width) for p in profiles])  # (S, P), a step's own points repeated
    lows = np.array([np.resize(p.bounds, width) for p in profiles])
    robust = np.array([p.robust for p in profiles])
    costs = np.empty((S, width))
    base = cfg.cost.token * tokens + cfg.cost.segment * pieces
    for j in range(width):
        costs[:, j] = critical_path(base + (cfg.cost.pair * prices[:, j])[:, None, None, None] * pairs)[1]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = costs / (lows * robust[:, None])
    at = np.argmax(ratio, axis=1)
    rows = np.arange(S)
    return robust, ratio[rows, at] - 1.0, prices[rows, at]
