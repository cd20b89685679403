"""``ringpack shard --engine ray`` on a local Ray cluster: byte for byte the local engine's files whatever the
block size and the number of writing tasks, each block tokenized once and its ids spilled until the files are
written, resumable after the driver dies (spilled ids left behind rewritten), a worker that dies retried, bad
input and a too-long sample named by file and row. Without Ray installed, the engine says how to get it in
one line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ringpack.data import ray_shards
from ringpack.data.id_spill import SPILL_FOLDER
from ringpack.data.input_blocks import TokenSpec
from ringpack.data.shard_reader import ShardReader
from ringpack.errors import DataError
from ringpack.shard_plan import PlanConfig
from tests.helpers.cli import assert_clean, digests, run_cli
from tests.helpers.data import corpus_jsonl

ROOT = Path(__file__).resolve().parents[2]
MESH = ["--dp", "2", "--cp", "2", "--tokens-per-rank", "2048", "--samples-per-step", "16", "--overflow", "split"]
CONFIG = PlanConfig(dp=2, cp=2, tokens_per_rank=2048, samples_per_step=16, overflow="split")


def test_without_ray_the_engine_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    run = _shard_one_rank(data, tmp_path, "--engine", "ray")
    assert_clean(run)
    assert run.code == 1 and run.err.strip().endswith("pip install 'ringpack[ray]'")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--ray-address", "auto"], "--ray-address applies to --engine ray only"),
        (["--engine", "ray", "--num-proc", "2"], "--num-proc applies to --engine local only"),
    ],
)
def test_a_flag_of_the_other_engine_is_refused(flags, named, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b c"}\n')
    run = _shard_one_rank(data, tmp_path, *flags)
    assert_clean(run)
    assert run.code == 1 and named in run.err


def _shard_one_rank(data, tmp_path, *flags):
    """``ringpack shard DATA`` on one rank of 8 tokens, into ``tmp_path / "out"``, with ``flags``."""
    mesh = ["--dp", "1", "--cp", "1", "--tokens-per-rank", "8"]
    return run_cli(["shard", data, "--out", tmp_path / "out", *mesh, *flags, "--quiet"])


@pytest.fixture(scope="module")
def cluster():
    """A local two-CPU Ray cluster, small and quiet, for this module's tests; stopped after them."""
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},  # the workers import ringpack and these tests
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two JSON-lines files of stdlib text (a folder source) and their local engine's shards."""
    root = tmp_path_factory.mktemp("ray-corpus")
    (root / "data").mkdir()
    corpus_jsonl(root / "data" / "a.jsonl", 40)
    corpus_jsonl(root / "data" / "b.jsonl", 25)
    local = root / "local"
    argv = ["shard", root / "data", *MESH, "--steps-per-file", "2", "--cache-dir", root / "hf", "--quiet"]
    assert run_cli([*argv, "--out", local]).code == 0
    return {"root": root, "data": root / "data", "local": local, "argv": argv}


@pytest.mark.slow
@pytest.mark.parametrize("block_bytes, write_tasks", [(1 << 30, 1), (30_000, 5)])
def test_ray_writes_the_local_engines_bytes_tokenizing_once(
    cluster, corpus, tmp_path, block_bytes, write_tasks, monkeypatch
):
    monkeypatch.setattr(ray_shards, "RayOptions", _options(block_bytes=block_bytes, write_tasks=write_tasks))
    monkeypatch.setattr(ray_shards, "_measure_block", counted_measure)
    monkeypatch.setattr(ray_shards, "_write_group", write_without_reading)
    (corpus["root"] / "measured-blocks").unlink(missing_ok=True)
    argv = [a for a in corpus["argv"] if a not in ("--cache-dir", corpus["root"] / "hf")]
    run = run_cli([*argv, "--out", tmp_path / "ray", "--engine", "ray"])  # the corpus is text: tokenized
    assert_clean(run)
    assert run.code == 0
    assert digests(tmp_path / "ray") == digests(corpus["local"])
    assert len(list(ShardReader(tmp_path / "ray", 1, 1, schedule=False))) > 0
    measured = (corpus["root"] / "measured-blocks").read_text().split()
    assert len(measured) == len(set(measured)) > (1 if block_bytes < 1 << 20 else 0), "each block read once"
    assert not (tmp_path / "ray" / SPILL_FOLDER).exists(), "the spilled ids are removed with the manifest written"


