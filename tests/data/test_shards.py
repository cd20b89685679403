"""End to end: a real `datasets` dataset from local files (the stdlib corpus) -> `ringpack shard` ->
ShardReader on every (DP, CP) rank: every token exactly once, equal to the collator, resumable,
byte-identical on re-run, crash-safe, and loud about corruption and mismatches."""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from ringpack._files import file_sha256
from ringpack.attention import ScheduleOptions, compile_schedule
from ringpack.cli import main
from ringpack.data import BalancedBatchSampler, DataError, PackedCollator, PackedDataset, ShardReader
from ringpack.data import shard_writer as shards_mod
from ringpack.data.shard_writer import write_shards
from ringpack.data.sources import load_source, tokenize_dataset
from ringpack.planner.epoch import expand_overflow
from ringpack.shard_plan import PlanConfig
from ringpack.tokenizer import regex_token_ids
from tests.helpers.data import Coverage, batch_signature, corpus_jsonl

DP, CP, T = 2, 2, 4096
OPTS = dict(samples_per_step=64, overflow="split", seed=7)
ARGS = [
    "--dp",
    str(DP),
    "--cp",
    str(CP),
    "--tokens-per-rank",
    str(T),
    "--samples-per-step",
    "64",
    "--overflow",
    "split",
    "--seed",
    "7",
    "--no-progress",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    path = corpus_jsonl(root / "corpus.jsonl", 200)
    cache = str(root / "hf-cache")
    ds = tokenize_dataset(load_source(path, cache_dir=cache), "text")
    out = root / "shards"
    assert main(["shard", str(path), "--out", str(out), "--cache-dir", cache, *ARGS]) == 0
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    tokens = [np.asarray(regex_token_ids(t), dtype=np.int64) for t in texts]
    return {"path": path, "cache": cache, "ds": ds, "out": out, "tokens": tokens, "root": root}


def plan_docs(tokens):
    """The plan's samples: rows, cut into documents where overflow="split" cut them."""
    lengths = np.array([len(t) for t in tokens])
    doc_len, doc_row, doc_off = expand_overflow(lengths, CP * T)
    return [tokens[r][o : o + n] for n, r, o in zip(doc_len, doc_row, doc_off)]


def test_every_token_exactly_once_across_ranks(corpus):
    manifest = json.loads((corpus["out"] / "manifest.json").read_text())
    assert manifest["num_samples"] == 200 and len(manifest["files"]) == DP
    docs = plan_docs(corpus["tokens"])
    assert sum(len(d) for d in docs) == sum(len(t) for t in corpus["tokens"]) == manifest["num_tokens"]
    cov = Coverage(docs)
    counts = set()
    for d in range(DP):
        for c in range(CP):
            reader = ShardReader(corpus["out"], d, c, dp_size=DP, cp_size=CP, schedule=False)
            counts.add(cov.add_all(reader))
    assert len(counts) == 1
    cov.check_exactly_once()


def test_reader_matches_collator_and_resumes(corpus):
    ds = corpus["ds"]
    for d, c in ((0, 1), (1, 0)):
        sampler = BalancedBatchSampler(ds, d, DP, CP, T, **OPTS)
        reader = ShardReader(corpus["out"], d, c, schedule=False)
        assert sampler.plan_hash == reader.plan_hash
        collator = PackedCollator(c, CP, schedule=False)
        from_loader = [batch_signature(collator(PackedDataset(ds).__getitems__(t))) for t in sampler]
        full = [batch_signature(b) for b in reader]
        assert full == from_loader
        k = len(full) // 2 + 1
        r1 = ShardReader(corpus["out"], d, c, schedule=False)
        it = iter(r1)
        head = [batch_signature(next(it)) for _ in range(k)]
        state = r1.state_dict()
        r2 = ShardReader(corpus["out"], d, c, schedule=False)
        r2.load_state_dict(state)
        assert head + [batch_signature(b) for b in r2] == full


def test_rerun_is_byte_identical_and_resumes_after_crash(corpus, tmp_path, monkeypatch):
    ref = {p.name: file_sha256(p) for p in corpus["out"].iterdir()}
    # same inputs again into the same directory: nothing changes, byte for byte
    assert main(["shard", str(corpus["path"]), "--out", str(corpus["out"]), "--cache-dir", corpus["cache"], *ARGS]) == 0
    assert {p.name: file_sha256(p) for p in corpus["out"].iterdir()} == ref

    # a run that dies in the middle of the second file
    out = tmp_path / "crashed"
    config = PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **OPTS)
    calls = {"n": 0}
    real = shards_mod._microbatch_table

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 50:
            raise KeyboardInterrupt("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(shards_mod, "_microbatch_table", dying)
    with pytest.raises(KeyboardInterrupt):
        write_shards(corpus["ds"], out, config, progress=False, write_threads=1)
    monkeypatch.setattr(shards_mod, "_microbatch_table", real)
    assert not (out / "manifest.json").exists()
    assert (out / "dp00000-of-00002.parquet").exists() and not (out / "dp00001-of-00002.parquet").exists()
    with pytest.raises(DataError, match="interrupted"):
        ShardReader(out, 0, 0)
    first = file_sha256(out / "dp00000-of-00002.parquet")
    write_shards(
        corpus["ds"],
        out,
        config,
        progress=False,
        source=json.loads((corpus["out"] / "manifest.json").read_text())["source"],
        write_threads=3,
    )
    assert file_sha256(out / "dp00000-of-00002.parquet") == first
    assert {p.name: file_sha256(p) for p in out.iterdir()} == ref


def test_files_written_in_parallel_are_the_same_and_a_failure_leaves_whole_files(corpus, tmp_path, monkeypatch):
    """Three writing threads over many small files: the files equal one thread's; a file that fails
    stops the files not started, the others finish whole, no manifest is written, and a re-run
    completes the same files."""
    config = PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **OPTS)
    one = tmp_path / "one-thread"
    write_shards(corpus["ds"], one, config, progress=False, steps_per_file=1, write_threads=1)
    ref = {p.name: file_sha256(p) for p in one.iterdir()}
    assert len(ref) > 8

    out = tmp_path / "three-threads"
    real = shards_mod.write_shard_file

    def failing(out_dir, plan, file, rows, bar=None):
        if file.name == "dp00000-of-00002-steps-000000-000000.parquet":  # the first file, at once
            raise OSError("disk full (simulated)")
        time.sleep(0.2)  # the others take a while: the error comes while they are being written
        return real(out_dir, plan, file, rows, bar)

    monkeypatch.setattr(shards_mod, "write_shard_file", failing)
    with pytest.raises(OSError, match="disk full"):
        write_shards(corpus["ds"], out, config, progress=False, steps_per_file=1, write_threads=3)
    monkeypatch.setattr(shards_mod, "write_shard_file", real)
    assert not (out / "manifest.json").exists()
    written = {p.name: file_sha256(p) for p in out.iterdir() if p.name.endswith(".parquet")}
    assert written and all(ref[name] == sha for name, sha in written.items()), "every file left is whole"
    assert len(written) <= 3, "the files not started when the error came were left"
    write_shards(corpus["ds"], out, config, progress=False, steps_per_file=1, write_threads=3)
    assert {p.name: file_sha256(p) for p in out.iterdir()} == ref


