"""Corruption matrix: damaged plans (JSON and Parquet), shards, manifests and resume states.

Every damaged input must be refused with the documented error (``PlanError`` / ``DataError``), in
bounded time, or read back as exactly the original: never a different plan or different batches.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.data.shard_reader import ShardReader
from ringpack.data.shard_writer import write_shards
from ringpack.errors import DataError, PlanError
from ringpack.shard_plan import MicroBatch, Piece, Plan, PlanConfig, RankShard, Step
from tests.helpers.cli import CP, DP, TOKENS, small_plan, token_rows

#: What a number in a plan or manifest is replaced with.
MUTATIONS = (
    lambda v: v + 1,
    lambda v: v - 1,
    lambda v: -v - 1,
    lambda v: 0,
    lambda v: 2**63,
    lambda v: 10**9,
    lambda v: 1.5,
    lambda v: float("nan"),
    lambda v: str(v),
    lambda v: None,
    lambda v: True,
    lambda v: [v],
    lambda v: {"v": v},
)
#: Longest a refusal may take: counts in a damaged file must never drive a long loop.
BOUND_S = 5.0


def leaves(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths (key and index tuples) of every number in a JSON document."""
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in leaves(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in leaves(v, (*path, i))]
    return [path] if isinstance(doc, (int, float)) and not isinstance(doc, bool) else []


def containers(doc: Any, path: tuple = ()) -> list[tuple]:
    """Paths of every object in a JSON document (the document itself first)."""
    if isinstance(doc, dict):
        return [path] + [p for k, v in doc.items() for p in containers(v, (*path, k))]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in containers(v, (*path, i))]
    return []


