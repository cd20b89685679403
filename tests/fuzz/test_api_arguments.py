"""Every public function and config of the Python API refuses a bad argument up front, as a new user
would pass it (None, a wrong type, an empty or negative size, a tensor of the wrong kind, a broken
micro-batch, a mesh of the wrong dimensions), with ringpack's own error naming the argument.

One table: ``(case, call, error type, words the message must hold)``. Each call must raise exactly
that type (``PlanError`` or ``DataError``, both ``ValueError``), in one line holding the words:
never an ``AttributeError``, ``KeyError``, ``IndexError``, ``ZeroDivisionError``, a bare
``TypeError``, or a silent result. DeviceMesh cases need a process group, so they run in one
spawned single-rank gloo process and report back the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import ringpack
from ringpack import BalancedBatchSampler, PackedCollator, PackedDataset, ShardReader
from ringpack.attention import RingAttention, compile_schedule, ring_attention
from ringpack.cost import CostModel
from ringpack.errors import DataError, PlanError
from ringpack.integrations import distributed, transformers
from ringpack.integrations.trainer import PlannedSteps, RingpackConfig, RingpackTrainer, model_mode_choice
from ringpack.planner import make_plan
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, RankShard, microbatch_from_shards


@dataclass(frozen=True)
class Case:
    name: str
    call: Callable[[], object]
    error: type[Exception]
    words: tuple[str, ...]


# --------------------------------------------------------------------------------------- fixtures

LENGTHS = [5, 3, 8, 2, 6, 4]
TWO_RANKS = microbatch_from_shards([0, 1], [[Piece(0, 0, 5)], [Piece(0, 5, 8), Piece(1, 0, 3)]], {0: 8, 1: 3})
ONE_RANK = microbatch_from_shards([0], [[Piece(0, 0, 6)]], {0: 6})
SCHEDULE = compile_schedule(ONE_RANK, 0)


def _qkv(tokens: int = 6, heads: int = 2, kv_heads: int = 1, dim: int = 4, dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, k.clone()


Q, K, V = _qkv()


def _microbatch(*shards: tuple[Piece, ...], samples=(0,)) -> MicroBatch:
    """A hand-built micro-batch, pieces as given (no sorting, no checks)."""
    return MicroBatch(samples=tuple(samples), shards=tuple(RankShard(tuple(s)) for s in shards), loss_tokens=1)


def _plan() -> Plan:
    return ringpack.plan(LENGTHS, dp=1, cp=1, tokens_per_rank=16)


def _sampler() -> BalancedBatchSampler:
    return BalancedBatchSampler(LENGTHS, 0, 1, 1, 16)


def _state(text: object) -> Callable[[], object]:
    return lambda: distributed.SamplerState(_sampler()).load_state_dict({"rank0": text})


def _attention(query=None, key=None, value=None, **kwargs):
    """transformers' call of the ringpack attention function: ``(1, H, T, D)`` tensors."""
    q, k, v = (x.transpose(0, 1)[None] for x in (Q, K, V))
    query, key, value = (q if query is None else query), (k if key is None else key), (v if value is None else value)
    kwargs = {"attention_mask": None, "ringpack_schedule": SCHEDULE, **kwargs}
    mask = kwargs.pop("attention_mask")
    return lambda: transformers.ringpack_attention_forward(torch.nn.Module(), query, key, value, mask, **kwargs)