def counted_measure(block, spec, *args):
    """``_measure_block`` that notes each block it reads in the corpus folder (the workers are other processes)."""
    with open(Path(block.path).parent.parent / "measured-blocks", "a") as f:
        f.write(f"{block.index}\n")
    return REAL_MEASURE(block, spec, *args)


def write_without_reading(*args):
    """``_write_group`` in a worker where reading or tokenizing a block of the source fails."""
    from ringpack.data import input_blocks, sources

    def refuse(*_, **__):
        raise AssertionError("a writing task read or tokenized the source")

    saved = [(m, n, getattr(m, n)) for m, n in ((input_blocks, "read_block"), (input_blocks, "encode_texts"))]
    saved += [(sources, "encode_texts", sources.encode_texts), (sources, "regex_token_ids", sources.regex_token_ids)]
    for module, name, _ in saved:
        setattr(module, name, refuse)
    try:
        return REAL_WRITE(*args)
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


def _options(**fixed):
    """``RayOptions`` with some fields fixed (the CLI builds its own)."""
    real = ray_shards.RayOptions
    return lambda **kwargs: real(**{**kwargs, **fixed})


@pytest.mark.slow
def test_a_run_whose_driver_died_resumes_to_the_same_bytes(cluster, corpus, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = ray_shards.ShardRun.record_finished
    calls = []

    def dying(self, name, sha256):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt("the driver dies")
        real(self, name, sha256)

    monkeypatch.setattr(ray_shards.ShardRun, "record_finished", dying)
    monkeypatch.setattr(ray_shards.Measured, "discard", lambda self: None)  # killed: nothing is cleaned up
    options = ray_shards.RayOptions(write_tasks=4, block_bytes=30_000)
    spec = TokenSpec(text_column="text")
    record = json.loads((corpus["local"] / "manifest.json").read_text())["source"]
    with pytest.raises(KeyboardInterrupt):
        ray_shards.write_shards_ray(
            corpus["data"], out, CONFIG, spec=spec, steps_per_file=2, options=options, progress=False, record=record
        )
    monkeypatch.undo()
    assert not (out / "manifest.json").exists() and (out / "_progress.json").exists()
    progress = json.loads((out / "_progress.json").read_text())
    assert len(progress["files_written"]) == 1
    spilled = sorted((out / SPILL_FOLDER).iterdir())
    assert len(spilled) > 1, "the dead driver left its spilled ids"
    spilled[0].write_bytes(spilled[1].read_bytes())  # stale ids of another block: never trusted
    (out / SPILL_FOLDER / "block-000999.arrow").write_bytes(b"stale")
    (out / "notes.txt").write_text("not ringpack's")
    ray_shards.write_shards_ray(
        corpus["data"], out, CONFIG, spec=spec, steps_per_file=2, options=options, progress=False, record=record
    )
    assert (out / "notes.txt").read_text() == "not ringpack's"
    (out / "notes.txt").unlink()
    assert not (out / SPILL_FOLDER).exists()
    assert digests(out) == digests(corpus["local"])


def dies_once(block, spec, *args):
    """``_measure_block`` whose worker process dies the first time it reads block 0 (a marker file remembers)."""
    marker = Path(block.path).parent.parent / "worker-died"
    if block.index == 0 and not marker.exists():
        marker.write_text("died")
        os._exit(1)
    return REAL_MEASURE(block, spec, *args)


REAL_MEASURE = ray_shards._measure_block
REAL_WRITE = ray_shards._write_group


@pytest.mark.slow
def test_a_killed_worker_is_retried_or_the_block_is_named(cluster, corpus, monkeypatch, tmp_path):
    monkeypatch.setattr(ray_shards, "_measure_block", dies_once)
    marker = corpus["root"] / "worker-died"
    spec = TokenSpec(text_column="text")
    options = ray_shards.RayOptions(max_retries=2)
    with ray_shards.measure(corpus["data"], spec, out_dir=tmp_path / "out", options=options, progress=False) as m:
        assert marker.exists() and len(m.lengths) == 65
        assert (tmp_path / "out" / SPILL_FOLDER / "block-000000.arrow").is_file()
    assert not (tmp_path / "out").exists(), "the spilled ids are removed, and the folder the run made"

    marker.unlink()
    options = ray_shards.RayOptions(max_retries=0)
    with pytest.raises(DataError, match=r"reading .*a\.jsonl \(block 0: bytes 0-\d+\) failed on Ray"):
        ray_shards.measure(corpus["data"], spec, out_dir=tmp_path / "out", options=options, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_bad_input_names_the_file_and_row(cluster, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text('{"input_ids": [1, 2]}\n{"input_ids": [3]}\n')
    (tmp_path / "data" / "b.jsonl").write_text('{"input_ids": [4]}\n{"input_ids": [5, -6]}\n')
    base = [
        "shard",
        tmp_path / "data",
        "--dp",
        "1",
        "--cp",
        "1",
        "--tokens-per-rank",
        "8",
        "--engine",
        "ray",
        "--quiet",
    ]
    run = run_cli([*base, "--out", tmp_path / "o1"])
    assert_clean(run)
    assert "column 'input_ids', sample 3: token id -6 is not an integer" in run.err
    assert f"[row 1 of {tmp_path / 'data' / 'b.jsonl'}]" in run.err
    (tmp_path / "data" / "b.jsonl").write_text('{"input_ids": [4]}\n{"input_ids": []}\n')
    run = run_cli([*base, "--out", tmp_path / "o2"])
    assert "sample 3 has length 0" in run.err and f"[row 1 of {tmp_path / 'data' / 'b.jsonl'}]" in run.err
    (tmp_path / "data" / "b.jsonl").write_text('{"input_ids": [4]}\n{"input_ids": [5\n')
    run = run_cli([*base, "--out", tmp_path / "o3"])
    assert_clean(run)
    assert f"cannot read {tmp_path / 'data' / 'b.jsonl'} (block 1: bytes 0-" in run.err
    assert not any((tmp_path / name / "manifest.json").exists() for name in ("o1", "o2", "o3"))
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3")), "spilled ids removed, folders too"


@pytest.mark.slow
def test_a_too_long_sample_is_refused_as_it_is_measured_naming_file_and_row(cluster, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("".join(json.dumps({"text": f"short {i}"}) + "\n" for i in range(3)))
    (tmp_path / "data" / "b.jsonl").write_text(json.dumps({"text": "x"}) + "\n" + json.dumps({"text": "w " * 50}))
    argv = ["shard", tmp_path / "data", "--dp", "1", "--cp", "2", "--tokens-per-rank", "8", "--quiet"]
    local = run_cli([*argv, "--out", tmp_path / "local", "--cache-dir", tmp_path / "hf"])
    ray = run_cli([*argv, "--out", tmp_path / "ray", "--engine", "ray"])
    assert_clean(ray)
    assert local.code == ray.code == 1
    message = local.err.splitlines()[-1]
    assert f"sample 4 of {tmp_path / 'data'} has 50 tokens, more than one CP group holds (cp=2" in message
    assert ray.err.splitlines()[-1] == f"{message} [row 1 of {tmp_path / 'data' / 'b.jsonl'}]"
    assert not (tmp_path / "ray").exists()


@pytest.mark.slow
def test_ray_tokenizes_with_a_tokenizer_json_as_the_local_engine(cluster, corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["def", "return", "self", "(", ")", ":", "import", "="])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    argv = ["shard", corpus["data"], *MESH, "--tokenizer", tmp_path / "tokenizer.json", "--quiet"]
    assert run_cli([*argv, "--out", tmp_path / "local", "--cache-dir", tmp_path / "hf"]).code == 0
    run = run_cli([*argv, "--out", tmp_path / "ray", "--engine", "ray", "--json"])
    assert_clean(run)
    assert run.code == 0 and json.loads(run.out)["files"] == 2
    assert digests(tmp_path / "ray") == digests(tmp_path / "local")
