"""``BalancedBatchSampler``: this DP rank's micro-batches of a balanced plan, for ``DataLoader(batch_sampler=...)``.

How the sampler and the collator talk (the handshake)
-----------------------------------------------------
``DataLoader`` hands a batch sampler's output only to the dataset, and the collate function only
sees what the dataset returns. The collator needs the micro-batch's *plan* (which pieces each CP
rank holds), not just sample ids. So:

1. the sampler yields a :class:`MicroBatchTicket` per micro-batch: a ``list`` of sample indices (in
   the micro-batch's canonical order, so any code that treats it as a list of indices still works)
   that also carries the micro-batch's plan (its pieces on every CP rank) and where it sits
   (epoch, step, index in the step, cursor, the step's global loss-token count, the plan hash);
2. :class:`~ringpack.data.collator.PackedDataset` wraps the user's dataset; its
   ``__getitems__`` (which ``DataLoader`` calls with the whole ticket) returns the ticket together
   with the samples' token ids;
3. :class:`~ringpack.data.collator.PackedCollator` cuts this CP rank's pieces out of them.

The plan is computed once per epoch, in the process that iterates the sampler (the main process);
workers never re-plan, so they cannot disagree with it. A ticket crossing into a worker is ordinary
``DataLoader`` mechanics (the index queue); it pickles as plain integers (``__reduce__``), never as
a pickled plan object. Plans themselves are only ever stored as JSON/Parquet.

Determinism: the plan of an epoch is a pure function of ``(lengths, config, seed, epoch)``; every
DP rank computes the same plan independently (no communication) and takes its own micro-batches.
All DP ranks therefore run the same number of micro-batches in every step. ``plan_hash`` lets a
trainer check agreement across ranks once (all-gather the hash).

Resume semantics
----------------
``state_dict()`` is ``{"epoch", "cursor", ...}`` where ``cursor`` counts the micro-batches this
sampler has *yielded* in the epoch — the StatefulDataLoader convention: ``torchdata``'s
``StatefulDataLoader`` snapshots its batch sampler's state each time it hands out an index and
restores the snapshot of the last batch delivered to the training loop, so prefetching by workers
is accounted for. ``load_state_dict`` *seeks* (the next ``iter()`` starts at ``cursor``), it never
replays. With a plain ``DataLoader`` and workers the sampler runs ahead of the training loop by the
prefetch depth; use the ``cursor`` the collator puts in every batch: ``sampler.state_dict(cursor=
batch["cursor"])`` is the state that resumes right after that batch. So N micro-batches consumed
equal k consumed, save, restore, N-k consumed, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ringpack.cost import CostModel
from ringpack.errors import PlanError
from ringpack.lengths import DataError, sample_lengths
from ringpack.mesh import mesh_coordinates
from ringpack.planner import make_plan
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, RankShard

__all__ = ["BalancedBatchSampler", "MicroBatchTicket", "STATE_VERSION", "check_plan_options"]

STATE_VERSION = 1

try:  # a real torch Sampler where torch is installed (it always is for DataLoader users)
    from torch.utils.data import Sampler as _SamplerBase
except ImportError:  # pragma: no cover
    _SamplerBase = object  # type: ignore[assignment,misc]


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool and not a float: what a state's counters must be."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


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


def _encode_microbatch(mb: MicroBatch) -> tuple:
    return (
        mb.samples,
        tuple(tuple((p.sample, p.start, p.stop) for p in shard.pieces) for shard in mb.shards),
        mb.loss_tokens,
    )


def _decode_microbatch(data: tuple) -> MicroBatch:
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
    ``step_loss_tokens`` (loss tokens of the whole global batch of the step, all DP ranks) and
    ``plan_hash``.
    """

    def __init__(
        self,
        microbatch: MicroBatch,
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
    ) -> None:
        rows = tuple(microbatch.samples) if rows is None else tuple(int(r) for r in rows)
        super().__init__(rows)
        self.offsets = tuple(0 for _ in rows) if offsets is None else tuple(int(o) for o in offsets)
        self.row_lengths = None if row_lengths is None else tuple(int(n) for n in row_lengths)
        self.microbatch = microbatch
        self.epoch = epoch
        self.step = step
        self.index = index
        self.microbatches_in_step = microbatches_in_step
        self.cursor = cursor
        self.step_loss_tokens = step_loss_tokens
        self.plan_hash = plan_hash

    def __reduce__(self) -> tuple:
        meta = (
            self.epoch,
            self.step,
            self.index,
            self.microbatches_in_step,
            self.cursor,
            self.step_loss_tokens,
            self.plan_hash,
        )
        return (
            _rebuild_ticket,
            (_encode_microbatch(self.microbatch), meta, tuple(self), self.offsets, self.row_lengths),
        )

    def __repr__(self) -> str:
        return f"MicroBatchTicket(epoch={self.epoch}, step={self.step}, index={self.index}, samples={list(self)})"


