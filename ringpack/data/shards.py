"""Balanced Parquet shards: preprocess a dataset once (``ringpack shard``), stream it back (:class:`ShardReader`).

Layout of an output directory::

    manifest.json                       written last: plan hash, config, files, row counts, sha256s
    plan.parquet                        the plan (Plan.write_parquet), for the attention schedule
    dp00000-of-00002.parquet            one file per DP rank ...
    dp00000-of-00002-steps-000000-000009.parquet   ... or per DP rank and step range (steps_per_file)

Each shard file has one row per *piece* (``step, microbatch, cp, slot, sample, row, start, stop,
next_token, input_ids``) and one row group per micro-batch, in plan order; ``input_ids`` holds the
piece's tokens and ``next_token`` the token after the piece in its sample (``-100`` at a sample's
end), which is all a CP rank needs to rebuild exactly the tensors :class:`PackedCollator` makes.
``row`` is the dataset row the piece came from (``sample`` is the plan's sample; they differ only
when ``overflow="split"`` cut long rows into documents).

Crash safety and determinism: every file is written under a temporary name and ``os.replace``-d
into place; ``_progress.json`` records each finished file's sha256; ``manifest.json`` is written
last (also atomically), so a directory without a manifest is never taken for a finished one.
Re-running with the same inputs resumes (files whose checksum matches are kept) and produces
byte-identical files (fixed writer options, no statistics, no timestamps). A directory holding
shards of another plan or dataset is refused unless ``overwrite=True``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.data.collator import IGNORE_INDEX, check_schedule_options, rank_arrays, to_batch
from ringpack.lengths import DataError, lengths_from_dataset
from ringpack.shard_plan import MicroBatch, Plan, PlanConfig

__all__ = [
    "write_shards",
    "ShardReader",
    "load_source",
    "tokenize_dataset",
    "regex_token_ids",
    "file_sha256",
    "MANIFEST",
    "SHARD_FORMAT_VERSION",
]

MANIFEST = "manifest.json"
PROGRESS = "_progress.json"
PLAN_FILE = "plan.parquet"
SHARD_FORMAT_VERSION = 1
_COLUMNS = ("step", "microbatch", "cp", "slot", "sample", "row", "start", "stop", "next_token")
_WRITE_OPTIONS = dict(
    compression="zstd", compression_level=3, write_statistics=False, use_dictionary=False, version="2.6"
)


# ------------------------------------------------------------------------------------- helpers
def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_json(path: Path, obj: Any) -> None:
    _atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def regex_token_ids(text: str, vocab_size: int = 65536) -> list[int]:
    """Token ids for the regex pre-tokenizer of :mod:`corpus`: ``blake2b-64(token) mod vocab_size``.

    A stable hash (identical on every machine and Python version, unlike ``hash()``); distinct
    tokens may share an id (a hashed vocabulary). Use ``--tokenizer tokenizer.json`` for a real
    model's ids.
    """
    from ringpack.data.corpus import regex_tokenize

    cache: dict[str, int] = {}
    out = []
    for tok in regex_tokenize(text or ""):
        tid = cache.get(tok)
        if tid is None:
            digest = hashlib.blake2b(tok.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            tid = cache[tok] = int.from_bytes(digest, "little") % vocab_size
        out.append(tid)
    return out


class _TokenizeMap:
    """Picklable batched ``map`` function: texts -> ``input_ids`` (regex-hash ids or a tokenizer.json)."""

    def __init__(self, tokenizer: Any, vocab_size: int, column: str) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.column = column
        self._tok = None

    def __getstate__(self) -> dict:
        return {"tokenizer": self.tokenizer, "vocab_size": self.vocab_size, "column": self.column, "_tok": None}

    def __call__(self, texts: list[str]) -> dict[str, list[list[int]]]:
        if self.tokenizer in (None, "regex"):
            return {self.column: [regex_token_ids(t, self.vocab_size) for t in texts]}
        if self._tok is None:
            path = Path(self.tokenizer)
            path = path / "tokenizer.json" if path.is_dir() else path
            if not path.is_file():
                raise FileNotFoundError(
                    f"no tokenizer file at {path} (want a Hugging Face tokenizer.json or its folder)"
                )
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))
        return {
            self.column: [e.ids for e in self._tok.encode_batch([t or "" for t in texts], add_special_tokens=False)]
        }


def tokenize_dataset(
    ds: Any,
    text_column: str,
    tokenizer: Any = None,
    *,
    column: str = "input_ids",
    vocab_size: int = 65536,
    num_proc: int | None = None,
    batch_size: int = 256,
) -> Any:
    """Add a token-id column to a ``datasets.Dataset`` from ``text_column`` (batched ``map``, ``num_proc``)."""
    if text_column not in ds.column_names:
        raise DataError(f"dataset has no column {text_column!r}; its columns are {list(ds.column_names)}")
    return ds.map(
        _TokenizeMap(tokenizer, vocab_size, column),
        input_columns=[text_column],
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        desc="tokenizing",
    )


_EXTENSIONS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".arrow": "arrow", ".csv": "csv"}


def load_source(source: str | os.PathLike, split: str = "train", cache_dir: str | None = None) -> Any:
    """A ``datasets.Dataset`` from a local path (Parquet, JSON lines, Arrow, CSV, a saved ``datasets``
    directory, or a folder of such files) or, when no such path exists, a Hub dataset name."""
    import datasets

    path = Path(source)
    if path.is_dir():
        if any((path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{path} holds splits {sorted(ds)}, not {split!r} (pass --split)")
                ds = ds[split]
            return ds
        files = sorted(p for p in path.rglob("*") if p.suffix in _EXTENSIONS and not p.name.startswith("."))
        kinds = {_EXTENSIONS[p.suffix] for p in files}
        if len(kinds) != 1:
            raise DataError(
                f"{path}: want a saved datasets directory or files of one kind ({', '.join(_EXTENSIONS)}), "
                f"found {sorted(kinds) or 'none'}"
            )
        return _load_files(kinds.pop(), [str(p) for p in files], cache_dir)
    if path.is_file():
        if path.suffix not in _EXTENSIONS:
            raise DataError(f"{path}: unknown file type {path.suffix!r}; want one of {', '.join(_EXTENSIONS)}")
        return _load_files(_EXTENSIONS[path.suffix], [str(path)], cache_dir)
    looks_local = str(source).startswith((".", "/", "~")) or path.suffix in _EXTENSIONS
    if looks_local or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise FileNotFoundError(f"no dataset at {source} (and Hub names are not tried offline)")
    return datasets.load_dataset(str(source), split=split, cache_dir=cache_dir)


def _load_files(kind: str, files: list[str], cache_dir: str | None) -> Any:
    import datasets

    if kind == "arrow":
        parts = [datasets.Dataset.from_file(f) for f in files]
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir)


def _content_fingerprint(ds: Any, column: str, lengths: np.ndarray) -> str:
    """SHA-256 of the token ids in dataset order (identity of the input for resume checks)."""
    import pyarrow as pa

    h = hashlib.sha256(b"ringpack-tokens-v1|")
    h.update(np.asarray(lengths, dtype="<i8").tobytes())
    arrow = ds.with_format("arrow")
    for start in range(0, len(ds), 65536):
        col = arrow[start : start + 65536].column(column)
        col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        values = col.flatten().to_numpy(zero_copy_only=False)
        h.update(np.asarray(values, dtype="<i8").tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class _ShardFile:
    """One output file: DP rank ``dp_rank``'s micro-batches of steps ``[lo, hi)``."""

    name: str
    dp_rank: int
    lo: int
    hi: int


