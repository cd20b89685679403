"""Hugging Face ``Trainer`` on ringpack's plan: balanced DP x CP batches and context-parallel attention.

:class:`RingpackTrainer` takes the usual Trainer arguments plus
``ringpack=RingpackConfig(plan=PlanConfig(dp=..., cp=..., tokens_per_rank=..., ...))``, the plan
config whole; launch one process per device (``torchrun`` or ``accelerate launch``) on a
``("dp", "cp")`` grid with CP innermost. It wires a :class:`~ringpack.data.BalancedBatchSampler` per
DP rank and a :class:`~ringpack.data.PackedCollator` per CP rank (one Trainer batch is one planned
optimizer step, so ``gradient_accumulation_steps`` stays 1), ``attn_implementation="ringpack"`` with
the CP group, the loss rule (each micro-batch's loss sum over the global batch's loss tokens,
gradients summed by :func:`~ringpack.integrations.distributed.sum_gradients`) and a logged loss that
is the global per-token mean.

Not wired: evaluation through ringpack attention, Trainer's data skipping on resume (the sampler
resumes exactly), DeepSpeed and ``DataParallel``.

See docs/integrations.md, "Hugging Face Trainer".
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.utils import logging

from ringpack._checks import is_int
from ringpack.attention import BACKENDS, MODES, ModeChoice, ScheduleOptions
from ringpack.comm_model import CommModel
from ringpack.cost import CostModel
from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset
from ringpack.data.collator import schedule_options_of
from ringpack.data.sampler import check_plan_options
from ringpack.errors import DataError, PlanError
from ringpack.integrations.distributed import gradient_sync, sum_gradients
from ringpack.integrations.transformers import causal_lm_loss_sum, register
from ringpack.lengths import sample_lengths
from ringpack.mesh import MeshCoordinates, mesh_coordinates
from ringpack.modes import HYBRID_MODES
from ringpack.shard_plan import STRATEGIES, PlanConfig

logger = logging.get_logger(__name__)

__all__ = ["PlannedSteps", "RingpackConfig", "RingpackTrainer", "model_mode_choice"]


class _NotGiven:
    """The default of RingpackConfig's old-spelling fields: not given (``None`` is a value they refuse)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()

#: RingpackConfig's old spelling of the plan, taken apart: the fields and their defaults.
_OLD_SPELLING = {"cp_size": 1, "tokens_per_rank": 4096, "strategy": "balanced", "plan_options": {}}


