"""``PackedDataset`` + ``PackedCollator``: one CP rank's tensors for a planned micro-batch.

The sampler (:class:`~ringpack.data.sampler.BalancedBatchSampler`) yields a ticket per
micro-batch; ``PackedDataset.__getitems__`` fetches those samples' token ids and passes the ticket
along; :class:`PackedCollator` cuts out this CP rank's pieces. Nothing re-plans in worker
processes, so the tensors always follow the plan the main process iterates.

A batch is a plain ``dict``: ``input_ids``, **already shifted** ``labels`` (``-100`` at every
sample's last token: do not shift again), ``position_ids`` within each sample, ``cu_seqlens`` /
``max_seqlen``, ``sample_ids``, the loss-token counts (``step_loss_tokens`` is the loss
denominator), the compiled ``schedule`` and where the batch sits (``cursor`` feeds
``sampler.state_dict(cursor=...)``).

See docs/data.md, "`PackedDataset` and `PackedCollator`", for every key's dtype, shape and meaning.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ringpack._checks import is_int
from ringpack.attention import compile_schedule
from ringpack.attention.api import mesh_dimension
from ringpack.attention.schedule import ScheduleOptions
from ringpack.data.sampler import MicroBatchTicket
from ringpack.data.shard_format import IGNORE_INDEX, TOKEN_ID_LIMIT
from ringpack.lengths import DataError, is_dataset
from ringpack.ranges import cumsum0
from ringpack.shard_plan import MicroBatch

__all__ = [
    "PackedDataset",
    "PackedSamples",
    "PackedCollator",
    "check_schedule_flag",
    "schedule_options_of",
    "rank_arrays",
    "to_batch",
    "check_token_ids",
    "IGNORE_INDEX",
]

try:
    from torch.utils.data import Dataset as _DatasetBase
    from torch.utils.data import IterableDataset as _TorchStream
except ImportError:  # pragma: no cover
    _DatasetBase = _TorchStream = object  # type: ignore[assignment,misc]

#: Why a stream cannot be wrapped, and what to do instead (the plan needs every sample by index).
STREAM_REFUSAL = (
    "PackedDataset needs random access to the samples a plan names, and {what} is a stream: materialise it "
    "(datasets.Dataset.from_generator(lambda: (yield from stream), features=stream.features)) or write balanced "
    "shards once (`ringpack shard` / ringpack.data.write_shards) and read them with ShardReader"
)


class PackedSamples:
    """What :class:`PackedDataset` returns for a ticket: the ticket and each sample's token ids."""

    __slots__ = ("ticket", "tokens")

    def __init__(self, ticket: MicroBatchTicket, tokens: list[np.ndarray]) -> None:
        self.ticket = ticket
        self.tokens = tokens

    def __reduce__(self) -> tuple:
        return (PackedSamples, (self.ticket, self.tokens))