def _layout(plan: Plan, steps_per_file: int) -> list[_ShardFile]:
    """The output files in write order: per DP rank, one file or one per ``steps_per_file`` steps."""
    dp, n = plan.config.dp, plan.num_steps
    if steps_per_file <= 0:
        return [_ShardFile(f"dp{d:05d}-of-{dp:05d}.parquet", d, 0, n) for d in range(dp)]
    return [
        _ShardFile(f"dp{d:05d}-of-{dp:05d}-steps-{lo:06d}-{hi - 1:06d}.parquet", d, lo, hi)
        for d in range(dp)
        for lo, hi in ((lo, min(lo + steps_per_file, n)) for lo in range(0, n, steps_per_file))
    ]


def _schema(meta: dict[str, Any]) -> Any:
    import pyarrow as pa

    fields = [pa.field(name, pa.int64()) for name in _COLUMNS] + [pa.field("input_ids", pa.list_(pa.int32()))]
    return pa.schema(fields, metadata={b"ringpack.shard": json.dumps(meta, sort_keys=True).encode()})


def _microbatch_table(
    mb: MicroBatch, tokens: dict[int, np.ndarray], rows: dict[int, int], schema: Any, *, step: int, index: int
) -> Any:
    """One row group: a row per piece of micro-batch ``index`` of ``step`` (``tokens``/``rows`` by plan sample)."""
    import pyarrow as pa

    cols: dict[str, list[int]] = {name: [] for name in _COLUMNS}
    pieces: list[np.ndarray] = []
    slot_of = {sample: k for k, sample in enumerate(mb.samples)}
    for c, shard in enumerate(mb.shards):
        for p in shard.pieces:
            ids = tokens[p.sample]
            values = (step, index, c, slot_of[p.sample], p.sample, rows[p.sample], p.start, p.stop)
            for name, value in zip(_COLUMNS, values):
                cols[name].append(value)
            cols["next_token"].append(int(ids[p.stop]) if p.stop < len(ids) else IGNORE_INDEX)
            pieces.append(ids[p.start : p.stop])
    lens = np.fromiter((len(x) for x in pieces), dtype=np.int32, count=len(pieces))
    offsets = np.zeros(len(pieces) + 1, dtype=np.int32)
    np.cumsum(lens, out=offsets[1:])
    values = np.concatenate(pieces).astype(np.int32)
    arrays = [pa.array(np.asarray(cols[name], dtype=np.int64)) for name in _COLUMNS]
    arrays.append(pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_shards(
    dataset: Any,
    out_dir: str | os.PathLike,
    config: PlanConfig,
    *,
    column: str = "input_ids",
    steps_per_file: int = 0,
    progress: bool | None = None,
    overwrite: bool = False,
    source: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plan ``dataset`` and write its balanced shards (layout in the module docstring).

    Args:
        dataset: a ``datasets.Dataset`` whose ``column`` holds each row's token ids (a list of
            integers per row, int32 range).
        out_dir: the output directory (created if missing).
        config: the plan config (mesh, token budget, strategy, ...); the plan is made here.
        column: the token-id column.
        steps_per_file: split each DP rank's file every this many steps (``0``: one file per DP rank).
        progress: show a progress bar (``None``: tqdm decides by the terminal).
        overwrite: replace the shards of another plan or dataset found in ``out_dir``.
        source: where the data came from, recorded in the manifest as given.

    Returns:
        The manifest, also written to ``out_dir/manifest.json`` (plan hash, dataset fingerprint,
        config, per-file row groups, rows, tokens, bytes and sha256).

    Raises:
        DataError: ``out_dir`` holds shards of another plan or dataset (or unreadable bookkeeping)
            and ``overwrite`` is false; a missing column or bad lengths.
        PlanError: the lengths cannot be planned under ``config``.

    An interrupted run of the same inputs resumes: files whose checksum matches are kept.
    """
    from tqdm.auto import tqdm

    from ringpack.planner import make_plan

    out = Path(out_dir)
    lengths = lengths_from_dataset(dataset, column)
    plan = make_plan(lengths, config)
    fingerprint = _content_fingerprint(dataset, column, lengths)
    layout = _layout(plan, steps_per_file)
    identity = {
        "format": "ringpack-shards",
        "version": SHARD_FORMAT_VERSION,
        "plan_hash": plan.content_hash,
        "dataset_fingerprint": fingerprint,
        "column": column,
        "files": [f.name for f in layout],
    }
    out.mkdir(parents=True, exist_ok=True)
    done = _finished_files(out, identity, overwrite)
    _clear_stale(out, {f.name for f in layout} | {PLAN_FILE}, overwrite)
    verified = {
        f.name: done[f.name]
        for f in layout
        if f.name in done and (out / f.name).exists() and file_sha256(out / f.name) == done[f.name]
    }

    total_mb = sum(len(step.microbatches[d]) for d in range(config.dp) for step in plan.steps)
    disable = (not progress) if progress is not None else None
    bar = tqdm(total=total_mb, desc=f"ringpack shard -> {out}", unit="mb", disable=disable)
    writer = _ShardWriter(out, plan, dataset, column)
    progress_state = {**identity, "files_written": dict(verified)}
    _write_json(out / PROGRESS, progress_state)
    records = []
    for file in layout:
        if file.name not in verified:
            verified[file.name] = writer.write(file, bar)
            progress_state["files_written"][file.name] = verified[file.name]
            _write_json(out / PROGRESS, progress_state)
        else:
            bar.update(writer.microbatches(file))
        records.append(writer.record(file, verified[file.name]))
    bar.close()

    manifest = _manifest(identity, plan, lengths, _write_plan_file(out, plan), records, source)
    _write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _finished_files(out: Path, identity: dict[str, Any], overwrite: bool) -> dict[str, str]:
    """sha256 of the files an earlier run of the same inputs finished in ``out``, by name.

    Raises :class:`DataError` when ``out`` holds another plan's or dataset's shards (or bookkeeping
    that is not JSON) and ``overwrite`` is false; with ``overwrite`` the bookkeeping is removed.
    """
    done: dict[str, str] = {}
    for marker in (MANIFEST, PROGRESS):
        path = out / marker
        if not path.exists():
            continue
        try:
            old = json.loads(path.read_text())
        except ValueError as exc:
            if not overwrite:
                raise DataError(
                    f"{path} is not valid JSON ({exc}); pass overwrite=True / --overwrite to rewrite {out}"
                ) from exc
            old = {}
        same, recorded = _same_run(old, identity, marker)
        if not same and not overwrite:
            raise DataError(
                f"{out} holds shards of another plan or dataset (plan {str(old.get('plan_hash'))[:12]}..., "
                f"this run plans {identity['plan_hash'][:12]}...); pass overwrite=True / --overwrite, or another --out"
            )
        if same:
            done.update(recorded)
    if overwrite:
        (out / MANIFEST).unlink(missing_ok=True)
        (out / PROGRESS).unlink(missing_ok=True)
        return {}
    return done


def _same_run(old: dict[str, Any], identity: dict[str, Any], marker: str) -> tuple[bool, dict[str, str]]:
    """Whether a manifest or progress record ``old`` is of this run's inputs, and the files it records."""
    if marker == PROGRESS:
        return all(old.get(k) == v for k, v in identity.items()), old.get("files_written") or {}
    same = (
        all(old.get(k) == identity[k] for k in ("plan_hash", "dataset_fingerprint", "column"))
        and [f.get("name") for f in old.get("files", [])] == identity["files"]
    )
    return same, {f["name"]: f.get("sha256") for f in old.get("files", [])}


def _clear_stale(out: Path, keep: set[str], overwrite: bool) -> None:
    """Remove shard files this run does not write (any Parquet file with ``overwrite``), temporaries and the manifest.

    The manifest is rewritten last, so it is never stale while files change.
    """
    for stale in out.glob("*.parquet"):
        if stale.name not in keep and (overwrite or stale.name.startswith("dp")):
            stale.unlink()
    for tmp in out.glob(".*.tmp-*"):
        tmp.unlink()
    (out / MANIFEST).unlink(missing_ok=True)


class _ShardWriter:
    """Writes the shard files of one plan of one dataset into ``out``."""

    def __init__(self, out: Path, plan: Plan, dataset: Any, column: str) -> None:
        self.out = out
        self.plan = plan
        self.arrow = dataset.with_format("arrow")
        self.column = column
        self.doc_row, self.doc_offset = plan.origin_arrays()

    def microbatches(self, file: _ShardFile) -> int:
        return sum(len(self.plan.steps[s].microbatches[file.dp_rank]) for s in range(file.lo, file.hi))

    def write(self, file: _ShardFile, bar: Any) -> str:
        """Write ``file`` under a temporary name, fsync and move it into place; its sha256."""
        import pyarrow.parquet as pq

        meta = {
            "plan_hash": self.plan.content_hash,
            "dp_rank": file.dp_rank,
            "steps": [file.lo, file.hi],
            "version": SHARD_FORMAT_VERSION,
        }
        schema = _schema(meta)
        tmp = self.out / f".{file.name}.tmp-{os.getpid()}"
        with pq.ParquetWriter(str(tmp), schema, **_WRITE_OPTIONS) as writer:
            for s in range(file.lo, file.hi):
                for i, mb in enumerate(self.plan.steps[s].microbatches[file.dp_rank]):
                    tokens, rows = self._sample_tokens(mb)
                    writer.write_table(_microbatch_table(mb, tokens, rows, schema, step=s, index=i))
                    bar.update(1)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.out / file.name)
        return file_sha256(self.out / file.name)

    def _sample_tokens(self, mb: MicroBatch) -> tuple[dict[int, np.ndarray], dict[int, int]]:
        """Token ids and dataset row of each plan sample of ``mb`` (documents cut from rows by ``origins``)."""
        samples = np.asarray(mb.samples, dtype=np.int64)
        rows = self.doc_row[samples]
        col = self.arrow[rows.tolist()].column(self.column).combine_chunks()
        offs = col.offsets.to_numpy().astype(np.int64)
        vals = col.values.to_numpy(zero_copy_only=False)
        tokens = {}
        for k, sample in enumerate(mb.samples):
            a = offs[k] + self.doc_offset[sample]
            tokens[sample] = vals[a : a + self.plan.lengths[sample]]
        return tokens, dict(zip(mb.samples, rows.tolist()))

    def record(self, file: _ShardFile, sha256: str) -> dict[str, Any]:
        """The manifest entry of a written ``file``."""
        import pyarrow.parquet as pq

        path = self.out / file.name
        md = pq.ParquetFile(str(path)).metadata
        mbs = [mb for s in range(file.lo, file.hi) for mb in self.plan.steps[s].microbatches[file.dp_rank]]
        return {
            "name": file.name,
            "dp_rank": file.dp_rank,
            "steps": [file.lo, file.hi],
            "microbatches": len(mbs),
            "row_groups": md.num_row_groups,
            "rows": md.num_rows,
            "tokens": int(sum(mb.num_tokens for mb in mbs)),
            "bytes": path.stat().st_size,
            "sha256": sha256,
        }


