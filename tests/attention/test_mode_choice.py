"""``mode="auto"``: the per-micro-batch pick (ringpack/attention/mode_choice.py) and its runs.

Single-process tests check what the pick chooses on micro-batches whose answer is known (fast
links and one rank holding the causal tail: head-parallel; every sample whole on its own rank:
no exchange, so the ring), that it never picks a mode the heads cannot split, that every rank
picks the same, and that a schedule without a pick is refused. One spawn of 4 gloo processes
(``slow``) runs ``mode="auto"`` over micro-batches that pick different modes, the hybrid among
them, one after another on one group, forward and backward against the dense reference in fp64.
"""

from __future__ import annotations

import pickle
import zlib

import pytest
import torch.distributed as dist

from ringpack.attention import ModeChoice, ScheduleOptions, compile_schedule, ring_attention
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.errors import DataError, PlanError
from ringpack.shard_plan import Piece, microbatch_from_shards
from tests.helpers.attention import Problem, dense_reference, max_errors, run_processes, within

TOL = 1e-10
FAST = CommModel(bandwidth=1e30, latency=0.0, inter_bandwidth=1e30, inter_latency=0.0, heads=8, kv_heads=2)
SLOW = CommModel(bandwidth=1e3, latency=1e-3, inter_bandwidth=1e2, inter_latency=1e-2, heads=8, kv_heads=2)
MODEL = CostModel(token=1.0, pair=1.0, unit="s")


def tail_on_last_rank(cp: int, length: int = 64):
    """One sample split contiguously: the last rank holds the causal tail (most pairs)."""
    step = length // cp
    shards = [[Piece(0, r * step, (r + 1) * step if r < cp - 1 else length)] for r in range(cp)]
    return microbatch_from_shards([0], shards, {0: length}), {0: length}


def whole_samples(cp: int, length: int = 16):
    """Every rank one whole sample of its own: nothing moves under a sequence split."""
    lengths = {s: length for s in range(cp)}
    return microbatch_from_shards(list(lengths), [[Piece(s, 0, length)] for s in range(cp)], lengths), lengths


def test_fast_links_and_a_causal_tail_pick_head_parallel():
    mb, _ = tail_on_last_rank(4)
    assert ModeChoice(cost=MODEL, comm=FAST).pick(mb) == "ulysses"
    assert ModeChoice(cost=MODEL, comm=FAST, modes=("ring", "p2p")).pick(mb) in ("ring", "p2p")


def test_whole_samples_on_their_own_ranks_pick_the_ring():
    mb, _ = whole_samples(4)
    # no K/V moves: the sequence modes tie at the compute (the first listed wins); ulysses pays its all-to-alls
    assert ModeChoice(cost=MODEL, comm=SLOW).pick(mb) == "ring"
    assert ModeChoice(cost=MODEL, comm=SLOW, modes=("ulysses", "allgather", "ring")).pick(mb) == "allgather"


def test_heads_that_do_not_split_are_never_picked():
    mb, _ = tail_on_last_rank(4)
    six_heads = CommModel(bandwidth=1e30, latency=0.0, heads=6, kv_heads=2)
    assert ModeChoice(cost=MODEL, comm=six_heads).pick(mb) != "ulysses"
    with pytest.raises(PlanError, match=r"mode='auto': no mode of \['ulysses'\].*6 query heads over 4 ranks"):
        ModeChoice(cost=MODEL, comm=six_heads, modes=("ulysses",)).pick(mb)


def test_the_hybrid_is_a_candidate_over_nodes_only():
    mb, _ = tail_on_last_rank(4)
    choice = ModeChoice(cost=MODEL, comm=FAST, modes=("ring", "ulysses+p2p"))
    assert choice.pick(mb, gpus_per_node=2) == "ulysses+p2p"
    assert choice.pick(mb) == "ring"  # one node: the hybrid cannot run


def test_every_rank_compiles_the_same_pick_and_it_travels_with_the_schedule():
    mb, _ = tail_on_last_rank(4)
    options = ScheduleOptions(mode_choice=ModeChoice(cost=MODEL, comm=FAST), gpus_per_node=2)
    schedules = [compile_schedule(mb, r, options=options) for r in range(4)]
    assert {s.mode for s in schedules} == {"ulysses"}
    for copy in (schedules[1].to("cpu"), pickle.loads(pickle.dumps(schedules[1]))):
        assert copy.mode == "ulysses"
    assert compile_schedule(mb, 0).mode is None


def test_bad_choices_are_refused_naming_the_field():
    with pytest.raises(PlanError, match="ModeChoice.modes must be some of"):
        ModeChoice(modes=("tree",))
    with pytest.raises(PlanError, match="ModeChoice.modes must be some of"):
        ModeChoice(modes=())
    with pytest.raises(PlanError, match="ModeChoice.cost must be a CostModel"):
        ModeChoice(cost="llama3-8b")
    with pytest.raises(PlanError, match="mode_choice must be None or a ModeChoice"):
        ScheduleOptions(mode_choice="auto")
    assert ModeChoice(modes="p2p").modes == ("p2p",)