class PackedDataset(_DatasetBase):
    """Wrap a map-style dataset so a ``DataLoader`` batch carries its micro-batch ticket.

    Args:
        dataset: ``dataset[i]`` is a ``datasets.Dataset`` row (a dict with ``column``), a dict, or
            a sequence / array / tensor of token ids (integers, 1-D). ``datasets.Dataset`` objects
            are read in one Arrow ``take`` per micro-batch (no per-row Python dicts).
        column: the token-id field of dict rows.

    ``dataset[i]`` returns sample ``i``'s token ids (int64 ``[L]``); ``__getitems__(ticket)``,
    which ``DataLoader`` calls with a :class:`~ringpack.data.sampler.MicroBatchTicket`, returns
    a :class:`PackedSamples` (the ticket and each sample's ids) for :class:`PackedCollator`, and
    a plain list of id arrays for an ordinary list of indices.

    Streams (``datasets.IterableDataset``, ``torch.utils.data.IterableDataset``) are refused: a
    plan reorders samples across a whole epoch, so they must be addressable by index.

    Raises:
        DataError: a stream (naming the alternatives); a ``dataset`` without ``len()`` and
            ``dataset[i]``; a ``column`` that is not a string; a ``datasets.Dataset`` without
            ``column``; a row without it or with a null.
    """

    def __init__(self, dataset: Any, column: str = "input_ids") -> None:
        _refuse_stream(dataset)
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise DataError(f"dataset must be a map-style dataset (len() and dataset[i]), got {type(dataset).__name__}")
        if not isinstance(column, str):
            raise DataError(f"column must be the name of the token-id field, got {column!r}")
        self.dataset = dataset
        self.column = column
        self._arrow = None
        if type(dataset).__module__.startswith("datasets."):
            names = list(dataset.column_names)
            if column not in names:
                raise DataError(f"dataset has no column {column!r}; its columns are {names}")
            self._arrow = dataset.with_format("arrow")

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> np.ndarray:
        if self._arrow is not None:
            return self._fetch([int(index)])[0]
        return self._as_ids(self.dataset[index], index)

    def _as_ids(self, item: Any, index: int) -> np.ndarray:
        if isinstance(item, Mapping):
            if self.column not in item:
                raise DataError(f"sample {index} has no {self.column!r} field; it has {sorted(item)}")
            item = item[self.column]
        if hasattr(item, "detach"):
            item = item.detach().cpu().numpy()
        try:
            ids = np.asarray(item).reshape(-1)
        except (TypeError, ValueError) as exc:  # ragged nesting, ...
            raise DataError(f"row {index}: token ids must be a flat sequence of integers ({exc})") from None
        return _integer_ids(ids, lambda k: index)

    def _fetch(self, indices: list[int]) -> list[np.ndarray]:
        import pyarrow as pa

        table = self._arrow[indices]
        column = table.column(self.column)
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if column.null_count:
            raise DataError(
                f"sample {indices[column.is_null().to_numpy(zero_copy_only=False).argmax()]} has a null {self.column!r}"
            )
        offsets = column.offsets.to_numpy().astype(np.int64)
        values = column.values.slice(offsets[0], offsets[-1] - offsets[0]).to_numpy(zero_copy_only=False)
        offsets -= offsets[0]
        values = _integer_ids(values, lambda k: indices[int(np.searchsorted(offsets, k, side="right")) - 1])
        return [values[offsets[k] : offsets[k + 1]] for k in range(len(indices))]

    def __getitems__(self, ticket: Sequence[int]) -> Any:
        indices = [int(i) for i in ticket]
        if self._arrow is not None:
            tokens = self._fetch(indices)
        else:
            tokens = [self._as_ids(self.dataset[i], i) for i in indices]
        if not isinstance(ticket, MicroBatchTicket):
            return tokens  # an ordinary batch sampler: behave like a plain dataset
        return PackedSamples(ticket, tokens)


def _integer_ids(ids: np.ndarray, row_of: Any) -> np.ndarray:
    """``ids`` (1-D) as int64; whole floats are accepted. ``row_of(k)``: the dataset row of ``ids[k]``.

    Raises:
        DataError: a value that is no integer int64 holds (a fraction, NaN, a bool, a string, an
            integer beyond int64), naming the row and the value.
    """
    if ids.dtype.kind in "iu" and not (ids.dtype == np.uint64 and ids.size and int(ids.max()) >= 2**63):
        return ids.astype(np.int64, copy=False)
    if ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    if ids.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(ids) | (ids != np.round(ids)) | (np.abs(ids) >= 2.0**63)
        if not bad.any():
            return ids.astype(np.int64)
        k = int(np.flatnonzero(bad)[0])
    elif ids.dtype.kind == "O":  # Python objects: integers beyond int64 among them, or other things
        k = next(i for i, v in enumerate(ids.tolist()) if not is_int(v) or not -(2**63) <= v < 2**63)
    else:  # bools, strings, unsigned ids past int64
        k = 0
    value = ids[k].item() if hasattr(ids[k], "item") else ids[k]
    raise DataError(f"row {row_of(k)}: token id {value!r} is not an integer (int64) token id")