def _write_plan_file(out: Path, plan: Plan) -> dict[str, Any]:
    """Write ``plan.parquet`` atomically; its manifest entry."""
    import pyarrow.parquet as pq

    path = out / PLAN_FILE
    tmp = out / f".{PLAN_FILE}.tmp-{os.getpid()}"
    pq.write_table(plan.to_table(), str(tmp), **_WRITE_OPTIONS)
    os.replace(tmp, path)
    return {"name": PLAN_FILE, "sha256": file_sha256(path), "bytes": path.stat().st_size}


def _manifest(
    identity: dict[str, Any],
    plan: Plan,
    lengths: np.ndarray,
    plan_file: dict[str, Any],
    records: list[dict[str, Any]],
    source: dict[str, Any] | None,
) -> dict[str, Any]:
    config = plan.config
    doc_row, _ = plan.origin_arrays()
    return {
        "format": "ringpack-shards",
        "version": SHARD_FORMAT_VERSION,
        "plan_hash": plan.content_hash,
        "dataset_fingerprint": identity["dataset_fingerprint"],
        "column": identity["column"],
        "config": config.to_dict(),
        "dp": config.dp,
        "cp": config.cp,
        "tokens_per_rank": config.tokens_per_rank,
        "num_steps": plan.num_steps,
        "num_samples": int(len(lengths)),
        "num_tokens": int(lengths.sum()),
        "dropped": [int(doc_row[x]) for x in plan.dropped],
        "microbatches_per_step": [len(step.microbatches[0]) for step in plan.steps],
        "step_loss_tokens": [step.loss_tokens for step in plan.steps],
        "source": source or {},
        "plan_file": plan_file,
        "files": records,
    }