@dataclass(frozen=True, kw_only=True)
class RingpackConfig:
    """How :class:`RingpackTrainer` plans and runs a dataset: the plan config whole, the runtime apart.

    Args:
        plan: the :class:`~ringpack.shard_plan.PlanConfig` every rank plans with, whole
            (``PlanConfig(dp=..., cp=..., tokens_per_rank=..., samples_per_step=..., seed=...)``):
            ``dp x cp`` must be the world (the mesh's ``"dp"`` and ``"cp"`` sizes where a mesh is
            given); its ``seed`` shuffles the data. ``None``: CP size 1 (or the mesh's), the world
            as DP, 4096 tokens per rank, the seed of ``args.data_seed`` or ``args.seed``.
        mode: one of :data:`~ringpack.attention.MODES` (:func:`~ringpack.attention.ring_attention`):
            ``"ring"``, ``"allgather"``, ``"p2p"``, ``"ulysses"``, or the hybrids ``"ulysses+p2p"`` and
            ``"ulysses+ring"`` (nodes of the plan's ``gpus_per_node`` ranks), or ``"auto"``: each
            micro-batch's fastest by the plan's cost model and the links of ``schedule_options``'
            ``mode_choice`` (default: NVLink within a node, InfiniBand across, the model's heads and
            layers from its config).
        backend: the attention kernels (``"auto"``, ``"flash_attn"``, ``"reference"``, ...).
        column: the token-id field of dict rows.
        lengths: token count of each dataset row (default: read from the dataset).
        schedule_options: the collator's :class:`~ringpack.attention.ScheduleOptions` (a dict of
            its fields still works for one release, with a ``DeprecationWarning``).
        cp_size, tokens_per_rank, strategy, plan_options: the old spelling of ``plan``, taken
            apart (the plan's DP size from the world, its seed from ``TrainingArguments``); it
            still works for one release, with a ``DeprecationWarning``.

    Raises:
        PlanError: a ``plan`` that is not a PlanConfig, or given with the old spelling; in the old
            spelling: a ``cp_size`` or ``tokens_per_rank`` that is not a positive integer, an
            unknown ``strategy``, ``plan_options`` that are not a dict of other PlanConfig fields
            with valid values (the fields set by the old spelling or the Trainer are refused).
        DataError: an unknown ``mode`` or ``backend``, a ``column`` that is not a string, bad
            ``schedule_options``.
    """

    plan: PlanConfig | None = None
    mode: str = "ring"
    backend: str = "auto"
    column: str = "input_ids"
    lengths: Any = None
    schedule_options: ScheduleOptions | None = None
    cp_size: int = _NOT_GIVEN
    tokens_per_rank: int = _NOT_GIVEN
    strategy: str = _NOT_GIVEN
    plan_options: dict[str, Any] = _NOT_GIVEN

    def __post_init__(self) -> None:
        old = [name for name in _OLD_SPELLING if getattr(self, name) is not _NOT_GIVEN]
        if self.plan is not None and not isinstance(self.plan, PlanConfig):
            raise PlanError(f"RingpackConfig.plan must be a PlanConfig, got {type(self.plan).__name__}")
        if self.plan is not None and old:
            raise PlanError(f"RingpackConfig: give plan=PlanConfig(...) or the old {', '.join(old)}, not both")
        if old:
            warnings.warn(
                f"RingpackConfig({'=..., '.join(old)}=...) is deprecated: pass RingpackConfig(plan=PlanConfig(dp=..., "
                "cp=..., tokens_per_rank=..., strategy=..., seed=..., ...)), the plan config whole",
                DeprecationWarning,
                stacklevel=3,
            )
            self._check_old_spelling()
        if not isinstance(self.mode, str) or self.mode not in (*MODES, "auto"):
            raise DataError(f"RingpackConfig.mode must be one of {(*MODES, 'auto')}, got {self.mode!r}")
        if not isinstance(self.backend, str) or (self.backend != "auto" and self.backend not in BACKENDS):
            raise DataError(f"RingpackConfig.backend must be 'auto' or one of {BACKENDS}, got {self.backend!r}")
        if not isinstance(self.column, str):
            raise DataError(f"RingpackConfig.column must be the name of the token-id field, got {self.column!r}")
        object.__setattr__(
            self, "schedule_options", schedule_options_of(self.schedule_options, "RingpackConfig", stacklevel=4)
        )

    def _check_old_spelling(self) -> None:
        """The old spelling's fields, checked now rather than when training starts."""
        cp_size, tokens_per_rank, strategy, plan_options = self._old_fields()
        for name, value in (("cp_size", cp_size), ("tokens_per_rank", tokens_per_rank)):
            if not is_int(value) or value < 1:
                raise PlanError(f"RingpackConfig.{name} must be a positive integer, got {value!r}")
        if strategy not in STRATEGIES:
            raise PlanError(f"RingpackConfig.strategy must be one of {STRATEGIES}, got {strategy!r}")
        if not isinstance(plan_options, Mapping):
            raise PlanError(f"RingpackConfig.plan_options must be a dict, got {type(plan_options).__name__}")
        check_plan_options(plan_options, _SET_BY_TRAINER, "RingpackConfig.plan_options")
        try:
            PlanConfig(dp=1, cp=cp_size, tokens_per_rank=tokens_per_rank, **plan_options)
        except PlanError as exc:
            raise PlanError(f"RingpackConfig.plan_options: {exc}") from exc

    def _old_fields(self) -> tuple[Any, ...]:
        """``(cp_size, tokens_per_rank, strategy, plan_options)``, the defaults where not given."""
        return tuple(
            default if getattr(self, name) is _NOT_GIVEN else getattr(self, name)
            for name, default in _OLD_SPELLING.items()
        )

    def _cp(self, coordinates: MeshCoordinates | None = None) -> int:
        """The CP size this config asks for (``plan.cp``; without a plan, the mesh's or 1)."""
        if self.plan is not None:
            return self.plan.cp
        if self.cp_size is _NOT_GIVEN and coordinates is not None:
            return coordinates.cp_size
        return self._old_fields()[0]

    def plan_for(self, args: Any, coordinates: MeshCoordinates | None) -> PlanConfig:
        """The plan config of a run with TrainingArguments ``args`` on the mesh at ``coordinates``.

        Returns ``plan`` as given, or the plan of the old spelling (or of no plan): DP size from
        the mesh or the world, seed from ``args.data_seed`` or ``args.seed``.

        Raises:
            PlanError: a plan whose ``dp x cp`` is not the world (the mesh's sizes, with a mesh), or
                a world that is not a multiple of the CP size.
        """
        world = args.world_size
        if self.plan is not None:
            plan = self.plan
            sizes = (world // plan.cp, plan.cp) if coordinates is None else (coordinates.dp_size, coordinates.cp_size)
            if (plan.dp, plan.cp) != sizes or (coordinates is None and world % plan.cp):
                where = f"a world of {world} ranks" if coordinates is None else "a mesh of dp={}, cp={}".format(*sizes)
                raise PlanError(f"RingpackConfig.plan has dp={plan.dp}, cp={plan.cp} but the run is {where}")
            return plan
        cp = self._cp(coordinates)
        if world % cp:
            raise PlanError(f"world size {world} is not a multiple of RingpackConfig.cp_size={cp}")
        _, tokens_per_rank, strategy, plan_options = self._old_fields()
        return PlanConfig(
            dp=coordinates.dp_size if coordinates is not None else world // cp,
            cp=cp,
            tokens_per_rank=tokens_per_rank,
            strategy=strategy,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            **plan_options,
        )


#: PlanConfig fields that the old spelling of RingpackConfig or the Trainer set, and what sets them.
_SET_BY_TRAINER = {
    "dp": "the mesh (the world over cp_size)",
    "cp": "RingpackConfig.cp_size",
    "tokens_per_rank": "RingpackConfig.tokens_per_rank",
    "strategy": "RingpackConfig.strategy",
    "seed": "TrainingArguments.data_seed or seed",
    "epoch": "the Trainer's epoch",
}


class PlannedSteps:
    """A loader of optimizer steps: each item is one step's micro-batches for this rank.

    Items are ``{"microbatches": [batch, ...], "input_ids": int64 [T]}`` where each batch is a
    :class:`~ringpack.data.PackedCollator` batch and ``input_ids`` concatenates the step's local tokens
    (Trainer counts tokens and FLOPs from it). ``len()`` is the epoch's step count and
    ``set_epoch(e)`` starts epoch ``e``'s plan, as Trainer expects of a loader.
    """

    def __init__(self, loader: torch.utils.data.DataLoader, sampler: BalancedBatchSampler) -> None:
        if not isinstance(loader, torch.utils.data.DataLoader):
            raise DataError(f"loader must be a torch DataLoader, got {type(loader).__name__}")
        if not isinstance(sampler, BalancedBatchSampler):
            raise DataError(f"sampler must be the loader's BalancedBatchSampler, got {type(sampler).__name__}")
        self.loader, self.sampler, self.dataset = loader, sampler, loader.dataset

    def __len__(self) -> int:
        return self.sampler.num_steps

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        step: list[dict[str, Any]] = []
        for batch in self.loader:
            if batch["microbatch_index"] != len(step):  # a step trained without some of its micro-batches
                raise DataError(
                    f"step {batch['step']} of epoch {batch['epoch']}: the loader gave micro-batch "
                    f"{batch['microbatch_index']} of {batch['microbatches_in_step']} after {len(step)} of them; "
                    "resume the sampler at a step boundary (a cursor after a step's last micro-batch)"
                )
            step.append(batch)
            if batch["microbatch_index"] + 1 == batch["microbatches_in_step"]:
                yield {"microbatches": step, "input_ids": torch.cat([b["input_ids"] for b in step])}
                step = []
        if step:
            raise RuntimeError(f"the loader ended inside a step ({len(step)} of its micro-batches)")


class RingpackTrainer(Trainer):
    """``transformers.Trainer`` that trains on ringpack's plan with context-parallel attention (module docstring).

    Args:
        *args, **kwargs: those of ``Trainer``; ``train_dataset`` rows are token ids (or dicts with
            ``ringpack.column``), ``data_collator`` is ignored.
        ringpack: how to plan and run (:class:`RingpackConfig`).
        mesh: a DeviceMesh with dimensions ``"dp"`` and ``"cp"`` (default: one over the whole world,
            CP innermost).

    ``TrainingArguments.ddp_find_unused_parameters`` left at ``None`` is set to ``False``: every
    parameter of a causal LM takes part in its forward.

    Raises:
        DataError: (a ``ValueError``) ``ringpack`` not a :class:`RingpackConfig`, a ``mesh`` that is
            not a DeviceMesh with dimensions ``"dp"`` and ``"cp"``, a model without
            ``set_attn_implementation`` (not a transformers model); when training: a ``train_dataset``
            that is missing or a stream, ``RingpackConfig.lengths`` with another count than its rows,
            a row holding a token id outside ``[0, vocab_size)`` of the model's input embedding
            (the row named, before the model sees it).
        PlanError: a world or mesh of other DP x CP sizes than ``ringpack.plan``'s (in the old
            spelling: a world that is not a multiple of ``cp_size``, a mesh of another CP size).
        ValueError: ``gradient_accumulation_steps`` other than 1, ``DataParallel`` (several devices
            per process), or a model whose attention does not go through transformers'
            ``AttentionInterface``.
    """

    def __init__(self, *args: Any, ringpack: RingpackConfig | None = None, mesh: Any = None, **kwargs: Any) -> None:
        if ringpack is not None and not isinstance(ringpack, RingpackConfig):
            raise DataError(f"ringpack must be a RingpackConfig, got {type(ringpack).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "ddp_find_unused_parameters", False) is None:
            # a causal LM's forward uses every parameter: DDP's search for unused ones (transformers'
            # default without activation checkpointing) would only cost a graph traversal and a warning
            training_args.ddp_find_unused_parameters = False
        coordinates = None if mesh is None else mesh_coordinates(mesh)  # before Trainer's set-up: fail fast
        if coordinates is not None and ringpack is not None and coordinates.cp_size != ringpack._cp(coordinates):
            name = "plan.cp" if ringpack.plan is not None else "cp_size"
            raise PlanError(
                f"RingpackConfig.{name}={ringpack._cp(coordinates)} but the mesh's 'cp' dimension has "
                f"{coordinates.cp_size} ranks"
            )
        super().__init__(*args, **kwargs)
        ringpack = RingpackConfig() if ringpack is None else ringpack
        plan = ringpack.plan_for(self.args, coordinates)
        #: the run's config, its plan resolved (the old spelling's and the default's as a PlanConfig)
        self.ringpack = replace(ringpack, plan=plan, **dict.fromkeys(_OLD_SPELLING, _NOT_GIVEN))
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError("the plan sets each step's micro-batches: use gradient_accumulation_steps=1")
        if self.args.n_gpu > 1:
            raise ValueError("RingpackTrainer runs one process per device; launch with torchrun or accelerate launch")
        if not hasattr(self.model, "set_attn_implementation"):
            raise DataError(
                f"model must be a transformers model (set_attn_implementation), got {type(self.model).__name__}"
            )
        self.mesh = mesh if mesh is not None else _grid_mesh(self.args, plan.cp)
        self.coordinates = coordinates if coordinates is not None else _coordinates(self.mesh)
        register()
        self.model.set_attn_implementation("ringpack")
        if self.model.config._attn_implementation != "ringpack":
            raise ValueError(f"{type(self.model).__name__} cannot run ringpack attention (no AttentionInterface)")
        self.sampler: BalancedBatchSampler | None = None
        self._summing_model: torch.nn.Module | None = None

    def get_train_dataloader(self) -> PlannedSteps:
        """This rank's planned steps (:class:`PlannedSteps`); ``self.sampler`` is the plan's sampler."""
        if self.train_dataset is None:
            raise DataError("RingpackTrainer: training requires a train_dataset")
        config, c, args = self.ringpack, self.coordinates, self.args
        dataset = PackedDataset(self.train_dataset, config.column)
        # tickets list only the rows this CP rank's pieces come from: its loader reads no other sample
        self.sampler = BalancedBatchSampler(_lengths(dataset, config), config.plan, c.dp_rank, cp_rank=c.cp_rank)
        dropped = self.sampler.dropped  # overflow="drop" leaves samples out by request: say how many
        if dropped:
            logger.warning(
                "ringpack: overflow='drop' leaves out %d of %d training rows (longer than %d tokens), e.g. row %d",
                len(dropped), len(dataset), self.sampler.config.group_capacity, dropped[0],
            )  # fmt: skip
        workers = args.dataloader_num_workers
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=self.sampler,
            collate_fn=PackedCollator(
                c.cp_rank, c.cp_size, schedule_options=self._schedule_options(), vocab_size=_vocab_size(self.model)
            ),
            num_workers=workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and workers > 0,
            prefetch_factor=args.dataloader_prefetch_factor if workers > 0 else None,
        )
        return PlannedSteps(loader, self.sampler)

    def _schedule_options(self) -> ScheduleOptions:
        """The collator's schedule options: with the node layout for a hybrid mode; under ``mode="auto"``
        with a pick priced by the plan's cost model and, unless the options give one, links for the
        model's shape (:func:`model_mode_choice`)."""
        options = self.ringpack.schedule_options
        if self.ringpack.mode in HYBRID_MODES:
            return replace(options, hybrid_layout=True)
        if self.ringpack.mode != "auto" or options.mode_choice is not None:
            return options
        return replace(options, mode_choice=model_mode_choice(self.model, self.ringpack.plan.cost))

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
        """Forward and backward of one planned step; returns ``world x`` this rank's share of its loss."""
        model.train()
        if model is not self._summing_model:  # the model accelerate prepared (DDP or FSDP2): sum, not average
            self._summing_model = sum_gradients(model)
        microbatches = inputs["microbatches"]
        total = torch.zeros((), dtype=torch.float64, device=self.args.device)
        for index, batch in enumerate(microbatches):
            with gradient_sync(model, enabled=index + 1 == len(microbatches)):
                with self.compute_loss_context_manager():
                    loss = self.microbatch_loss(model, batch)
                self.accelerator.backward(loss)
            total += loss.detach().double()
        return total * self.args.world_size

    def microbatch_loss(self, model: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        """This rank's token-loss sum of one micro-batch over the step's loss tokens (override for another loss).

        Args:
            model: the prepared model.
            batch: a :class:`~ringpack.data.PackedCollator` batch (host tensors and schedule).

        Returns:
            A scalar whose gradients, summed over all ranks and the step's micro-batches, are those
            of the single-device per-token mean over the global batch.
        """
        device = self.args.device
        logits = model(
            input_ids=batch["input_ids"].to(device)[None],
            position_ids=batch["position_ids"].to(device)[None],
            ringpack_schedule=batch["schedule"].to(device),
            ringpack_group=self.coordinates.cp_group,
            ringpack_mode=self.ringpack.mode,
            ringpack_backend=self.ringpack.backend,
            use_cache=False,
        ).logits
        return causal_lm_loss_sum(logits[0], batch["labels"].to(device)) / batch["step_loss_tokens"]


def model_mode_choice(model: torch.nn.Module, cost: CostModel) -> ModeChoice:
    """How ``mode="auto"`` prices a Hugging Face model's modes: ``cost`` for the compute, NVLink within a
    node and InfiniBand across (:data:`~ringpack.comm_model.LINKS`), and the model config's heads,
    K/V heads, head dim and layers in its parameters' dtype.

    Raises:
        DataError: a model config without ``num_attention_heads`` or ``num_hidden_layers``.
    """
    config = model.config
    heads, layers = getattr(config, "num_attention_heads", None), getattr(config, "num_hidden_layers", None)
    if not (is_int(heads) and is_int(layers)):
        raise DataError(f"mode='auto': {type(model).__name__}'s config names no num_attention_heads/num_hidden_layers")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype_bytes = next(model.parameters()).element_size()
    comm = CommModel(
        heads=heads,
        kv_heads=kv_heads,
        layers=layers,
        q_bytes_per_token_layer=heads * head_dim * dtype_bytes,
        kv_bytes_per_token_layer=2 * kv_heads * head_dim * dtype_bytes,
    )
    return ModeChoice(cost=cost, comm=comm)


def _vocab_size(model: torch.nn.Module) -> int | None:
    """Rows of the model's input embedding (every token id must be below it); None if it has none."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) and rows > 0 else getattr(model.config, "vocab_size", None)


def _grid_mesh(args: Any, cp_size: int) -> Any:
    """A ``("dp", "cp")`` DeviceMesh over the world (None for one process)."""
    world = args.world_size  # a multiple of cp_size (RingpackConfig.plan_for)
    if world == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(args.device.type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))


def _coordinates(mesh: Any) -> MeshCoordinates:
    """This rank's place in ``mesh`` (one process: the only place)."""
    if mesh is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            raise DataError("a distributed run needs a DeviceMesh")
        return MeshCoordinates(0, 1, 0, 1, None)
    return mesh_coordinates(mesh)


def _lengths(rows: PackedDataset, config: RingpackConfig) -> np.ndarray:
    """Token count of each row: given (one per row, or the plan would leave rows out or name rows
    that do not exist), read from a ``datasets.Dataset`` column, or counted row by row."""
    if config.lengths is not None:
        lengths = sample_lengths(config.lengths)
        if len(lengths) != len(rows):
            raise DataError(
                f"RingpackConfig.lengths has {len(lengths)} entries but train_dataset has {len(rows)} rows: "
                "give one token count per row"
            )
        return lengths
    dataset = rows.dataset
    if hasattr(dataset, "column_names"):  # a datasets.Dataset: read its column, not its rows
        return sample_lengths(dataset, config.column)
    return sample_lengths([len(rows[i]) for i in range(len(rows))])
