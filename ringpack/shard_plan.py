"""The shard plan: the one contract between the balancer, the dataloaders and the attention runtime.

DESIGN.md section 1. A plan says, for every step, which DP rank processes which micro-batches, and
for every micro-batch which token ranges ("pieces") of which samples each CP rank holds. Plans are
plain frozen dataclasses: they serialise to JSON and to an Arrow/Parquet table of pieces, carry a
content hash that is identical on every process and machine, and are never pickled.

Invariants checked by :meth:`Plan.validate` (each names the offending step, DP rank, micro-batch,
CP rank or sample):

* config: ``dp, cp, tokens_per_rank >= 1``; every sample length ``>= 1``;
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
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ringpack.cost import CostModel
from ringpack.errors import PlanError

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
]

FORMAT_VERSION = 1
#: CP split strategies, packings and overflow policies a :class:`PlanConfig` accepts.
STRATEGIES = ("balanced", "zigzag", "contiguous")
PACKINGS = ("balanced", "first_fit")
OVERFLOW_POLICIES = ("error", "split", "drop")
TABLE_COLUMNS = ("step", "dp", "microbatch", "cp", "slot", "sample", "start", "stop")


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


@dataclass(frozen=True)
class MicroBatch:
    """Samples one CP group runs in one forward/backward; ``shards[r]`` is CP rank ``r``'s share.

    ``samples`` fixes the canonical order: pieces on every rank are sorted by their sample's
    position here, then by ``start``.
    """

    samples: tuple[int, ...]
    shards: tuple[RankShard, ...]
    loss_tokens: int

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


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


#: The default pair-price range of plans made with a FLOP cost model (:attr:`PlanConfig.price_range`):
#: on GPUs attention kernels run at roughly half the FLOP rate of the linear layers, and how far
#: depends on the kernel, the head shape and the lengths.
FLOP_PRICE_RANGE: tuple[float, float] = (0.25, 2.0)
#: The ``balanced`` split's default token guard when prices are uncertain: with every CP rank's
#: tokens within 2% of the mean and its cost within 0.1% at the model's price, its pairs are
#: balanced too, so the split stays balanced at any price of a pair.
ROBUST_TOKEN_SLACK = 0.02


def _price_range(value: Any) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in value)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"PlanConfig.pair_price_range must be a pair (low, high), got {value!r}") from exc
    if not (0 < low <= 1.0 <= high < float("inf")):
        raise PlanError(f"PlanConfig.pair_price_range must satisfy 0 < low <= 1 <= high < inf, got {value!r}")
    return low, high


@dataclass(frozen=True)
class PlanConfig:
    """Everything that decides a plan besides the sample lengths (a plan is a pure function of both).

    ``samples_per_step`` is the global batch in samples (``0``: all samples in one step);
    ``microbatches_per_rank`` fixes how many micro-batches each DP rank runs per step (``0``:
    the fewest that hold the tokens, plus one when the token budget would otherwise keep the step
    more than 1% above its lower bound). ``packing`` is ``"balanced"`` (cost-driven) or
    ``"first_fit"`` (token-count first fit, the common baseline).

    Price robustness: ``pair_price_range = (low, high)`` says how far the true price of an
    attention pair may lie from the cost model's, as factors (``(0.25, 2.0)``: a quarter to twice
    the model's price). Packing balances every DP rank at both ends of the range, and the
    ``balanced`` split holds every CP rank's tokens within ``1 + cp_token_slack`` of the
    micro-batch's mean, so the plan stays balanced whatever the true price within the range. The
    default (``None``) is :data:`FLOP_PRICE_RANGE` for a FLOP model (``cost.unit == "flop"``),
    whose price of a pair is only an estimate, and exact prices ``(1.0, 1.0)`` for a measured
    model (``"s"``: a calibrated profile or one learned from the run). ``cp_token_slack=None``
    means :data:`ROBUST_TOKEN_SLACK` when the range is not exact and no token guard when it is.
    """

    dp: int
    cp: int
    tokens_per_rank: int
    strategy: str = "balanced"
    packing: str = "balanced"
    samples_per_step: int = 0
    microbatches_per_rank: int = 0
    seed: int = 0
    epoch: int = 0
    overflow: str = "error"
    solver_time_limit_s: float = 0.0
    cp_token_slack: float | None = None
    cost: CostModel = field(default_factory=lambda: CostModel.preset("llama3-8b"))
    pair_price_range: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "cp", "tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise PlanError(f"PlanConfig.{name} must be a positive integer, got {value!r}")
        for name in ("samples_per_step", "microbatches_per_rank", "seed", "epoch"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 0:
                raise PlanError(f"PlanConfig.{name} must be a non-negative integer, got {value!r}")
        if self.strategy not in STRATEGIES:
            raise PlanError(f"PlanConfig.strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.packing not in PACKINGS:
            raise PlanError(f"PlanConfig.packing must be one of {PACKINGS}, got {self.packing!r}")
        if self.overflow not in OVERFLOW_POLICIES:
            raise PlanError(f"PlanConfig.overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if self.solver_time_limit_s < 0:
            raise PlanError("PlanConfig.solver_time_limit_s must be >= 0")
        if self.cp_token_slack is not None and not (
            isinstance(self.cp_token_slack, (int, float)) and 0 <= self.cp_token_slack < float("inf")
        ):
            raise PlanError(
                f"PlanConfig.cp_token_slack must be None or a finite number >= 0, got {self.cp_token_slack!r}"
            )
        if self.pair_price_range is not None:
            object.__setattr__(self, "pair_price_range", _price_range(self.pair_price_range))

    @property
    def price_range(self) -> tuple[float, float]:
        """The pair-price range the plan is balanced for (``pair_price_range`` with its default resolved)."""
        if self.pair_price_range is not None:
            return self.pair_price_range
        return FLOP_PRICE_RANGE if self.cost.unit == "flop" else (1.0, 1.0)

    @property
    def token_slack(self) -> float | None:
        """The ``balanced`` split's token guard (``cp_token_slack`` with its default resolved)."""
        if self.cp_token_slack is not None:
            return float(self.cp_token_slack)
        return None if self.price_range == (1.0, 1.0) else ROBUST_TOKEN_SLACK

    @property
    def group_capacity(self) -> int:
        """Tokens one CP group can hold in one micro-batch."""
        return self.cp * self.tokens_per_rank

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["cost"] = self.cost.to_dict()
        if self.pair_price_range is None:
            del out["pair_price_range"]  # the default: plan files and hashes carry set fields only
        else:
            out["pair_price_range"] = list(self.pair_price_range)
        return {k: (int(v) if isinstance(v, np.integer) else v) for k, v in out.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PlanConfig:
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise PlanError(f"unknown PlanConfig fields {sorted(unknown)}")
        if "cost" in data:
            data["cost"] = CostModel.from_dict(data["cost"])
        return cls(**data)


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
        return self.steps[step].microbatches[dp_rank][index]

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
        h = hashlib.sha256()
        h.update(f"ringpack-plan-v{FORMAT_VERSION}\n".encode())
        h.update(json.dumps(self.config.to_dict(), sort_keys=True, separators=(",", ":")).encode())
        h.update(np.asarray(self.lengths, dtype="<i8").tobytes())
        h.update(b"|dropped|" + np.asarray(self.dropped, dtype="<i8").tobytes())
        h.update(b"|origins|" + np.asarray(self.origins, dtype="<i8").tobytes())
        arrays = self.piece_arrays
        for name in TABLE_COLUMNS:
            h.update(f"|{name}|".encode() + arrays[name].astype("<i8").tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------ validation
    def validate(self) -> Plan:
        """Check every invariant of the module docstring.

        Returns:
            ``self``, so calls chain (``Plan.load(path).validate()``).

        Raises:
            PlanError: the first broken invariant, naming its step, DP rank, micro-batch, CP rank
                or sample.
        """
        cfg = self.config
        lengths = np.asarray(self.lengths, dtype=np.int64)
        bad = np.flatnonzero(lengths < 1)
        if bad.size:
            raise PlanError(f"sample {int(bad[0])} has length {int(lengths[bad[0]])}; lengths must be >= 1")
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
        if data.get("format") != "ringpack-plan":
            raise PlanError("not a ringpack plan (missing format='ringpack-plan')")
        if data.get("version") != FORMAT_VERSION:
            raise PlanError(f"plan format version {data.get('version')} is not supported (want {FORMAT_VERSION})")
        steps = tuple(
            Step(
                microbatches=tuple(
                    tuple(
                        MicroBatch(
                            samples=tuple(int(x) for x in mb["samples"]),
                            shards=tuple(
                                RankShard(tuple(Piece(int(a), int(b), int(c)) for a, b, c in shard))
                                for shard in mb["shards"]
                            ),
                            loss_tokens=int(mb["loss_tokens"]),
                        )
                        for mb in rank
                    )
                    for rank in step["microbatches"]
                ),
                lower_bound=step.get("lower_bound"),
            )
            for step in data["steps"]
        )
        plan = cls(
            config=PlanConfig.from_dict(data["config"]),
            lengths=tuple(int(x) for x in data["lengths"]),
            steps=steps,
            dropped=tuple(int(x) for x in data.get("dropped", ())),
            origins=tuple((int(a), int(b)) for a, b in data.get("origins", ())),
        )
        _check_hash(plan, data.get("hash"))
        return plan

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))

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
        return pa.table({name: arrays[name] for name in TABLE_COLUMNS}, schema=schema)

    @classmethod
    def from_table(cls, table: pa.Table) -> Plan:
        metadata = table.schema.metadata or {}
        if b"ringpack.shard_plan" not in metadata:
            raise PlanError("table carries no ringpack plan metadata")
        meta = json.loads(metadata[b"ringpack.shard_plan"])
        if meta.get("version") != FORMAT_VERSION:
            raise PlanError(f"plan format version {meta.get('version')} is not supported (want {FORMAT_VERSION})")
        missing = [name for name in TABLE_COLUMNS if name not in table.column_names]
        if missing:
            raise PlanError(f"plan table lacks columns {missing}")
        config = PlanConfig.from_dict(meta["config"])
        lengths = np.frombuffer(metadata[b"ringpack.lengths"], dtype="<i8")
        cols = {name: table.column(name).to_numpy().astype(np.int64) for name in TABLE_COLUMNS}
        steps = _steps_from_columns(cols, config, meta["num_steps"], meta["lower_bounds"], lengths)
        origins = np.frombuffer(metadata.get(b"ringpack.origins", b""), dtype="<i8").reshape(-1, 2)
        plan = cls(
            config=config,
            lengths=tuple(int(x) for x in lengths),
            steps=steps,
            dropped=tuple(meta["dropped"]),
            origins=tuple((int(a), int(b)) for a, b in origins),
        )
        _check_hash(plan, meta.get("hash"))
        return plan

    def write_parquet(self, path: str | Path) -> None:
        import pyarrow.parquet as pq

        pq.write_table(self.to_table(), str(path))

    @classmethod
    def read_parquet(cls, path: str | Path) -> Plan:
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(str(path))
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise PlanError(f"cannot read plan file {path}: {exc}") from exc
        return cls.from_table(table)

    def save(self, path: str | Path) -> None:
        """Write the plan to ``path``, by suffix: ``.json`` as JSON, anything else as Parquet.

        Args:
            path: the file to write (replaced if it exists). Both formats carry the content hash,
                which :meth:`load` checks.

        Raises:
            OSError: the file cannot be written. Parquet needs ``pyarrow``.
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
            The plan, its content hash checked against the stored one. Not validated: call
            :meth:`validate` for a file from an untrusted source.

        Raises:
            PlanError: not a ringpack plan, an unsupported format version, an unreadable Parquet
                file, or a hash mismatch (a corrupt or edited file).
            FileNotFoundError: no JSON file at ``path``.
        """
        return cls.from_json(path) if str(path).endswith(".json") else cls.read_parquet(path)


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


