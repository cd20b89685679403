"""A shard directory is ringpack's: no link in it is followed, no file outside it is read, and a
forged record cannot make a run delete or replace a file ringpack did not write."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from ringpack import _files
from ringpack._files import file_sha256
from ringpack.data import shard_writer as shards_module
from ringpack.data.shard_reader import ShardReader
from ringpack.errors import DataError
from tests.helpers.cli import assert_clean, digests, run_cli, token_rows, write_jsonl

SHARD = "dp00001-of-00002.parquet"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A finished shard directory of a small dataset and the command that wrote it (minus ``--out``)."""
    root = tmp_path_factory.mktemp("links")
    data = write_jsonl(root / "ids.jsonl", [{"input_ids": r} for r in token_rows(40)])
    argv = ["shard", data, "--dp", "2", "--cp", "2", "--tokens-per-rank", "256", "--samples-per-step", "8"]
    argv += ["--no-progress", "--cache-dir", root / "cache"]
    reference = root / "reference"
    assert run_cli([*argv, "--out", reference]).code == 0
    return {"argv": argv, "reference": reference, "digests": digests(reference)}


def copy_of(job, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(job["reference"], out)
    return out


def planted(out: Path, name: str, target: Path) -> Path:
    """``out/name`` replaced by a symbolic link to ``target``."""
    (out / name).unlink()
    (out / name).symlink_to(target)
    return target


# ------------------------------------------------------------------------------------ reading
@pytest.mark.parametrize("same_bytes", [True, False])
def test_the_reader_refuses_a_shard_that_links_out(job, tmp_path, same_bytes):
    out = copy_of(job, tmp_path)
    outside = tmp_path / "elsewhere.parquet"
    outside.write_bytes((out / SHARD).read_bytes() if same_bytes else b"someone's private file")
    planted(out, SHARD, outside)
    reader = ShardReader(out, 1, 0)
    with pytest.raises(DataError, match=rf"shard file .*{SHARD} is a symbolic link") as info:
        list(reader)
    assert hashlib.sha256(outside.read_bytes()).hexdigest()[:8] not in str(info.value)  # never hashed
    assert len(list(ShardReader(out, 0, 0, schedule=False))) == len(ShardReader(out, 0, 0))  # rank 0 reads on


@pytest.mark.parametrize("name", ["manifest.json", "plan.parquet"])
def test_the_reader_refuses_a_linked_manifest_or_plan(job, tmp_path, name):
    out = copy_of(job, tmp_path)
    outside = tmp_path / name
    outside.write_bytes((out / name).read_bytes())
    planted(out, name, outside)
    with pytest.raises(DataError, match="is a symbolic link"):
        reader = ShardReader(out, 0, 0)
        reader.plan  # noqa: B018 (the plan is read on first use)


def test_file_sha256_and_open_regular_refuse_links(tmp_path):
    target = tmp_path / "target.bin"
    target.write_bytes(b"x")
    (tmp_path / "link.bin").symlink_to(target)
    with pytest.raises(DataError, match="symbolic link"):
        file_sha256(tmp_path / "link.bin")
    with pytest.raises(DataError, match="not a regular file"):
        _files.open_regular(tmp_path, "folder")
    assert file_sha256(target) == hashlib.sha256(b"x").hexdigest()


# ---------------------------------------------------------------------------- the writer's resume
def test_resume_rewrites_a_linked_shard_without_reading_through_it(job, tmp_path, monkeypatch):
    """A shard swapped for a link to a byte-identical copy outside is rewritten, not hashed and kept."""
    out = copy_of(job, tmp_path)
    outside = tmp_path / "copy.parquet"
    outside.write_bytes((out / SHARD).read_bytes())
    planted(out, SHARD, outside)
    hashed = []
    real = shards_module.file_sha256
    monkeypatch.setattr(shards_module, "file_sha256", lambda p, *a: hashed.append(Path(p)) or real(p, *a))
    assert run_cli([*job["argv"], "--out", out]).code == 0
    assert not (out / SHARD).is_symlink() and digests(out) == job["digests"]
    assert outside.read_bytes() == (job["reference"] / SHARD).read_bytes()
    assert all(not p.is_symlink() and p.resolve().parent == out.resolve() for p in hashed), hashed


@pytest.mark.parametrize("record", ["manifest.json", "_progress.json"])
def test_resume_refuses_a_linked_record(job, tmp_path, record):
    out = copy_of(job, tmp_path)
    outside = tmp_path / "record.json"
    outside.write_text((out / "manifest.json").read_text())
    if record == "manifest.json":
        planted(out, record, outside)
    else:
        (out / record).symlink_to(outside)
    before = digests(out)
    run = run_cli([*job["argv"], "--out", out, "--overwrite"])
    assert_clean(run)
    assert run.code == 1 and "symbolic link" in run.err and record in run.err
    assert digests(out) == before and (out / record).is_symlink()
    assert outside.read_text() == (job["reference"] / "manifest.json").read_text()


# ------------------------------------------------------------------------------ forged records
def forge(out: Path, owned: list, **fields) -> None:
    """A progress record of another run that claims ``owned``."""
    record = {"format": "ringpack-shards", "version": 1, "plan_hash": "0" * 64, "owned": owned, **fields}
    (out / "_progress.json").write_text(json.dumps(record))


@pytest.mark.parametrize("overwrite", [True, False])
def test_a_forged_record_naming_a_user_file_inside_deletes_nothing(job, tmp_path, overwrite):
    out = copy_of(job, tmp_path)
    (out / "notes.txt").write_text("mine")
    forge(out, ["notes.txt"])
    before = digests(out)
    run = run_cli([*job["argv"], "--out", out, *(["--overwrite"] if overwrite else [])])
    assert_clean(run)
    assert run.code == 1 and "notes.txt" in run.err, run.err
    assert digests(out) == before


@pytest.mark.parametrize("name", ["../victim.txt", "{victim}", "sub/victim.txt"])
def test_a_forged_record_naming_a_file_outside_deletes_nothing(job, tmp_path, name):
    out = copy_of(job, tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / "sub").mkdir()
    (out / "sub" / "victim.txt").write_text("precious too")
    forge(out, [name.format(victim=victim)])
    run = run_cli([*job["argv"], "--out", out, "--overwrite"])
    assert_clean(run)
    assert run.code == 1 and "not a plain file name" in run.err
    assert victim.read_text() == "precious" and (out / "sub" / "victim.txt").read_text() == "precious too"


def test_a_user_file_under_a_shard_name_is_left_in_place(job, tmp_path):
    """A forged record can name a file that looks like a stale shard: it is not ringpack's, so it stays."""
    out = copy_of(job, tmp_path)
    (out / "dp00000-of-00009.parquet").write_bytes(b"not a shard")
    victim = tmp_path / "victim.parquet"
    victim.write_bytes(b"precious")
    (out / "dp00001-of-00009.parquet").symlink_to(victim)
    stale = out / "dp00002-of-00009.parquet"
    shutil.copy(out / SHARD, stale)  # a real ringpack shard of an older plan: removable
    forge(out, ["dp00000-of-00009.parquet", "dp00001-of-00009.parquet", stale.name])
    run = run_cli([*job["argv"], "--out", out, "--overwrite"])
    assert_clean(run)
    assert run.code == 0, run.err
    assert run.err.count("left in place") == 2
    assert (out / "dp00000-of-00009.parquet").read_bytes() == b"not a shard"
    assert (out / "dp00001-of-00009.parquet").is_symlink() and victim.read_bytes() == b"precious"
    assert not stale.exists()
    kept = {k: v for k, v in digests(out).items() if k in job["digests"]}
    assert kept == job["digests"]


def test_a_forged_record_cannot_make_a_run_replace_a_user_file_under_a_record_name(job, tmp_path):
    """A record that names itself after a user file ringpack never writes is refused before anything changes."""
    out = copy_of(job, tmp_path)
    (out / "data.csv").write_text("a,b\n1,2\n")
    forge(out, [], files=["data.csv"])
    before = digests(out)
    run = run_cli([*job["argv"], "--out", out, "--overwrite"])
    assert_clean(run)
    assert run.code == 1 and "data.csv" in run.err and "never writes" in run.err
    assert digests(out) == before
