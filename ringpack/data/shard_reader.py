"""Stream one (DP rank, CP rank)'s micro-batches back from a shard directory, checked first (docs/data.md).

:class:`ShardReader` reads nothing through a symbolic link and accepts only plain file names
inside its directory. It checks the manifest against itself (one entry per file, every DP rank's
steps covered once, counts that add up), against the plan and against each file (size, sha256,
schema, row groups in plan order) before it yields a batch, and yields exactly the dicts
:class:`~ringpack.data.collator.PackedCollator` makes for the same plan. Every failure is one
:class:`DataError` naming the file and what disagrees.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ringpack._checks import is_bool, is_int
from ringpack._files import file_sha256, open_regular, refuse_link
from ringpack.attention.schedule import ScheduleOptions
from ringpack.data.collator import check_schedule_flag, rank_arrays, schedule_options_of, to_batch
from ringpack.data.shard_format import MANIFEST, PIECE_COLUMNS, PLAN_FILE, PROGRESS, SHARD_FORMAT_VERSION, plain_name
from ringpack.errors import DataError
from ringpack.mesh import mesh_coordinates
from ringpack.shard_plan import Plan

__all__ = ["ShardReader"]


class ShardReader:
    """Stream one (DP rank, CP rank)'s micro-batches back from a shard directory.

    Args:
        path: a directory :func:`write_shards` finished (it holds ``manifest.json``).
        dp_rank, cp_rank: this process's coordinates in the mesh the shards were written for.
        dp_size, cp_size: this job's mesh; when given, they must match the manifest's.
        verify: check each file's sha256 against the manifest before reading it.
        schedule, schedule_options: as for :class:`~ringpack.data.collator.PackedCollator`.

    Iterating yields exactly the dicts ``PackedCollator`` makes for the same plan (same keys,
    same tensors: int64 ``input_ids``/``labels``/``position_ids`` ``[T]``, int32 ``cu_seqlens``
    ``[P+1]``, ...), one per micro-batch of this DP rank, in plan order. ``state_dict`` /
    ``load_state_dict`` resume mid-epoch by seeking.

    Raises:
        DataError: a ``path`` that is not a str or path, ranks or sizes that are not
            non-negative integers, a ``verify`` that is not a bool, a bad ``schedule`` or
            ``schedule_options``; no finished shard directory (an interrupted run says so), a manifest of
            another format or mesh or one that disagrees with itself (a file name that is not a
            plain name in the directory, a file listed twice, a DP rank's steps not covered
            exactly once, counts that do not add up), ranks out of range; while reading: a
            missing, corrupt or truncated file (named), a manifest that disagrees with the plan,
            or row groups that disagree with the plan.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        dp_rank: int,
        cp_rank: int,
        *,
        dp_size: int | None = None,
        cp_size: int | None = None,
        verify: bool = True,
        schedule: Any = "auto",
        schedule_options: ScheduleOptions | None = None,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise DataError(f"path must be a shard directory (a str or os.PathLike), got {type(path).__name__}")
        for name, value in (("dp_rank", dp_rank), ("cp_rank", cp_rank), ("dp_size", dp_size), ("cp_size", cp_size)):
            if (value is not None or name.endswith("rank")) and not (is_int(value) and value >= 0):
                raise DataError(f"{name} must be a non-negative integer, got {value!r}")
        if not is_bool(verify):
            raise DataError(f"verify must be True or False, got {verify!r}")
        check_schedule_flag(schedule)
        self.path = Path(path)
        self.schedule_options = schedule_options_of(schedule_options, "ShardReader")
        manifest_path = refuse_link(self.path / MANIFEST, "manifest")
        if not manifest_path.is_file():
            hint = (
                " (an interrupted `ringpack shard` run: re-run it to resume)" if (self.path / PROGRESS).exists() else ""
            )
            raise DataError(f"no {MANIFEST} in {self.path}: not a finished ringpack shard directory{hint}")
        try:
            with open_regular(manifest_path, "manifest") as f:
                self.manifest = json.loads(f.read().decode("utf-8"))
        except DataError:
            raise
        except (ValueError, RecursionError) as exc:
            raise DataError(f"{manifest_path} is corrupt: {exc}") from exc
        m = self.manifest
        _check_manifest(m, manifest_path)
        if dp_size is not None and dp_size != m["dp"] or cp_size is not None and cp_size != m["cp"]:
            raise DataError(
                f"{self.path} was sharded for dp={m['dp']}, cp={m['cp']}; this job runs dp={dp_size}, cp={cp_size} "
                "(re-run `ringpack shard` with this job's sizes)"
            )
        if not 0 <= dp_rank < m["dp"]:
            raise DataError(f"dp_rank {dp_rank} outside [0, {m['dp']}) of {self.path}")
        if not 0 <= cp_rank < m["cp"]:
            raise DataError(f"cp_rank {cp_rank} outside [0, {m['cp']}) of {self.path}")
        self.dp_rank, self.cp_rank = int(dp_rank), int(cp_rank)
        self.verify = verify
        self.schedule = schedule
        self.files = sorted((f for f in m["files"] if f["dp_rank"] == self.dp_rank), key=lambda f: f["steps"][0])
        self._verified: set[str] = set()
        self._plan: Plan | None = None
        self._cursor = 0
        self._pending: int | None = None

    @classmethod
    def from_mesh(
        cls, path: str | os.PathLike, mesh: Any, *, dp_dim: str = "dp", cp_dim: str = "cp", **options: Any
    ) -> ShardReader:
        """The reader of this rank of a DeviceMesh with dimensions ``dp_dim`` and ``cp_dim``; the
        manifest's DP and CP sizes are checked against the mesh's. ``options``: as for the constructor."""
        c = mesh_coordinates(mesh, dp_dim, cp_dim)
        return cls(path, c.dp_rank, c.cp_rank, dp_size=c.dp_size, cp_size=c.cp_size, **options)

    # -------------------------------------------------------------- views
    @property
    def plan_hash(self) -> str:
        return self.manifest["plan_hash"]

    @property
    def num_steps(self) -> int:
        return self.manifest["num_steps"]

    def __len__(self) -> int:
        return sum(f["microbatches"] for f in self.files)

    def __repr__(self) -> str:
        dp, cp = self.manifest["dp"], self.manifest["cp"]
        return (
            f"ShardReader({str(self.path)!r}, dp_rank={self.dp_rank} of {dp}, cp_rank={self.cp_rank} of {cp}, "
            f"steps={self.num_steps}, microbatches={len(self)}, files={len(self.files)}, plan={self.plan_hash[:12]})"
        )

    def _check(self, entry: dict[str, Any]) -> Path:
        """The path of a manifest entry's file, checked: present, its sha256 (with ``verify``) and size."""
        path = refuse_link(self.path / entry["name"], "shard file")
        if not path.is_file():
            raise DataError(f"shard file {path} listed in the manifest is missing")
        if self.verify and entry["name"] not in self._verified:
            digest = file_sha256(path)
            if digest != entry["sha256"]:
                raise DataError(
                    f"checksum mismatch for {path}: sha256 {digest[:16]}..., manifest says {entry['sha256'][:16]}... "
                    "(corrupt or truncated)"
                )
            self._verified.add(entry["name"])
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise DataError(f"shard file {path} has {size} bytes, the manifest says {entry['bytes']} (truncated?)")
        return path

    @property
    def plan(self) -> Plan:
        """The plan of the shards (loaded from ``plan.parquet``, checked against the manifest)."""
        if self._plan is None:
            path = self._check(self.manifest["plan_file"])
            try:
                plan = Plan.read_parquet(path)
            except ValueError as exc:
                raise DataError(f"cannot read {path}: {exc}") from exc
            if plan.content_hash != self.plan_hash:
                raise DataError(
                    f"{path} holds plan {plan.content_hash[:12]}..., manifest says {self.plan_hash[:12]}..."
                )
            _check_manifest_against_plan(self.manifest, plan, self.path / MANIFEST)
            self._plan = plan
        return self._plan

    # ----------------------------------------------------------- iterate
    def __iter__(self) -> Iterator[dict[str, Any]]:
        start = self._pending if self._pending is not None else 0
        self._pending = None
        self._cursor = start
        plan = self.plan
        position = 0
        for entry in self.files:
            n = entry["microbatches"]
            if position + n <= start:
                position += n
                continue
            path = self._check(entry)
            pf = self._open(path, entry)
            order = [
                (s, i) for s in range(*entry["steps"]) for i in range(len(plan.steps[s].microbatches[self.dp_rank]))
            ]
            for g in range(max(0, start - position), n):
                try:
                    table = pf.read_row_group(g)
                except Exception as exc:
                    raise DataError(f"cannot read row group {g} of shard file {path}: {exc}") from exc
                batch = self._batch(plan, table, path, g, position + g, order[g])
                self._cursor = position + g + 1
                yield batch
            position += n

    def _open(self, path: Path, entry: dict[str, Any]) -> Any:
        """The ``ParquetFile`` of a shard, its schema, metadata and row-group count checked against the manifest."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(str(path))
            schema = pf.schema_arrow
            meta = json.loads((schema.metadata or {}).get(b"ringpack.shard", b"{}"))
        except Exception as exc:  # pyarrow raises several types for unreadable files
            raise DataError(f"cannot read shard file {path}: {exc}") from exc
        types = {name: schema.field(name).type for name in schema.names}
        ids = types.get("input_ids")
        if any(types.get(name) != pa.int64() for name in PIECE_COLUMNS) or not (
            ids is not None and pa.types.is_list(ids) and ids.value_type == pa.int32()
        ):
            raise DataError(f"shard file {path} does not have the shard schema (columns {schema.names})")
        want = {"plan_hash": self.plan_hash, "dp_rank": entry["dp_rank"], "steps": entry["steps"]}
        if not isinstance(meta, dict) or any(meta.get(k) != v for k, v in want.items()):
            raise DataError(
                f"shard file {path} holds another plan's, rank's or steps' shard (its metadata: {meta!r:.120})"
            )
        if pf.metadata.num_rows != entry["rows"]:
            raise DataError(f"shard file {path} has {pf.metadata.num_rows} rows, manifest says {entry['rows']}")
        if pf.metadata.num_row_groups != entry["microbatches"]:
            raise DataError(
                f"shard file {path} has {pf.metadata.num_row_groups} row groups, "
                f"manifest says {entry['microbatches']} micro-batches"
            )
        return pf

    def _batch(
        self, plan: Plan, table: Any, path: Path, group: int, position: int, expected: tuple[int, int]
    ) -> dict[str, Any]:
        where = f"{path} row group {group}"
        steps = table.column("step").to_numpy()
        indices = table.column("microbatch").to_numpy()
        if not len(steps) or (steps != expected[0]).any() or (indices != expected[1]).any():
            raise DataError(
                f"{where}: not all rows are of step {expected[0]} micro-batch {expected[1]}, as the plan says"
            )
        step, index = expected
        mb = plan.steps[step].microbatches[self.dp_rank][index]
        cp = table.column("cp").to_numpy()
        keep = np.flatnonzero(cp == self.cp_rank)
        starts = table.column("start").to_numpy()[keep]
        stops = table.column("stop").to_numpy()[keep]
        samples = table.column("sample").to_numpy()[keep]
        want = [(p.sample, p.start, p.stop) for p in mb.shards[self.cp_rank].pieces]
        if list(zip(samples.tolist(), starts.tolist(), stops.tolist())) != want:
            raise DataError(f"{path} row group {group}: pieces of cp rank {self.cp_rank} differ from the plan")
        ids = table.column("input_ids").combine_chunks()
        offs = ids.offsets.to_numpy().astype(np.int64)
        vals = ids.values.to_numpy(zero_copy_only=False).astype(np.int64)
        pieces = [vals[offs[k] : offs[k + 1]] for k in keep]
        if any(len(p) != b - a for p, a, b in zip(pieces, starts, stops)):
            raise DataError(
                f"{path} row group {group}: a piece's token count differs from its [start, stop) (corrupt file)"
            )
        nexts = table.column("next_token").to_numpy()[keep]
        arrays = rank_arrays(starts, pieces, nexts)
        meta = {
            "step_loss_tokens": int(plan.steps[step].loss_tokens),
            "epoch": int(plan.config.epoch),
            "step": step,
            "microbatch_index": index,
            "microbatches_in_step": len(plan.steps[step].microbatches[self.dp_rank]),
            "cursor": position + 1,
            "plan_hash": self.plan_hash,
        }
        options = self.schedule_options.with_node_size(plan.config.gpus_per_node, plan.config.max_partners)
        return to_batch(arrays, mb, self.cp_rank, meta, self.schedule, options=options)

    # -------------------------------------------------------------- state
    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        if cursor is None:
            cursor = self._pending if self._pending is not None else self._cursor
        if not is_int(cursor) or cursor < 0:
            raise DataError(f"cursor must be a non-negative integer (a batch's 'cursor'), got {cursor!r}")
        return {"version": SHARD_FORMAT_VERSION, "plan_hash": self.plan_hash, "cursor": int(cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to ``state`` (:meth:`state_dict`): the next ``iter()`` yields from its cursor on.

        Raises:
            DataError: not a reader state, another plan's, or a cursor that is not an integer in
                ``[0, len(self)]``.
        """
        if not isinstance(state, dict) or state.get("version") != SHARD_FORMAT_VERSION:
            raise DataError(f"not a ShardReader state (version {SHARD_FORMAT_VERSION}): {state!r:.200}")
        if state.get("plan_hash") != self.plan_hash:
            raise DataError(
                f"reader state is for plan {str(state.get('plan_hash'))[:12]}..., "
                f"these shards hold {self.plan_hash[:12]}..."
            )
        cursor = state.get("cursor")
        if not is_int(cursor):
            raise DataError(f"reader state cursor must be an integer, got {cursor!r}")
        if not 0 <= cursor <= len(self):
            raise DataError(f"reader state cursor {cursor} outside [0, {len(self)}]")
        self._cursor = self._pending = cursor