def check_token_ids(ids: np.ndarray, vocab_size: int | None, row: int) -> None:
    """Refuse token ids a model cannot embed, before they reach it.

    Args:
        ids: one row's token ids (int64 ``[L]``).
        vocab_size: the model's vocabulary size; ``None``: ids must be in the int32 range
            (``[0, 2**31)``, what shards store).
        row: the dataset row, for the message.

    Raises:
        DataError: a negative id, or one ``>= vocab_size`` (the row, the id and the range named).
    """
    if not len(ids):
        return
    limit = TOKEN_ID_LIMIT if vocab_size is None else vocab_size
    if int(ids.min()) >= 0 and int(ids.max()) < limit:
        return
    bad = int(ids[(ids < 0) | (ids >= limit)][0])
    what = "the int32 id range" if vocab_size is None else f"the model's vocabulary, vocab_size={vocab_size}"
    raise DataError(f"row {row}: token id {bad} is not in [0, {limit}) ({what})")


def _refuse_stream(dataset: Any) -> None:
    """Raise :class:`DataError` (:data:`STREAM_REFUSAL`) for a dataset without random access."""
    if is_dataset(dataset) and not hasattr(dataset, "__len__"):  # datasets.IterableDataset
        raise DataError(STREAM_REFUSAL.format(what=f"a datasets.{type(dataset).__name__}"))
    if isinstance(dataset, _TorchStream) and _TorchStream is not object:
        raise DataError(STREAM_REFUSAL.format(what=f"a torch IterableDataset ({type(dataset).__name__})"))


def rank_arrays(
    starts: np.ndarray, piece_tokens: list[np.ndarray], next_tokens: np.ndarray, ignore_index: int = IGNORE_INDEX
) -> dict[str, np.ndarray]:
    """Local arrays of one CP rank from its pieces (the collator's and the shard reader's common core).

    ``piece_tokens[k]`` are the token ids of piece ``k`` (positions ``starts[k]..``) and
    ``next_tokens[k]`` the id of the token after the piece in its sample, or ``ignore_index`` when
    the piece ends its sample.
    """
    lens = np.fromiter((len(t) for t in piece_tokens), dtype=np.int64, count=len(piece_tokens))
    cu = cumsum0(lens)
    total = int(cu[-1])
    input_ids = (
        np.concatenate(piece_tokens).astype(np.int64, copy=False) if piece_tokens else np.zeros(0, dtype=np.int64)
    )
    labels = np.empty(total, dtype=np.int64)
    if total:
        labels[:-1] = input_ids[1:]
        labels[cu[1:] - 1] = next_tokens  # each piece's last label: the next token of its sample
    position_ids = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1] - np.asarray(starts, dtype=np.int64), lens)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "cu_seqlens": cu.astype(np.int32)}


def _extents(microbatch: MicroBatch) -> dict[int, int]:
    """Each sample's length in the plan: the stop of its last piece, over every CP rank's pieces."""
    _, sample, _, stop = microbatch.piece_columns
    if not sample.size:
        return {}
    order = np.lexsort((stop, sample))
    last = np.r_[sample[order][1:] != sample[order][:-1], True]
    return dict(zip(sample[order][last].tolist(), stop[order][last].tolist()))


