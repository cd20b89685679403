"""``BalancedBatchSampler``: this DP rank's micro-batches of a balanced plan, for ``DataLoader(batch_sampler=...)``.

Each item is a :class:`MicroBatchTicket`: a ``list`` of sample indices in canonical order that
also carries the micro-batch's plan and where it sits (epoch, step, index, cursor, the step's loss
tokens, the plan hash). :class:`~ringpack.data.collator.PackedDataset` hands it with the token ids
to :class:`~ringpack.data.collator.PackedCollator`, so workers never re-plan; a ticket pickles as
plain integers and arrays.

The epoch's plan is a pure function of ``(lengths, config, seed, epoch)``, planned
``lookahead_steps`` ahead (:class:`~ringpack.planner.stream.StepStream`) by a planner process of
this rank or a thread (``planner=``); every DP rank plans alike without communicating.
``state_dict()`` / ``load_state_dict()`` resume exactly: ``cursor`` counts the micro-batches
yielded (the ``StatefulDataLoader`` convention), ``load_state_dict`` seeks and never replays, and
with a plain ``DataLoader`` ``state_dict(cursor=batch["cursor"])`` resumes right after that batch.

See docs/data.md, "The sampler".
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ringpack._checks import is_int
from ringpack.cost import CostModel
from ringpack.errors import PlanError
from ringpack.lengths import DataError, sample_lengths
from ringpack.mesh import mesh_coordinates
from ringpack.planner.stream import LOOKAHEAD_STEPS, PLANNERS, PackedMicroBatch, RankStep, StepStream
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, RankShard, Step

__all__ = ["BalancedBatchSampler", "MicroBatchTicket", "STATE_VERSION", "check_plan_options", "rank_positions"]

#: Version 2: a state names the step its cursor is in and that step's digest (checked by planning
#: it again), not the whole plan's hash; version-1 states still load.
STATE_VERSION = 2

try:  # a real torch Sampler where torch is installed (it always is for DataLoader users)
    from torch.utils.data import Sampler as _SamplerBase
except ImportError:  # pragma: no cover
    _SamplerBase = object  # type: ignore[assignment,misc]


def check_plan_options(options: dict[str, Any], set_by: dict[str, str], where: str = "plan option") -> None:
    """Raise unless every key of ``options`` is a :class:`PlanConfig` field the caller leaves to them.

    ``set_by`` maps the fields the caller sets itself to what sets them (``{"cp": "cp_size"}``);
    ``where`` names the options in messages.

    Raises:
        DataError: a field the caller sets (naming what sets it).
        PlanError: a name that is no PlanConfig field.
    """
    fields = {f.name for f in dataclasses.fields(PlanConfig)}
    for key in options:
        if key in set_by:
            raise DataError(f"{where} {key}= is set by {set_by[key]}, not here")
        if key not in fields:
            raise PlanError(f"unknown {where} {key!r}; PlanConfig fields are {sorted(fields - set(set_by))}")


def _pack_data(packed: PackedMicroBatch) -> tuple:
    return packed.fields()


def _encode_microbatch(mb: MicroBatch) -> tuple:
    return (
        mb.samples,
        tuple(tuple((p.sample, p.start, p.stop) for p in shard.pieces) for shard in mb.shards),
        mb.loss_tokens,
    )


def _decode_microbatch(data: tuple) -> MicroBatch | PackedMicroBatch:
    """A micro-batch of :func:`_encode_microbatch`, or packed (left packed) of :func:`_pack_data`."""
    if len(data) != 3:
        return PackedMicroBatch(*data)
    samples, shards, loss_tokens = data
    return MicroBatch(
        samples=tuple(samples),
        shards=tuple(RankShard(tuple(Piece(*p) for p in shard)) for shard in shards),
        loss_tokens=loss_tokens,
    )


class MicroBatchTicket(list):
    """A micro-batch's dataset rows (a ``list`` of indices) plus its plan and position.

    The list holds the dataset row of each of ``microbatch.samples`` (the same numbers, except with
    ``overflow="split"``, where the plan's samples are documents cut from long rows: document
    ``microbatch.samples[k]`` is tokens ``[offsets[k], offsets[k] + its length)`` of row ``self[k]``;
    ``row_lengths[k]`` is that row's full token count, checked by the collator).

    Attributes: ``microbatch`` (:class:`MicroBatch`: samples and every CP rank's pieces),
    ``epoch``, ``step``, ``index`` (its position among this DP rank's micro-batches of the step),
    ``microbatches_in_step``, ``cursor`` (1-based position among this DP rank's micro-batches of
    the epoch: the sampler state that resumes after it has ``cursor=ticket.cursor``),
    ``step_loss_tokens`` (loss tokens of the whole global batch of the step, all DP ranks),
    ``plan_hash`` and ``gpus_per_node`` (the plan's node size: the collator compiles the schedule's
    node-relayed exchange for it; None for a plan without one), ``max_partners`` (the plan's
    partner budget, which the collator compiles the schedule for; 0: none), and ``positions``: None when the
    list holds a row for every sample of the micro-batch, else the indices into
    ``microbatch.samples`` of the samples it holds rows for, those one CP rank's pieces come from
    (a sampler given ``cp_rank``), with ``offsets`` and ``row_lengths`` theirs.
    """

    def __init__(
        self,
        microbatch: MicroBatch | PackedMicroBatch,
        *,
        epoch: int,
        step: int,
        index: int,
        microbatches_in_step: int,
        cursor: int,
        step_loss_tokens: int,
        plan_hash: str,
        rows: Sequence[int] | None = None,
        offsets: Sequence[int] | None = None,
        row_lengths: Sequence[int] | None = None,
        gpus_per_node: int | None = None,
        positions: Sequence[int] | None = None,
        max_partners: int = 0,
    ) -> None:
        rows = tuple(int(r) for r in microbatch.samples) if rows is None else tuple(int(r) for r in rows)
        self.gpus_per_node = gpus_per_node
        self.max_partners = int(max_partners)
        self.positions = None if positions is None else tuple(int(k) for k in positions)
        super().__init__(rows)
        self.offsets = tuple(0 for _ in rows) if offsets is None else tuple(int(o) for o in offsets)
        self.row_lengths = None if row_lengths is None else tuple(int(n) for n in row_lengths)
        # a packed micro-batch (as the planner process sends it) is unpacked on first use: in the
        # DataLoader worker that collates it, not in the process that hands it out
        self._microbatch = microbatch if isinstance(microbatch, MicroBatch) else None
        self._packed = None if isinstance(microbatch, MicroBatch) else microbatch
        self.epoch = epoch
        self.step = step
        self.index = index
        self.microbatches_in_step = microbatches_in_step
        self.cursor = cursor
        self.step_loss_tokens = step_loss_tokens
        self.plan_hash = plan_hash

    @property
    def microbatch(self) -> MicroBatch:
        """The micro-batch: its samples and every CP rank's pieces."""
        if self._microbatch is None:
            self._microbatch = self._packed.unpack()
        return self._microbatch

    def __reduce__(self) -> tuple:
        meta = (
            self.epoch,
            self.step,
            self.index,
            self.microbatches_in_step,
            self.cursor,
            self.step_loss_tokens,
            self.plan_hash,
            self.gpus_per_node,
            self.positions,
            self.max_partners,
        )
        return (
            _rebuild_ticket,
            (
                _encode_microbatch(self._microbatch) if self._packed is None else _pack_data(self._packed),
                meta,
                tuple(self),
                self.offsets,
                self.row_lengths,
            ),
        )

    def __repr__(self) -> str:
        return f"MicroBatchTicket(epoch={self.epoch}, step={self.step}, index={self.index}, samples={list(self)})"


def _rebuild_ticket(mb: tuple, meta: tuple, rows: tuple, offsets: tuple, row_lengths: tuple | None) -> MicroBatchTicket:
    epoch, step, index, n, cursor, loss, plan_hash, gpus_per_node, positions, max_partners = meta
    return MicroBatchTicket(
        _decode_microbatch(mb),
        epoch=epoch,
        step=step,
        index=index,
        microbatches_in_step=n,
        cursor=cursor,
        step_loss_tokens=loss,
        plan_hash=plan_hash,
        rows=rows,
        offsets=offsets,
        row_lengths=row_lengths,
        gpus_per_node=gpus_per_node,
        positions=positions,
        max_partners=max_partners,
    )


def rank_positions(mb: MicroBatch | PackedMicroBatch, cp_rank: int) -> np.ndarray:
    """Indices into ``mb.samples`` of the samples CP rank ``cp_rank`` holds pieces of, ascending
    (int64; what a sampler given ``cp_rank`` lists in :attr:`MicroBatchTicket.positions`)."""
    if isinstance(mb, PackedMicroBatch):  # the slot of each piece is its sample's index
        return np.unique(mb.table.slot[mb.table.rows_of(cp_rank)])
    samples = np.asarray(mb.samples, dtype=np.int64)
    mine = np.fromiter((p.sample for p in mb.shards[cp_rank].pieces), dtype=np.int64)
    return np.flatnonzero(np.isin(samples, mine))


class BalancedBatchSampler(_SamplerBase):
    """Yield this DP rank's micro-batches (as :class:`MicroBatchTicket`), step after step.

    ``BalancedBatchSampler(lengths, config, dp_rank)``: the plan config passed whole, this rank's
    place apart (the spelling ``(lengths, dp_rank, dp_size, cp_size, tokens_per_rank, strategy,
    seed, **plan_options)`` still works, with a ``DeprecationWarning``).

    Args:
        lengths: token count per sample (array-like, a ``datasets.Dataset`` with ``input_ids``,
            or a lengths file); sample ``i`` is row ``i`` of the dataset the loader reads.
        config: the :class:`PlanConfig` every DP rank plans with (``dp``, ``cp``,
            ``tokens_per_rank``, ``strategy``, ``seed``, ``samples_per_step``, ``cost``, ...); its
            ``epoch`` is the first epoch iterated (:meth:`set_epoch` moves it).
        dp_rank: this rank's DP coordinate, in ``[0, config.dp)``.
        planner: keyword only: where steps are planned ahead, ``"process"`` (a planner process of
            this rank, forked, sending back this rank's micro-batches: the training loop keeps
            the interpreter), ``"thread"`` (a thread of this process) or ``"auto"`` (the default:
            the process on Linux for global batches of
            :data:`~ringpack.planner.stream.PROCESS_FROM_SAMPLES` samples or more, else the
            thread). Also the attribute ``planner``, read when an epoch's stream starts.
        cp_rank: keyword only: this rank's CP coordinate, in ``[0, config.cp)``, for tickets that
            list only the rows its pieces come from (:attr:`MicroBatchTicket.positions`), so its
            loader reads those samples, not the whole micro-batch's (on a pool of thousands of
            ranks, the whole global batch); give the collator the same CP rank. None (the
            default): every sample's row.

    Iterating yields one :class:`MicroBatchTicket` per micro-batch of this DP rank in the current
    epoch's plan (a ``list`` of dataset rows carrying the micro-batch's pieces on every CP rank),
    planned a few steps ahead in the background; an error planning a step is raised when
    iteration reaches it, and so is a planner process that died or stopped answering
    (:class:`~ringpack.planner.stream.PlannerDied`, a ``PlanError``: one line naming the process,
    how it ended and the step). ``len(sampler)`` is this rank's micro-batches in the current epoch (equal
    on every DP rank; without ``microbatches_per_rank`` it plans the steps not planned yet).
    See docs/data.md, "The sampler", for the handshake with the collator and for resume semantics.

    Raises:
        DataError: a bad length (naming the sample), a ``config`` that is not a :class:`PlanConfig`,
            ``dp_rank`` outside ``[0, config.dp)``, a ``cp_rank`` outside ``[0, config.cp)``, or
            ``planner`` not one of ``"auto"``, ``"thread"``, ``"process"``.
        PlanError: an invalid plan option in the old spelling (naming the field); when iterating,
            lengths that cannot be planned (a sample longer than a CP group holds under
            ``overflow="error"``).
    """

    def __init__(self, lengths: Any, config: PlanConfig | Any = None, dp_rank: Any = None, *args: Any, **kwargs: Any):
        planner = kwargs.pop("planner", "auto")
        cp_rank = kwargs.pop("cp_rank", None)
        if planner not in PLANNERS:
            raise DataError(f"planner must be one of {list(PLANNERS)}, got {planner!r}")
        if config is None and not args and not kwargs:
            raise DataError("BalancedBatchSampler(lengths, config, dp_rank): config must be a PlanConfig, got None")
        if config is None and "dp_size" in kwargs:  # the old spelling by keywords: dp_rank=..., dp_size=...
            config, dp_rank = _config_of_old_spelling(dp_rank, kwargs.pop("dp_size"), args, kwargs)
        elif not isinstance(config, PlanConfig):  # the old spelling by position: dp_rank, dp_size, ...
            config, dp_rank = _config_of_old_spelling(config, dp_rank, args, kwargs)
        elif args or kwargs:
            extra = [*(repr(a) for a in args), *kwargs]
            raise DataError(
                f"BalancedBatchSampler(lengths, config, dp_rank) takes nothing more, got {', '.join(extra)}"
            )
        if not is_int(dp_rank) or not 0 <= dp_rank < config.dp:
            raise DataError(f"dp_rank must be in [0, {config.dp}) (config.dp), got {dp_rank!r}")
        if cp_rank is not None and (not is_int(cp_rank) or not 0 <= cp_rank < config.cp):
            raise DataError(f"cp_rank must be None or in [0, {config.cp}) (config.cp), got {cp_rank!r}")
        first_epoch = config.epoch
        self.config = dataclasses.replace(config, epoch=0)
        self.lengths = sample_lengths(lengths)
        self.dp_rank = int(dp_rank)
        #: the CP rank whose pieces' rows the tickets list (None: every sample's)
        self.cp_rank = None if cp_rank is None else int(cp_rank)
        self._base_cost = self.config.cost
        # (epoch, step, cost model): from that step on the plan uses that model (set_cost_model)
        self._switches: list[tuple[int, int, CostModel]] = []
        self.epoch = first_epoch
        self._cursor = 0  # micro-batches yielded in this epoch (by the live iterator, or restored)
        self._pending: int | None = None  # cursor the next __iter__ starts at (set by load_state_dict)
        #: steps planned ahead of the one the loader is in (a window of this many + 1 is kept)
        self.lookahead_steps = LOOKAHEAD_STEPS
        #: where steps are planned ahead: "auto", "process" or "thread" (read when an epoch's stream starts)
        self.planner = planner
        self._epochs: dict[int, _EpochSteps] = {}  # the current epoch's (and at most one more)
        self._whole: tuple[int, int, Plan] | None = None  # (epoch, switches, plan) of plan()
        self._docs: tuple[np.ndarray, np.ndarray] | None = None  # (row, offset) of each plan sample
        self._lengths_hash: str | None = None

    @classmethod
    def from_mesh(
        cls, lengths: Any, mesh: Any, tokens_per_rank: int, *, dp_dim: str = "dp", cp_dim: str = "cp", **options: Any
    ) -> BalancedBatchSampler:
        """The sampler of this rank of a DeviceMesh with dimensions ``dp_dim`` and ``cp_dim``.

        Args:
            lengths: as for the constructor.
            tokens_per_rank, options: the :class:`PlanConfig` fields but ``dp`` and ``cp``
                (``strategy``, ``seed``, ``samples_per_step``, ...), and ``planner`` (as for the
                constructor).
            mesh: a ``torch.distributed.DeviceMesh`` (2-D ``("dp", "cp")``, or larger with those
                dimensions); this rank's DP coordinate and both sizes come from it.

        Raises:
            DataError: ``mesh`` not a DeviceMesh, ``dp_dim`` equal to ``cp_dim``, or a mesh without
                one of the two dimensions; and whatever the constructor raises.
        """
        c = mesh_coordinates(mesh, dp_dim, cp_dim)
        planner = options.pop("planner", "auto")
        check_plan_options(options, {"epoch": "sampler.set_epoch(e)", "dp": "the mesh", "cp": "the mesh"})
        config = PlanConfig(dp=c.dp_size, cp=c.cp_size, tokens_per_rank=tokens_per_rank, **options)
        return cls(lengths, config, c.dp_rank, planner=planner)

    # ------------------------------------------------------------------ plan
    def plan(self, epoch: int | None = None) -> Plan:
        """The whole plan of ``epoch`` (default: the current one), identical on every rank.

        Plans every step of the epoch (in this thread, once; the last one asked for is kept):
        for checks and tools, not needed to train, which streams the steps. Steps before a
        cost-model switch (:meth:`set_cost_model`) are planned with the model in use before it,
        later ones with the new model; the samples of every step do not depend on the cost model,
        so the spliced plan still plans every sample once.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if self._whole is not None and self._whole[:2] == (epoch, len(self._switches)):
            return self._whole[2]
        steps = self._steps_of(epoch)
        stream = steps.stream
        batches = stream.batches
        plan = Plan(
            config=dataclasses.replace(self.config, epoch=epoch, cost=self._cost_at(epoch, stream.num_steps - 1)),
            lengths=tuple(batches.lengths.tolist()),
            steps=tuple(stream.peek(s) for s in range(stream.num_steps)),
            dropped=batches.dropped,
            origins=batches.origins,
        )
        if any(e == epoch and s > 0 for e, s, _ in self._switches):
            plan.validate()
        self._whole = (epoch, len(self._switches), plan)
        return plan

    def _steps_of(self, epoch: int) -> _EpochSteps:
        """The streamed steps of ``epoch`` (made on first use; at most two epochs are kept)."""
        steps = self._epochs.get(epoch)
        if steps is None:
            for old in [e for e in self._epochs if e != self.epoch]:
                self._epochs.pop(old).close()
            config = dataclasses.replace(self.config, epoch=epoch, cost=self._cost_at(epoch, 0))
            stream = StepStream(
                self.lengths,
                config,
                self._schedule(epoch),
                self.lookahead_steps,
                planner=self.planner,
                rank=self.dp_rank,
            )
            steps = self._epochs[epoch] = _EpochSteps(self, stream)
        return steps

    def _schedule(self, epoch: int, switches: Sequence[tuple[int, int, CostModel]] | None = None) -> list:
        """The cost models of ``epoch``'s steps, ``[(first step, model), ...]`` from step 0, under
        ``switches`` (default: the sampler's)."""
        switches = self._switches if switches is None else switches
        inside = [(s, model) for e, s, model in switches if e == epoch and s > 0]
        return [(0, self._cost_at(epoch, 0, switches)), *inside]

    def _cost_at(
        self, epoch: int, step: int, switches: Sequence[tuple[int, int, CostModel]] | None = None
    ) -> CostModel:
        """The cost model in use at ``(epoch, step)`` under ``switches`` (default: the sampler's)."""
        cost = self._base_cost
        for e, s, model in self._switches if switches is None else switches:
            if (e, s) <= (epoch, step):
                cost = model
        return cost

    # --------------------------------------------------------- cost models
    def planned_through(self) -> tuple[int, int]:
        """``(epoch, step)`` of the last micro-batch this sampler has handed out (``step`` -1: none yet)."""
        cursor = self._pending if self._pending is not None else self._cursor
        if cursor == 0:
            return self.epoch, -1
        return self.epoch, self._steps_of(self.epoch).locate(cursor - 1)[0]

    def set_cost_model(self, cost: CostModel, after: tuple[int, int], lead_steps: int = 0) -> tuple[int, int]:
        """Plan with ``cost`` from the step ``lead_steps + 1`` steps after ``after = (epoch, step)``.

        ``after`` must be at or past what every rank's sampler has handed out (the maximum of
        :meth:`planned_through` over all ranks), so that no rank has already delivered a
        micro-batch of a re-planned step; :class:`~ringpack.training.CostLearner`
        agrees on it with one all-reduce. Every rank must make the same calls. Past the epoch's last
        step the model applies from the next epoch. Steps planned ahead from the switch on are
        planned again, in the background; those handed out never are. Returns the ``(epoch, step)``
        of the switch; the switch is recorded in :meth:`state_dict`.
        """
        epoch, step = int(after[0]), int(after[1]) + 1 + int(lead_steps)
        if (epoch, step) <= self.planned_through():
            raise DataError(f"cost model switch at epoch {epoch} step {step}: this rank has already planned past it")
        if step >= self._steps_of(epoch).stream.num_steps:
            epoch, step = epoch + 1, 0
        self._switches.append((epoch, step, cost))
        self.config = dataclasses.replace(self.config, cost=cost)
        self._whole = None
        for e, steps in self._epochs.items():
            if e >= epoch:
                steps.reschedule(self._schedule(e), step if e == epoch else 0)
        return epoch, step

    def __getstate__(self) -> dict[str, Any]:
        # Copies (e.g. into worker processes) carry lengths + config and plan on demand: plans,
        # streams and threads are never pickled.
        state = dict(self.__dict__)
        state["_epochs"], state["_whole"], state["_docs"] = {}, None, None
        return state

    def _doc_map(self, plan: Plan | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Dataset row and token offset of every plan sample (identity unless overflow="split" cut rows)."""
        if self._docs is None:
            origins = self._steps_of(self.epoch).stream.batches.origins if plan is None else plan.origins
            n = len(self._steps_of(self.epoch).stream.batches.lengths) if plan is None else len(plan.lengths)
            if origins:
                table = np.asarray(origins, dtype=np.int64).reshape(-1, 2)
                self._docs = table[:, 0].copy(), table[:, 1].copy()
            else:
                self._docs = np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        return self._docs

    @property
    def plan_hash(self) -> str:
        """Content hash of the current epoch's whole plan (:meth:`plan`: plans the whole epoch)."""
        return self.plan().content_hash

    @property
    def plan_key(self) -> str:
        """SHA-256 of what decides the current epoch's plan: the lengths, the config with its seed
        and epoch, the cost models of its steps. Equal on ranks that plan the same steps; cheap.
        Every ticket carries it as ``plan_hash``."""
        return self._plan_key(self.epoch, self._switches)

    def _plan_key(self, epoch: int, switches: Sequence[tuple[int, int, CostModel]]) -> str:
        return _key_of(self._plan_inputs(epoch, switches))

    def _plan_inputs(self, epoch: int, switches: Sequence[tuple[int, int, CostModel]]) -> dict[str, Any]:
        """What :attr:`plan_key` hashes, as plain data: the config (with ``epoch`` and the cost model
        at step 0), the lengths' SHA-256, and the cost-model switches inside the epoch."""
        if self._lengths_hash is None:
            self._lengths_hash = hashlib.sha256(np.ascontiguousarray(self.lengths, dtype="<i8").tobytes()).hexdigest()
        config = dataclasses.replace(self.config, epoch=epoch, cost=self._cost_at(epoch, 0, switches)).to_dict()
        inside = [[s, model.to_dict()] for e, s, model in switches if e == epoch and s > 0]
        return {"config": config, "lengths_sha256": self._lengths_hash, "cost_switches": inside}

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the current epoch (equal on every DP rank; plans nothing)."""
        return self._steps_of(self.epoch).stream.num_steps

    @property
    def dropped(self) -> tuple[int, ...]:
        """Samples the plan leaves out (only with ``overflow="drop"``; plans nothing)."""
        return self._steps_of(self.epoch).stream.batches.dropped

    def __len__(self) -> int:
        """This rank's micro-batches in the current epoch: immediate with ``microbatches_per_rank``
        set, else every step's count is needed (steps not planned yet are planned for it, once)."""
        return self._steps_of(self.epoch).total()

    def ticket(self, position: int, epoch: int | None = None) -> MicroBatchTicket:
        """The ticket at 0-based ``position`` of this rank's micro-batches in ``epoch``."""
        epoch = self.epoch if epoch is None else epoch
        steps = self._steps_of(epoch)
        s, i, _ = steps.locate(position)
        step = steps.peek(s)
        return self._ticket(step.microbatches[self.dp_rank], step.loss_tokens, s, i, position, epoch)

    def _ticket(
        self, mbs: Sequence[MicroBatch | PackedMicroBatch], loss_tokens: int, s: int, i: int, position: int, epoch: int
    ) -> MicroBatchTicket:
        doc_row, doc_offset = self._doc_map()
        samples = np.asarray(mbs[i].samples, dtype=np.int64)
        positions = None if self.cp_rank is None else rank_positions(mbs[i], self.cp_rank)
        if positions is not None:
            samples = samples[positions]
        rows = doc_row[samples]
        return MicroBatchTicket(
            mbs[i],
            positions=None if positions is None else positions.tolist(),
            rows=rows.tolist(),
            offsets=doc_offset[samples].tolist(),
            row_lengths=self.lengths[rows].tolist(),
            epoch=epoch,
            step=s,
            index=i,
            microbatches_in_step=len(mbs),
            cursor=position + 1,
            step_loss_tokens=loss_tokens,
            plan_hash=self._ticket_key(epoch),
            gpus_per_node=self.config.gpus_per_node,
            max_partners=self.config.max_partners,
        )

    def _ticket_key(self, epoch: int) -> str:
        """:attr:`plan_key` of ``epoch`` with the switches made so far (cached per switch count)."""
        keys = self._steps_of(epoch)._keys
        if len(self._switches) not in keys:
            keys[len(self._switches)] = self._plan_key(epoch, self._switches)
        return keys[len(self._switches)]

    # ------------------------------------------------------------- iterate
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a new plan, from the top). Call before ``iter()``, as with DistributedSampler."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise DataError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        self._cursor = 0
        self._pending = None
        if self.epoch in self._epochs:  # from the top: positions count from step 0 again
            self._epochs[self.epoch].restart()

    def __iter__(self) -> Iterator[MicroBatchTicket]:
        epoch = self.epoch
        position = self._pending if self._pending is not None else 0
        self._pending = None
        self._cursor = position
        steps = self._steps_of(epoch)
        s, i, _ = steps.locate(position)
        while s < steps.stream.num_steps:
            part = steps.get(s)  # planned ahead in the background; a planning error is raised here
            count = len(part.parts)
            while i < count:
                ticket = self._ticket(part.parts, part.loss_tokens, s, i, position, epoch)
                position += 1
                self._cursor = position
                yield ticket
                i += 1
            s, i = s + 1, 0

    # --------------------------------------------------------------- state
    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        """Plain-data state. ``cursor`` (default: micro-batches yielded so far) overrides the
        position, e.g. ``batch["cursor"]`` of the last batch the training loop consumed."""
        if cursor is None:
            cursor = self._pending if self._pending is not None else self._cursor
        if isinstance(cursor, bool) or not isinstance(cursor, (int, np.integer)):
            raise DataError(f"cursor must be an integer (a batch's 'cursor'), got {cursor!r}")
        if cursor < 0:
            raise DataError(f"cursor {cursor} is negative")
        steps = self._steps_of(self.epoch)
        step, start, digest = -1, 0, None
        if cursor > 0:
            step, _, start = steps.locate(int(cursor) - 1)
            digest = steps.stream.digest(step)
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": int(cursor),
            "seed": int(self.config.seed),
            "dp_size": int(self.config.dp),
            "cp_size": int(self.config.cp),
            "tokens_per_rank": int(self.config.tokens_per_rank),
            "num_samples": int(len(self.lengths)),
            "plan_key": self.plan_key,
            "plan_inputs": self._plan_inputs(self.epoch, self._switches),
            "step": step,
            "step_start": int(start),
            "step_hash": digest,
            "cost_switches": [[e, s, model.to_dict()] for e, s, model in self._switches],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to ``state``: the next ``iter()`` yields from its cursor on (no replay).

        The whole state is checked before anything changes: a missing or ill-typed key, a state
        made for other DP/CP sizes, another token budget, seed or dataset, or a plan that no longer
        matches (different lengths, config, cost models or planner version: the step the cursor
        is in is planned again and compared) is a :class:`DataError` naming it, and the sampler is
        left as it was. The DP rank may differ: cursors are equal on every DP rank (lockstep), so
        one rank's state resumes any rank. Planning the first step to resume from starts here.
        States of version 1 (whole-plan hashes) are checked by planning their whole epoch.
        """
        if not isinstance(state, dict):
            raise DataError(f"not a BalancedBatchSampler state (a dict of version {STATE_VERSION}): {state!r:.200}")
        version = state.get("version")
        if version not in (1, STATE_VERSION):
            raise DataError(f"sampler state key 'version': {version!r} is not a BalancedBatchSampler state version")
        mine = {
            "seed": self.config.seed,
            "dp_size": self.config.dp,
            "cp_size": self.config.cp,
            "tokens_per_rank": self.config.tokens_per_rank,
            "num_samples": len(self.lengths),
        }
        for key, value in mine.items():
            got = _state_int(state, key)
            if got != value:
                raise DataError(f"sampler state was made for {key}={got!r}, this sampler has {key}={value}")
        epoch, cursor = _state_int(state, "epoch", low=0), _state_int(state, "cursor", low=0)
        switches = _parse_switches(state.get("cost_switches", []))
        trial = _Trial(self, switches)
        if version == 1:
            steps = trial.check_whole_plan(epoch, cursor, _state_str(state, "plan_hash"))
        else:
            key = _state_str(state, "plan_key")
            theirs = _state_plan_inputs(state, key)
            mine = self._plan_inputs(epoch, switches)
            if key != _key_of(mine):
                raise DataError(_plan_difference(theirs, mine, key, epoch))
            step = _state_int(state, "step", low=-1)
            start = _state_int(state, "step_start", low=0)
            digest = None if step < 0 else _state_str(state, "step_hash")
            steps = trial.check_step(epoch, cursor, step, start, digest)
        # everything checked: install
        for old in self._epochs.values():
            old.close()
        self._switches = switches
        self.config = dataclasses.replace(self.config, cost=switches[-1][2] if switches else self._base_cost)
        self._epochs = {epoch: steps}
        self._whole = None
        self.epoch = epoch
        self._cursor = cursor
        self._pending = cursor


PLAN_KEY_FORMAT = "ringpack-sampler-plan-v1"


class _EpochSteps:
    """One epoch's steps as the sampler sees them: the stream, and where each step starts among
    this rank's micro-batches (known from an anchor step on, extended as steps are counted)."""

    def __init__(self, owner: BalancedBatchSampler, stream: StepStream, anchor: tuple[int, int] = (0, 0)) -> None:
        self.stream = stream
        self._lo = anchor[0]  # starts[j] is where step lo + j starts
        self._starts = [anchor[1]]
        self._total: int | None = None
        self._close = weakref.finalize(owner, stream.close)  # the thread ends with the sampler
        self._keys: dict[int, str] = {}  # plan key by number of cost switches

    def close(self) -> None:
        self._close()

    def restart(self) -> None:
        """Count positions from step 0 again (the epoch starts over; what is known of steps stays)."""
        if self._lo != 0:
            self._lo, self._starts = 0, [0]

    def get(self, s: int) -> RankStep:
        """This rank's part of step ``s``, planned ahead (the window moves to ``s``)."""
        return self.stream.get_rank(s)

    def peek(self, s: int) -> Step:
        return self.stream.peek(s)

    def reschedule(self, costs: list[tuple[int, CostModel]], first: int) -> None:
        """A new cost schedule from step ``first`` on: steps after it may hold other counts now."""
        self.stream.set_costs(costs)
        keep = first - self._lo + 1  # the start of step `first` depends on earlier steps only
        if keep < len(self._starts):
            del self._starts[max(keep, 1) :]
        self._total = None

    def start(self, s: int) -> int:
        """Where step ``s`` starts among this rank's micro-batches of the epoch."""
        while s < self._lo:  # before the anchor: count backwards
            self._lo -= 1
            self._starts.insert(0, self._starts[0] - self.stream.count(self._lo))
        while s >= self._lo + len(self._starts):
            last = self._lo + len(self._starts) - 1
            self._starts.append(self._starts[-1] + self.stream.count(last))
        return self._starts[s - self._lo]

    def locate(self, position: int) -> tuple[int, int, int]:
        """``(step, index in the step, start of the step)`` of a 0-based position; ``(num_steps, 0,
        total)`` at the end of the epoch. Raises DataError past it."""
        n = self.stream.num_steps
        if position < 0:
            raise DataError(f"position {position} is negative")
        # the step of the last start at or before the position
        while position < self._starts[0] and self._lo > 0:
            self.start(self._lo - 1)
        j = bisect.bisect_right(self._starts, position) - 1
        s = self._lo + j
        while True:
            if s >= n:
                total = self.start(n)
                if position == total:
                    return n, 0, total
                raise DataError(f"cursor {position} outside [0, {total}] for epoch {self.stream.config.epoch}")
            start = self.start(s)
            if position < start + self.stream.count(s):
                return s, position - start, start
            s += 1

    def total(self) -> int:
        """This rank's micro-batches in the epoch."""
        if self._total is None:
            fixed = self.stream.config.microbatches_per_rank
            self._total = fixed * self.stream.num_steps if fixed else self.start(self.stream.num_steps)
        return self._total


class _Trial:
    """Checks a state against this sampler with the state's cost models, changing nothing; the
    epoch's steps it planned to check are what the sampler continues from."""

    def __init__(self, sampler: BalancedBatchSampler, switches: list[tuple[int, int, CostModel]]) -> None:
        self.sampler = sampler
        self.switches = switches

    def _stream(self, epoch: int) -> StepStream:
        sampler = self.sampler
        schedule = sampler._schedule(epoch, self.switches)
        config = dataclasses.replace(sampler.config, epoch=epoch, cost=schedule[0][1])
        return StepStream(
            sampler.lengths, config, schedule, sampler.lookahead_steps, planner=sampler.planner, rank=sampler.dp_rank
        )

    def check_step(self, epoch: int, cursor: int, step: int, start: int, digest: str | None) -> _EpochSteps:
        """The state's step (holding micro-batch ``cursor - 1``) planned again and compared."""
        stream = self._stream(epoch)
        try:
            if step < 0:
                if cursor != 0:
                    raise DataError(f"sampler state cursor {cursor} needs the step it is in (state key 'step' is -1)")
                return _EpochSteps(self.sampler, stream)
            if step >= stream.num_steps:
                raise DataError(
                    f"sampler state key 'step': step {step} outside [0, {stream.num_steps}) of epoch {epoch}"
                )
            stream.get_rank(step)  # the planner plans on from here
            count = stream.count(step)
            if not start < cursor <= start + count:
                raise DataError(
                    f"sampler state cursor {cursor} is not in step {step} (its micro-batches are "
                    f"{start + 1}..{start + count} of the epoch)"
                )
            if stream.digest(step) != digest:
                raise DataError(
                    f"sampler state was made for another plan of step {step} of epoch {epoch} (planner version "
                    "or options changed)"
                )
        except BaseException:
            stream.close()
            raise
        return _EpochSteps(self.sampler, stream, (step, start))

    def check_whole_plan(self, epoch: int, cursor: int, plan_hash: str) -> _EpochSteps:
        """A version-1 state: the whole epoch planned and its content hash compared."""
        stream = self._stream(epoch)
        try:
            steps = [stream.peek(s) for s in range(stream.num_steps)]
            batches = stream.batches
            last = stream.num_steps - 1
            plan = Plan(
                config=dataclasses.replace(stream.config, cost=stream.cost_at(last)),
                lengths=tuple(batches.lengths.tolist()),
                steps=tuple(steps),
                dropped=batches.dropped,
                origins=batches.origins,
            )
            if plan.content_hash != plan_hash:
                raise DataError(
                    f"sampler state was made for plan {plan_hash[:12]}... of epoch {epoch}, but this sampler plans "
                    f"{plan.content_hash[:12]}... (lengths, plan options or planner version changed)"
                )
            epoch_steps = _EpochSteps(self.sampler, stream)
            epoch_steps.locate(cursor)  # raises past the end
        except BaseException:
            stream.close()
            raise
        return epoch_steps


def _key_of(inputs: dict[str, Any]) -> str:
    """The plan key of :meth:`BalancedBatchSampler._plan_inputs`' data (unchanged since states held only it)."""
    parts = [PLAN_KEY_FORMAT, inputs["config"], inputs["lengths_sha256"], inputs["cost_switches"]]
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _state_plan_inputs(state: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A state's ``plan_inputs``, checked against its ``plan_key``; ``None`` for a state made before it
    was kept (only the key then: a difference can be found, not named).

    Raises:
        DataError: ``plan_inputs`` that is not what the key hashes (the state was edited or damaged).
    """
    inputs = state.get("plan_inputs")
    if inputs is None:
        return None
    try:
        consistent = isinstance(inputs, dict) and isinstance(inputs.get("config"), dict) and _key_of(inputs) == key
    except (KeyError, TypeError, ValueError):
        consistent = False
    if not consistent:
        raise DataError(
            f"sampler state key 'plan_inputs' is not what its plan_key {key[:12]}... hashes (edited or damaged state)"
        )
    return inputs


#: The order plan options are compared in, and each one's value when a config's dict leaves it out.
_OPTION_DEFAULTS = {
    f.name: (f.default if f.default is not dataclasses.MISSING else None) for f in dataclasses.fields(PlanConfig)
}


def _plan_difference(theirs: dict[str, Any] | None, mine: dict[str, Any], key: str, epoch: int) -> str:
    """One line naming what the state's plan was made with that this sampler's is not."""
    where = f"sampler state of epoch {epoch} was made"
    if theirs is None:
        return (
            f"{where} for plan {key[:12]}..., but this sampler plans {_key_of(mine)[:12]}... (lengths, plan "
            "options or cost models changed; a state of this version names which)"
        )
    a, b = theirs["config"], mine["config"]
    for name in [*_OPTION_DEFAULTS, *sorted((set(a) | set(b)) - set(_OPTION_DEFAULTS))]:
        old, new = a.get(name, _OPTION_DEFAULTS.get(name)), b.get(name, _OPTION_DEFAULTS.get(name))
        if old == new:
            continue
        if name == "cost":
            return f"{where} with another cost model: {_cost_difference(old, new)}"
        return f"{where} with {name}={old!r}, this sampler has {name}={new!r}"
    if theirs["lengths_sha256"] != mine["lengths_sha256"]:
        return (
            f"{where} for other lengths (sha256 {str(theirs['lengths_sha256'])[:12]}..., this sampler's "
            f"{mine['lengths_sha256'][:12]}...): the same number of samples, other lengths"
        )
    return (
        f"{where} with cost-model switches inside the epoch at steps "
        f"{[s[0] for s in theirs['cost_switches']]}, this sampler's are at {[s[0] for s in mine['cost_switches']]}"
    )


def _cost_difference(old: Any, new: Any) -> str:
    """The first entry in which two cost models' dicts differ, with the models' names."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return f"{old!r:.100}, this sampler has {new!r:.100}"
    for entry in sorted(set(old) | set(new)):
        if old.get(entry) != new.get(entry):
            return (
                f"{old.get('name')!r} has {entry}={old.get(entry)!r}, this sampler's {new.get('name')!r} "
                f"has {entry}={new.get(entry)!r}"
            )
    return "the same entries"  # unreachable: the dicts differ


def _state_int(state: dict[str, Any], key: str, low: int | None = None) -> int:
    """``state[key]`` as an int (``DataError`` naming the key when missing, not an integer, or below ``low``)."""
    if key not in state:
        raise DataError(f"sampler state lacks key {key!r}")
    value = state[key]
    if not is_int(value):
        raise DataError(f"sampler state key {key!r} must be an integer, got {value!r:.100}")
    if low is not None and value < low:
        raise DataError(f"sampler state key {key!r} must be >= {low}, got {value!r}")
    return int(value)


def _state_str(state: dict[str, Any], key: str) -> str:
    """``state[key]`` as a string (``DataError`` naming the key when missing or not a string)."""
    if key not in state:
        raise DataError(f"sampler state lacks key {key!r}")
    value = state[key]
    if not isinstance(value, str):
        raise DataError(f"sampler state key {key!r} must be a string, got {value!r:.100}")
    return value


def _parse_switches(switches: Any) -> list[tuple[int, int, CostModel]]:
    """A state's ``cost_switches``: ``[[epoch, step, cost model], ...]`` (``DataError`` naming the entry)."""
    if not isinstance(switches, list):
        raise DataError(f"sampler state key 'cost_switches' must be a list, got {switches!r:.100}")
    restored = []
    for k, switch in enumerate(switches):
        if not (isinstance(switch, (list, tuple)) and len(switch) == 3 and all(is_int(x) for x in switch[:2])):
            raise DataError(f"sampler state cost_switches[{k}] must be [epoch, step, cost model], got {switch!r:.100}")
        try:
            restored.append((int(switch[0]), int(switch[1]), CostModel.from_dict(switch[2])))
        except ValueError as exc:
            raise DataError(f"sampler state cost_switches[{k}]: {exc}") from exc
    return restored


def _config_of_old_spelling(dp_rank: Any, dp_size: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[PlanConfig, Any]:
    """``(config, dp_rank)`` of ``BalancedBatchSampler(lengths, dp_rank, dp_size, cp_size, tokens_per_rank,
    strategy="balanced", seed=0, **plan_options)``, with a ``DeprecationWarning`` naming the new spelling."""
    names = ("cp_size", "tokens_per_rank", "strategy", "seed")
    given = dict(zip(names, args))
    if len(args) > len(names):
        raise DataError(f"BalancedBatchSampler: {len(args) + 3} positional arguments, at most {len(names) + 3}")
    dp_rank = kwargs.pop("dp_rank", dp_rank)
    dp_size = kwargs.pop("dp_size", dp_size)
    for name in names:
        if name in kwargs:
            given[name] = kwargs.pop(name)
    warnings.warn(
        "BalancedBatchSampler(lengths, dp_rank, dp_size, cp_size, tokens_per_rank, ...) is deprecated: pass "
        "BalancedBatchSampler(lengths, PlanConfig(dp=..., cp=..., tokens_per_rank=..., ...), dp_rank)",
        DeprecationWarning,
        stacklevel=3,
    )
    check_plan_options(kwargs, {"epoch": "sampler.set_epoch(e)", "dp": "dp_size", "cp": "cp_size"})
    if not is_int(dp_size) or dp_size < 1:
        raise DataError(f"dp_size must be a positive integer, got {dp_size!r}")
    config = PlanConfig(
        dp=dp_size,
        cp=given.get("cp_size"),
        tokens_per_rank=given.get("tokens_per_rank"),
        strategy=given.get("strategy", "balanced"),
        seed=given.get("seed", 0),
        **kwargs,
    )
    return config, dp_rank