def at(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def edited(doc: dict, path: tuple, change) -> dict:
    """A deep copy of ``doc`` with the value at ``path`` replaced by ``change(value)``."""
    doc = copy.deepcopy(doc)
    parent = at(doc, path[:-1])
    parent[path[-1]] = change(parent[path[-1]])
    return doc


def refused_or_same(load, original: Plan, error: type[Exception]) -> None:
    """``load()`` raises ``error`` quickly or returns ``original`` (lower bounds aside: they are outside the hash)."""
    t0 = time.perf_counter()
    try:
        again = load()
    except error:
        pass
    else:
        assert without_bounds(again) == without_bounds(original), "a damaged file loaded as a different plan"
    assert time.perf_counter() - t0 < BOUND_S


def refused(load, error: type[Exception]) -> None:
    """``load()`` raises ``error``, quickly: a named damage with one right answer, a refusal."""
    t0 = time.perf_counter()
    with pytest.raises(error):
        load()
    assert time.perf_counter() - t0 < BOUND_S


def without_bounds(plan: Plan) -> Plan:
    return dataclasses.replace(plan, steps=tuple(dataclasses.replace(s, lower_bound=None) for s in plan.steps))


# ---------------------------------------------------------------------------------- plans: JSON
PLAN = small_plan(overflow="split")
PLAN_DOC = PLAN.to_dict()
PLAN_LEAVES = leaves(PLAN_DOC)
PLAN_OBJECTS = containers(PLAN_DOC)


def test_the_fixture_plan_round_trips():
    assert Plan.from_dict(copy.deepcopy(PLAN_DOC)) == PLAN
    assert len(PLAN_LEAVES) > 200 and PLAN.num_steps > 1


def every_case(cases, check) -> None:
    """``check(case)`` for every case, failing with the case named (a whole list, not a sample of it)."""
    for case in cases:
        try:
            check(case)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from exc


@pytest.mark.parametrize("mutation", range(len(MUTATIONS)))
def test_plan_json_number_changed(mutation):
    """Every number of the plan file, each way (13 x 323 numbers: about 2 s in all)."""
    change = MUTATIONS[mutation]
    every_case(
        PLAN_LEAVES,
        lambda path: refused_or_same(lambda: Plan.from_dict(edited(PLAN_DOC, path, change)), PLAN, PlanError),
    )


@pytest.mark.parametrize("path", PLAN_OBJECTS, ids=lambda p: ".".join(map(str, p)) or "plan")
def test_plan_json_keys_removed_or_added(path):
    for key in list(at(PLAN_DOC, path)):
        doc = copy.deepcopy(PLAN_DOC)
        del at(doc, path)[key]
        refused_or_same(lambda: Plan.from_dict(doc), PLAN, PlanError)
    doc = copy.deepcopy(PLAN_DOC)
    at(doc, path)["surprise"] = 1
    with pytest.raises(PlanError, match="unknown"):
        Plan.from_dict(doc)


@pytest.mark.parametrize(
    "change",
    [
        "duplicate a sample",
        "drop a piece",
        "move a cut",
        "uneven DP ranks",
        "wrong loss tokens",
        "piece past the end",
        "lengths edited",
    ],
)
def test_plan_json_edited_and_rehashed_is_refused(change):
    """An edit whose hash is recomputed (or deleted) still fails validation, naming what is broken."""
    doc = copy.deepcopy(PLAN_DOC)
    mb = doc["steps"][0]["microbatches"][0][0]
    if change == "duplicate a sample":
        doc["steps"][1]["microbatches"][0][0]["samples"].append(mb["samples"][0])
    elif change == "drop a piece":
        next(shard for shard in mb["shards"] if shard).pop()
    elif change == "move a cut":
        piece = next(shard for shard in mb["shards"] if shard)[0]
        piece[2] = piece[2] - 1 if piece[2] - piece[1] > 1 else piece[2] + 1
    elif change == "uneven DP ranks":
        doc["steps"][0]["microbatches"][1].pop()
    elif change == "wrong loss tokens":
        mb["loss_tokens"] += 1
    elif change == "piece past the end":
        piece = next(shard for shard in mb["shards"] if shard)[-1]
        piece[2] = doc["lengths"][piece[0]] + 5
    else:
        doc["lengths"][mb["samples"][0]] += 1
    without_hash = dict(doc)
    del without_hash["hash"]
    with pytest.raises(PlanError, match="lacks 'hash'"):
        Plan.from_dict(without_hash)
    doc["hash"] = unchecked_plan(doc).content_hash
    with pytest.raises(PlanError, match=r"step|sample|piece|loss_tokens|micro-batch"):
        Plan.from_dict(doc)


def unchecked_plan(doc: dict) -> Plan:
    """The plan a JSON document describes, built without any check (to hash an edited document)."""
    steps = tuple(
        Step(
            tuple(
                tuple(
                    MicroBatch(
                        tuple(mb["samples"]),
                        tuple(RankShard(tuple(Piece(*p) for p in shard)) for shard in mb["shards"]),
                        mb["loss_tokens"],
                    )
                    for mb in rank
                )
                for rank in step["microbatches"]
            ),
            step["lower_bound"],
        )
        for step in doc["steps"]
    )
    config = PlanConfig.from_dict(doc["config"])
    return Plan(config, tuple(doc["lengths"]), steps, tuple(doc["dropped"]), tuple(map(tuple, doc["origins"])))


def test_plan_json_text_damage(tmp_path):
    path = tmp_path / "plan.json"
    PLAN.save(path)
    text = path.read_bytes()
    for damaged in (b"", text[: len(text) // 2], text + b"}", b"\xff" + text, b"[" * 50_000, b"null", b"{}"):
        path.write_bytes(damaged)
        with pytest.raises(PlanError, match="plan.json"):
            Plan.load(path)


# ------------------------------------------------------------------------------- plans: Parquet
def table_with(meta_change=None, columns=None, metadata_change=None) -> pa.Table:
    """The fixture plan's table with its plan metadata, columns or raw metadata changed."""
    table = PLAN.to_table()
    metadata = dict(table.schema.metadata)
    meta = json.loads(metadata[b"ringpack.shard_plan"])
    if meta_change:
        meta_change(meta)
    metadata[b"ringpack.shard_plan"] = json.dumps(meta).encode()
    if metadata_change:
        metadata_change(metadata)
    if columns:
        table = columns(table)
    return table.replace_schema_metadata(metadata)


def _set(key, value):
    return lambda meta: meta.__setitem__(key, value)


def _config(key, value):
    return lambda meta: meta["config"].__setitem__(key, value)


META_CHANGES = {
    "num_steps huge": _set("num_steps", 10**9),
    "num_steps negative": _set("num_steps", -1),
    "num_steps float": _set("num_steps", 2.0),
    "num_steps short": _set("num_steps", PLAN.num_steps - 1),
    "dp huge": _config("dp", 10**9),
    "cp huge": _config("cp", 10**9),
    "cp beyond int64": _config("cp", 2**70),
    "dp zero": _config("dp", 0),
    "lower bounds short": _set("lower_bounds", []),
    "lower bound NaN": lambda meta: meta["lower_bounds"].__setitem__(0, float("nan")),
    "lower bound text": lambda meta: meta["lower_bounds"].__setitem__(0, "low"),
    "dropped text": _set("dropped", "x"),
    "dropped out of range": _set("dropped", [10**6]),
    "unknown key": _set("surprise", 1),
    "no hash": lambda meta: meta.pop("hash"),
    "no config": lambda meta: meta.pop("config"),
    "no lower bounds": lambda meta: meta.pop("lower_bounds"),
    "wrong format": _set("format", "something"),
    "wrong version": _set("version", 99),
    "config unknown key": _config("surprise", 1),
    "cost unknown key": lambda meta: meta["config"]["cost"].__setitem__("surprise", 1),
    "cost NaN": lambda meta: meta["config"]["cost"].__setitem__("pair", float("nan")),
}


@pytest.mark.parametrize("name", sorted(META_CHANGES))
def test_parquet_metadata_damage(name):
    refused(lambda: Plan.from_table(table_with(meta_change=META_CHANGES[name])), PlanError)


def _column(name: str, values) -> Any:
    def change(table: pa.Table) -> pa.Table:
        return table.set_column(table.column_names.index(name), name, values(table.column(name)))

    return change


COLUMN_CHANGES = {
    "step as text": _column("step", lambda c: pa.array([str(x) for x in c.to_pylist()])),
    "stop as float": _column("stop", lambda c: pa.array([float(x) for x in c.to_pylist()])),
    "sample with a null": _column("sample", lambda c: pa.array([None, *c.to_pylist()[1:]], pa.int64())),
    "negative step": _column("step", lambda c: pa.array([-1, *c.to_pylist()[1:]], pa.int64())),
    "cp out of range": _column("cp", lambda c: pa.array([CP, *c.to_pylist()[1:]], pa.int64())),
    "micro-batch gap": _column("microbatch", lambda c: pa.array([x * 2 for x in c.to_pylist()], pa.int64())),
    "micro-batch huge": _column("microbatch", lambda c: pa.array([10**12, *c.to_pylist()[1:]], pa.int64())),
    "slot shuffled": _column("slot", lambda c: pa.array(c.to_pylist()[::-1], pa.int64())),
    "start shifted": _column("start", lambda c: pa.array([x + 1 for x in c.to_pylist()], pa.int64())),
    "uint64 beyond int64": _column("sample", lambda c: pa.array([2**64 - 1, *c.to_pylist()[1:]], pa.uint64())),
    "extra column": lambda t: t.append_column("extra", pa.array(np.zeros(len(t), dtype=np.int64))),
    "missing column": lambda t: t.drop_columns(["slot"]),
    "no rows": lambda t: t.slice(0, 0),
}


@pytest.mark.parametrize("name", sorted(COLUMN_CHANGES))
def test_parquet_column_damage(name):
    refused(lambda: Plan.from_table(table_with(columns=COLUMN_CHANGES[name])), PlanError)


@pytest.mark.parametrize(
    "blob",
    [
        {b"ringpack.lengths": b"1234567"},
        {b"ringpack.lengths": b""},
        {b"ringpack.origins": b"12345678"},
        {b"ringpack.shard_plan": b"{not json"},
        {b"ringpack.shard_plan": b"[]"},
        {b"ringpack.shard_plan": b"\xff\xfe"},
    ],
)
def test_parquet_raw_metadata_damage(blob):
    refused(lambda: Plan.from_table(table_with(metadata_change=lambda md: md.update(blob))), PlanError)


def test_parquet_missing_metadata():
    for key in (b"ringpack.shard_plan", b"ringpack.lengths"):
        with pytest.raises(PlanError, match="no ringpack plan metadata"):
            Plan.from_table(table_with(metadata_change=lambda md: md.pop(key)))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_parquet_file_bytes_damaged(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("plan") / "plan.parquet"
    PLAN.save(path)
    raw = bytearray(path.read_bytes())
    how = data.draw(st.sampled_from(["flip", "truncate", "zero"]))
    where = data.draw(st.integers(0, len(raw) - 1))
    if how == "flip":
        raw[where] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        raw = raw[:where]
    else:
        raw[where : where + 64] = bytes(len(raw[where : where + 64]))
    path.write_bytes(bytes(raw))
    refused_or_same(lambda: Plan.load(path), PLAN, PlanError)


# ----------------------------------------------------------------------------------------- shards
@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A shard directory (two files per DP rank) and every (DP, CP) rank's batches read from it."""
    out = tmp_path_factory.mktemp("shards") / "good"
    config = PlanConfig(dp=DP, cp=CP, tokens_per_rank=TOKENS, samples_per_step=10)
    write_shards(
        datasets.Dataset.from_dict({"input_ids": token_rows(30)}), out, config, steps_per_file=2, progress=False
    )
    return out, read_all(out)


def signature(batch: dict[str, Any]) -> tuple:
    return tuple(np.asarray(batch[k]).tobytes() for k in ("input_ids", "labels", "position_ids", "cu_seqlens"))


def read_all(folder: Path, verify: bool = True) -> dict[tuple[int, int], list[tuple]]:
    out = {}
    for d in range(DP):
        for c in range(CP):
            reader = ShardReader(folder, d, c, dp_size=DP, cp_size=CP, verify=verify, schedule=False)
            out[(d, c)] = [signature(b) for b in reader]
    return out


def refused_batches(folder: Path, verify: bool = True) -> None:
    """Reading every rank of ``folder`` raises ``DataError``, quickly: a named damage is refused."""
    t0 = time.perf_counter()
    with pytest.raises(DataError):
        read_all(folder, verify)
    assert time.perf_counter() - t0 < BOUND_S


def refused_or_same_batches(folder: Path, good: dict, verify: bool = True) -> None:
    t0 = time.perf_counter()
    try:
        batches = read_all(folder, verify)
    except DataError:
        pass
    else:
        assert batches == good, "damaged shards read back as different batches"
    assert time.perf_counter() - t0 < BOUND_S


def damaged_copy(source: Path, target: Path) -> Path:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    return target


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_the_fixture_shards_read_back(shards):
    out, good = shards
    assert len(manifest_of(out)["files"]) > DP and all(good.values())


@pytest.mark.parametrize("mutation", range(len(MUTATIONS)))
def test_manifest_number_changed(shards, tmp_path, mutation):
    """Every number of the manifest (its ``source`` aside), each way (13 x 58 numbers: about 7 s in all)."""
    out, good = shards
    manifest = manifest_of(out)
    paths = [p for p in leaves(manifest) if p[0] not in ("source",)]
    assert len(paths) > 40

    def check(path: tuple) -> None:
        folder = damaged_copy(out, tmp_path / "s")
        (folder / "manifest.json").write_text(json.dumps(edited(manifest, path, MUTATIONS[mutation])))
        refused_or_same_batches(folder, good)

    every_case(paths, check)


MANIFEST_CHANGES = {
    "a file dropped": lambda m: m["files"].pop(),
    "a file listed twice": lambda m: m["files"].append(copy.deepcopy(m["files"][0])),
    "two entries swapped": lambda m: m["files"].reverse(),
    "dp changed": lambda m: m.update(dp=4),
    "dp changed with its config": lambda m: (m.update(dp=1), m["config"].update(dp=1)),
    "cp changed with its config": lambda m: (m.update(cp=1), m["config"].update(cp=1)),
    "parent directory name": lambda m: m["files"][0].update(name="../manifest.json"),
    "absolute name": lambda m: m["files"][0].update(name="/etc/hostname"),
    "nested name": lambda m: m["files"][0].update(name="sub/file.parquet"),
    "plan file outside": lambda m: m["plan_file"].update(name="../plan.parquet"),
    "name of another file": lambda m: m["files"][0].update(name=m["files"][1]["name"]),
    "the manifest as a shard": lambda m: m["files"][0].update(name="manifest.json"),
    "name not a string": lambda m: m["files"][0].update(name=7),
    "steps overlap": lambda m: m["files"][1].update(steps=[0, m["files"][1]["steps"][1]]),
    "steps reversed": lambda m: m["files"][0].update(steps=m["files"][0]["steps"][::-1]),
    "sha256 wrong": lambda m: m["files"][0].update(sha256="0" * 64),
    "bytes wrong": lambda m: m["files"][0].update(bytes=m["files"][0]["bytes"] - 1),
    "files not a list": lambda m: m.update(files={}),
    "no files key": lambda m: m.pop("files"),
    "no plan file key": lambda m: m.pop("plan_file"),
    "no microbatches_per_step": lambda m: m.pop("microbatches_per_step"),
    "plan hash of another plan": lambda m: m.update(plan_hash="f" * 64),
    "not an object": lambda m: (m.clear(), m.update({"format": []})),
}


#: Edits that change nothing the reader reads: files are found by their rank and steps, not by
#: their place in the list. Every other named edit must be refused.
READ_AS_BEFORE = {"two entries swapped"}


@pytest.mark.parametrize("name", sorted(MANIFEST_CHANGES))
def test_manifest_edits(shards, tmp_path, name):
    out, good = shards
    folder = damaged_copy(out, tmp_path / "s")
    manifest = manifest_of(folder)
    MANIFEST_CHANGES[name](manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    if name in READ_AS_BEFORE:
        assert read_all(folder, verify=True) == good
    else:
        refused_batches(folder)


def test_manifest_names_cannot_reach_outside(shards, tmp_path):
    """A name pointing outside the directory is refused before anything is read, so no file's digest leaks."""
    out, _ = shards
    secret = tmp_path / "secret.parquet"
    secret.write_bytes(b"not for the reader")
    folder = damaged_copy(out, tmp_path / "s")
    manifest = manifest_of(folder)
    for name in ("../secret.parquet", str(secret)):
        manifest["files"][0]["name"] = name
        (folder / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(DataError, match="not a plain file name") as info:
            ShardReader(folder, 0, 0)
        assert "sha256" not in str(info.value)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_shard_file_bytes_damaged(shards, tmp_path_factory, data):
    out, good = shards
    folder = damaged_copy(out, tmp_path_factory.mktemp("b") / "s")
    victim = folder / data.draw(st.sampled_from(sorted(p.name for p in folder.glob("*.parquet"))))
    raw = bytearray(victim.read_bytes())
    where = data.draw(st.integers(0, len(raw) - 1))
    if data.draw(st.booleans()):
        raw[where] ^= 0xFF
    else:
        raw = raw[:where]
    victim.write_bytes(bytes(raw))
    refused_or_same_batches(folder, good)
    if len(raw) != (out / victim.name).stat().st_size:
        refused_or_same_batches(folder, good, verify=False)  # the size check still catches truncation


def test_shard_file_replaced_by_another_rank(shards, tmp_path):
    """Swapping two files and their manifest entries' checksums still fails: each file names its rank and steps."""
    out, good = shards
    folder = damaged_copy(out, tmp_path / "s")
    manifest = manifest_of(folder)
    a, b = manifest["files"][0], manifest["files"][-1]
    (folder / a["name"]).write_bytes((out / b["name"]).read_bytes())
    for key in ("sha256", "bytes", "rows", "microbatches", "row_groups", "tokens"):
        a[key] = b[key]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    refused_batches(folder)


# ------------------------------------------------------------------------------------ resume states
def test_reader_state_damage(shards):
    out, _ = shards
    reader = ShardReader(out, 0, 0, schedule=False)
    state = reader.state_dict()
    for key, value in [
        ("cursor", 2.7),
        ("cursor", True),
        ("cursor", "1"),
        ("cursor", -1),
        ("cursor", 10**6),
        ("cursor", None),
        ("plan_hash", "0" * 64),
        ("version", 99),
    ]:
        with pytest.raises(DataError):
            reader.load_state_dict({**state, key: value})
    for damaged in ({}, [], None, {k: v for k, v in state.items() if k != "cursor"}):
        with pytest.raises(DataError):
            reader.load_state_dict(damaged)


def test_sampler_state_damage():
    from ringpack.data.sampler import BalancedBatchSampler

    sampler = BalancedBatchSampler(token_rows_lengths(), 0, DP, CP, TOKENS, samples_per_step=10)
    iterator = iter(sampler)
    next(iterator)
    state = sampler.state_dict()
    for key, value in [
        ("cursor", 2.7),
        ("cursor", True),
        ("cursor", "1"),
        ("cursor", -1),
        ("epoch", 0.5),
        ("epoch", None),
        ("seed", 1.0),
        ("dp_size", "2"),
        ("cost_switches", [[0, 1]]),
        ("cost_switches", [[0, 1, {"token": 1.0}]]),
        ("cost_switches", [[0.5, 1, {"token": 1.0, "pair": 1.0}]]),
        ("cost_switches", "x"),
    ]:
        with pytest.raises(DataError):
            sampler.load_state_dict({**state, key: value})
    sampler.load_state_dict(state)  # the original still loads
    assert sampler.state_dict()["cursor"] == 1
    for cursor in (2.7, True, "1"):  # a position that is not a batch's cursor is refused, not rounded
        with pytest.raises(DataError, match="cursor"):
            sampler.state_dict(cursor=cursor)


def test_reader_state_of_a_bad_cursor_is_refused(shards):
    reader = ShardReader(shards[0], 0, 0, schedule=False)
    for cursor in (2.7, True, "1", -1):
        with pytest.raises(DataError, match="cursor"):
            reader.state_dict(cursor=cursor)


def token_rows_lengths() -> list[int]:
    return [len(r) for r in token_rows(30)]


def test_nan_never_reaches_a_plan():
    """Every number a plan file carries is checked where it is read: NaN anywhere is refused."""
    for path in PLAN_LEAVES:
        doc = edited(PLAN_DOC, path, lambda v: float("nan"))
        with pytest.raises(PlanError):
            Plan.from_dict(doc)
