"""Pool plans at the partner budget's edge, exact over real process groups: gloo, CPU, fp64, 8 ranks.

Pool plans of 8 ranks in nodes of 2 (the node-relayed targeted exchange): a budget equal to the
micro-batch's most partners runs the exchange as planned; one below it either splits the
micro-batch tighter (the planner) or, where that is still over it, runs the ring under
``mode="p2p"`` (the schedules). Each case runs forward and backward against the dense reference
to 1e-10. A schedule made to claim a budget its exchange exceeds is refused on every rank, the
offending rank named with its partners and the budget.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch.distributed as dist

import ringpack
from ringpack.attention import ScheduleMismatchError, compile_schedule, ring_attention
from ringpack.shard_plan import MicroBatch
from ringpack.traffic import exchange_partners
from tests.helpers.attention import Problem, dense_reference, max_errors, run_processes, within

TOL = 1e-10
WORLD, NODE, TOKENS = 8, 2, 12
#: (name, lengths): "tighter" holds 5 partners a rank at most, and 3 once split tighter; "ring"
#: holds 6, and no tighter split brings it to 5.
LENGTHS = {"tighter": [13, 8, 3], "ring": [3, 1, 3, 1, 3, 36]}


def pool_microbatch(lengths: list[int], max_partners: int) -> MicroBatch:
    plan = ringpack.plan(
        lengths,
        world=WORLD,
        gpus_per_node=NODE,
        tokens_per_rank=TOKENS,
        samples_per_step=0,
        microbatches_per_rank=1,
        max_partners=max_partners,
    )
    return plan.steps[0].microbatches[0][0]


def most_partners(mb: MicroBatch) -> int:
    rank, sample, start, stop = mb.piece_columns
    return int(exchange_partners(np.zeros_like(rank), rank, sample, start, stop, 1, WORLD, NODE).max())


def build_cases() -> list[tuple[str, MicroBatch, dict[int, int], int]]:
    """(name, micro-batch, lengths, budget): each plan at its edge and one below, identical on every rank."""
    cases = []
    for name, lengths in LENGTHS.items():
        free = pool_microbatch(lengths, 0)
        edge = most_partners(free)
        cases.append((f"{name}:at-edge", pool_microbatch(lengths, edge), dict(enumerate(lengths)), edge))
        cases.append((f"{name}:below", pool_microbatch(lengths, edge - 1), dict(enumerate(lengths)), edge - 1))
    return cases


def _errors(problem: Problem, schedule, rank: int, ref: dict) -> dict[str, float]:
    q, k, v = (problem.local(x, rank).requires_grad_() for x in (problem.q, problem.k, problem.v))
    out = ring_attention(q, k, v, schedule, mode="p2p", backend="reference")
    out.backward(problem.local(problem.dout, rank))
    return max_errors(problem, rank, ref, {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad})


def worker(rank: int, world: int) -> list[dict]:
    report = []
    for j, (name, mb, lengths, budget) in enumerate(build_cases()):
        problem = Problem.make(mb, lengths, 4, 2, 4, seed=100 + j)
        ref = dense_reference(problem)
        schedule = compile_schedule(mb, rank, gpus_per_node=NODE, max_partners=budget)
        ex = schedule.exchange
        report.append(
            {
                "name": name,
                "errors": _errors(problem, schedule, rank, ref),
                "fallback": schedule.partner_fallback,
                "partners": None if ex is None else ex.partners,
            }
        )
    # a schedule that claims a budget below its exchange's partners
    name, mb, lengths, budget = build_cases()[0]
    schedule = compile_schedule(mb, rank, gpus_per_node=NODE, max_partners=budget)
    claimed = dataclasses.replace(schedule, max_partners=budget - 1, verified=set())
    problem = Problem.make(mb, lengths, 4, 2, 4, seed=7)
    try:
        _errors(problem, claimed, rank, dense_reference(problem))
        refused = None
    except ScheduleMismatchError as exc:
        refused = str(exc)
    report.append({"name": "refused", "message": refused, "partners": schedule.exchange.partners})
    dist.barrier()
    return report


@pytest.fixture(scope="module")
def spawned() -> list[list[dict]]:
    return run_processes(WORLD, worker, join_s=300.0)


def test_the_cases_sit_at_the_edge():
    cases = {name: (mb, budget) for name, mb, _, budget in build_cases()}
    for name in LENGTHS:
        at, edge = cases[f"{name}:at-edge"]
        below, lower = cases[f"{name}:below"]
        assert most_partners(at) == edge == lower + 1
        assert at == pool_microbatch(LENGTHS[name], 0)  # a budget at the edge changes nothing
    tighter, budget = cases["tighter:below"]
    assert most_partners(tighter) <= budget and tighter != cases["tighter:at-edge"][0]
    ring, budget = cases["ring:below"]
    assert most_partners(ring) > budget and ring == cases["ring:at-edge"][0]


@pytest.mark.slow
def test_every_case_is_exact_and_within_the_budget(spawned):
    cases = {name: budget for name, _, _, budget in build_cases()}
    rows = [row for ranks in spawned for row in ranks if row["name"] != "refused"]
    assert len(rows) == WORLD * len(cases)
    bad = [(row["name"], row["errors"]) for row in rows if not within(row["errors"], TOL)]
    assert not bad, f"errors not below {TOL}: {bad[:4]}"
    for name, budget in cases.items():
        ranks = [row for row in rows if row["name"] == name]
        if name == "ring:below":  # over the budget: every rank runs the ring, no exchange map
            assert all(row["fallback"] and row["partners"] is None for row in ranks)
        else:
            assert not any(row["fallback"] for row in ranks)
            assert max(row["partners"] for row in ranks) <= budget
    at_edge = [row["partners"] for row in rows if row["name"] == "tighter:at-edge"]
    assert max(at_edge) == cases["tighter:at-edge"]  # some rank uses the whole budget


@pytest.mark.slow
def test_an_exchange_over_its_budget_is_refused_on_every_rank_naming_the_rank(spawned):
    rows = [row for ranks in spawned for row in ranks if row["name"] == "refused"]
    assert len(rows) == WORLD and all(row["message"] for row in rows)
    budget = build_cases()[0][3] - 1
    for rank, row in enumerate(rows):
        if row["partners"] > budget:
            want = f"CP rank {rank} exchanges with {row['partners']} partners, over max_partners={budget}"
            assert want in row["message"], row["message"]
    assert any(row["partners"] > budget for row in rows)