# ------------------------------------------------------------------------------ manifest checks
def _field(data: Any, key: str, where: str, low: int | None = 0) -> Any:
    """``data[key]``, which must exist; an integer ``>= low`` unless ``low`` is ``None`` (any value)."""
    if not isinstance(data, dict) or key not in data:
        raise DataError(f"{where} lacks {key!r}")
    value = data[key]
    if low is not None and (not is_int(value) or value < low):
        raise DataError(f"{where}: {key} must be an integer >= {low}, got {value!r:.60}")
    return value


def _check_manifest(m: Any, where: Path) -> None:
    """Check a manifest against itself before any shard is read.

    Types and plain file names, one entry per file, ``dp``/``cp`` equal to its config's, every DP
    rank's steps covered by its files exactly once, and each file's micro-batches and row groups
    equal to the steps it covers. Raises :class:`DataError` naming the manifest and the entry.
    """
    if not isinstance(m, dict) or m.get("format") != "ringpack-shards" or m.get("version") != SHARD_FORMAT_VERSION:
        raise DataError(f"{where}: not a ringpack shard manifest of version {SHARD_FORMAT_VERSION}")
    num_steps = _field(m, "num_steps", str(where))
    dp, cp = _field(m, "dp", str(where), low=1), _field(m, "cp", str(where), low=1)
    config = _field(m, "config", str(where), low=None)
    if not isinstance(config, dict) or (config.get("dp"), config.get("cp")) != (dp, cp):
        raise DataError(f"{where}: dp={dp}, cp={cp} disagree with its config")
    if not isinstance(_field(m, "plan_hash", str(where), low=None), str):
        raise DataError(f"{where}: plan_hash must be a string")
    per_step = _field(m, "microbatches_per_step", str(where), low=None)
    if not isinstance(per_step, list) or len(per_step) != num_steps or not all(is_int(x) and x > 0 for x in per_step):
        raise DataError(f"{where}: microbatches_per_step must list a positive count for each of {num_steps} steps")
    files = _field(m, "files", str(where), low=None)
    if not isinstance(files, list):
        raise DataError(f"{where}: files must be a list")
    names = [_check_entry(_field(m, "plan_file", str(where), low=None), f"{where}, plan_file")]
    for k, entry in enumerate(files):
        names.append(_check_entry(entry, f"{where}, files[{k}]"))
        _check_file_steps(entry, f"{where}, files[{k}] ({entry['name']})", dp, per_step)
    twice = sorted({n for n in names if names.count(n) > 1} | ({MANIFEST} & set(names)))
    if twice:
        raise DataError(f"{where}: {twice[0]!r} is listed twice (or is the manifest itself)")
    _check_coverage(files, dp, num_steps, where)