def test_write_threads_must_be_a_count(corpus, tmp_path):
    config = PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **OPTS)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="write_threads"):
            write_shards(corpus["ds"], tmp_path / "out", config, progress=False, write_threads=bad)
    assert not (tmp_path / "out").exists()


def test_corrupt_and_truncated_files_name_the_file(corpus, tmp_path):
    for damage in ("flip", "truncate"):
        out = tmp_path / damage
        shutil.copytree(corpus["out"], out)
        victim = out / "dp00001-of-00002.parquet"
        data = bytearray(victim.read_bytes())
        if damage == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) - 100]
        victim.write_bytes(bytes(data))
        ShardReader(out, 0, 0)  # other ranks' files are not read
        with pytest.raises(DataError, match="checksum mismatch for .*dp00001-of-00002.parquet"):
            list(ShardReader(out, 1, 0))
        # a re-run repairs it
        write_shards(corpus["ds"], out, PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **OPTS), progress=False)
        assert len(list(ShardReader(out, 1, 0, schedule=False))) == len(ShardReader(out, 1, 0))


def test_mismatches_are_clear_errors(corpus, tmp_path):
    with pytest.raises(DataError, match="sharded for dp=2, cp=2"):
        ShardReader(corpus["out"], 0, 0, dp_size=4, cp_size=2)
    with pytest.raises(DataError, match="dp_rank 2"):
        ShardReader(corpus["out"], 2, 0)
    with pytest.raises(DataError, match="no manifest.json"):
        ShardReader(tmp_path, 0, 0)
    out = tmp_path / "other"
    shutil.copytree(corpus["out"], out)
    other = PlanConfig(dp=DP, cp=CP, tokens_per_rank=T, **{**OPTS, "seed": 8})
    with pytest.raises(DataError, match="another plan"):
        write_shards(corpus["ds"], out, other, progress=False)
    manifest = write_shards(corpus["ds"], out, other, progress=False, overwrite=True)
    assert ShardReader(out, 0, 0).plan_hash == manifest["plan_hash"]


