"""A text --lengths: plan, report and simulate count the tokens shard writes, once; the length cache is
reused, refreshed when the file changes, and never trusted when damaged; errors never quote a text."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ringpack.cli.plan
import ringpack.cli.report
import ringpack.cli.simulate
import ringpack.lengths
from ringpack.shard_plan import Plan
from ringpack.tokenizer import regex_token_count
from tests.helpers.cli import assert_clean, run_cli, write_jsonl

SECRET = "confidential-payload-7f3a"
TEXTS = [f"def f{k}(x): return x + {k} # {'word ' * (k % 7)} {SECRET if k == 3 else ''}".strip() for k in range(30)] + [
    "",
    None,
]
MESH = ["--dp", 1, "--cp", 2, "--tokens-per-rank", 64, "--samples-per-step", 8, "--model", "tiny"]
HIT = "from the length cache"


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """The texts as JSON lines and Parquet (empty and null texts left out: no sample has 0 tokens), and a
    byte-level BPE tokenizer.json trained on them, whose counts differ from the regex tokenizer's."""
    root = tmp_path_factory.mktemp("texts")
    kept = [t for t in TEXTS if t]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        kept * 4, trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    bpe.save(str(root / "tokenizer.json"))
    pq.write_table(pa.table({"text": kept, "id": list(range(len(kept)))}), root / "texts.parquet")
    return {
        "root": root,
        ".jsonl": write_jsonl(root / "texts.jsonl", [{"text": t, "id": k} for k, t in enumerate(kept)]),
        ".parquet": root / "texts.parquet",
        "tokenizer": root / "tokenizer.json",
        "kept": kept,
    }


@pytest.fixture
def counted(monkeypatch):
    """Texts counted by every tokenizer run here (a counter that wraps the real one)."""
    calls = []
    real = ringpack.lengths.make_counter

    def counting(tokenizer):
        count = real(tokenizer)

        def run(batch):
            calls.append(len(batch))
            return count(batch)

        return run

    monkeypatch.setattr(ringpack.lengths, "make_counter", counting)
    return calls


def shard_counts(texts, source, tokenizer, tmp_path) -> np.ndarray:
    """The token counts of the ids ``ringpack shard`` writes for ``source``."""
    pytest.importorskip("datasets")
    out = tmp_path / "shards"
    argv = ["shard", source, *MESH, "--out", out, "--cache-dir", tmp_path / "hf", "--quiet", "--no-length-cache"]
    run = run_cli(argv + (["--tokenizer", tokenizer] if tokenizer else []))
    assert run.code == 0, run.err
    return np.asarray(Plan.load(out / "plan.parquet").lengths)


def spy(monkeypatch, module) -> list:
    """The lengths ``module``'s command reads from its flags."""
    seen = []
    real = module.lengths_from_args

    def recording(args):
        seen.append(real(args))
        return seen[-1]

    monkeypatch.setattr(module, "lengths_from_args", recording)
    return seen


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
@pytest.mark.parametrize("tokenizer", ["regex", "tokenizer.json"])
def test_plan_report_and_simulate_count_the_tokens_shard_writes(texts, suffix, tokenizer, tmp_path, monkeypatch):
    source = texts[suffix]
    spec = texts["tokenizer"] if tokenizer == "tokenizer.json" else None
    expected = shard_counts(texts, source, spec, tmp_path)
    regex = [regex_token_count(t) for t in texts["kept"]]
    assert (expected.tolist() == regex) == (spec is None)  # the trained tokenizer counts otherwise
    text = ["--text-column", "text", "--no-length-cache"] + (["--tokenizer", spec] if spec else [])
    plan = run_cli(["plan", "--lengths", source, *text, *MESH, "--out", tmp_path / "p.json", "--quiet"])
    assert plan.code == 0, plan.err
    assert np.asarray(Plan.load(tmp_path / "p.json").lengths).tolist() == expected.tolist()
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert Plan.load(tmp_path / "p.json").content_hash == manifest["plan_hash"]  # the very plan shard wrote
    for module, argv in (
        (ringpack.cli.report, ["report", "--out", tmp_path / "r", "--dp", 1, "--cp", 2, "--tokens-per-rank", 64]),
        (ringpack.cli.simulate, ["simulate", "--out", tmp_path / "s", "--world", 2, "--cp", 2, "--jobs", 1]),
    ):
        seen = spy(monkeypatch, module)
        run = run_cli([*argv, "--lengths", source, *text, "--model", "tiny", "--no-plots", "--quiet"])
        assert run.code == 0, run.err
        assert [s.tolist() for s in seen] == [expected.tolist()], argv[0]