def _check_entry(entry: Any, where: str) -> str:
    """A file entry's common fields (plain name, byte count, sha256); its name."""
    name = plain_name(_field(entry, "name", where, low=None), where)
    _field(entry, "bytes", where)
    digest = _field(entry, "sha256", where, low=None)
    if not isinstance(digest, str) or len(digest) != 64:
        raise DataError(f"{where}: sha256 must be 64 hex digits, got {digest!r:.80}")
    return name


def _check_file_steps(entry: dict[str, Any], where: str, dp: int, per_step: list[int]) -> None:
    """A shard entry's DP rank and step range, and its micro-batch and row-group counts against them."""
    rank = _field(entry, "dp_rank", where)
    if rank >= dp:
        raise DataError(f"{where}: dp_rank {rank} outside [0, {dp})")
    steps = _field(entry, "steps", where, low=None)
    if not (isinstance(steps, list) and len(steps) == 2 and all(is_int(x) for x in steps)):
        raise DataError(f"{where}: steps must be [first, end), got {steps!r:.60}")
    lo, hi = steps
    if not 0 <= lo <= hi <= len(per_step):
        raise DataError(f"{where}: steps [{lo}, {hi}) outside the plan's [0, {len(per_step)})")
    want = sum(per_step[lo:hi])
    for key in ("microbatches", "row_groups"):
        if _field(entry, key, where) != want:
            raise DataError(f"{where}: {key} is {entry[key]}, steps [{lo}, {hi}) hold {want} micro-batches")
    _field(entry, "rows", where)
    _field(entry, "tokens", where)


