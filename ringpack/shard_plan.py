"""The shard plan: the one contract between the balancer, the dataloaders and the attention runtime.

A plan says, for every step, which DP rank processes which micro-batches, and for every
micro-batch which token ranges ("pieces") of which samples each CP rank holds. Plans are plain
frozen dataclasses (:class:`Plan`, :class:`Step`, :class:`MicroBatch`, :class:`Piece`,
:class:`PlanConfig`, defined in :mod:`ringpack.plan_config`): they serialise to JSON and to an
Arrow/Parquet table of pieces, carry a content hash that is identical on every process and
machine, and are never pickled.
:meth:`Plan.validate` checks every invariant (listed in its docstring) and names the offending
step, DP rank, micro-batch, CP rank or sample.

See docs/plan.md ("The objects", "Invariants", "File formats", "Content hash").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from functools import cached_property
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ringpack._checks import is_finite, is_int
from ringpack._files import atomic_write
from ringpack.errors import PlanError
from ringpack.lengths import check_lengths
from ringpack.plan_config import (
    FLOP_PRICE_RANGE,
    INT64_LIMIT,
    MAX_CP,
    MAX_DP,
    NO_TOKEN_GUARD,
    OVERFLOW_POLICIES,
    PACKINGS,
    ROBUST_TOKEN_SLACK,
    STRATEGIES,
    OverflowPolicy,
    Packing,
    PlanConfig,
    Strategy,
    check_keys,
    field_doc,
    global_batch_samples,
)

if TYPE_CHECKING:  # pyarrow is imported lazily: the attention runtime must import without it
    import pyarrow as pa

__all__ = [
    "Piece",
    "RankShard",
    "MicroBatch",
    "Step",
    "PlanConfig",
    "Plan",
    "PlanError",
    "FORMAT_VERSION",
    "STRATEGIES",
    "PACKINGS",
    "OVERFLOW_POLICIES",
    "MAX_DP",
    "MAX_CP",
    "field_doc",
    "global_batch_samples",
    # the plan config's names, defined in ringpack.plan_config
    "FLOP_PRICE_RANGE",
    "NO_TOKEN_GUARD",
    "ROBUST_TOKEN_SLACK",
    "OverflowPolicy",
    "Packing",
    "Strategy",
]

FORMAT_VERSION = 1
TABLE_COLUMNS = ("step", "dp", "microbatch", "cp", "slot", "sample", "start", "stop")
#: Items a repr lists before it only counts the rest (a plan's objects can hold millions).
_SHOWN = 4


def _preview(items: Sequence[Any], count: int) -> str:
    """``count`` items as ``[a, b]``, or ``7: [a, b, c, d, ...]`` when there are more than :data:`_SHOWN`."""
    if count <= _SHOWN:
        return "[" + ", ".join(map(str, items[:count])) + "]"
    return f"{count}: [" + ", ".join(map(str, items[:_SHOWN])) + ", ...]"


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, stop)`` of sample ``sample`` (its index in the planner's input)."""

    sample: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RankShard:
    """The pieces one CP rank holds for one micro-batch, in canonical order."""

    pieces: tuple[Piece, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(p.stop - p.start for p in self.pieces)

    def __repr__(self) -> str:
        pieces = _preview([f"{p.sample}[{p.start}:{p.stop}]" for p in self.pieces[: _SHOWN + 1]], len(self.pieces))
        return f"RankShard(tokens={self.num_tokens}, pieces={pieces})"


class ColumnShards(Sequence[RankShard]):
    """A micro-batch's rank shards read from its pieces as int64 arrays, each :class:`RankShard`
    built on first access and kept: a loader that needs one rank's shard of a micro-batch spanning
    thousands of ranks builds that one, not every rank's pieces as objects.

    Equal (and hashing alike) to the tuple of the same shards; :attr:`MicroBatch.piece_columns` of a
    micro-batch holding one reads the arrays, not objects.

    Args:
        pieces: int64 ``[P, 3]``, ``(sample, start, stop)`` of every piece, CP rank after CP rank.
        bounds: int64 ``[cp + 1]``, non-decreasing from 0 to ``P``: rank ``r``'s pieces are
            ``pieces[bounds[r]:bounds[r + 1]]``.
    """

    __slots__ = ("_pieces", "_bounds", "_built")

    def __init__(self, pieces: np.ndarray, bounds: np.ndarray) -> None:
        self._pieces = np.asarray(pieces, dtype=np.int64).reshape(-1, 3)
        self._bounds = np.asarray(bounds, dtype=np.int64)
        self._built: dict[int, RankShard] = {}

    def __len__(self) -> int:
        return self._bounds.size - 1

    def __getitem__(self, index):  # int -> RankShard, slice -> tuple
        if isinstance(index, slice):
            return tuple(self[r] for r in range(len(self))[index])
        r = range(len(self))[index]  # IndexError / TypeError as a tuple's
        shard = self._built.get(r)
        if shard is None:
            rows = self._pieces[self._bounds[r] : self._bounds[r + 1]].tolist()
            shard = self._built[r] = RankShard(tuple(Piece(*row) for row in rows))
        return shard

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (tuple, ColumnShards)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"ColumnShards(cp={len(self)}, pieces={len(self._pieces)})"

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(cp_rank, sample, start, stop)`` of every piece (:attr:`MicroBatch.piece_columns`)."""
        rank = np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self._bounds))
        return (rank, *(np.ascontiguousarray(self._pieces[:, k]) for k in range(3)))


@dataclass(frozen=True)
class MicroBatch:
    """Samples one CP group runs in one forward/backward; ``shards[r]`` is CP rank ``r``'s share.

    ``samples`` fixes the canonical order: pieces on every rank are sorted by their sample's
    position here, then by ``start``. ``shards`` is a tuple, or the :class:`ColumnShards` of a
    micro-batch read from arrays (as a planner process delivers it), equal to that tuple.
    """

    samples: tuple[int, ...]
    shards: tuple[RankShard, ...] | ColumnShards
    loss_tokens: int

    @property
    def num_tokens(self) -> int:
        if isinstance(self.shards, ColumnShards):
            _, _, start, stop = self.piece_columns
            return int((stop - start).sum())
        return sum(s.num_tokens for s in self.shards)

    @cached_property
    def piece_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every piece as int64 columns ``(cp_rank, sample, start, stop)``, rank by rank in shard order.

        Read once per object (one pass over the pieces, then numpy) and kept on it: compiling the
        schedules of several ranks, or a schedule and a batch, reads the pieces once. Not a field:
        equality, hash, repr and pickles ignore it. The pieces' order and values are taken as they
        are (no check that they tile their samples).

        Raises:
            TypeError: a shard that is not a :class:`RankShard`, a piece that is not a
                :class:`Piece`, or a piece field that is not an integer (bools included).
            OverflowError: a field outside int64.
        """
        if isinstance(self.shards, ColumnShards):
            return self.shards.columns()
        return _piece_columns(self.shards)

    @cached_property
    def fingerprint(self) -> int:
        """A signed 64-bit hash of the micro-batch's CP size, samples and pieces (every rank's), what
        each rank's schedule carries so ranks can check they run the same one. Computed once per
        object, like :attr:`piece_columns` (a planner process computes it and sends it along)."""
        h = hashlib.blake2b(digest_size=8, person=b"ringpack-mbatch")
        h.update(np.int64(len(self.shards)).tobytes())
        h.update(np.asarray(self.samples, dtype="<i8").tobytes())
        for column in self.piece_columns:
            h.update(column.astype("<i8", copy=False).tobytes())
        return int.from_bytes(h.digest(), "little", signed=True)

    def __getstate__(self) -> dict[str, Any]:  # pickles carry the fields only, as before the cache
        return {f.name: self.__dict__[f.name] for f in fields(self)}

    def __repr__(self) -> str:
        if isinstance(self.shards, ColumnShards):
            rank, _, start, stop = self.piece_columns
            ranks = np.bincount(rank, weights=stop - start, minlength=len(self.shards)).astype(np.int64).tolist()
        else:
            ranks = [shard.num_tokens for shard in self.shards]
        spread = f"{min(ranks)}..{max(ranks)}" if ranks else "-"
        return (
            f"MicroBatch(samples={_preview(self.samples[: _SHOWN + 1], len(self.samples))}, "
            f"tokens={sum(ranks)}, loss_tokens={self.loss_tokens}, cp={len(ranks)}, rank_tokens={spread})"
        )


@dataclass(frozen=True)
class Step:
    """One optimizer step: ``microbatches[d]`` is the list DP rank ``d`` runs, in order.

    ``lower_bound`` is a proven lower bound, in the plan's cost unit, on this step's cost as the
    planner defines it: a micro-batch costs the max over its CP ranks, a DP rank the sum over its
    micro-batches, the step the max over DP ranks (``ringpack.planner.bounds``). ``None`` when
    the planner computed none.
    """

    microbatches: tuple[tuple[MicroBatch, ...], ...]
    lower_bound: float | None = None

    @property
    def loss_tokens(self) -> int:
        """Loss tokens of the whole global batch: the denominator for per-token loss."""
        return sum(mb.loss_tokens for rank in self.microbatches for mb in rank)

    def __repr__(self) -> str:
        mbs = [mb for rank in self.microbatches for mb in rank]
        per_rank = sorted({len(rank) for rank in self.microbatches})
        bound = "None" if self.lower_bound is None else f"{self.lower_bound:.6g}"
        return (
            f"Step(dp={len(self.microbatches)}, microbatches_per_rank={'/'.join(map(str, per_rank))}, "
            f"samples={sum(len(mb.samples) for mb in mbs)}, tokens={sum(mb.num_tokens for mb in mbs)}, "
            f"loss_tokens={self.loss_tokens}, lower_bound={bound})"
        )


@dataclass(frozen=True)
class Plan:
    """A whole shard plan: the config, the planned sample lengths, the steps, the samples dropped.

    With ``overflow="split"`` the planned samples are documents cut from over-long input samples;
    ``origins[k] = (input_sample, offset)`` says where document ``k`` starts. Empty otherwise.
    """

    config: PlanConfig
    lengths: tuple[int, ...]
    steps: tuple[Step, ...]
    dropped: tuple[int, ...] = ()
    origins: tuple[tuple[int, int], ...] = ()

    def __repr__(self) -> str:
        c = self.config
        microbatches = sum(len(rank) for step in self.steps for rank in step.microbatches)
        tokens = sum(self.lengths) - sum(self.lengths[k] for k in self.dropped)  # the planned samples'
        return (
            f"Plan(dp={c.dp}, cp={c.cp}, tokens_per_rank={c.tokens_per_rank}, strategy={c.strategy}, "
            f"packing={c.packing}, steps={self.num_steps}, microbatches={microbatches}, samples={len(self.lengths)}, "
            f"dropped={len(self.dropped)}, tokens={tokens}, hash={self.content_hash[:12]})"
        )

    def origin_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(input_sample, offset)`` of every planned sample as int64 arrays (identity when no cuts)."""
        if not self.origins:
            n = len(self.lengths)
            return np.arange(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        table = np.asarray(self.origins, dtype=np.int64).reshape(-1, 2)
        return table[:, 0].copy(), table[:, 1].copy()

    # ------------------------------------------------------------------ views
    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def microbatch(self, step: int, dp_rank: int, index: int) -> MicroBatch:
        """Micro-batch ``index`` of DP rank ``dp_rank`` in step ``step``; PlanError naming an index out of range."""
        for name, value, count in (("step", step, len(self.steps)), ("dp_rank", dp_rank, self.config.dp)):
            if not is_int(value) or not 0 <= value < count:
                raise PlanError(f"{name} must be an integer in [0, {count}), got {value!r}")
        mbs = self.steps[step].microbatches[dp_rank]
        if not is_int(index) or not 0 <= index < len(mbs):
            raise PlanError(
                f"index must be an integer in [0, {len(mbs)}) (step {step}, dp rank {dp_rank}), got {index!r}"
            )
        return mbs[index]

    def iter_microbatches(self) -> Iterator[tuple[int, int, int, MicroBatch]]:
        """Yield ``(step, dp_rank, index, microbatch)`` in plan order."""
        for s, step in enumerate(self.steps):
            for d, rank in enumerate(step.microbatches):
                for i, mb in enumerate(rank):
                    yield s, d, i, mb

    @cached_property
    def piece_arrays(self) -> dict[str, np.ndarray]:
        """The plan as columns of int64 arrays, one row per piece (the Parquet table's content).

        Rows are in plan order: step, DP rank, micro-batch, CP rank, then canonical piece order.
        Vectorised consumers (costs, reports, hashing) read this instead of walking objects.
        """
        rows: list[tuple[int, ...]] = []
        for s, d, i, mb in self.iter_microbatches():
            slot_of = {sample: k for k, sample in enumerate(mb.samples)}
            for c, shard in enumerate(mb.shards):
                for p in shard.pieces:
                    rows.append((s, d, i, c, slot_of.get(p.sample, -1), p.sample, p.start, p.stop))
        table = np.array(rows, dtype=np.int64).reshape(-1, len(TABLE_COLUMNS))
        return {name: np.ascontiguousarray(table[:, k]) for k, name in enumerate(TABLE_COLUMNS)}

    # --------------------------------------------------------------- hashing
    @cached_property
    def content_hash(self) -> str:
        """SHA-256 over the config, lengths, dropped samples and the piece table.

        Fixed-width little-endian integers and sorted-key JSON make it identical across processes,
        machines and Python versions. Lower bounds are annotations, not identity, and are excluded.
        """
        return plan_content_hash(self.config, self.lengths, self.dropped, self.origins, self.piece_arrays)

    # ------------------------------------------------------------ validation
    def validate(self) -> Plan:
        """Check every invariant of the plan (docs/plan.md, "Invariants").

        * config: ``dp, cp, tokens_per_rank >= 1``, ``dp <= MAX_DP``, ``cp <= MAX_CP``,
          ``cp * tokens_per_rank <= MAX_SAMPLE_TOKENS``; every
          sample length in ``[1, MAX_SAMPLE_TOKENS]`` (:func:`ringpack.lengths.check_lengths`);
        * every step has ``dp`` lists of micro-batches, all of the same non-zero length (DP ranks run in
          lockstep: FSDP and pipeline schedules need the same number of forward passes on every DP rank);
        * every micro-batch lists its samples (non-empty, no repeats) and has exactly ``cp`` rank shards;
        * every piece names a sample of its micro-batch and satisfies ``0 <= start < stop <= length``;
        * each rank shard is in canonical order (sample's slot in the micro-batch, then ``start``) and
          holds at most ``tokens_per_rank`` tokens;
        * the pieces of each sample of a micro-batch tile ``[0, length)`` exactly (no gap, no overlap);
        * every sample of the plan is in exactly one micro-batch, except those listed in ``dropped``,
          which are in none;
        * ``loss_tokens`` of a micro-batch is ``sum(length - 1)`` over its samples (next-token targets
          never cross a sample boundary);
        * ``origins`` is empty (planned sample ``k`` is input sample ``k``) or gives, for every planned
          sample, the input sample and token offset it was cut from (``overflow="split"``), in order.

        Returns:
            ``self``, so calls chain (``Plan.load(path).validate()``).

        Raises:
            PlanError: the first broken invariant, naming its step, DP rank, micro-batch, CP rank
                or sample.
        """
        cfg = self.config
        lengths = check_lengths(self.lengths, what="plan lengths", error=PlanError)
        n = len(lengths)
        seen_in = np.full(n, -1, dtype=np.int64)  # flat micro-batch id holding each sample
        for d_sample in self.dropped:
            if not 0 <= d_sample < n:
                raise PlanError(f"dropped sample {d_sample} is out of range [0, {n})")
        if self.origins:
            if len(self.origins) != n:
                raise PlanError(f"origins has {len(self.origins)} entries for {n} planned samples")
            for k, (source, offset) in enumerate(self.origins):
                if source < 0 or offset < 0:
                    raise PlanError(f"sample {k} has origin ({source}, {offset}); both must be >= 0")
        mb_id = 0
        for s, step in enumerate(self.steps):
            if len(step.microbatches) != cfg.dp:
                raise PlanError(f"step {s} has {len(step.microbatches)} DP ranks, plan is for dp={cfg.dp}")
            counts = {len(rank) for rank in step.microbatches}
            if len(counts) != 1 or 0 in counts:
                per_rank = [len(rank) for rank in step.microbatches]
                raise PlanError(
                    f"step {s}: DP ranks run {per_rank} micro-batches; every DP rank needs the same non-zero number"
                )
            for d, rank in enumerate(step.microbatches):
                for i, mb in enumerate(rank):
                    where = f"step {s}, dp rank {d}, micro-batch {i}"
                    self._validate_microbatch(mb, lengths, where)
                    for sample in mb.samples:
                        if seen_in[sample] >= 0:
                            raise PlanError(f"sample {sample} is planned twice ({where} and an earlier micro-batch)")
                        seen_in[sample] = mb_id
                    mb_id += 1
        dropped = np.zeros(n, dtype=bool)
        dropped[list(self.dropped)] = True
        both = np.flatnonzero(dropped & (seen_in >= 0))
        if both.size:
            raise PlanError(f"sample {int(both[0])} is listed as dropped but is planned")
        missing = np.flatnonzero(~dropped & (seen_in < 0))
        if missing.size:
            raise PlanError(f"sample {int(missing[0])} is in no micro-batch and not dropped ({missing.size} missing)")
        return self

    def _validate_microbatch(self, mb: MicroBatch, lengths: np.ndarray, where: str) -> None:
        cfg = self.config
        n = len(lengths)
        if not mb.samples:
            raise PlanError(f"{where} has no samples")
        if len(set(mb.samples)) != len(mb.samples):
            raise PlanError(f"{where} lists a sample twice: {list(mb.samples)}")
        for sample in mb.samples:
            if not 0 <= sample < n:
                raise PlanError(f"{where} names sample {sample}, outside [0, {n})")
        if len(mb.shards) != cfg.cp:
            raise PlanError(f"{where} has {len(mb.shards)} rank shards, plan is for cp={cfg.cp}")
        slot_of = {sample: k for k, sample in enumerate(mb.samples)}
        covered: dict[int, list[tuple[int, int, int]]] = {sample: [] for sample in mb.samples}
        for c, shard in enumerate(mb.shards):
            previous = (-1, -1)
            tokens = 0
            for p in shard.pieces:
                if p.sample not in slot_of:
                    raise PlanError(
                        f"{where}, cp rank {c}: piece of sample {p.sample}, which the micro-batch does not list"
                    )
                length = int(lengths[p.sample])
                if not 0 <= p.start < p.stop <= length:
                    raise PlanError(
                        f"{where}, cp rank {c}: piece [{p.start}, {p.stop}) of sample {p.sample} "
                        f"is empty or outside [0, {length})"
                    )
                key = (slot_of[p.sample], p.start)
                if key <= previous:
                    raise PlanError(
                        f"{where}, cp rank {c}: piece [{p.start}, {p.stop}) of sample {p.sample} breaks canonical "
                        "order (sample's position in the micro-batch, then start)"
                    )
                previous = key
                tokens += p.stop - p.start
                covered[p.sample].append((p.start, p.stop, c))
            if tokens > cfg.tokens_per_rank:
                raise PlanError(
                    f"{where}, cp rank {c} holds {tokens} tokens, over tokens_per_rank={cfg.tokens_per_rank}"
                )
        for sample, spans in covered.items():
            spans.sort()
            end = 0
            for start, stop, c in spans:
                if start < end:
                    raise PlanError(
                        f"{where}: sample {sample} tokens [{start}, {min(end, stop)}) are in two pieces (cp rank {c})"
                    )
                if start > end:
                    raise PlanError(f"{where}: sample {sample} tokens [{end}, {start}) are in no piece")
                end = stop
            if end != lengths[sample]:
                raise PlanError(f"{where}: sample {sample} tokens [{end}, {int(lengths[sample])}) are in no piece")
        expected = int(sum(int(lengths[sample]) - 1 for sample in mb.samples))
        if mb.loss_tokens != expected:
            raise PlanError(f"{where}: loss_tokens is {mb.loss_tokens}, its samples give {expected}")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """Plain data: config, lengths, dropped, and steps as nested lists of piece triples."""
        steps = []
        for step in self.steps:
            steps.append(
                {
                    "lower_bound": step.lower_bound,
                    "microbatches": [
                        [
                            {
                                "samples": list(mb.samples),
                                "loss_tokens": mb.loss_tokens,
                                "shards": [[[p.sample, p.start, p.stop] for p in shard.pieces] for shard in mb.shards],
                            }
                            for mb in rank
                        ]
                        for rank in step.microbatches
                    ],
                }
            )
        return {
            "format": "ringpack-plan",
            "version": FORMAT_VERSION,
            "hash": self.content_hash,
            "config": self.config.to_dict(),
            "lengths": [int(x) for x in self.lengths],
            "dropped": [int(x) for x in self.dropped],
            "origins": [[int(a), int(b)] for a, b in self.origins],
            "steps": steps,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """The plan of :meth:`to_dict`'s document, its hash checked and every invariant validated.

        Every key ``to_dict`` writes is required (``dropped`` and ``origins`` default to empty),
        unknown keys are refused, and every number must be an integer of the right kind.

        Raises:
            PlanError: a missing, unknown or mistyped key (named by its path, e.g.
                ``steps[3].microbatches[0][1].loss_tokens``), a hash mismatch, or a broken invariant.
        """
        check_keys(data, "plan", required=_JSON_KEYS, optional=("dropped", "origins"))
        _check_format(data)
        plan = cls(
            config=PlanConfig.from_dict(data["config"]),
            lengths=tuple(_int(x, f"lengths[{k}]") for k, x in enumerate(_list(data["lengths"], "lengths"))),
            steps=tuple(_step_from_dict(step, f"steps[{s}]") for s, step in enumerate(_list(data["steps"], "steps"))),
            dropped=_ints_of(data.get("dropped", []), "dropped"),
            origins=tuple(_origin(x, f"origins[{k}]") for k, x in enumerate(_list(data.get("origins", []), "origins"))),
        )
        _check_hash(plan, data["hash"])
        return plan.validate()

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path is not None:
            with atomic_write(path) as f:
                f.write(text.encode())
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        """A plan from JSON text (starting with ``{``) or a JSON file (:meth:`from_dict`).

        Raises:
            PlanError: not JSON, or not a valid plan (:meth:`from_dict`); a file is named.
            FileNotFoundError: no file at the path.
        """
        text = str(text_or_path)
        where = "plan JSON"
        if not text.lstrip().startswith("{"):
            where = f"plan file {text_or_path}"
            try:
                text = Path(text_or_path).read_text(encoding="utf-8")
            except UnicodeDecodeError as exc:
                raise PlanError(f"{where} is not UTF-8 text: {exc}") from exc
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise PlanError(f"{where} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from exc

    # --------------------------------------------------------------- Parquet
    def to_table(self) -> pa.Table:
        """One row per piece (``step, dp, microbatch, cp, slot, sample, start, stop``).

        ``slot`` is the sample's position in its micro-batch (the canonical order, which the other
        columns cannot recover when a sample sits on one rank only). Config, lengths, dropped
        samples, lower bounds and the hash travel in the schema metadata.
        """
        import pyarrow as pa

        arrays = self.piece_arrays
        meta = {
            "format": "ringpack-plan",
            "version": FORMAT_VERSION,
            "hash": self.content_hash,
            "config": self.config.to_dict(),
            "num_steps": self.num_steps,
            "lower_bounds": [step.lower_bound for step in self.steps],
            "dropped": [int(x) for x in self.dropped],
        }
        metadata = {
            b"ringpack.shard_plan": json.dumps(meta, sort_keys=True).encode(),
            b"ringpack.lengths": np.asarray(self.lengths, dtype="<i8").tobytes(),
            b"ringpack.origins": np.asarray(self.origins, dtype="<i8").tobytes(),
        }
        schema = pa.schema(
            [pa.field(name, pa.int64()) for name in TABLE_COLUMNS],
            metadata=metadata,
        )
        return pa.Table.from_arrays([_int64_array(arrays[name]) for name in TABLE_COLUMNS], schema=schema)

    @classmethod
    def from_table(cls, table: pa.Table) -> Plan:
        """The plan of :meth:`to_table`'s table, its hash checked and every invariant validated.

        Counts in the metadata are checked against the rows, never trusted for allocation:
        ``num_steps`` must be the steps the rows hold, every DP rank of every step needs a row,
        and a table whose micro-batches would need more than ``64 x rows`` (at least ``2**22``)
        rank shards, mostly empty, is refused as corrupt.

        Raises:
            PlanError: not a pyarrow Table, missing or unknown metadata keys or columns, mistyped or
                null values, counts that disagree with the rows, a hash mismatch, or a broken invariant.
        """
        import pyarrow as pa

        if not isinstance(table, pa.Table):
            raise PlanError(f"table must be a pyarrow Table of a plan, got {type(table).__name__}")
        meta, lengths, origins = _table_metadata(table)
        config = PlanConfig.from_dict(meta["config"])
        cols = _table_columns(table)
        plan = cls(
            config=config,
            lengths=tuple(lengths.tolist()),
            steps=_steps_from_columns(cols, config, meta, lengths),
            dropped=_ints_of(meta["dropped"], "dropped"),
            origins=tuple(map(tuple, origins.tolist())),
        )
        _check_hash(plan, meta["hash"])
        return plan.validate()

    def write_parquet(self, path: str | Path) -> None:
        import pyarrow.parquet as pq

        with atomic_write(path) as f:
            pq.write_table(self.to_table(), f)

    @classmethod
    def read_parquet(cls, path: str | Path) -> Plan:
        """A plan from a Parquet file (:meth:`from_table`); every error names the file.

        Raises:
            PlanError: not a readable Parquet file, a directory, or not a valid plan.
            FileNotFoundError: no file at ``path``.
        """
        import pyarrow.parquet as pq

        if Path(path).is_dir():
            raise PlanError(f"plan file {Path(path)} is a directory")
        if not Path(path).exists():
            raise FileNotFoundError(f"no plan file at {path}")
        try:
            table = pq.read_table(str(path))
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise PlanError(f"cannot read plan file {path}: {exc}") from exc
        try:
            return cls.from_table(table)
        except (PlanError, UnicodeDecodeError) as exc:  # damaged bytes can leave names undecodable
            raise PlanError(f"plan file {path}: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path``, by suffix: ``.json`` as JSON, anything else as Parquet.

        Args:
            path: the file to write. It is written under a temporary name and renamed into place,
                so an existing file is replaced whole or not at all. Both formats carry the
                content hash, which :meth:`load` checks.

        Raises:
            OSError: the file cannot be written (a directory, a missing folder). Parquet needs ``pyarrow``.
        """
        if str(path).endswith(".json"):
            self.to_json(path)
        else:
            self.write_parquet(path)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save` (``.json`` as JSON, anything else as Parquet).

        Args:
            path: the plan file.

        Returns:
            The plan, its content hash checked against the stored one and every invariant of
            :meth:`validate` checked: a plan that loads is a valid plan.

        Raises:
            PlanError: not a ringpack plan, an unsupported format version, an unreadable file,
                a missing, unknown or mistyped key, a hash mismatch (a corrupt or edited file) or
                a broken invariant; the message names the file.
            FileNotFoundError: no file at ``path``.
        """
        return cls.from_json(path) if str(path).endswith(".json") else cls.read_parquet(path)


def plan_content_hash(
    config: PlanConfig, lengths: Any, dropped: Any, origins: Any, arrays: dict[str, np.ndarray]
) -> str:
    """:attr:`Plan.content_hash` of the plan with these fields and piece table (``Plan.piece_arrays``
    columns, rows in plan order): for tools that build the table without the plan's objects."""
    h = hashlib.sha256()
    h.update(f"ringpack-plan-v{FORMAT_VERSION}\n".encode())
    h.update(json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":")).encode())
    h.update(np.asarray(lengths, dtype="<i8").tobytes())
    h.update(b"|dropped|" + np.asarray(dropped, dtype="<i8").tobytes())
    h.update(b"|origins|" + np.asarray(origins, dtype="<i8").tobytes())
    for name in TABLE_COLUMNS:
        h.update(f"|{name}|".encode() + np.asarray(arrays[name]).astype("<i8").tobytes())
    return h.hexdigest()


def new_rank_shard(
    slot_pieces: Sequence[tuple[int, int, int]], samples: Sequence[int], _new=object.__new__
) -> RankShard:
    """``RankShard(tuple(Piece(samples[k], start, stop) for k, start, stop in slot_pieces))``, faster.

    For the planner's hot loop: the frozen dataclass ``__init__`` sets each field through
    ``object.__setattr__``; this fills the instance dicts directly. The result is an ordinary
    :class:`RankShard` of ordinary :class:`Piece` objects (same fields, equality, hash, repr).
    """
    pieces = []
    append = pieces.append
    for k, start, stop in slot_pieces:
        piece = _new(Piece)
        d = piece.__dict__
        d["sample"] = samples[k]
        d["start"] = start
        d["stop"] = stop
        append(piece)
    shard = _new(RankShard)
    shard.__dict__["pieces"] = tuple(pieces)
    return shard


def _piece_columns(shards: Sequence[RankShard]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """:attr:`MicroBatch.piece_columns` of ``shards``: C-level maps over the pieces, one field at a
    time (lists of ints: nothing for the cyclic collector to track), types checked per distinct type."""
    if any(not issubclass(kind, RankShard) for kind in set(map(type, shards))):
        raise TypeError("every shard must be a RankShard")
    per_rank = [shard.pieces for shard in shards]
    counts = np.fromiter(map(len, per_rank), dtype=np.int64, count=len(per_rank))
    pieces = list(chain.from_iterable(per_rank))
    if any(not issubclass(kind, Piece) for kind in set(map(type, pieces))):
        raise TypeError("every piece must be a Piece")
    columns = []
    for name in ("sample", "start", "stop"):
        values = list(map(attrgetter(name), pieces))
        if not all(map(_is_int_type, set(map(type, values)))):
            raise TypeError(f"every piece's {name} must be an integer")
        columns.append(np.fromiter(values, dtype=np.int64, count=len(values)))
    rank = np.repeat(np.arange(len(per_rank), dtype=np.int64), counts)
    return rank, columns[0], columns[1], columns[2]


def _is_int_type(kind: type) -> bool:
    return issubclass(kind, (int, np.integer)) and not issubclass(kind, (bool, np.bool_))


def microbatch_from_shards(
    samples: Sequence[int], shards: Sequence[Sequence[Piece]], lengths: Sequence[int]
) -> MicroBatch:
    """Build a MicroBatch, putting each shard's pieces in canonical order and deriving loss tokens."""
    slot_of = {sample: k for k, sample in enumerate(samples)}
    ordered = tuple(
        RankShard(tuple(sorted(shard, key=lambda p: (slot_of.get(p.sample, -1), p.start)))) for shard in shards
    )
    loss_tokens = int(sum(int(lengths[s]) - 1 for s in samples))
    return MicroBatch(samples=tuple(int(s) for s in samples), shards=ordered, loss_tokens=loss_tokens)


# ------------------------------------------------------------------ reading plan files
_JSON_KEYS = ("format", "version", "hash", "config", "lengths", "steps")
_TABLE_META_KEYS = ("format", "version", "hash", "config", "num_steps", "lower_bounds", "dropped")
#: ``from_table``: rank shards allowed per piece row (over a floor), so metadata cannot make a few
#: rows allocate millions of empty shards.
_SHARDS_PER_ROW = 64
_MIN_SHARD_BUDGET = 1 << 22


def _check_format(meta: dict[str, Any]) -> None:
    if meta["format"] != "ringpack-plan":
        raise PlanError(f"not a ringpack plan (format {meta['format']!r}, want 'ringpack-plan')")
    if meta["version"] != FORMAT_VERSION:
        raise PlanError(f"plan format version {meta['version']!r} is not supported (want {FORMAT_VERSION})")


def _int(value: Any, where: str) -> int:
    """``value`` as an int: an integer (not a bool, not a float) that fits in 64 bits."""
    if not is_int(value):
        raise PlanError(f"{where} must be an integer, got {value!r:.60}")
    if not -INT64_LIMIT <= int(value) < INT64_LIMIT:
        raise PlanError(f"{where} = {int(value)} does not fit in 64 bits")
    return int(value)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise PlanError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _ints_of(values: Any, where: str) -> tuple[int, ...]:
    return tuple(_int(x, f"{where}[{k}]") for k, x in enumerate(_list(values, where)))


def _origin(value: Any, where: str) -> tuple[int, int]:
    pair = _ints_of(value, where)
    if len(pair) != 2:
        raise PlanError(f"{where} must be [input_sample, offset], got {value!r:.60}")
    return pair[0], pair[1]


def _lower_bound(value: Any, where: str) -> float | None:
    if value is not None and not is_finite(value):
        raise PlanError(f"{where} must be a finite number or null, got {value!r:.60}")
    return value


def _step_from_dict(data: Any, where: str) -> Step:
    check_keys(data, where, required=("microbatches",), optional=("lower_bound",))
    ranks = _list(data["microbatches"], f"{where}.microbatches")
    return Step(
        microbatches=tuple(
            tuple(
                _microbatch_from_dict(mb, f"{where}.microbatches[{d}][{i}]")
                for i, mb in enumerate(_list(rank, f"{where}.microbatches[{d}]"))
            )
            for d, rank in enumerate(ranks)
        ),
        lower_bound=_lower_bound(data.get("lower_bound"), f"{where}.lower_bound"),
    )


def _microbatch_from_dict(data: Any, where: str) -> MicroBatch:
    check_keys(data, where, required=("samples", "loss_tokens", "shards"))
    shards = []
    for c, shard in enumerate(_list(data["shards"], f"{where}.shards")):
        pieces = []
        for k, piece in enumerate(_list(shard, f"{where}.shards[{c}]")):
            triple = _ints_of(piece, f"{where}.shards[{c}][{k}]")
            if len(triple) != 3:
                raise PlanError(f"{where}.shards[{c}][{k}] must be [sample, start, stop], got {piece!r:.60}")
            pieces.append(Piece(*triple))
        shards.append(RankShard(tuple(pieces)))
    return MicroBatch(
        samples=_ints_of(data["samples"], f"{where}.samples"),
        shards=tuple(shards),
        loss_tokens=_int(data["loss_tokens"], f"{where}.loss_tokens"),
    )


def _check_hash(plan: Plan, stored: Any) -> None:
    if not isinstance(stored, str):
        raise PlanError(f"the plan's hash must be a string, got {stored!r:.60}")
    if stored != plan.content_hash:
        raise PlanError(
            f"plan hash mismatch: file says {stored[:12]}..., content gives {plan.content_hash[:12]}... "
            "(corrupt or edited)"
        )


def _int64_blob(metadata: dict, key: bytes, width: int) -> np.ndarray:
    """A little-endian int64 array of ``width`` columns stored under ``key`` in the table's metadata."""
    blob = metadata.get(key, b"")
    if len(blob) % (8 * width):
        raise PlanError(f"metadata {key.decode()} has {len(blob)} bytes, not a whole number of {8 * width}-byte rows")
    return np.frombuffer(blob, dtype="<i8").astype(np.int64).reshape(-1, width)


def _table_metadata(table: pa.Table) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The plan metadata of a piece table: the JSON document, the lengths and the origins (``[N, 2]``)."""
    metadata = table.schema.metadata or {}
    if b"ringpack.shard_plan" not in metadata or b"ringpack.lengths" not in metadata:
        raise PlanError("table carries no ringpack plan metadata")
    try:
        meta = json.loads(metadata[b"ringpack.shard_plan"])
    except (ValueError, RecursionError) as exc:
        raise PlanError(f"plan metadata is not valid JSON: {exc}") from exc
    check_keys(meta, "plan metadata", required=_TABLE_META_KEYS)
    _check_format(meta)
    return meta, _int64_blob(metadata, b"ringpack.lengths", 1)[:, 0], _int64_blob(metadata, b"ringpack.origins", 2)


def _table_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """The piece table's columns as int64 arrays; exactly :data:`TABLE_COLUMNS`, integers, no nulls."""
    import pyarrow as pa

    if sorted(table.column_names) != sorted(TABLE_COLUMNS):
        raise PlanError(f"plan table has columns {table.column_names}, want {list(TABLE_COLUMNS)}")
    cols = {}
    for name in TABLE_COLUMNS:
        column = table.column(name)
        if not pa.types.is_integer(column.type) or column.null_count:
            raise PlanError(f"plan table column {name!r} must hold integers without nulls, got {column.type}")
        values = column.to_numpy()
        if values.dtype == np.uint64 and values.size and int(values.max()) >= INT64_LIMIT:
            raise PlanError(f"plan table column {name!r} holds values beyond 64-bit integers")
        cols[name] = values.astype(np.int64)
    return cols


def _check_table_counts(cols: dict[str, np.ndarray], config: PlanConfig, meta: dict[str, Any]) -> int:
    """Check the metadata's counts against the rows before anything is allocated; the number of steps."""
    num_steps = _int(meta["num_steps"], "num_steps")
    rows = len(cols["step"])
    for name, bound in (("step", num_steps), ("dp", config.dp), ("microbatch", rows), ("cp", config.cp)):
        bad = np.flatnonzero((cols[name] < 0) | (cols[name] >= bound))
        if bad.size:
            raise PlanError(f"piece row {int(bad[0])}: {name} {int(cols[name][bad[0]])} outside [0, {bound})")
    held = int(cols["step"].max()) + 1 if rows else 0
    if num_steps != held:
        raise PlanError(f"metadata says num_steps={num_steps}, the piece rows hold {held} steps")
    if num_steps * config.dp > rows:
        raise PlanError(f"{num_steps} steps x dp={config.dp} need a piece per DP rank and step, the table has {rows}")
    keys = np.unique(np.stack([cols["step"], cols["dp"], cols["microbatch"]], axis=1), axis=0)
    if len(keys) * config.cp > max(_MIN_SHARD_BUDGET, _SHARDS_PER_ROW * rows):
        raise PlanError(f"{len(keys)} micro-batches x cp={config.cp} rank shards for {rows} pieces (corrupt counts)")
    lower_bounds = _list(meta["lower_bounds"], "lower_bounds")
    if len(lower_bounds) != num_steps:
        raise PlanError(f"metadata has {len(lower_bounds)} lower bounds for {num_steps} steps")
    return num_steps


def _steps_from_columns(
    cols: dict[str, np.ndarray], config: PlanConfig, meta: dict[str, Any], lengths: np.ndarray
) -> tuple[Step, ...]:
    """The steps of a piece table whose counts :func:`_check_table_counts` has checked."""
    num_steps = _check_table_counts(cols, config, meta)
    order = np.lexsort((cols["start"], cols["slot"], cols["cp"], cols["microbatch"], cols["dp"], cols["step"]))
    cols = {k: v[order] for k, v in cols.items()}
    grouped: dict[tuple[int, int, int], dict[str, Any]] = {}
    for s, d, i, c, slot, sample, start, stop in zip(*(cols[name].tolist() for name in TABLE_COLUMNS)):
        mb = grouped.setdefault((s, d, i), {"slots": {}, "shards": [[] for _ in range(config.cp)]})
        if mb["slots"].setdefault(slot, sample) != sample:
            raise PlanError(f"step {s}, dp rank {d}, micro-batch {i}: slot {slot} holds two samples")
        mb["shards"][c].append(Piece(sample, start, stop))
    steps = []
    for s in range(num_steps):
        ranks = []
        for d in range(config.dp):
            mbs = []
            while (s, d, len(mbs)) in grouped:
                mb = grouped[(s, d, len(mbs))]
                samples = tuple(mb["slots"][k] for k in sorted(mb["slots"]))
                loss = sum(int(lengths[x]) - 1 for x in samples if 0 <= x < len(lengths))
                mbs.append(MicroBatch(samples, tuple(RankShard(tuple(p)) for p in mb["shards"]), loss))
            ranks.append(tuple(mbs))
        lower_bound = _lower_bound(meta["lower_bounds"][s], f"lower_bounds[{s}]")
        steps.append(Step(microbatches=tuple(ranks), lower_bound=lower_bound))
    built = sum(len(rank) for step in steps for rank in step.microbatches)
    if built != len(grouped):
        raise PlanError(f"{len(grouped) - built} micro-batches of the piece table do not follow 0, 1, 2, ... per rank")
    return tuple(steps)


def _int64_array(values: np.ndarray) -> Any:
    """``values`` as an Arrow int64 array, sharing their memory. Not ``pa.array``: it asks pandas
    whether the input is one of its types, which imports pandas (0.7 s) in a process that has not
    (a Ray driver writing ``plan.parquet``)."""
    import pyarrow as pa

    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])