def schedule_options_of(options: Any, owner: str, stacklevel: int = 3) -> ScheduleOptions:
    """``options`` as :class:`~ringpack.attention.ScheduleOptions` (None: the defaults).

    A dict of its fields still works for one release, with a ``DeprecationWarning``. ``owner`` names
    the argument in messages (``"PackedCollator"``: ``PackedCollator(schedule_options=...)``);
    ``stacklevel`` points the warning at the caller's caller (``warnings.warn``'s).

    Raises:
        DataError: neither ScheduleOptions, a dict nor None; a dict with an unknown key or a bad value (named).
    """
    if options is None:
        return ScheduleOptions()
    if isinstance(options, ScheduleOptions):
        return options
    if not isinstance(options, Mapping):
        raise DataError(f"{owner}.schedule_options must be a ScheduleOptions, got {type(options).__name__}")
    warnings.warn(
        f"{owner}(schedule_options=dict) is deprecated: pass ringpack.attention.ScheduleOptions(...) "
        "with the same fields; dicts will be refused",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    try:
        return ScheduleOptions.from_keywords(options)
    except ValueError as exc:
        raise DataError(f"{owner}.schedule_options: {exc}") from exc


def check_schedule_flag(schedule: Any, name: str = "schedule") -> None:
    """Raise :class:`DataError` unless ``schedule`` (the flag ``name`` of a collator or reader: whether
    it compiles attention schedules) is ``"auto"``, True, False or None."""
    if not (schedule is None or isinstance(schedule, bool) or (isinstance(schedule, str) and schedule == "auto")):
        raise DataError(f"{name} must be 'auto', True or False, got {schedule!r}")


_UNSET = object()


def _renamed_flag(compile_schedules: Any, schedule: Any) -> Any:
    """``compile_schedules``, or the value given by its old name ``schedule=`` (a DeprecationWarning)."""
    if schedule is _UNSET:
        return compile_schedules
    if not (isinstance(compile_schedules, str) and compile_schedules == "auto"):
        raise DataError("PackedCollator: pass compile_schedules= only (schedule= is its old name)")
    warnings.warn(
        "PackedCollator(schedule=...) is renamed compile_schedules=...; the old name will be removed",
        DeprecationWarning,
        stacklevel=3,
    )
    return schedule


def _schedule(microbatch: MicroBatch, cp_rank: int, mode: Any, options: ScheduleOptions | None = None) -> Any:
    if mode is False or mode is None:
        return None
    return compile_schedule(microbatch, cp_rank, options=options)


def to_batch(
    arrays: dict[str, np.ndarray],
    microbatch: MicroBatch,
    cp_rank: int,
    meta: dict[str, Any],
    schedule: Any,
    ignore_index: int = IGNORE_INDEX,
    options: ScheduleOptions | None = None,
) -> dict[str, Any]:
    """Turn :func:`rank_arrays` output into the batch dict (torch tensors + plan metadata)."""
    import torch

    shard = microbatch.shards[cp_rank]
    cu = arrays["cu_seqlens"]
    labels = torch.from_numpy(arrays["labels"])
    batch = {
        "input_ids": torch.from_numpy(arrays["input_ids"]),
        "labels": labels,
        "position_ids": torch.from_numpy(arrays["position_ids"]),
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(np.diff(cu).max()) if len(cu) > 1 else 0,
        "sample_ids": torch.tensor([p.sample for p in shard.pieces], dtype=torch.int64),
        "num_loss_tokens": int((arrays["labels"] != ignore_index).sum()),
        "microbatch_loss_tokens": int(microbatch.loss_tokens),
        "schedule": _schedule(microbatch, cp_rank, schedule, options),
        "microbatch": microbatch,
    }
    batch.update(meta)
    return batch


def ticket_meta(ticket: MicroBatchTicket) -> dict[str, Any]:
    return {
        "step_loss_tokens": int(ticket.step_loss_tokens),
        "epoch": ticket.epoch,
        "step": ticket.step,
        "microbatch_index": ticket.index,
        "microbatches_in_step": ticket.microbatches_in_step,
        "cursor": ticket.cursor,
        "plan_hash": ticket.plan_hash,
    }


class PackedCollator:
    """``collate_fn`` that builds CP rank ``cp_rank``'s tensors of a micro-batch.

    Args:
        cp_rank, cp_size: this process's CP rank and the CP group's size.
        compile_schedules: ``"auto"`` or ``True``: compile each micro-batch's attention schedule
            for this rank; ``False``: leave ``batch["schedule"]`` ``None``.
        ignore_index: the label of every sample's last token.
        schedule_options: ``compile_schedule``'s :class:`~ringpack.attention.ScheduleOptions`: the
            dense split's, and ``gpus_per_node`` (a ticket of a plan with ``gpus_per_node`` brings
            its own, which an explicit value here overrides); None: the defaults. A dict of its
            fields still works for one release, with a ``DeprecationWarning``.
        schedule: the old name of ``compile_schedules`` (a ``DeprecationWarning``).
        vocab_size: the model's vocabulary size: every token id must be in ``[0, vocab_size)``;
            ``None``: in ``[0, 2**31)`` (:func:`check_token_ids`).

    Called with what :class:`PackedDataset` returns for a ticket, it returns the batch dict of
    docs/data.md (int64 ``input_ids``, ``labels``, ``position_ids`` ``[T]``; int32
    ``cu_seqlens`` ``[P+1]``; the schedule and plan metadata). The collator holds no plan:
    everything it needs arrives with the ticket, so it pickles into workers as a few integers.

    Raises:
        DataError: bad ranks or options, ``compile_schedules`` and ``schedule`` both given; when
            called: a batch without its ticket (the dataset is not wrapped in
            :class:`PackedDataset`), samples whose token counts differ from the plan's (the
            dataset changed since its lengths were taken), or a token id outside the vocabulary
            (the dataset row named).
    """

    def __init__(
        self,
        cp_rank: int,
        cp_size: int,
        *,
        compile_schedules: Any = "auto",
        ignore_index: int = IGNORE_INDEX,
        schedule_options: ScheduleOptions | None = None,
        schedule: Any = _UNSET,
        vocab_size: int | None = None,
    ) -> None:
        compile_schedules = _renamed_flag(compile_schedules, schedule)
        if vocab_size is not None and (not is_int(vocab_size) or vocab_size < 1):
            raise DataError(f"vocab_size must be None or a positive integer (the model's vocabulary): {vocab_size!r}")
        if not is_int(cp_size) or cp_size < 1:
            raise DataError(f"cp_size must be a positive integer, got {cp_size!r}")
        if not is_int(cp_rank) or not 0 <= cp_rank < cp_size:
            raise DataError(f"cp_rank must be in [0, {cp_size}), got {cp_rank!r}")
        check_schedule_flag(compile_schedules, "compile_schedules")
        if not is_int(ignore_index):
            raise DataError(
                f"ignore_index must be an integer (the label of a sample's last token), got {ignore_index!r}"
            )
        self.cp_rank = int(cp_rank)
        self.cp_size = int(cp_size)
        self.compile_schedules = compile_schedules
        self.schedule_options = schedule_options_of(schedule_options, "PackedCollator")
        self.ignore_index = ignore_index
        self.vocab_size = None if vocab_size is None else int(vocab_size)

    @classmethod
    def from_mesh(cls, mesh: Any, *, cp_dim: str = "cp", **options: Any) -> PackedCollator:
        """The collator of this rank of a DeviceMesh: its position in the ``cp_dim`` dimension (or in
        a 1-D mesh of that dimension, or unnamed). ``options``: as for the constructor.

        Raises:
            DataError: not a DeviceMesh, no dimension ``cp_dim``, a 1-D mesh of another dimension
                (``mesh["dp"]``), or a bad option.
        """
        sub = mesh_dimension(mesh, cp_dim)
        return cls(sub.get_local_rank(), sub.size(), **options)

    def __call__(self, batch: Any) -> dict[str, Any]:
        if not isinstance(batch, PackedSamples):
            raise DataError(
                "PackedCollator needs the micro-batch ticket: wrap the dataset in PackedDataset(dataset) and pass "
                "batch_sampler=BalancedBatchSampler(...) to the DataLoader"
            )
        t = batch.ticket
        return self.collate(
            t.microbatch,
            batch.tokens,
            ticket_meta(t),
            t.offsets,
            t.row_lengths,
            gpus_per_node=t.gpus_per_node,
            max_partners=getattr(t, "max_partners", 0),
            rows=list(t),
            positions=getattr(t, "positions", None),
        )

    def collate(
        self,
        microbatch: MicroBatch,
        tokens: Sequence[Any],
        meta: dict[str, Any] | None = None,
        offsets: Sequence[int] | None = None,
        row_lengths: Sequence[int] | None = None,
        gpus_per_node: int | None = None,
        rows: Sequence[int] | None = None,
        positions: Sequence[int] | None = None,
        max_partners: int = 0,
    ) -> dict[str, Any]:
        """Build the batch from a micro-batch and its samples' token ids (in ``microbatch.samples`` order).

        ``gpus_per_node``: the plan's node size, for the schedule's node-relayed exchange (the
        ticket's, from the sampler); ``max_partners``: the plan's partner budget (the ticket's; 0:
        none); ``schedule_options`` may override either.

        ``positions``: ``tokens`` (and ``offsets``, ``row_lengths``, ``rows``) are those of
        ``microbatch.samples[k]`` for ``k`` in ``positions`` only, which must include every sample
        this CP rank holds pieces of (a sampler given ``cp_rank``: :attr:`MicroBatchTicket.positions`).

        ``offsets``/``row_lengths`` (from the ticket) locate plan documents inside longer dataset
        rows when ``overflow="split"`` cut them; by default each token array is the whole sample.

        Raises:
            DataError: ``microbatch`` not a MicroBatch of this CP size, ``tokens`` not one token
                array per sample, ``offsets``/``row_lengths`` not one per sample, a sample whose
                tokens are not the plan's (the dataset changed, or a document runs past its row),
                a token id outside ``[0, vocab_size)`` (:func:`check_token_ids`), or ``positions``
                without a sample this CP rank holds pieces of (the sampler's ``cp_rank`` is another).
        """
        if not isinstance(microbatch, MicroBatch):
            raise DataError(f"microbatch must be a ringpack MicroBatch, got {type(microbatch).__name__}")
        if not hasattr(tokens, "__len__") or isinstance(tokens, (str, bytes)):
            raise DataError(f"tokens must be a sequence of token-id arrays, got {type(tokens).__name__}")
        if len(microbatch.shards) != self.cp_size:
            raise DataError(
                f"micro-batch has {len(microbatch.shards)} CP shards but the collator is for cp_size={self.cp_size}"
            )
        given = list(microbatch.samples) if positions is None else [microbatch.samples[k] for k in positions]
        for name, values in (("offsets", offsets), ("row_lengths", row_lengths), ("rows", rows)):
            if values is not None and (not hasattr(values, "__len__") or len(values) != len(given)):
                raise DataError(f"{name} must hold one integer per sample of the micro-batch ({len(given)})")
        if len(tokens) != len(given):
            raise DataError(f"micro-batch lists {len(given)} samples, got {len(tokens)} token arrays")
        shard = microbatch.shards[self.cp_rank]
        missing = {p.sample for p in shard.pieces} - set(given) if positions is not None else set()
        if missing:
            raise DataError(
                f"cp rank {self.cp_rank}: the ticket has no rows of sample {min(missing)}, which this rank holds "
                "pieces of: give the sampler and the collator the same cp_rank"
            )
        extent = _extents(microbatch)  # each plan sample's length: the stop of its last piece
        offsets = [0] * len(tokens) if offsets is None else offsets
        by_sample = {}
        for k, (sample, ids) in enumerate(zip(given, tokens)):
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            want = extent.get(sample, -1) if row_lengths is None else row_lengths[k]
            if len(ids) != want:
                raise DataError(
                    f"sample {sample} has {len(ids)} tokens but the plan has {want}: the dataset changed "
                    "since its lengths were taken (re-create the sampler from the current dataset)"
                )
            if offsets[k] + extent[sample] > len(ids):
                raise DataError(
                    f"sample {sample}: tokens [{offsets[k]}, {offsets[k] + extent[sample]}) of its row, "
                    f"which has {len(ids)} tokens"
                )
            by_sample[sample] = ids[offsets[k] : offsets[k] + extent[sample]]
            check_token_ids(by_sample[sample], self.vocab_size, sample if rows is None else rows[k])
        starts = np.array([p.start for p in shard.pieces], dtype=np.int64)
        pieces = [by_sample[p.sample][p.start : p.stop] for p in shard.pieces]
        nexts = np.array(
            [
                by_sample[p.sample][p.stop] if p.stop < len(by_sample[p.sample]) else self.ignore_index
                for p in shard.pieces
            ],
            dtype=np.int64,
        )
        arrays = rank_arrays(starts, pieces, nexts, self.ignore_index)
        meta = dict(meta or {})
        meta.setdefault("step_loss_tokens", None)
        options = self.schedule_options.with_node_size(gpus_per_node, max_partners)
        return to_batch(arrays, microbatch, self.cp_rank, meta, self.compile_schedules, self.ignore_index, options)