def _check_coverage(files: list[dict[str, Any]], dp: int, num_steps: int, where: Path) -> None:
    """Every DP rank's files cover steps ``[0, num_steps)`` exactly once."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for entry in files:
        spans.setdefault(entry["dp_rank"], []).append(tuple(entry["steps"]))
    if num_steps and len(spans) != dp:
        missing = next(d for d in range(dp) if d not in spans)  # dp <= len(files) here
        raise DataError(f"{where}: no file holds dp rank {missing}'s steps")
    for rank, ranges in spans.items():
        end = 0
        for lo, hi in sorted(ranges):
            if lo != end:
                what = "are in two files" if lo < end else "are in no file"
                raise DataError(f"{where}: dp rank {rank}'s steps [{min(lo, end)}, {max(lo, end)}) {what}")
            end = hi
        if end != num_steps:
            raise DataError(f"{where}: dp rank {rank}'s steps [{end}, {num_steps}) are in no file")


def _check_manifest_against_plan(m: dict[str, Any], plan: Plan, where: Path) -> None:
    """The manifest's mesh, steps, micro-batch and token counts equal the plan's."""
    config = plan.config
    per_step = [len(step.microbatches[0]) for step in plan.steps]
    mine = {
        "dp": config.dp,
        "cp": config.cp,
        "num_steps": plan.num_steps,
        "microbatches_per_step": per_step,
        "step_loss_tokens": [step.loss_tokens for step in plan.steps],
    }
    for key, value in mine.items():
        if m.get(key) != value:
            raise DataError(f"{where}: {key} disagrees with the plan in {PLAN_FILE}")
    for entry in m["files"]:
        lo, hi = entry["steps"]
        tokens = sum(mb.num_tokens for s in range(lo, hi) for mb in plan.steps[s].microbatches[entry["dp_rank"]])
        if entry["tokens"] != tokens:
            raise DataError(f"{where}: {entry['name']} has {entry['tokens']} tokens, the plan gives it {tokens}")