def test_auto_without_a_pick_is_refused_in_one_line():
    mb, lengths = whole_samples(1)
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=0)
    q, k, v = (problem.local(x, 0) for x in (problem.q, problem.k, problem.v))
    with pytest.raises(DataError, match=r"^mode='auto' runs the mode picked .* ScheduleOptions\(mode_choice="):
        ring_attention(q, k, v, compile_schedule(mb, 0), mode="auto", backend="reference")


def test_auto_on_one_rank_matches_the_dense_reference():
    mb, lengths = tail_on_last_rank(1)
    problem = Problem.make(mb, lengths, 4, 2, 8, seed=3)
    sched = compile_schedule(mb, 0, options=ScheduleOptions(mode_choice=ModeChoice(cost=MODEL, comm=FAST)))
    q, k, v = (problem.local(x, 0).requires_grad_() for x in (problem.q, problem.k, problem.v))
    out = ring_attention(q, k, v, sched, mode="auto", backend="reference")
    out.backward(problem.local(problem.dout, 0))
    errors = max_errors(problem, 0, dense_reference(problem), {"out": out, "dq": q.grad, "dk": k.grad, "dv": v.grad})
    assert within(errors, TOL), errors


# ------------------------------------------------------------------------------- multi-process


def build_cases():
    """(name, micro-batch, lengths, options) on 4 ranks in nodes of 2, picking different modes."""
    fast = ModeChoice(cost=MODEL, comm=FAST)
    slow = ModeChoice(cost=MODEL, comm=SLOW)
    hybrid = ModeChoice(cost=MODEL, comm=FAST, modes=("ring", "ulysses+p2p"))
    cases = [
        ("tail-fast", *tail_on_last_rank(4), fast),
        ("whole-slow", *whole_samples(4), slow),
        ("tail-hybrid", *tail_on_last_rank(4, 40), hybrid),
    ]
    # a sample over ranks 0 and 3 only, rank 1 idle, rank 2 holding a piece of another's sample
    lengths = {0: 9, 1: 7}
    shards = [[Piece(0, 0, 4)], [], [Piece(1, 0, 7)], [Piece(0, 4, 9)]]
    cases.append(("ranks-0-and-3-fast", microbatch_from_shards([0, 1], shards, lengths), lengths, fast))
    cases.append(("ranks-0-and-3-slow", microbatch_from_shards([0, 1], shards, lengths), lengths, slow))
    options = {choice: ScheduleOptions(mode_choice=choice, gpus_per_node=2) for choice in (fast, slow, hybrid)}
    return [(name, mb, lengths, options[choice]) for name, mb, lengths, choice in cases]


def worker(rank: int, world: int) -> list:
    report = []
    for name, mb, lengths, options in build_cases():
        problem = Problem.make(mb, lengths, 8, 2, 4, seed=zlib.crc32(name.encode()) % 10_000)
        sched = compile_schedule(mb, rank, options=options)
        q, k, v = (problem.local(x, rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
        out = ring_attention(q, k, v, sched, group=dist.group.WORLD, mode="auto", backend="reference")
        out.backward(problem.local(problem.dout, rank))
        grads = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
        report.append((name, sched.mode, max_errors(problem, rank, dense_reference(problem), grads)))
    return report


@pytest.mark.slow
def test_auto_switches_modes_per_microbatch_exactly():
    results = run_processes(4, worker)
    picks = {}
    for rank, report in enumerate(results):
        assert len(report) == len(build_cases())
        for name, mode, errors in report:
            assert within(errors, TOL), (name, rank, mode, errors)
            picks.setdefault(name, set()).add(mode)
    assert all(len(modes) == 1 for modes in picks.values()), picks  # every rank picked the same
    chosen = {name: modes.pop() for name, modes in picks.items()}
    assert chosen["tail-fast"] == "ulysses" and chosen["whole-slow"] == "ring", chosen
    assert chosen["tail-hybrid"] == "ulysses+p2p", chosen
    assert len(set(chosen.values())) >= 3, chosen


def test_the_pick_reads_the_remembered_partner_budget_decision(monkeypatch):
    """Under a partner budget, ``pick`` prices p2p from the micro-batch's remembered decision (the
    planner's, or the schedule's first count) and never counts every rank's partners again."""
    import ringpack.comm_model as comm_model
    import ringpack.traffic as traffic

    mb, _ = tail_on_last_rank(8)
    choice = ModeChoice(cost=MODEL, comm=SLOW, modes=("ring", "p2p"))
    expected = choice.pick(mb, gpus_per_node=2, max_partners=2)  # counts once, remembers it on mb

    def counted(*args, **kwargs):
        raise AssertionError("partners counted again")

    monkeypatch.setattr(comm_model, "_p2p_partners", counted)
    monkeypatch.setattr(traffic, "over_partner_budget", counted)
    assert choice.pick(mb, gpus_per_node=2, max_partners=2) == expected
    fresh, _ = tail_on_last_rank(8)
    with pytest.raises(AssertionError, match="partners counted again"):
        choice.pick(fresh, gpus_per_node=2, max_partners=2)