# --------------------------------------------------------------------------------------- reading
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
        DataError: no finished shard directory (an interrupted run says so), a manifest of
            another format or mesh, ranks out of range; while reading: a missing, corrupt or
            truncated file (named), or row groups that disagree with the plan.
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
        schedule_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.schedule_options = check_schedule_options(schedule_options)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            hint = (
                " (an interrupted `ringpack shard` run: re-run it to resume)" if (self.path / PROGRESS).exists() else ""
            )
            raise DataError(f"no {MANIFEST} in {self.path}: not a finished ringpack shard directory{hint}")
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except ValueError as exc:
            raise DataError(f"{manifest_path} is corrupt: {exc}") from exc
        m = self.manifest
        if m.get("format") != "ringpack-shards" or m.get("version") != SHARD_FORMAT_VERSION:
            raise DataError(f"{manifest_path}: not a ringpack shard manifest of version {SHARD_FORMAT_VERSION}")
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

    # -------------------------------------------------------------- views
    @property
    def plan_hash(self) -> str:
        return self.manifest["plan_hash"]

    @property
    def num_steps(self) -> int:
        return self.manifest["num_steps"]

    def __len__(self) -> int:
        return sum(f["microbatches"] for f in self.files)

    def _check(self, entry: dict[str, Any]) -> Path:
        path = self.path / entry["name"]
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
            self._plan = plan
        return self._plan

    # ----------------------------------------------------------- iterate
    def __iter__(self) -> Iterator[dict[str, Any]]:
        import pyarrow.parquet as pq

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
            try:
                pf = pq.ParquetFile(str(path))
            except Exception as exc:
                raise DataError(f"cannot read shard file {path}: {exc}") from exc
            if pf.metadata.num_row_groups != n:
                raise DataError(
                    f"shard file {path} has {pf.metadata.num_row_groups} row groups, manifest says {n} micro-batches"
                )
            for g in range(max(0, start - position), n):
                try:
                    table = pf.read_row_group(g)
                except Exception as exc:
                    raise DataError(f"cannot read row group {g} of shard file {path}: {exc}") from exc
                batch = self._batch(plan, table, path, g, position + g)
                self._cursor = position + g + 1
                yield batch
            position += n

    def _batch(self, plan: Plan, table: Any, path: Path, group: int, position: int) -> dict[str, Any]:
        step = int(table.column("step")[0].as_py())
        index = int(table.column("microbatch")[0].as_py())
        if not 0 <= step < plan.num_steps or index >= len(plan.steps[step].microbatches[self.dp_rank]):
            raise DataError(f"{path} row group {group}: step {step} micro-batch {index} is not in the plan")
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
        return to_batch(arrays, mb, self.cp_rank, meta, self.schedule, options=self.schedule_options)

    # -------------------------------------------------------------- state
    def state_dict(self, cursor: int | None = None) -> dict[str, Any]:
        if cursor is None:
            cursor = self._pending if self._pending is not None else self._cursor
        return {"version": SHARD_FORMAT_VERSION, "plan_hash": self.plan_hash, "cursor": int(cursor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("plan_hash") != self.plan_hash:
            raise DataError(
                f"reader state is for plan {str(state.get('plan_hash'))[:12]}..., "
                f"these shards hold {self.plan_hash[:12]}..."
            )
        cursor = int(state["cursor"])
        if not 0 <= cursor <= len(self):
            raise DataError(f"reader state cursor {cursor} outside [0, {len(self)}]")
        self._cursor = self._pending = cursor
