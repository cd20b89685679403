"""The recipe resumes bit for bit: N steps equal k steps, a DCP save, a restore in fresh processes and N-k steps.

4 gloo processes run ``examples/recipe.py`` on a ``("dp", "cp") = (2, 2)`` DeviceMesh: FSDP2 over all
ranks, ring attention in each CP pair, fp64, AdamW with a linear warm-up and gradient clipping. The
cost learner runs on a fake clock (a micro-batch's seconds are a fixed function of what its rank
holds), so its fits are deterministic and it re-plans during the run: once before the save (the
switch travels in the sampler's state) and once after the restore (fitted on observations restored
from the checkpoint). Losses, parameters and cost-model switches must be identical, bit for bit.

The resume runs eager. The first launch also trains the N steps with every decoder layer compiled
(``fullgraph=True``, the ``aot_eager`` backend, which runs eager's kernels): every graph must hold
ringpack's attention op, and losses and parameters must equal eager training's, bit for bit.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from ringpack._spawn import run_ranks
from ringpack.cost_fit import microbatch_features
from ringpack.training.cost_learner import CostLearner, LearnerConfig
from tests.helpers.training import load_example

WORLD, CP, STEPS, SPLIT = 4, 2, 4, 2
# imported once by the forkserver rather than by every rank (if this file's ranks start it first)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "transformers.models.llama.modeling_llama", __name__]
# a fit after every step from the second on, each switching the plan from the next step
LEARNER = LearnerConfig(
    warmup_steps=0, first_fit_after=1, refit_every=1, min_observations=3, min_change=0.0, lead_steps=0
)


def fake_seconds(batch: dict, cp_rank: int) -> float:
    """A micro-batch's 'measured' time on ``cp_rank``: linear prices with a deterministic 3% wobble,
    so fits over different windows differ and each one switches the plan."""
    tokens, pairs, pieces = microbatch_features(batch["microbatch"])[0][cp_rank]
    return (1e-4 * tokens + 1e-6 * pairs + 1e-5 * pieces + 1e-5) * (1 + 0.03 * math.sin(tokens))


class FakeClockLearner(CostLearner):
    @contextlib.contextmanager
    def measure(self, batch):
        yield
        self.record(batch, fake_seconds(batch, self.cp_rank))


def fake_clock_learner(sampler, grid) -> CostLearner:
    return FakeClockLearner(sampler, grid.cp_rank, config=LEARNER)


def recipe_args(steps: int, checkpoint_dir: str | None = None, *extra: str):
    """A tiny fp64 DP=2 x CP=2 run: 96 heavy-tailed samples, 16 per step (six steps an epoch)."""
    argv = [
        *("--cp", str(CP), "--model", "tiny", "--dtype", "fp64", "--tokens-per-rank", "48"),
        *("--samples", "96", "--samples-per-step", "16", "--steps", str(steps), "--lr", "1e-2"),
        *("--warmup-steps", "3", "--max-norm", "0.5", "--quiet", "--no-compile", *extra),
    ]
    if checkpoint_dir is not None:
        argv += ["--checkpoint-dir", checkpoint_dir]
    return load_example("recipe").parse_args(argv)


def outcome(trainer, losses: list[float]) -> dict:
    """Losses, whole parameters (gathered: collective), step count and cost-model switches of a run."""
    params = {name: p.full_tensor() for name, p in trainer.model.named_parameters()}
    switches = trainer.sampler.state_dict()["cost_switches"]
    return dict(losses=losses, params=params, step=trainer.step, switches=switches)


class GraphRecorder:
    """A ``torch.compile`` backend (``aot_eager``) that records the ringpack ops of every graph it gets."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(
            [str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "ringpack" in str(n.target)]
        )
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)


def compiled_run(samples) -> dict:
    """N steps straight with every decoder layer compiled (``fullgraph=True``); a recompile limit is an error."""
    recipe = load_example("recipe")
    args = recipe_args(STEPS, None, "--compile")
    args.compile_backend = recorder = GraphRecorder()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        result = outcome(*recipe.run(args, samples, fake_clock_learner))
    return dict(result, graphs=recorder.graphs)


def first_run(rank: int, world: int, folder: str) -> tuple[dict, dict, dict] | None:
    """N steps straight, eager and compiled; then, from scratch, SPLIT steps and a save into ``folder``."""
    recipe = load_example("recipe")
    samples = recipe.samples_for(recipe_args(STEPS))
    straight = outcome(*recipe.run(recipe_args(STEPS), samples, fake_clock_learner))
    compiled = compiled_run(samples)
    head = outcome(*recipe.run(recipe_args(SPLIT, folder), samples, fake_clock_learner))
    return (straight, compiled, head) if rank == 0 else None


def resumed_run(rank: int, world: int, folder: str) -> dict | None:
    """Fresh processes: restore the newest checkpoint in ``folder`` and train up to N steps."""
    recipe = load_example("recipe")
    args = recipe_args(STEPS, folder)
    result = outcome(*recipe.run(args, recipe.samples_for(args), fake_clock_learner))
    return result if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("recipe-checkpoints"))
    spawn = dict(timeout_s=120.0, join_s=280.0, start_method="forkserver", preload=PRELOAD)
    straight, compiled, head = run_ranks(first_run, WORLD, (folder,), name="recipe: straight and first part", **spawn)[
        0
    ]
    resumed = run_ranks(resumed_run, WORLD, (folder,), name="recipe: resumed", **spawn)[0]
    return dict(straight=straight, compiled=compiled, head=head, resumed=resumed)