def test_the_cache_is_hit_on_a_second_run_and_refreshed_when_the_file_changes(texts, tmp_path, counted):
    source = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts["kept"]])
    argv = ["plan", "--lengths", source, "--tokenizer", texts["tokenizer"], *MESH]
    first = run_cli([*argv, "--out", tmp_path / "1.json"])
    assert first.code == 0 and HIT not in first.err and sum(counted) == len(texts["kept"]), first.err
    counted.clear()
    second = run_cli([*argv, "--out", tmp_path / "2.json"])
    assert second.code == 0 and counted == [], second.err
    assert [line for line in second.err.splitlines() if HIT in line] == [
        f"ringpack plan: token counts of column 'text' of {source} from the length cache "
        "(--no-length-cache counts them again)"
    ]
    assert Plan.load(tmp_path / "1.json").content_hash == Plan.load(tmp_path / "2.json").content_hash
    assert run_cli([*argv, "--out", tmp_path / "q.json", "--quiet"]).err == ""  # --quiet: no line

    with source.open("a") as f:  # one more row: counted again, and the new counts cached
        f.write(json.dumps({"text": "one more row"}) + "\n")
    third = run_cli([*argv, "--out", tmp_path / "3.json"])
    assert third.code == 0 and HIT not in third.err and sum(counted) == len(texts["kept"]) + 1, third.err
    assert len(Plan.load(tmp_path / "3.json").lengths) == len(texts["kept"]) + 1
    counted.clear()
    assert HIT in run_cli([*argv, "--out", tmp_path / "4.json"]).err and counted == []


def test_another_tokenizer_or_column_is_another_entry(texts, tmp_path, counted):
    source = texts[".parquet"]
    base = ["plan", "--lengths", source, *MESH, "--out", tmp_path / "p.json"]
    for extra in (["--text-column", "text"], ["--tokenizer", texts["tokenizer"]]):
        assert HIT not in run_cli([*base, *extra, "--no-length-cache"]).err
    regex = run_cli([*base, "--text-column", "text"])
    bpe = run_cli([*base, "--tokenizer", texts["tokenizer"]])
    counted.clear()
    assert HIT in run_cli([*base, "--text-column", "text", "--vocab-size", 7]).err  # counts ignore the id range
    assert HIT in run_cli([*base, "--tokenizer", texts["root"]]).err  # the folder of the same tokenizer.json
    assert counted == [] and regex.code == bpe.code == 0


def test_a_damaged_cache_entry_is_ignored_and_rewritten(texts, tmp_path, counted):
    source = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts["kept"]])
    argv = ["plan", "--lengths", source, "--text-column", "text", *MESH]
    assert run_cli([*argv, "--out", tmp_path / "0.json"]).code == 0
    (entry,) = [p for p in entries() if _entry_of(p, source)]
    good = entry.read_bytes()
    for damaged in (good[:-3], good[:-8] + (10**6).to_bytes(8, "little"), b"garbage", b""):
        entry.write_bytes(damaged)
        counted.clear()
        run = run_cli([*argv, "--out", tmp_path / "p.json"])
        assert run.code == 0 and HIT not in run.err and counted, run.err
        assert Plan.load(tmp_path / "p.json").content_hash == Plan.load(tmp_path / "0.json").content_hash
        assert entry.read_bytes() == good  # written again, whole
    counted.clear()
    assert HIT in run_cli([*argv, "--out", tmp_path / "p.json"]).err and counted == []