CASES = [
    # ---------------------------------------------------------------- plan contract and planner
    Case("plan lengths None", lambda: ringpack.plan(None, dp=1, cp=1, tokens_per_rank=8), PlanError, ("lengths",)),
    Case("make_plan config None", lambda: make_plan([3], None), PlanError, ("config", "PlanConfig")),
    Case("make_plan config dict", lambda: make_plan([3], {"dp": 1}), PlanError, ("config", "dict")),
    Case(
        "make_plan progress int",
        lambda: make_plan([3], PlanConfig(dp=1, cp=1, tokens_per_rank=8), progress=3),
        PlanError,
        ("progress",),
    ),
    Case("PlanConfig dp 0", lambda: PlanConfig(dp=0, cp=1, tokens_per_rank=8), PlanError, ("dp",)),
    Case("PlanConfig cost str", lambda: PlanConfig(dp=1, cp=1, tokens_per_rank=8, cost="x"), PlanError, ("cost",)),
    Case("PlanConfig.from_dict None", lambda: PlanConfig.from_dict(None), PlanError, ("config",)),
    Case("Plan.from_dict None", lambda: Plan.from_dict(None), PlanError, ("plan",)),
    Case("Plan.from_table None", lambda: Plan.from_table(None), PlanError, ("table",)),
    Case("Plan.microbatch step", lambda: _plan().microbatch(9, 0, 0), PlanError, ("step", "9")),
    Case("Plan.microbatch dp_rank", lambda: _plan().microbatch(0, 1, 0), PlanError, ("dp_rank",)),
    Case("Plan.microbatch index", lambda: _plan().microbatch(0, 0, 99), PlanError, ("index", "99")),
    Case("Plan.microbatch None", lambda: _plan().microbatch(None, 0, 0), PlanError, ("step", "None")),
    Case("CostModel.from_shape None", lambda: CostModel.from_shape(None), PlanError, ("shape",)),
    # ---------------------------------------------------------------- compile_schedule
    Case("compile microbatch None", lambda: compile_schedule(None, 0), PlanError, ("microbatch",)),
    Case("compile microbatch list", lambda: compile_schedule([0, 1], 0), PlanError, ("microbatch",)),
    Case("compile cp_rank None", lambda: compile_schedule(TWO_RANKS, None), PlanError, ("cp_rank", "None")),
    Case("compile cp_rank str", lambda: compile_schedule(TWO_RANKS, "0"), PlanError, ("cp_rank",)),
    Case("compile cp_rank float", lambda: compile_schedule(TWO_RANKS, 0.5), PlanError, ("cp_rank", "0.5")),
    Case("compile cp_rank bool", lambda: compile_schedule(TWO_RANKS, True), PlanError, ("cp_rank",)),
    Case("compile cp_rank range", lambda: compile_schedule(TWO_RANKS, 2), PlanError, ("cp_rank", "[0, 2)")),
    Case("compile no shards", lambda: compile_schedule(_microbatch(), 0), PlanError, ("cp_rank", "[0, 0)")),
    Case(
        "compile dense_threshold str",
        lambda: compile_schedule(TWO_RANKS, 0, dense_threshold="x"),
        PlanError,
        ("dense_threshold",),
    ),
    Case(
        "compile dense_threshold 0",
        lambda: compile_schedule(TWO_RANKS, 0, dense_threshold=0),
        PlanError,
        ("dense_threshold",),
    ),
    Case(
        "compile dense_buckets 3",
        lambda: compile_schedule(TWO_RANKS, 0, dense_buckets=3),
        PlanError,
        ("dense_buckets",),
    ),
    Case(
        "compile dense_batches str",
        lambda: compile_schedule(TWO_RANKS, 0, dense_batches="yes"),
        PlanError,
        ("dense_batches",),
    ),
    Case(
        "compile gap",
        lambda: compile_schedule(_microbatch((Piece(0, 0, 3),), (Piece(0, 5, 8),)), 0),
        PlanError,
        ("sample 0", "[3, 5)", "no piece"),
    ),
    Case(
        "compile negative start",
        lambda: compile_schedule(_microbatch((Piece(0, -2, 3),), (Piece(0, 3, 8),)), 0),
        PlanError,
        ("sample 0", "[-2, 3)", "below 0"),
    ),
    Case(
        "compile first piece after 0",
        lambda: compile_schedule(_microbatch((Piece(0, 2, 4),), (Piece(0, 4, 8),)), 1),
        PlanError,
        ("sample 0", "[0, 2)", "no piece"),
    ),
    Case(
        "compile sample without pieces",
        lambda: compile_schedule(_microbatch((Piece(0, 0, 3),), samples=(0, 7)), 0),
        PlanError,
        ("sample 7", "no piece"),
    ),
    Case(
        "compile sample listed twice",
        lambda: compile_schedule(_microbatch((Piece(0, 0, 3),), samples=(0, 0)), 0),
        PlanError,
        ("twice",),
    ),
    Case(
        "compile float piece",
        lambda: compile_schedule(_microbatch((Piece(0, 0, 3.5),)), 0),
        PlanError,
        ("cp rank 0", "sample 0", "integer"),
    ),
    Case(
        "compile piece not a Piece",
        lambda: compile_schedule(_microbatch(((0, 0, 3),)), 0),
        PlanError,
        ("cp rank 0", "Piece"),
    ),
    # ---------------------------------------------------------------- ring_attention / RingAttention
    Case("attention q None", lambda: ring_attention(None, K, V, SCHEDULE), DataError, ("q", "NoneType")),
    Case("attention k None", lambda: ring_attention(Q, None, V, SCHEDULE), DataError, ("k", "NoneType")),
    Case("attention v ndarray", lambda: ring_attention(Q, K, V.numpy(), SCHEDULE), DataError, ("v", "ndarray")),
    Case("attention schedule None", lambda: ring_attention(Q, K, V, None), DataError, ("schedule", "NoneType")),
    Case("attention schedule str", lambda: ring_attention(Q, K, V, "s"), DataError, ("schedule", "str")),
    Case("attention int64", lambda: ring_attention(*_qkv(dtype=torch.int64), SCHEDULE), DataError, ("int64",)),
    Case(
        "attention int64 reference",
        lambda: ring_attention(*_qkv(dtype=torch.int64), SCHEDULE, backend="reference"),
        DataError,
        ("int64",),
    ),
    Case(
        "attention zero kv heads",
        lambda: ring_attention(*_qkv(kv_heads=0), SCHEDULE),
        DataError,
        ("key/value heads",),
    ),
    Case("attention zero heads", lambda: ring_attention(*_qkv(heads=0), SCHEDULE), DataError, ("heads",)),
    Case("attention head_dim 0", lambda: ring_attention(*_qkv(dim=0), SCHEDULE), DataError, ("head_dim",)),
    Case(
        "attention 2-D", lambda: ring_attention(Q[0], K[0], V[0], SCHEDULE), DataError, ("[tokens, heads, head_dim]",)
    ),
    Case("attention tokens", lambda: ring_attention(Q[:-1], K[:-1], V[:-1], SCHEDULE), DataError, ("q has 5 tokens",)),
    Case("attention gqa", lambda: ring_attention(*_qkv(heads=3, kv_heads=2), SCHEDULE), DataError, ("multiple",)),
    Case("attention mode None", lambda: ring_attention(Q, K, V, SCHEDULE, mode=None), DataError, ("mode",)),
    Case("attention backend None", lambda: ring_attention(Q, K, V, SCHEDULE, backend=None), DataError, ("backend",)),
    Case(
        "attention backend CUDA on CPU",
        lambda: ring_attention(Q, K, V, SCHEDULE, backend="torch_flash"),
        DataError,
        ("backend", "torch_flash"),
    ),
    Case(
        "attention scale nan",
        lambda: ring_attention(Q, K, V, SCHEDULE, softmax_scale=float("nan")),
        DataError,
        ("softmax_scale",),
    ),
    Case(
        "attention scale 0", lambda: ring_attention(Q, K, V, SCHEDULE, softmax_scale=0), DataError, ("softmax_scale",)
    ),
    Case(
        "attention scale str",
        lambda: ring_attention(Q, K, V, SCHEDULE, softmax_scale="1"),
        DataError,
        ("softmax_scale",),
    ),
    Case("attention group str", lambda: ring_attention(Q, K, V, SCHEDULE, group="cp"), DataError, ("group", "str")),
    Case("attention causal None", lambda: ring_attention(Q, K, V, SCHEDULE, causal=None), DataError, ("causal",)),
    Case("RingAttention mode", lambda: RingAttention(mode="tree"), DataError, ("mode", "tree")),
    Case("RingAttention backend", lambda: RingAttention(backend="fast"), DataError, ("backend", "fast")),
    Case("RingAttention scale", lambda: RingAttention(softmax_scale=-1.0), DataError, ("softmax_scale",)),
    Case("RingAttention group", lambda: RingAttention(group=3), DataError, ("group", "int")),
    Case("RingAttention schedule None", lambda: RingAttention()(Q, K, V, None), DataError, ("schedule",)),
    # ---------------------------------------------------------------- BalancedBatchSampler
    Case("sampler lengths None", lambda: BalancedBatchSampler(None, 0, 1, 1, 8), DataError, ("lengths",)),
    Case("sampler dp_rank None", lambda: BalancedBatchSampler(LENGTHS, None, 1, 1, 8), DataError, ("dp_rank",)),
    Case("sampler dp_rank range", lambda: BalancedBatchSampler(LENGTHS, 1, 1, 1, 8), DataError, ("dp_rank", "[0, 1)")),
    Case("sampler dp_size None", lambda: BalancedBatchSampler(LENGTHS, 0, None, 1, 8), DataError, ("dp_size",)),
    Case("sampler dp_size 0", lambda: BalancedBatchSampler(LENGTHS, 0, 0, 1, 8), DataError, ("dp_size",)),
    Case("sampler cp_size -1", lambda: BalancedBatchSampler(LENGTHS, 0, 1, -1, 8), PlanError, ("cp", "-1")),
    Case(
        "sampler tokens_per_rank None",
        lambda: BalancedBatchSampler(LENGTHS, 0, 1, 1, None),
        PlanError,
        ("tokens_per_rank",),
    ),
    Case("sampler cost None", lambda: BalancedBatchSampler(LENGTHS, 0, 1, 1, 8, cost=None), PlanError, ("cost",)),
    Case("sampler unknown option", lambda: BalancedBatchSampler(LENGTHS, 0, 1, 1, 8, bogus=1), PlanError, ("bogus",)),
    Case(
        "sampler epoch=", lambda: BalancedBatchSampler(LENGTHS, 0, 1, 1, 8, epoch=1), DataError, ("epoch", "set_epoch")
    ),
    Case("sampler dp=", lambda: BalancedBatchSampler(LENGTHS, 0, 1, 1, 8, dp=2), DataError, ("dp", "dp_size")),
    Case("sampler from_mesh None", lambda: BalancedBatchSampler.from_mesh(LENGTHS, None, 8), DataError, ("mesh",)),
    Case("sampler from_mesh str", lambda: BalancedBatchSampler.from_mesh(LENGTHS, "dp,cp", 8), DataError, ("mesh",)),
    # ---------------------------------------------------------------- PackedCollator / PackedDataset
    Case("collator cp_rank None", lambda: PackedCollator(None, 1), DataError, ("cp_rank",)),
    Case("collator cp_rank range", lambda: PackedCollator(2, 2), DataError, ("cp_rank", "[0, 2)")),
    Case("collator cp_size None", lambda: PackedCollator(0, None), DataError, ("cp_size",)),
    Case("collator schedule str", lambda: PackedCollator(0, 1, schedule="yes"), DataError, ("schedule",)),
    Case("collator ignore_index", lambda: PackedCollator(0, 1, ignore_index="x"), DataError, ("ignore_index",)),
    Case(
        "collator schedule_options list",
        lambda: PackedCollator(0, 1, schedule_options=[1]),
        DataError,
        ("schedule_options", "list"),
    ),
    Case(
        "collator schedule_options key",
        lambda: PackedCollator(0, 1, schedule_options={"bogus": 1}),
        DataError,
        ("schedule_options", "bogus"),
    ),
    Case(
        "collator schedule_options value",
        lambda: PackedCollator(0, 1, schedule_options={"dense_threshold": "x"}),
        DataError,
        ("schedule_options", "dense_threshold"),
    ),
    Case("collator from_mesh None", lambda: PackedCollator.from_mesh(None), DataError, ("mesh",)),
    Case("collate microbatch None", lambda: PackedCollator(0, 1).collate(None, [[1]]), DataError, ("microbatch",)),
    Case("collate tokens None", lambda: PackedCollator(0, 2).collate(TWO_RANKS, None), DataError, ("tokens",)),
    Case(
        "collate offsets short",
        lambda: PackedCollator(0, 2).collate(TWO_RANKS, [range(8), range(3)], offsets=[0]),
        DataError,
        ("offsets",),
    ),
    Case(
        "collate document past its row",
        lambda: PackedCollator(0, 2).collate(TWO_RANKS, [range(8), range(3)], offsets=[4, 0], row_lengths=[8, 3]),
        DataError,
        ("sample 0", "[4, 12)", "8 tokens"),
    ),
    Case("collate without ticket", lambda: PackedCollator(0, 1)(None), DataError, ("PackedDataset",)),
    Case("dataset None", lambda: PackedDataset(None), DataError, ("dataset", "NoneType")),
    Case("dataset int", lambda: PackedDataset(3), DataError, ("dataset", "int")),
    Case("dataset column None", lambda: PackedDataset([[1, 2]], column=None), DataError, ("column",)),
    # ---------------------------------------------------------------- ShardReader
    Case("reader path None", lambda: ShardReader(None, 0, 0), DataError, ("path", "NoneType")),
    Case("reader path int", lambda: ShardReader(3, 0, 0), DataError, ("path", "int")),
    Case("reader dp_rank None", lambda: ShardReader("shards", None, 0), DataError, ("dp_rank", "None")),
    Case("reader cp_rank -1", lambda: ShardReader("shards", 0, -1), DataError, ("cp_rank", "-1")),
    Case("reader dp_size str", lambda: ShardReader("shards", 0, 0, dp_size="2"), DataError, ("dp_size",)),
    Case("reader verify str", lambda: ShardReader("shards", 0, 0, verify="no"), DataError, ("verify",)),
    Case("reader schedule str", lambda: ShardReader("shards", 0, 0, schedule="x"), DataError, ("schedule",)),
    Case(
        "reader schedule_options",
        lambda: ShardReader("shards", 0, 0, schedule_options={"x": 1}),
        DataError,
        ("schedule_options",),
    ),
    Case("reader from_mesh None", lambda: ShardReader.from_mesh("shards", None), DataError, ("mesh",)),
    # ---------------------------------------------------------------- integrations.distributed
    Case("cp_group str", lambda: distributed.cp_group("cp"), DataError, ("group", "str")),
    Case("cp_group int", lambda: distributed.cp_group(3), DataError, ("group", "int")),
    Case("mesh_coordinates None", lambda: distributed.mesh_coordinates(None), DataError, ("mesh", "NoneType")),
    Case("mesh_coordinates str", lambda: distributed.mesh_coordinates("dp"), DataError, ("mesh", "str")),
    Case("data_parallel_mesh None", lambda: distributed.data_parallel_mesh(None), DataError, ("mesh",)),
    Case("sum_gradients None", lambda: distributed.sum_gradients(None), DataError, ("model", "NoneType")),
    Case(
        "gradient_sync None",
        lambda: distributed.gradient_sync(None, True).__enter__(),
        DataError,
        ("model", "NoneType"),
    ),
    Case(
        "gradient_sync enabled",
        lambda: distributed.gradient_sync(torch.nn.Linear(2, 2), "yes").__enter__(),
        DataError,
        ("enabled",),
    ),
    Case("SamplerState None", lambda: distributed.SamplerState(None), DataError, ("sampler", "NoneType")),
    Case("SamplerState learner", lambda: distributed.SamplerState(_sampler(), 3), DataError, ("learner",)),
    Case(
        "SamplerState load None",
        lambda: distributed.SamplerState(_sampler()).load_state_dict(None),
        DataError,
        ("state_dict", "NoneType"),
    ),
    Case(
        "SamplerState load other rank",
        lambda: distributed.SamplerState(_sampler()).load_state_dict({"rank1": "{}"}),
        DataError,
        ("rank0", "rank1"),
    ),
    Case("SamplerState load not JSON", _state("{"), DataError, ("rank0", "JSON")),
    Case("SamplerState load not text", _state(None), DataError, ("rank0", "JSON")),
    Case("SamplerState load no sampler key", _state("{}"), DataError, ("rank0", "'sampler'")),
    Case("SamplerState load list", _state("[1]"), DataError, ("rank0", "'sampler'")),
    Case(
        "SamplerState load missing learner",
        lambda: distributed.SamplerState(_sampler(), _sampler()).load_state_dict(
            distributed.SamplerState(_sampler()).state_dict()
        ),
        DataError,
        ("cost learner",),
    ),
    Case(
        "SamplerState mark_consumed None",
        lambda: distributed.SamplerState(_sampler()).mark_consumed(None),
        DataError,
        ("batch",),
    ),
    Case(
        "SamplerState mark_consumed keys",
        lambda: distributed.SamplerState(_sampler()).mark_consumed({"cursor": 1}),
        DataError,
        ("batch", "epoch"),
    ),
    # ---------------------------------------------------------------- integrations.transformers
    Case(
        "loss logits None",
        lambda: transformers.causal_lm_loss_sum(None, torch.zeros(3, dtype=torch.long)),
        DataError,
        ("logits",),
    ),
    Case("loss labels None", lambda: transformers.causal_lm_loss_sum(torch.zeros(3, 5), None), DataError, ("labels",)),
    Case(
        "loss labels float",
        lambda: transformers.causal_lm_loss_sum(torch.zeros(3, 5), torch.zeros(3)),
        DataError,
        ("labels",),
    ),
    Case(
        "loss counts",
        lambda: transformers.causal_lm_loss_sum(torch.zeros(3, 5), torch.zeros(4, dtype=torch.long)),
        DataError,
        ("labels", "(4,)", "(3, 5)"),
    ),
    Case("hf attention query None", _attention(query=torch.zeros(0)[None]), DataError, ("query",)),
    Case("hf attention key 3-D", _attention(key=K), DataError, ("key",)),
    Case("hf attention value None", _attention(value=3), DataError, ("value", "int")),
    Case("hf attention no schedule", _attention(ringpack_schedule=None), DataError, ("ringpack_schedule",)),
    Case("hf attention dropout", _attention(dropout=0.1), DataError, ("dropout",)),
    Case("hf attention mask", _attention(attention_mask=torch.ones(1)), DataError, ("attention_mask",)),
    Case(
        "hf attention batch 2",
        _attention(query=torch.zeros(2, 2, 6, 4, dtype=torch.float64)),
        DataError,
        ("batch 2",),
    ),
    # ---------------------------------------------------------------- integrations.trainer
    Case("RingpackConfig cp_size -1", lambda: RingpackConfig(cp_size=-1), PlanError, ("cp_size", "-1")),
    Case("RingpackConfig cp_size 0", lambda: RingpackConfig(cp_size=0), PlanError, ("cp_size",)),
    Case("RingpackConfig cp_size float", lambda: RingpackConfig(cp_size=2.0), PlanError, ("cp_size",)),
    Case("RingpackConfig tokens_per_rank", lambda: RingpackConfig(tokens_per_rank=0), PlanError, ("tokens_per_rank",)),
    Case("RingpackConfig strategy", lambda: RingpackConfig(strategy="ring"), PlanError, ("strategy", "ring")),
    Case("RingpackConfig mode", lambda: RingpackConfig(mode="tree"), DataError, ("mode", "tree")),
    Case("RingpackConfig backend", lambda: RingpackConfig(backend="fast"), DataError, ("backend", "fast")),
    Case("RingpackConfig column", lambda: RingpackConfig(column=None), DataError, ("column",)),
    Case(
        "model_mode_choice no heads",
        lambda: model_mode_choice(_Headless(), CostModel.preset("tiny")),
        DataError,
        ("mode='auto'", "num_attention_heads"),
    ),
    Case("RingpackConfig plan_options None", lambda: RingpackConfig(plan_options=None), PlanError, ("plan_options",)),
    Case(
        "RingpackConfig plan_options cp",
        lambda: RingpackConfig(plan_options={"cp": 2}),
        DataError,
        ("plan_options", "cp=", "cp_size"),
    ),
    Case(
        "RingpackConfig plan_options seed",
        lambda: RingpackConfig(plan_options={"seed": 2}),
        DataError,
        ("plan_options", "seed="),
    ),
    Case(
        "RingpackConfig plan_options unknown",
        lambda: RingpackConfig(plan_options={"samples": 2}),
        PlanError,
        ("plan_options", "samples"),
    ),
    Case(
        "RingpackConfig plan_options value",
        lambda: RingpackConfig(plan_options={"samples_per_step": -1}),
        PlanError,
        ("plan_options", "samples_per_step"),
    ),
    Case(
        "RingpackConfig schedule_options",
        lambda: RingpackConfig(schedule_options={"dense": 1}),
        DataError,
        ("RingpackConfig.schedule_options", "dense"),
    ),
    Case("PlannedSteps None", lambda: PlannedSteps(None, None), DataError, ("loader",)),
    Case("RingpackTrainer ringpack", lambda: RingpackTrainer(ringpack={"cp_size": 2}), DataError, ("ringpack", "dict")),
    Case("RingpackTrainer mesh", lambda: RingpackTrainer(mesh="dp,cp"), DataError, ("mesh", "str")),
]


