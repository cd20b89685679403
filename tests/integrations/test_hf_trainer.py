"""Hugging Face Trainer with ringpack (RingpackTrainer) equals single-process training, to fp64 precision.

4 gloo processes, launched as ``torchrun`` would (its environment variables, so accelerate sees a
multi-CPU run and wraps the model in DDP), train a tiny fp64 Llama with :class:`RingpackTrainer` at
DP=2 x CP=2 for two optimizer steps: Trainer's own AdamW, constant learning rate and gradient
clipping. The step losses (from each rank's share) and the gradients the optimizer gets must equal
the per-sample single-process reference of ``tests/helpers/training.py`` with the same
optimizer and clipping. Then the pool layout: one CP group of all four ranks (``dp=1, cp=4``) in nodes of
two, with the node-relayed targeted exchange; then both layouts head-parallel (``mode="ulysses"``
at DP=2 x CP=2, the hybrid ``"ulysses+p2p"`` on the pool in nodes of two).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from ringpack._spawn import run_ranks
from ringpack.plan_config import PlanConfig
from tests.helpers.training import assert_same_training, build_model, example_args, load_example, reference

WORLD, CP, STEPS = 4, 2, 2
#: name -> (cp_size, K/V exchange mode, gpus_per_node)
LAYOUTS = {
    "dp2 x cp2 ring": (CP, "ring", None),
    "pool p2p relayed": (WORLD, "p2p", 2),
    "dp2 x cp2 ulysses": (CP, "ulysses", None),
    "pool ulysses+p2p": (WORLD, "ulysses+p2p", 2),
    "pool auto": (WORLD, "auto", 2),  # each micro-batch its own mode, priced for the tiny model
}
LR, MAX_GRAD_NORM = 1e-2, 0.2  # clips the summed gradients (norm ~0.33), not a quarter of them


def training_arguments(out_dir: str, seed: int):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch",
        max_grad_norm=MAX_GRAD_NORM,
        seed=seed,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def layout_args(name: str):
    """The example's arguments of layout ``name`` (its CP size and nodes)."""
    cp, _, node = LAYOUTS[name]
    args = example_args(cp, steps=STEPS)
    args.gpus_per_node = node
    return args


def worker(rank: int, world: int, out_dir: str, name: str) -> dict:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1"
    )
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")  # read by accelerate; the group already exists
    from transformers import TrainerCallback

    from ringpack.integrations.trainer import RingpackConfig, RingpackTrainer

    example = load_example()
    args = layout_args(name)
    cp, mode, node = LAYOUTS[name]
    grads, shares = [], []

    class RecordGradients(TrainerCallback):
        def on_pre_optimizer_step(self, train_args, state, control, model=None, **kwargs):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    class RecordingTrainer(RingpackTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            value = super().training_step(model, inputs, num_items_in_batch)
            shares.append(float(value) / self.args.world_size)
            return value

    plan = PlanConfig(
        dp=world // cp,
        cp=cp,
        tokens_per_rank=args.tokens_per_rank,
        strategy=args.strategy,
        packing=args.packing,
        samples_per_step=args.samples_per_step,
        cost=example._cost_model(args.model),
        seed=args.seed,
        gpus_per_node=node,
    )
    ringpack = RingpackConfig(plan=plan, backend=args.backend, mode=mode)
    trainer = RecordingTrainer(
        model=build_model(args.model, torch.float64, args.seed),
        args=training_arguments(out_dir, args.seed),
        train_dataset=example.samples_for(args),
        ringpack=ringpack,
        callbacks=[RecordGradients()],
    )
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    unused = trainer.model_wrapped.find_unused_parameters  # no per-step search DDP warns about
    accumulating = training_arguments(out_dir, args.seed)
    accumulating.gradient_accumulation_steps = 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        RingpackTrainer(model=trainer.model, args=accumulating, train_dataset=[], ringpack=ringpack)
    return dict(
        shares=shares,
        grads=grads if rank == 0 else None,
        wrapped=wrapped,
        unused=unused,
        steps=trainer.state.global_step,
    )


@pytest.fixture(scope="module", params=list(LAYOUTS))
def trainer_results(request, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("hf-trainer"))
    results = run_ranks(worker, WORLD, (out_dir, request.param), timeout_s=120.0, join_s=280.0, name="RingpackTrainer")
    return request.param, results


@pytest.mark.slow
def test_ringpack_trainer_equals_single_process(trainer_results):
    name, trainer_results = trainer_results
    assert [r["wrapped"] for r in trainer_results] == ["DistributedDataParallel"] * WORLD
    assert [r["unused"] for r in trainer_results] == [False] * WORLD
    assert [r["steps"] for r in trainer_results] == [STEPS] * WORLD
    losses = [sum(r["shares"][step] for r in trainer_results) for step in range(STEPS)]
    want_losses, want_grads = reference(
        layout_args(name),
        WORLD,
        STEPS,
        make_optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False),
        before_step=lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM),
    )
    assert_same_training(losses, trainer_results[0]["grads"], want_losses, want_grads, STEPS, grad_rtol=1e-10)


