"""Random valid plans (hypothesis strategies) for the plan-contract, cost and metrics tests.

Plans are built independently of the balancer (random packing, random cuts, random rank per
piece) so the tests exercise the contract, not one planner's habits.
"""

from __future__ import annotations

from hypothesis import strategies as st

from ringpack.cost import CostModel
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, Step, microbatch_from_shards


@st.composite
def random_microbatch(draw, samples: list[int], lengths: list[int], cp: int) -> MicroBatch:
    """Cut each sample at random points and scatter the pieces over random CP ranks."""
    shards: list[list[Piece]] = [[] for _ in range(cp)]
    for sample in samples:
        length = lengths[sample]
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, length - 1)), max_size=3)) if length > 1 else []))
        bounds = [0, *[c for c in cuts if 0 < c < length], length]
        for start, stop in zip(bounds, bounds[1:]):
            shards[draw(st.integers(0, cp - 1))].append(Piece(sample, start, stop))
    return microbatch_from_shards(samples, shards, lengths)


@st.composite
def random_plan(draw, max_samples: int = 24, max_len: int = 40) -> Plan:
    dp = draw(st.integers(1, 3))
    cp = draw(st.integers(1, 4))
    steps_n = draw(st.integers(1, 2))
    mbs_per_rank = draw(st.integers(1, 2))
    bins = steps_n * dp * mbs_per_rank
    n = draw(st.integers(bins, max(bins, max_samples)))
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    order = draw(st.permutations(range(n)))
    n_dropped = draw(st.integers(0, min(2, n - bins)))
    dropped, planned = sorted(order[:n_dropped]), list(order[n_dropped:])
    groups: list[list[int]] = [[s] for s in planned[:bins]]
    for s in planned[bins:]:
        groups[draw(st.integers(0, bins - 1))].append(s)
    mbs = [draw(random_microbatch(g, lengths, cp)) for g in groups]
    budget = max(shard.num_tokens for mb in mbs for shard in mb.shards) or 1
    steps = []
    k = 0
    for _ in range(steps_n):
        ranks = []
        for _ in range(dp):
            ranks.append(tuple(mbs[k : k + mbs_per_rank]))
            k += mbs_per_rank
        steps.append(Step(tuple(ranks), lower_bound=draw(st.none() | st.floats(0, 1e6))))
    config = PlanConfig(
        dp=dp,
        cp=cp,
        tokens_per_rank=budget + draw(st.integers(0, 5)),
        strategy=draw(st.sampled_from(["balanced", "zigzag", "contiguous"])),
        seed=draw(st.integers(0, 2**31)),
        cost=CostModel.preset(draw(st.sampled_from(["llama3-8b", "tiny"]))),
    )
    origins: tuple[tuple[int, int], ...] = ()
    if draw(st.booleans()):  # documents cut from input samples (overflow="split")
        origins = tuple((k // 2, (k % 2) * 1000) for k in range(n))
    return Plan(config=config, lengths=tuple(lengths), steps=tuple(steps), dropped=tuple(dropped), origins=origins)