def _check(name: str, error_type: str, message: str, want: type[Exception], words: tuple[str, ...]) -> None:
    assert error_type == want.__name__, f"{name}: raised {error_type}: {message}"
    assert "\n" not in message, f"{name}: more than one line: {message!r}"
    missing = [w for w in words if w not in message]
    assert not missing, f"{name}: the message does not name {missing}: {message}"


def _outcome(call: Callable[[], object]) -> tuple[str, str]:
    try:
        result = call()
    except Exception as exc:  # the type is what the test checks
        return type(exc).__name__, str(exc)
    return "no error", repr(result)[:200]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_a_bad_argument_is_refused_naming_it(case: Case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "shards" does not exist there: the reader's arguments are checked first
    _check(case.name, *_outcome(case.call), case.error, case.words)


class _Headless(torch.nn.Linear):
    """A model whose config names no attention heads."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.config = type("Config", (), {"hidden_size": 8})()


def test_the_table_covers_the_public_api():
    """Every name ``import ringpack`` exports (the learner aside, tested with its own module) and
    the integrations' public functions appear in some case."""
    import inspect
    import re

    import ringpack.integrations.trainer as trainer

    source = inspect.getsource(inspect.getmodule(test_the_table_covers_the_public_api))
    table = source[source.index("LENGTHS = ") : source.index("def _check(")]
    names = set(ringpack.__all__) - {"__version__", "CostLearner", "PlanError", "DataError"}
    names |= set(distributed.__all__) - {"MeshCoordinates"}
    names |= {"causal_lm_loss_sum", "ringpack_attention_forward"} | set(trainer.__all__)
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", table))
    assert not missing, f"no case calls {missing}"


# ---------------------------------------------------------------------------------------- meshes


def _mesh_cases(rank: int, world: int) -> list[tuple[str, str, str]]:
    """Mesh cases on real DeviceMeshes of this 1-rank gloo group: ``(case, error type, message)``."""
    from torch.distributed.device_mesh import init_device_mesh

    grid = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"))
    dp_only = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    cp_only = grid["cp"]
    calls = {
        "from_mesh same dimension": lambda: BalancedBatchSampler.from_mesh(LENGTHS, grid, 8, dp_dim="cp"),
        "reader from_mesh same dimension": lambda: ShardReader.from_mesh("shards", grid, dp_dim="cp", cp_dim="cp"),
        "mesh_coordinates same dimension": lambda: distributed.mesh_coordinates(grid, "dp", "dp"),
        "mesh_coordinates dim None": lambda: distributed.mesh_coordinates(grid, None, "cp"),
        "from_mesh 1-D dp mesh": lambda: BalancedBatchSampler.from_mesh(LENGTHS, dp_only, 8),
        "from_mesh no tp": lambda: BalancedBatchSampler.from_mesh(LENGTHS, grid, 8, cp_dim="tp"),
        "collator from_mesh 1-D dp mesh": lambda: PackedCollator.from_mesh(dp_only),
        "collator from_mesh no tp": lambda: PackedCollator.from_mesh(grid, cp_dim="tp"),
        "cp_group 1-D dp mesh": lambda: distributed.cp_group(dp_only),
        "cp_group no tp": lambda: distributed.cp_group(grid, dim="tp"),
        "data_parallel_mesh unknown": lambda: distributed.data_parallel_mesh(grid, ("dp", "tp")),
        "data_parallel_mesh twice": lambda: distributed.data_parallel_mesh(grid, ("dp", "dp")),
        "attention 2-D mesh": lambda: ring_attention(Q, K, V, SCHEDULE, group=grid),
        "RingpackTrainer mesh cp_size": lambda: RingpackTrainer(ringpack=RingpackConfig(cp_size=2), mesh=grid),
    }
    report = [(name, *_outcome(call)) for name, call in calls.items()]
    # the same meshes, used as they should be, still work
    good = PackedCollator.from_mesh(cp_only), distributed.cp_group(cp_only), distributed.mesh_coordinates(grid)
    report.append(("well-formed meshes", "no error", repr((good[0].cp_size, good[2].cp_size))))
    return report


MESH_CASES = {
    "from_mesh same dimension": (DataError, ("dp_dim", "cp_dim", "'cp'")),
    "reader from_mesh same dimension": (DataError, ("dp_dim", "cp_dim", "'cp'")),
    "mesh_coordinates same dimension": (DataError, ("dp_dim", "cp_dim", "'dp'")),
    "mesh_coordinates dim None": (DataError, ("dp_dim", "None")),
    "from_mesh 1-D dp mesh": (DataError, ("'cp'", "cp_dim")),
    "from_mesh no tp": (DataError, ("'tp'", "cp_dim")),
    "collator from_mesh 1-D dp mesh": (DataError, ("1-D", "'dp'", "'cp'")),
    "collator from_mesh no tp": (DataError, ("'tp'",)),
    "cp_group 1-D dp mesh": (DataError, ("group", "'dp'", "'cp'")),
    "cp_group no tp": (DataError, ("group", "'tp'")),
    "data_parallel_mesh unknown": (DataError, ("dims", "'tp'")),
    "data_parallel_mesh twice": (DataError, ("dims",)),
    "attention 2-D mesh": (DataError, ("group", "1-D DeviceMesh", "mesh['cp']")),
    "RingpackTrainer mesh cp_size": (PlanError, ("cp_size=2", "1 ranks")),
}


@pytest.fixture(scope="module")
def mesh_report():
    from ringpack._spawn import run_ranks

    (report,) = run_ranks(_mesh_cases, 1, timeout_s=60.0, join_s=120.0, name="meshes")
    return {name: (error, message) for name, error, message in report}


@pytest.mark.slow
def test_meshes_of_the_wrong_dimensions_are_refused_naming_them(mesh_report):
    assert set(mesh_report) == set(MESH_CASES) | {"well-formed meshes"}
    for name, (want, words) in MESH_CASES.items():
        _check(name, *mesh_report[name], want, words)
    assert mesh_report["well-formed meshes"] == ("no error", "(1, 1)")


def test_sampler_state_round_trips_through_the_checks():
    """The checks refuse only what is broken: a real state still loads."""
    saved = distributed.SamplerState(_sampler()).state_dict()
    json.loads(saved["rank0"])
    distributed.SamplerState(_sampler()).load_state_dict(saved)
    assert np.array_equal(_sampler().lengths, LENGTHS)