@pytest.mark.slow
def test_import_ringpack_does_not_import_transformers():
    code = (
        "import sys, ringpack, ringpack.integrations, ringpack.integrations.distributed; "
        "ringpack.ring_attention; ringpack.BalancedBatchSampler; "
        "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules, 'imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------ nothing is left out in silence

ROWS = [list(range(2 + (7 * i) % 11)) for i in range(10)]
ROWS[7] = list(range(20))  # the longest row: 20 tokens


def _trainer(tmp_path, model=None, rows=ROWS, plan=None, ringpack=None, **config):
    """A one-process RingpackTrainer over ``rows`` (no training run: the tests read its loader), with
    ``ringpack`` or a RingpackConfig of ``plan`` and ``config``."""
    from transformers import TrainingArguments

    from ringpack.integrations.trainer import RingpackConfig, RingpackTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, max_steps=1)
    model = build_model("tiny", torch.float64, 0) if model is None else model
    plan = PlanConfig(dp=1, cp=1, tokens_per_rank=24, samples_per_step=5, seed=args.seed) if plan is None else plan
    ringpack = RingpackConfig(plan=plan, **config) if ringpack is None else ringpack
    return RingpackTrainer(model=model, args=args, train_dataset=rows, ringpack=ringpack)


def test_the_config_takes_the_plan_config_whole_and_the_old_spelling_warns(tmp_path):
    """RingpackConfig(plan=PlanConfig(...)) plans with that config as given, without a warning; the old
    spelling (cp_size, tokens_per_rank, plan_options; seed from TrainingArguments) warns, naming the
    new one, and plans the same epoch."""
    from ringpack.integrations.trainer import RingpackConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = _trainer(tmp_path)
    spelled = r"RingpackConfig\(tokens_per_rank=..., plan_options=...\) is deprecated: pass .*\(plan=PlanConfig"
    with pytest.warns(DeprecationWarning, match=spelled):
        old = RingpackConfig(tokens_per_rank=24, plan_options={"samples_per_step": 5})
    old = _trainer(tmp_path / "old", ringpack=old)
    new.get_train_dataloader(), old.get_train_dataloader()
    assert new.sampler.config == old.sampler.config and new.sampler.plan_key == old.sampler.plan_key
    assert old.ringpack.plan == new.ringpack.plan
    assert new.ringpack.plan == PlanConfig(dp=1, cp=1, tokens_per_rank=24, samples_per_step=5, seed=42)
    reseeded = _trainer(tmp_path / "seed", plan=PlanConfig(dp=1, cp=1, tokens_per_rank=24, samples_per_step=5, seed=7))
    reseeded.get_train_dataloader()
    assert reseeded.sampler.config.seed == 7 and reseeded.sampler.plan_key != new.sampler.plan_key


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (dict(plan=PlanConfig(dp=2, cp=1, tokens_per_rank=24)), "^RingpackConfig.plan has dp=2, cp=1 but the run"),
        (dict(plan={"dp": 1}), "^RingpackConfig.plan must be a PlanConfig, got dict$"),
        (dict(plan=PlanConfig(dp=1, cp=1, tokens_per_rank=24), cp_size=1), "or the old cp_size, not both$"),
    ],
)
def test_a_plan_config_that_does_not_fit_the_run_is_refused(tmp_path, config, message):
    from ringpack.errors import PlanError
    from ringpack.integrations.trainer import RingpackConfig

    with pytest.raises(PlanError, match=message):
        _trainer(tmp_path, ringpack=RingpackConfig(**config))


def test_schedule_options_are_typed_and_a_dict_warns():
    from ringpack.attention import ScheduleOptions
    from ringpack.errors import DataError
    from ringpack.integrations.trainer import RingpackConfig

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        typed = RingpackConfig(schedule_options=ScheduleOptions(dense_buckets=None))
    assert RingpackConfig().schedule_options == ScheduleOptions()
    with pytest.warns(DeprecationWarning, match="ScheduleOptions"):
        assert RingpackConfig(schedule_options={"dense_buckets": None}).schedule_options == typed.schedule_options
    with pytest.raises(DataError, match="^RingpackConfig.schedule_options must be a ScheduleOptions, got list$"):
        RingpackConfig(schedule_options=[1])