def entries() -> list[Path]:
    """The length cache's entries (the tests' cache folder: tests/conftest.py)."""
    folder = Path(os.environ["RINGPACK_CACHE"], "lengths")
    return sorted(folder.iterdir()) if folder.is_dir() else []


def _entry_of(path: Path, source: Path) -> bool:
    return str(os.path.realpath(source)).encode() in path.read_bytes()


def test_no_length_cache_counts_and_stores_nothing(texts, tmp_path, counted):
    source = write_jsonl(tmp_path / "fresh.jsonl", [{"text": t} for t in texts["kept"]])
    argv = ["plan", "--lengths", source, "--text-column", "text", *MESH, "--no-length-cache"]
    for name in ("1.json", "2.json"):
        counted.clear()
        run = run_cli([*argv, "--out", tmp_path / name])
        assert run.code == 0 and HIT not in run.err and counted, run.err
    assert not any(_entry_of(p, source) for p in entries())


def test_shard_stores_the_counts_plan_reads(texts, tmp_path, counted):
    pytest.importorskip("datasets")
    source = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts["kept"]])
    shard = ["shard", source, *MESH, "--out", tmp_path / "shards", "--cache-dir", tmp_path / "hf", "--quiet"]
    assert run_cli([*shard, "--tokenizer", texts["tokenizer"]]).code == 0
    counted.clear()
    run = run_cli(["plan", "--lengths", source, "--tokenizer", texts["tokenizer"], *MESH, "--out", tmp_path / "p.json"])
    assert run.code == 0 and HIT in run.err and counted == [], run.err
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert Plan.load(tmp_path / "p.json").content_hash == manifest["plan_hash"]


def test_errors_on_a_text_column_name_it_and_the_file_and_never_quote_a_text(texts, tmp_path):
    pq.write_table(pa.table({"text": [SECRET * 3, "b"]}), tmp_path / "secret.parquet")
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"text": {"body": SECRET}}, {"text": "b"}])
    cases = [
        (["--lengths", texts[".jsonl"], "--column", "text"], "column 'text'"),
        (["--lengths", texts[".jsonl"]], "--text-column text"),
        (["--lengths", tmp_path / "secret.parquet", "--column", "text"], "column 'text' holds text"),
        (["--lengths", tmp_path / "secret.parquet", "--text-column", "body"], "no column 'body'"),
        (["--lengths", nested, "--text-column", "text"], "record 0 holds a dict value, not text"),
        (["--lengths", texts[".jsonl"], "--text-column", "id"], "record 0 holds a int value, not text"),
    ]
    for argv, said in cases:
        for command in ("plan", "report", "simulate"):
            out = tmp_path / ("p.json" if command == "plan" else command)
            mesh = MESH if command == "plan" else ["--model", "tiny", "--no-plots"]
            run = run_cli([command, *argv, *mesh, "--out", out, "--quiet"])
            assert_clean(run)
            path = str(argv[1])
            assert run.code == 1 and said in run.err and path in run.err, (command, run.err)
            assert SECRET not in run.err and SECRET not in run.out, (command, run.err)


def test_vocab_size_with_a_tokenizer_is_refused(texts, tmp_path):
    argv = ["plan", "--lengths", texts[".jsonl"], "--tokenizer", texts["tokenizer"], "--vocab-size", 9, *MESH]
    run = run_cli([*argv, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and "--vocab-size sets the id range of the regex tokenizer" in run.err


def test_a_saved_text_dataset_is_counted_and_without_datasets_refused_in_one_line(texts, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": texts["kept"]}).save_to_disk(str(saved))
    argv = ["plan", "--lengths", saved, *MESH, "--out", tmp_path / "p.json"]
    run = run_cli(argv)
    assert run.code == 1 and "count the tokens of its text with --text-column text" in run.err, run.err
    assert run_cli([*argv, "--text-column", "text"]).code == 0
    assert Plan.load(tmp_path / "p.json").lengths == tuple(regex_token_count(t) for t in texts["kept"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    run = run_cli([*argv, "--text-column", "text", "--no-length-cache"])
    assert_clean(run)
    assert run.code == 1 and "pip install datasets" in run.err and str(saved) in run.err