def test_steps_per_file_and_bad_inputs(corpus, tmp_path, capsys):
    out = tmp_path / "ranges"
    small = corpus["ds"].select(range(60))
    m = write_shards(
        small,
        out,
        PlanConfig(dp=2, cp=2, tokens_per_rank=T, samples_per_step=16, overflow="drop"),
        steps_per_file=2,
        progress=False,
    )
    assert len(m["files"]) == 2 * -(-m["num_steps"] // 2) and all(
        f["row_groups"] == f["microbatches"] for f in m["files"]
    )
    assert m["dropped"], "the long rows were dropped"
    assert sum(len(list(ShardReader(out, d, 0, schedule=False))) for d in range(2)) == sum(
        f["microbatches"] for f in m["files"]
    )

    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["a b", "", "c"]) + "\n")
    base = [
        "--out",
        str(tmp_path / "x"),
        "--dp",
        "1",
        "--cp",
        "1",
        "--tokens-per-rank",
        "64",
        "--cache-dir",
        corpus["cache"],
        "--no-progress",
    ]
    assert main(["shard", str(jsonl), *base]) == 1
    assert "sample 1 has length 0" in capsys.readouterr().err
    assert main(["shard", str(jsonl), "--column", "ids", "--text-column", "body", *base]) == 1
    assert "no column 'body'" in capsys.readouterr().err
    assert main(["shard", str(tmp_path / "missing.parquet"), *base]) == 1
    assert "no dataset at" in capsys.readouterr().err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"input_ids": list(range(100))}) + "\n" + json.dumps({"input_ids": [1, 2]}) + "\n")
    assert main(["shard", str(long), *base]) == 1
    assert "sample 0" in capsys.readouterr().err


def test_exactly_once_after_mid_epoch_resume_reader_and_loader(corpus):
    """Interrupt every rank mid-epoch, restore in a fresh object, finish: still every token once,
    both from the shards and from the live DataLoader (workers, prefetch) on the datasets source."""
    from torch.utils.data import DataLoader

    docs = plan_docs(corpus["tokens"])
    from_shards, from_loader = Coverage(docs), Coverage(docs)
    ds = corpus["ds"]
    for d in range(DP):
        for c in range(CP):
            reader = ShardReader(corpus["out"], d, c, schedule=False)
            k = len(reader) // 3
            it = iter(reader)
            for _ in range(k):
                from_shards.add(next(it))
            state = reader.state_dict()
            resumed = ShardReader(corpus["out"], d, c, schedule=False)
            resumed.load_state_dict(state)
            assert from_shards.add_all(resumed) == len(reader) - k

            sampler = BalancedBatchSampler(ds, d, DP, CP, T, **OPTS)
            loader = DataLoader(
                PackedDataset(ds),
                batch_sampler=sampler,
                collate_fn=PackedCollator(c, CP, schedule=False),
                num_workers=1,
            )
            it = iter(loader)
            last = None
            for _ in range(k):
                last = next(it)
                from_loader.add(last)
            state = sampler.state_dict(cursor=last["cursor"])
            del it
            fresh = BalancedBatchSampler(ds, d, DP, CP, T, **OPTS)
            fresh.load_state_dict(state)
            loader = DataLoader(
                PackedDataset(ds), batch_sampler=fresh, collate_fn=PackedCollator(c, CP, schedule=False), num_workers=1
            )
            from_loader.add_all(loader)
    from_shards.check_exactly_once()
    from_loader.check_exactly_once()


def test_tokenizer_json_with_num_proc(tmp_path, corpus):
    vocab = {"[UNK]": 0, "def": 1, "return": 2, "x": 3, "(": 4, ")": 5, ":": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    jsonl = tmp_path / "t.jsonl"
    texts = ["def f(x): return x", "x y z", "return (x)"] * 10
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    args = [
        "shard",
        str(jsonl),
        "--out",
        str(out),
        "--dp",
        "1",
        "--cp",
        "2",
        "--tokens-per-rank",
        "16",
        "--samples-per-step",
        "8",
        "--tokenizer",
        str(tmp_path),
        "--num-proc",
        "2",
        "--cache-dir",
        corpus["cache"],
        "--no-progress",
    ]
    assert main(args) == 0
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    cov = Coverage([np.asarray(x) for x in ids])
    for c in range(2):
        cov.add_all(ShardReader(out, 0, c, schedule=False))
    cov.check_exactly_once()
    assert json.loads((out / "manifest.json").read_text())["source"]["tokenized_from"]["tokenizer"] == tmp_path.name


def test_reader_passes_schedule_options(corpus):
    """ShardReader(schedule_options=ScheduleOptions(...)) compiles the same schedule as compile_schedule
    with those options; the old dict spelling warns and reads the same."""
    keywords = {"dense_threshold": 2, "dense_buckets": None}
    batch = next(iter(ShardReader(corpus["out"], 0, 1, schedule=True, schedule_options=ScheduleOptions(**keywords))))
    want = compile_schedule(batch["microbatch"], 1, **keywords)
    assert batch["schedule"].local.dense == want.local.dense and batch["schedule"].local.dense
    with pytest.warns(DeprecationWarning, match="ScheduleOptions"):
        old = ShardReader(corpus["out"], 0, 1, schedule=True, schedule_options=keywords)
    assert next(iter(old))["schedule"].local.dense == want.local.dense
    with pytest.raises(DataError, match="unknown schedule option"), pytest.warns(DeprecationWarning):
        ShardReader(corpus["out"], 0, 1, schedule_options={"threshold": 2})
