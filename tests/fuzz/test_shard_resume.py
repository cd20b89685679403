"""``ringpack shard`` killed (SIGKILL) at several points, then re-run: the files come out byte-identical.

Also: a run removes or replaces only files a ringpack record names, never writes through a planted
link, and leaves no temporary file behind once it finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from ringpack import _files
from ringpack.data import shard_writer as shards_module
from ringpack.data.shard_reader import ShardReader
from ringpack.errors import DataError
from tests.helpers.cli import assert_clean, digests, run_cli, token_rows, write_jsonl

if not hasattr(os, "fork"):
    pytest.skip("killing a run at a chosen point needs os.fork", allow_module_level=True)

#: How long a killed child may take to reach its kill point.
CHILD_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The input, the command (minus ``--out``) and a reference output of one uninterrupted run."""
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "ids.jsonl", [{"input_ids": r} for r in token_rows(40)])
    argv = ["shard", data, "--dp", "2", "--cp", "2", "--tokens-per-rank", "256", "--samples-per-step", "8"]
    argv += ["--steps-per-file", "2", "--no-progress", "--cache-dir", root / "cache"]
    reference = root / "reference"
    run = run_cli([*argv, "--out", reference])
    assert run.code == 0, run.err
    return {"root": root, "argv": argv, "reference": digests(reference)}


def killed_run(argv: list, point: str, n: int) -> None:
    """Run ``ringpack shard`` in a forked child and SIGKILL it at the ``n``-th ``point``.

    ``point``: ``"table"`` (building a micro-batch's row group, mid-file), ``"before rename"`` or
    ``"after rename"`` (around an ``os.replace`` into ``--out``: a shard, the progress record, the
    plan, the manifest).
    """
    out = str(argv[argv.index("--out") + 1])
    pid = os.fork()
    if pid == 0:  # the child: no cleanup of any kind runs after the kill
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        calls = {"n": 0}

        def tick() -> None:
            calls["n"] += 1
            if calls["n"] == n:
                os.kill(os.getpid(), signal.SIGKILL)

        if point == "table":
            real_table = shards_module._microbatch_table

            def table(*args, **kwargs):
                tick()
                return real_table(*args, **kwargs)

            shards_module._microbatch_table = table
        else:
            real_replace = os.replace

            def replace(src, dst):
                ours = str(dst).startswith(out)
                if ours and point == "before rename":
                    tick()
                real_replace(src, dst)
                if ours and point == "after rename":
                    tick()

            os.replace = replace
        try:
            run_cli(argv)
        finally:
            os._exit(0)  # reached only when the run ended before its kill point
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child did not reach {point} #{n} in {CHILD_TIMEOUT_S} s")
        time.sleep(0.01)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"{point} #{n} was never reached"


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# Renames of a fresh run: the progress record, then each shard and the progress record again (six
# shard files), the plan file, the manifest; so #1 is the first record, #2 the first shard, #15 the manifest.
KILL_POINTS = [
    ("table", 1),
    ("table", 7),
    ("before rename", 1),
    ("before rename", 2),
    ("after rename", 2),
    ("after rename", 5),
    ("before rename", 14),
    ("before rename", 15),
    ("after rename", 15),
]


@pytest.mark.parametrize(("point", "n"), KILL_POINTS, ids=[f"{p} #{n}" for p, n in KILL_POINTS])
def test_killed_then_rerun_is_byte_identical(job, tmp_path, point, n):
    out = tmp_path / "out"
    argv = [*job["argv"], "--out", out]
    killed_run(argv, point, n)
    if not (out / "manifest.json").exists():
        with pytest.raises(DataError, match="no manifest.json"):
            ShardReader(out, 0, 0)
    run = run_cli(argv)
    assert run.code == 0, run.err
    assert digests(out) == job["reference"]
    assert leftovers(out) == []
    assert len(list(ShardReader(out, 1, 1, schedule=False))) == len(ShardReader(out, 1, 1))


def test_killed_twice_while_resuming(job, tmp_path):
    out = tmp_path / "out"
    argv = [*job["argv"], "--out", out]
    killed_run(argv, "table", 9)
    killed_run(argv, "before rename", 3)
    assert run_cli(argv).code == 0
    assert digests(out) == job["reference"]