def _check_hash(plan: Plan, stored: str | None) -> None:
    if stored is not None and stored != plan.content_hash:
        raise PlanError(
            f"plan hash mismatch: file says {stored[:12]}..., content gives {plan.content_hash[:12]}... "
            "(corrupt or edited)"
        )


def _steps_from_columns(
    cols: dict[str, np.ndarray], config: PlanConfig, num_steps: int, lower_bounds: list, lengths: np.ndarray
) -> tuple[Step, ...]:
    order = np.lexsort((cols["start"], cols["slot"], cols["cp"], cols["microbatch"], cols["dp"], cols["step"]))
    cols = {k: v[order] for k, v in cols.items()}
    grouped: dict[tuple[int, int, int], dict[str, Any]] = {}
    for s, d, i, c, slot, sample, start, stop in zip(*(cols[name].tolist() for name in TABLE_COLUMNS)):
        mb = grouped.setdefault((s, d, i), {"slots": {}, "shards": [[] for _ in range(config.cp)]})
        if not 0 <= c < config.cp:
            raise PlanError(f"step {s}, dp rank {d}, micro-batch {i}: cp rank {c} outside [0, {config.cp})")
        mb["slots"][slot] = sample
        mb["shards"][c].append(Piece(sample, start, stop))
    steps = []
    for s in range(num_steps):
        ranks = []
        for d in range(config.dp):
            mbs = []
            i = 0
            while (s, d, i) in grouped:
                mb = grouped[(s, d, i)]
                samples = tuple(mb["slots"][k] for k in sorted(mb["slots"]))
                mbs.append(
                    MicroBatch(
                        samples=samples,
                        shards=tuple(RankShard(tuple(p)) for p in mb["shards"]),
                        loss_tokens=int(sum(int(lengths[x]) - 1 for x in samples if 0 <= x < len(lengths))),
                    )
                )
                i += 1
            ranks.append(tuple(mbs))
        steps.append(Step(microbatches=tuple(ranks), lower_bound=lower_bounds[s] if s < len(lower_bounds) else None))
    return tuple(steps)