def _rebuild_ticket(mb: tuple, meta: tuple, rows: tuple, offsets: tuple, row_lengths: tuple | None) -> MicroBatchTicket:
    epoch, step, index, n, cursor, loss, plan_hash = meta
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
    )


class BalancedBatchSampler(_SamplerBase):
    """Yield this DP rank's micro-batches (as :class:`MicroBatchTicket`), step after step.

    Args:
        lengths: token count per sample (array-like, a ``datasets.Dataset`` with ``input_ids``,
            or a lengths file); sample ``i`` is row ``i`` of the dataset the loader reads.
        dp_rank, dp_size, cp_size: this rank's DP coordinate and the mesh sizes.
        tokens_per_rank: token budget of one CP rank in one micro-batch.
        strategy: CP split (``"balanced"``, ``"zigzag"``, ``"contiguous"``).
        seed: shuffling seed; the plan of epoch ``e`` uses ``(seed, e)``.
        **plan_options: any other :class:`PlanConfig` field (``samples_per_step``,
            ``microbatches_per_rank``, ``packing``, ``overflow``, ``cost``, ...).

    Iterating yields one :class:`MicroBatchTicket` per micro-batch of this DP rank in the current
    epoch's plan (a ``list`` of dataset rows carrying the micro-batch's pieces on every CP rank).
    ``len(sampler)`` is this rank's micro-batches in the current epoch (equal on every DP rank).
    See the module docstring for the handshake with the collator and for resume semantics.

    Raises:
        DataError: a bad length (naming the sample), a ``dp_size`` that is not a positive integer,
            ``dp_rank`` outside ``[0, dp_size)``, or ``epoch=`` (use :meth:`set_epoch`), ``dp=``,
            ``cp=`` or ``tokens_per_rank=`` among the options.
        PlanError: an unknown or invalid plan option (naming the field); when iterating, lengths that cannot
            be planned (a sample longer than a CP group holds under ``overflow="error"``).
    """

    def __init__(
        self,
        lengths: Any,
        dp_rank: int,
        dp_size: int,
        cp_size: int,
        tokens_per_rank: int,
        strategy: str = "balanced",
        seed: int = 0,
        **plan_options: Any,
    ) -> None:
        check_plan_options(plan_options, {"epoch": "sampler.set_epoch(e)", "dp": "dp_size", "cp": "cp_size"})
        if not _is_int(dp_size) or dp_size < 1:
            raise DataError(f"dp_size must be a positive integer, got {dp_size!r}")
        if not _is_int(dp_rank) or not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank must be in [0, {dp_size}), got {dp_rank!r}")
        self.lengths = sample_lengths(lengths)
        # Validates every option (PlanError, a ValueError, names the bad field).
        self.config = PlanConfig(
            dp=dp_size,
            cp=cp_size,
            tokens_per_rank=tokens_per_rank,
            strategy=strategy,
            seed=seed,
            epoch=0,
            **plan_options,
        )
        self.dp_rank = int(dp_rank)
        self._base_cost = self.config.cost
        # (epoch, step, cost model): from that step on the plan uses that model (set_cost_model)
        self._switches: list[tuple[int, int, CostModel]] = []
        self.epoch = 0
        self._cursor = 0  # micro-batches yielded in this epoch (by the live iterator, or restored)
        self._pending: int | None = None  # cursor the next __iter__ starts at (set by load_state_dict)
        self._plans: dict[int, Plan] = {}
        self._orders: dict[int, list[tuple[int, int]]] = {}
        self._docs: tuple[np.ndarray, np.ndarray] | None = None  # (row, offset) of each plan sample

    @classmethod
    def from_mesh(
        cls, lengths: Any, mesh: Any, tokens_per_rank: int, *, dp_dim: str = "dp", cp_dim: str = "cp", **options: Any
    ) -> BalancedBatchSampler:
        """The sampler of this rank of a DeviceMesh with dimensions ``dp_dim`` and ``cp_dim``.

        Args:
            lengths, tokens_per_rank, options: as for the constructor (``strategy``, ``seed`` and
                :class:`PlanConfig` fields).
            mesh: a ``torch.distributed.DeviceMesh`` (2-D ``("dp", "cp")``, or larger with those
                dimensions); this rank's DP coordinate and both sizes come from it.

        Raises:
            DataError: ``mesh`` not a DeviceMesh, ``dp_dim`` equal to ``cp_dim``, or a mesh without
                one of the two dimensions; and whatever the constructor raises.
        """
        c = mesh_coordinates(mesh, dp_dim, cp_dim)
        return cls(lengths, c.dp_rank, c.dp_size, c.cp_size, tokens_per_rank, **options)

    # ------------------------------------------------------------------ plan
    def plan(self, epoch: int | None = None) -> Plan:
        """The (cached) plan of ``epoch`` (default: the current one), identical on every rank.

        Steps before a cost-model switch (:meth:`set_cost_model`) are planned with the model in use
        before it, later ones with the new model; the samples of every step do not depend on the
        cost model, so the spliced plan still plans every sample once.
        """
        epoch = self.epoch if epoch is None else int(epoch)
        if epoch not in self._plans:
            if len(self._plans) >= 2:  # keep the current epoch's plan and this one
                for old in [e for e in self._plans if e != self.epoch]:
                    self._plans.pop(old)
                    self._orders.pop(old, None)
            self._plans[epoch] = self._spliced_plan(epoch)
        return self._plans[epoch]

    def _spliced_plan(self, epoch: int) -> Plan:
        def planned(cost: CostModel) -> Plan:
            return make_plan(self.lengths, dataclasses.replace(self.config, epoch=epoch, cost=cost))

        plan = planned(self._cost_at(epoch, 0))
        for e, step, cost in self._switches:
            if e == epoch and 0 < step < plan.num_steps:
                tail = planned(cost)
                plan = dataclasses.replace(plan, config=tail.config, steps=plan.steps[:step] + tail.steps[step:])
        return plan.validate() if any(e == epoch and s > 0 for e, s, _ in self._switches) else plan

    def _cost_at(self, epoch: int, step: int) -> CostModel:
        """The cost model in use at ``(epoch, step)``."""
        cost = self._base_cost
        for e, s, model in self._switches:
            if (e, s) <= (epoch, step):
                cost = model
        return cost

    # --------------------------------------------------------- cost models
    def planned_through(self) -> tuple[int, int]:
        """``(epoch, step)`` of the last micro-batch this sampler has handed out (``step`` -1: none yet)."""
        cursor = self._pending if self._pending is not None else self._cursor
        if cursor == 0:
            return self.epoch, -1
        return self.epoch, self._order(self.epoch)[cursor - 1][0]

    def set_cost_model(self, cost: CostModel, after: tuple[int, int], lead_steps: int = 0) -> tuple[int, int]:
        """Plan with ``cost`` from the step ``lead_steps + 1`` steps after ``after = (epoch, step)``.

        ``after`` must be at or past what every rank's sampler has handed out (the maximum of
        :meth:`planned_through` over all ranks), so that no rank has already delivered a
        micro-batch of a re-planned step; :class:`~ringpack.analysis.calibration.online.CostLearner`
        agrees on it with one all-reduce. Every rank must make the same calls. Past the epoch's last
        step the model applies from the next epoch. Returns the ``(epoch, step)`` of the switch;
        the switch is recorded in :meth:`state_dict`.
        """
        epoch, step = int(after[0]), int(after[1]) + 1 + int(lead_steps)
        if (epoch, step) <= self.planned_through():
            raise DataError(f"cost model switch at epoch {epoch} step {step}: this rank has already planned past it")
        if step >= self.plan(epoch).num_steps:
            epoch, step = epoch + 1, 0
        self._switches.append((epoch, step, cost))
        self.config = dataclasses.replace(self.config, cost=cost)
        for e in [e for e in self._plans if e >= epoch]:
            self._plans.pop(e)
            self._orders.pop(e, None)
        return epoch, step

    def _order(self, epoch: int) -> list[tuple[int, int]]:
        """(step, index) of each of this rank's micro-batches of ``epoch``, in yield order."""
        if epoch not in self._orders:
            plan = self.plan(epoch)
            self._orders[epoch] = [
                (s, i) for s, step in enumerate(plan.steps) for i in range(len(step.microbatches[self.dp_rank]))
            ]
        return self._orders[epoch]

    def __getstate__(self) -> dict[str, Any]:
        # Copies (e.g. into worker processes) carry lengths + config and re-plan on demand: plan
        # objects are never pickled.
        state = dict(self.__dict__)
        state["_plans"], state["_orders"], state["_docs"] = {}, {}, None
        return state

    def _doc_map(self, plan: Plan) -> tuple[np.ndarray, np.ndarray]:
        """Dataset row and token offset of every plan sample (identity unless overflow="split" cut rows)."""
        if self._docs is None:
            self._docs = plan.origin_arrays()
        return self._docs

    @property
    def plan_hash(self) -> str:
        return self.plan().content_hash

    @property
    def num_steps(self) -> int:
        """Optimizer steps in the current epoch (equal on every DP rank)."""
        return self.plan().num_steps

    @property
    def dropped(self) -> tuple[int, ...]:
        """Samples the plan leaves out (only with ``overflow="drop"``)."""
        return self.plan().dropped

    def __len__(self) -> int:
        return len(self._order(self.epoch))

    def ticket(self, position: int, epoch: int | None = None) -> MicroBatchTicket:
        """The ticket at 0-based ``position`` of this rank's micro-batches in ``epoch``."""
        epoch = self.epoch if epoch is None else epoch
        plan = self.plan(epoch)
        s, i = self._order(epoch)[position]
        step = plan.steps[s]
        mbs = step.microbatches[self.dp_rank]
        doc_row, doc_offset = self._doc_map(plan)
        samples = np.asarray(mbs[i].samples, dtype=np.int64)
        rows = doc_row[samples]
        return MicroBatchTicket(
            mbs[i],
            rows=rows.tolist(),
            offsets=doc_offset[samples].tolist(),
            row_lengths=self.lengths[rows].tolist(),
            epoch=epoch,
            step=s,
            index=i,
            microbatches_in_step=len(mbs),
            cursor=position + 1,
            step_loss_tokens=step.loss_tokens,
            plan_hash=plan.content_hash,
        )

    # ------------------------------------------------------------- iterate
    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a new plan, from the top). Call before ``iter()``, as with DistributedSampler."""
        if not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise DataError(f"epoch must be a non-negative integer, got {epoch!r}")
        self.epoch = int(epoch)
        self._cursor = 0
        self._pending = None

    def __iter__(self) -> Iterator[MicroBatchTicket]:
        epoch = self.epoch
        position = self._pending if self._pending is not None else 0
        self._pending = None
        self._cursor = position
        while position < len(self._order(epoch)):  # re-read: a cost-model switch may re-plan later steps
            ticket = self.ticket(position, epoch)
            position += 1
            self._cursor = position
            yield ticket

    # --------------------------------------------------------------- state
    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        """Plain-data state. ``cursor`` (default: micro-batches yielded so far) overrides the
        position, e.g. ``batch["cursor"]`` of the last batch the training loop consumed."""
        if cursor is None:
            cursor = self._pending if self._pending is not None else self._cursor
        if isinstance(cursor, bool) or not isinstance(cursor, (int, np.integer)):
            raise DataError(f"cursor must be an integer (a batch's 'cursor'), got {cursor!r}")
        if not 0 <= cursor <= len(self):
            raise DataError(f"cursor {cursor} outside [0, {len(self)}] for epoch {self.epoch}")
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": int(cursor),
            "seed": int(self.config.seed),
            "dp_size": int(self.config.dp),
            "cp_size": int(self.config.cp),
            "tokens_per_rank": int(self.config.tokens_per_rank),
            "num_samples": int(len(self.lengths)),
            "plan_hash": self.plan_hash,
            "cost_switches": [[e, s, model.to_dict()] for e, s, model in self._switches],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to ``state``: the next ``iter()`` yields from its cursor on (no replay).

        A state made for other DP/CP sizes, another token budget, seed or dataset, or a plan that
        no longer matches (different lengths, config or planner version) is a clear error.
        The DP rank may differ: cursors are equal on every DP rank (lockstep), so one rank's
        state resumes any rank.
        """
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise DataError(f"not a BalancedBatchSampler state (version {STATE_VERSION}): {state!r:.200}")
        mine = {
            "seed": self.config.seed,
            "dp_size": self.config.dp,
            "cp_size": self.config.cp,
            "tokens_per_rank": self.config.tokens_per_rank,
            "num_samples": len(self.lengths),
        }
        for key, value in mine.items():
            if not _is_int(state.get(key)) or state[key] != value:
                raise DataError(f"sampler state was made for {key}={state.get(key)!r}, this sampler has {key}={value}")
        epoch, cursor = state.get("epoch"), state.get("cursor")
        for key, value in (("epoch", epoch), ("cursor", cursor)):
            if not _is_int(value) or value < 0:
                raise DataError(f"sampler state {key} must be a non-negative integer, got {value!r}")
        self._restore_switches(state.get("cost_switches", []))
        epoch, cursor = int(epoch), int(cursor)
        plan_hash = self.plan(epoch).content_hash
        if state.get("plan_hash") != plan_hash:
            raise DataError(
                f"sampler state was made for plan {str(state.get('plan_hash'))[:12]}... of epoch {epoch}, but this "
                f"sampler plans {plan_hash[:12]}... (lengths, plan options or planner version changed)"
            )
        total = len(self._order(epoch))
        if not 0 <= cursor <= total:
            raise DataError(f"sampler state cursor {cursor} outside [0, {total}] for epoch {epoch}")
        self.epoch = epoch
        self._cursor = cursor
        self._pending = cursor

    def _restore_switches(self, switches: Any) -> None:
        restored = []
        for k, switch in enumerate(switches if isinstance(switches, list) else [switches]):
            if not (isinstance(switch, (list, tuple)) and len(switch) == 3 and all(_is_int(x) for x in switch[:2])):
                raise DataError(
                    f"sampler state cost_switches[{k}] must be [epoch, step, cost model], got {switch!r:.100}"
                )
            try:
                restored.append((int(switch[0]), int(switch[1]), CostModel.from_dict(switch[2])))
            except ValueError as exc:
                raise DataError(f"sampler state cost_switches[{k}]: {exc}") from exc
        self._switches = restored
        self.config = dataclasses.replace(self.config, cost=restored[-1][2] if restored else self._base_cost)
        self._plans.clear()
        self._orders.clear()