@pytest.mark.parametrize("count", [len(ROWS) - 1, len(ROWS) + 1])
def test_lengths_must_give_one_count_per_row(tmp_path, count):
    from ringpack.errors import DataError

    lengths = ([len(r) for r in ROWS] + [4])[:count]
    trainer = _trainer(tmp_path, lengths=lengths)
    with pytest.raises(DataError, match=f"RingpackConfig.lengths has {count} entries but train_dataset has 10 rows"):
        trainer.get_train_dataloader()


def test_an_epoch_trains_every_row_once(tmp_path):
    trainer = _trainer(tmp_path, lengths=[len(r) for r in ROWS])
    steps = list(trainer.get_train_dataloader())
    rows = sorted(s for step in steps for batch in step["microbatches"] for s in batch["microbatch"].samples)
    assert rows == list(range(len(ROWS)))
    assert len(steps) == trainer.sampler.num_steps == 2
    assert all(len(step["microbatches"]) > 1 for step in steps), "the resume test below needs steps of several"


def test_a_step_started_in_the_middle_is_refused(tmp_path):
    """A sampler resumed inside a step would give the Trainer a step without its first micro-batches."""
    from ringpack.errors import DataError

    trainer = _trainer(tmp_path)
    loader = trainer.get_train_dataloader()
    state = trainer.sampler.state_dict(cursor=1)  # after the first micro-batch of step 0
    trainer.sampler.load_state_dict(state)
    with pytest.raises(DataError, match="step 0 of epoch 0: the loader gave micro-batch 1 of"):
        next(iter(loader))


def test_dropped_rows_are_reported(tmp_path, monkeypatch):
    from ringpack.integrations import trainer as trainer_module

    warnings = []
    monkeypatch.setattr(trainer_module.logger, "warning", lambda *args: warnings.append(args[0] % args[1:]))
    plan = PlanConfig(dp=1, cp=1, tokens_per_rank=16, samples_per_step=5, overflow="drop")
    trainer = _trainer(tmp_path, plan=plan)
    trainer.get_train_dataloader()
    assert trainer.sampler.dropped == (7,)  # the only row longer than 16 tokens (cp_size=1)
    assert warnings == [
        "ringpack: overflow='drop' leaves out 1 of 10 training rows (longer than 16 tokens), e.g. row 7"
    ]


def test_a_model_without_attention_interface_is_refused(tmp_path):
    from ringpack.errors import DataError

    with pytest.raises(DataError, match="model must be a transformers model"):
        _trainer(tmp_path, model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("bad", [-1, "vocab", 2**40])
def test_a_row_with_a_token_id_the_model_cannot_embed_is_refused_naming_it(tmp_path, bad):
    from ringpack.errors import DataError

    model = build_model("tiny", torch.float64, 0)
    vocab = model.get_input_embeddings().num_embeddings
    bad = vocab if bad == "vocab" else bad
    rows = [list(r) for r in ROWS]
    rows[4][1] = bad
    trainer = _trainer(tmp_path, model=model, rows=rows)
    with pytest.raises(DataError, match=rf"^row 4: token id {bad} is not in \[0, {vocab}\) \(the model's vocabulary"):
        list(trainer.get_train_dataloader())


@pytest.mark.parametrize("mode", ["ulysses", "allgather"])
def test_the_mode_flows_to_the_attention_with_ring_s_loss_and_gradients(tmp_path, monkeypatch, mode):
    """One process: the first micro-batch's loss and gradients under ``mode`` equal ``mode="ring"``'s (fp64)."""
    from ringpack.attention import dispatch

    calls = []
    real = dispatch.head_parallel_attention
    monkeypatch.setattr(dispatch, "head_parallel_attention", lambda *args: calls.append(args[5]) or real(*args))
    results = []
    for m in ("ring", mode):
        trainer = _trainer(tmp_path, mode=m)
        batch = next(iter(trainer.get_train_dataloader()))["microbatches"][0]
        trainer.model.zero_grad()
        loss = trainer.microbatch_loss(trainer.model, batch)
        loss.backward()
        results.append([loss.detach(), *(p.grad.clone() for p in trainer.model.parameters())])
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert (len(calls) > 0) == (mode == "ulysses") and set(calls) <= {"ulysses"}