def test_other_files_survive_kill_resume_and_overwrite(job, tmp_path):
    """Files the run did not write stay byte for byte, through a kill, a resume and an ``--overwrite`` re-plan."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.parquet").write_bytes(b"mine")
    (out / ".hidden.tmp").write_bytes(b"also mine")
    argv = [*job["argv"], "--out", out]
    killed_run(argv, "after rename", 4)
    assert run_cli(argv).code == 0
    assert {k: v for k, v in digests(out).items() if k in job["reference"]} == job["reference"]
    replan = [*argv[: argv.index("--steps-per-file")], *argv[argv.index("--steps-per-file") + 2 :]]
    assert run_cli([*replan, "--seed", "5", "--steps-per-file", "0", "--overwrite"]).code == 0
    assert (out / "notes.parquet").read_bytes() == b"mine" and (out / ".hidden.tmp").read_bytes() == b"also mine"
    written = {p.name for p in out.iterdir()} - {"notes.parquet", ".hidden.tmp"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert written == {f["name"] for f in manifest["files"]} | {"plan.parquet", "manifest.json"}


@pytest.mark.parametrize("overwrite", [False, True])
def test_refuses_files_in_the_way(job, tmp_path, overwrite):
    out = tmp_path / "out"
    out.mkdir()
    (out / "dp00000-of-00002-steps-000000-000001.parquet").write_bytes(b"someone's")
    run = run_cli([*job["argv"], "--out", out, *(["--overwrite"] if overwrite else [])])
    assert_clean(run)
    assert run.code == 1 and "in the way" in run.err
    assert (out / "dp00000-of-00002-steps-000000-000001.parquet").read_bytes() == b"someone's"
    (out / "dp00000-of-00002-steps-000000-000001.parquet").unlink()
    (out / "manifest.json").write_text('{"not": "ours"}')
    run = run_cli([*job["argv"], "--out", out, *(["--overwrite"] if overwrite else [])])
    assert run.code == 1 and "not a ringpack shard record" in run.err
    assert (out / "manifest.json").read_text() == '{"not": "ours"}'


def test_refuses_an_output_that_is_or_holds_the_input(job, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(job["argv"][1], folder / "ids.jsonl")
    rest = job["argv"][2:]
    for source, out in [
        (folder, folder),
        (folder, folder / "shards"),
        (folder / "ids.jsonl", folder),
        (folder / "ids.jsonl", folder / "ids.jsonl"),
    ]:
        run = run_cli(["shard", source, *rest, "--out", out, "--overwrite"])
        assert_clean(run)
        assert run.code == 1 and str(out) in run.err
    assert sorted(p.name for p in folder.iterdir()) == ["ids.jsonl"]


def test_a_planted_link_is_replaced_not_written_through(job, tmp_path):
    """A shard swapped for a link to another file is rewritten as a file; the link's target is untouched."""
    out = tmp_path / "out"
    argv = [*job["argv"], "--out", out]
    assert run_cli(argv).code == 0
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    shard = out / "dp00001-of-00002-steps-000002-000003.parquet"
    shard.unlink()
    shard.symlink_to(victim)
    assert run_cli(argv).code == 0
    assert victim.read_bytes() == b"precious"
    assert not shard.is_symlink() and digests(out) == job["reference"]


def test_temporaries_are_exclusive(tmp_path, monkeypatch):
    """``atomic_write`` never opens an existing name: a link planted at its temporary name is skipped."""
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    names = iter(["aaaaaaaaaaaaaaaa", "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"])
    monkeypatch.setattr(_files.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".out.json.aaaaaaaaaaaaaaaa.tmp").symlink_to(victim)
    with _files.atomic_write(tmp_path / "out.json") as f:
        f.write(b"new")
    assert victim.read_bytes() == b"precious" and (tmp_path / "out.json").read_bytes() == b"new"
    assert not (tmp_path / ".out.json.bbbbbbbbbbbbbbbb.tmp").exists()
    with pytest.raises(RuntimeError), _files.atomic_write(tmp_path / "out.json") as f:
        f.write(b"half")
        raise RuntimeError("crash")
    assert (tmp_path / "out.json").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.json.aaaaaaaaaaaaaaaa.tmp", "out.json", "victim.bin"]


def test_only_durable_writes_are_fsynced(tmp_path, monkeypatch):
    """Shard files are fsynced before the rename; scratch files (``durable=False``) are renamed whole
    without it."""
    synced = []
    monkeypatch.setattr(_files.os, "fsync", lambda fd: synced.append(fd))
    for name, durable in (("shard.parquet", True), ("block.arrow", False)):
        with _files.atomic_write(tmp_path / name, durable=durable) as f:
            f.write(name.encode())
        assert (tmp_path / name).read_bytes() == name.encode()
    assert len(synced) == 1, "one fsync: the durable file's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["block.arrow", "shard.parquet"], "no temporaries left"