@pytest.mark.slow
def test_resumed_run_equals_the_uninterrupted_one(runs):
    straight, head, resumed = runs["straight"], runs["head"], runs["resumed"]
    assert straight["step"] == resumed["step"] == STEPS and head["step"] == SPLIT
    assert head["losses"] == straight["losses"][:SPLIT]
    assert resumed["losses"] == straight["losses"][SPLIT:], "the resumed steps' losses differ"
    assert straight["params"].keys() == resumed["params"].keys()
    for name, want in straight["params"].items():
        assert torch.equal(resumed["params"][name], want), f"{name} differs after resuming"


@pytest.mark.slow
def test_cost_model_switches_cross_the_checkpoint(runs):
    straight, head, resumed = runs["straight"], runs["head"], runs["resumed"]
    switch_steps = [step for _, step, _ in straight["switches"]]
    assert any(step <= SPLIT for step in switch_steps), "no switch was made before the save"
    assert any(step > SPLIT for step in switch_steps), "no switch was made after the restore"
    assert resumed["switches"] == straight["switches"]
    assert head["switches"] == [s for s in straight["switches"] if s[1] <= SPLIT]


@pytest.mark.slow
def test_compiled_layers_hold_the_attention_and_train_as_eager(runs):
    straight, compiled = runs["straight"], runs["compiled"]
    assert compiled["graphs"], "nothing was compiled"
    assert all(ops == ["ringpack.ring_attention.default"] for ops in compiled["graphs"]), compiled["graphs"]
    assert compiled["losses"] == straight["losses"]
    for name, want in straight["params"].items():
        assert torch.equal(compiled["params"][name], want), f"{name} differs between compiled and eager training"


# ------------------------------------------------------------------ the DCP adapter, one process


def _sampler():
    from ringpack.data import BalancedBatchSampler

    lengths = [5, 40, 17, 3, 28, 9, 33, 12, 21, 7, 30, 14, 2, 25, 18, 6]
    return BalancedBatchSampler(lengths, 0, 1, 2, 24, samples_per_step=4, seed=1)


def _batch(ticket) -> dict:
    return {"epoch": ticket.epoch, "cursor": ticket.cursor, "microbatch": ticket.microbatch, "microbatch_index": 0}


def test_sampler_state_saves_the_consumed_position_not_the_prefetched_one():
    from ringpack.integrations.distributed import SamplerState

    sampler = _sampler()
    data = SamplerState(sampler)
    tickets = iter(sampler)
    consumed = [next(tickets) for _ in range(2)]
    next(tickets)  # a loader worker's prefetch: handed out, not consumed
    assert json_state(data)["sampler"]["cursor"] == 3  # nothing marked: the sampler's own position
    data.mark_consumed(_batch(consumed[-1]))
    saved = data.state_dict()
    assert json_state(data)["sampler"]["cursor"] == 2

    resumed = _sampler()
    SamplerState(resumed).load_state_dict(saved)
    assert [list(t) for t in resumed] == [list(sampler.ticket(p)) for p in range(2, len(sampler))]
    sampler.set_epoch(1)  # the loop moved on: nothing of the new epoch consumed yet
    assert json_state(data)["sampler"] == sampler.state_dict(cursor=0)


def test_sampler_state_refuses_another_ranks_or_a_missing_learner_state():
    from ringpack.integrations.distributed import SamplerState

    data = SamplerState(_sampler())
    with pytest.raises(ValueError, match="no sampler state for rank0"):
        data.load_state_dict({"rank5": data.state_dict()["rank0"]})
    with_learner = SamplerState(_sampler(), CostLearner(_sampler(), 0))
    with pytest.raises(ValueError, match="without a cost learner"):
        with_learner.load_state_dict(data.state_dict())


def test_learner_state_round_trips_through_json():
    import json

    from ringpack.cost import CostModel
    from ringpack.cost_fit import FitResult

    config = LearnerConfig(first_fit_after=100)  # no fit: one process has no group to gather over
    sampler = _sampler()
    learner = CostLearner(sampler, 1, config=config)
    for ticket in sampler:
        learner.record(_batch(ticket), fake_seconds({"microbatch": ticket.microbatch}, 1))
        if ticket.index + 1 == ticket.microbatches_in_step:
            learner.end_step()
    model = CostModel(token=1e-4, pair=1e-6, segment=1e-5, unit="s", name="learned", microbatch=1e-5)
    learner.history.append(FitResult(model, 1e-5, 0.01, 0.03, 12, 1))
    state = json.loads(json.dumps(learner.state_dict()))
    copy = CostLearner(_sampler(), 1, config=config)
    copy.load_state_dict(state)
    assert copy.state_dict() == learner.state_dict() and state["rows"] and state["unread"]
    assert copy.history == learner.history
    with pytest.raises(ValueError, match="every row needs 9 values"):
        copy.load_state_dict(dict(state, rows=[[1.0, 2.0]]))


def json_state(data) -> dict:
    import json

    return json.loads(data.state_dict()["rank0"])
