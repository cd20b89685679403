"""A flag that does not apply to the input it is given is refused in one line, never silently ignored."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

import ringpack
from ringpack.data.sources import load_source
from ringpack.errors import DataError
from ringpack.lengths import read_lengths
from tests.helpers.cli import assert_clean, run_cli, token_rows, write_jsonl

MESH = ["--dp", 1, "--cp", 1, "--tokens-per-rank", 512]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    rows = token_rows(12)
    np.save(root / "lengths.npy", np.array([len(r) for r in rows]))
    (root / "lengths.json").write_text(json.dumps([len(r) for r in rows]))
    (root / "records.jsonl").write_text("".join(json.dumps({"n": len(r)}) + "\n" for r in rows))
    ids = write_jsonl(root / "ids.jsonl", [{"input_ids": r} for r in rows])
    text = write_jsonl(root / "text.jsonl", [{"text": " ".join(map(str, r))} for r in rows])
    (root / "folder").mkdir()
    write_jsonl(root / "folder" / "part.jsonl", [{"input_ids": r} for r in rows])
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(root / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": rows[:6]})}).save_to_disk(
        str(root / "saved_dict")
    )
    (root / "not_a_tokenizer.json").write_text('{"version": "1.0"}')
    return {"root": root, "ids": ids, "text": text, "cache": root / "cache"}


def one_line(run, *words) -> None:
    assert_clean(run)
    assert run.code == 1, (run.code, run.out, run.err)
    for word in words:
        assert str(word) in run.err, (word, run.err)


# ------------------------------------------------------------------------------------------ --column
@pytest.mark.parametrize("name", ["lengths.npy", "lengths.json"])
def test_plan_refuses_a_column_for_a_file_without_columns(inputs, tmp_path, name):
    path = inputs["root"] / name
    run = run_cli(["plan", "--lengths", path, "--column", "length", *MESH, "--out", tmp_path / "p.json"])
    one_line(run, "--column length does not apply", path)
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(DataError, match=r"column='length' does not apply"):
        read_lengths(path, column="length")
    with pytest.raises(DataError, match=r"column='length' does not apply"):
        ringpack.plan(str(path), column="length", dp=1, cp=1, tokens_per_rank=512)


def test_a_column_still_picks_a_column_where_there_are_columns(inputs):
    assert read_lengths(inputs["root"] / "records.jsonl", column="n").tolist() == [len(r) for r in token_rows(12)]
    assert read_lengths(inputs["root"] / "lengths.npy").size == 12


def test_report_and_simulate_refuse_a_column_without_lengths(inputs, tmp_path):
    plan = tmp_path / "plan.json"
    assert run_cli(["plan", "--lengths", inputs["root"] / "lengths.npy", *MESH, "--out", plan]).code == 0
    quiet = ["--no-plots", "--quiet"]
    one_line(run_cli(["report", plan, "--column", "n", "--out", tmp_path / "r", *quiet]), "--column n", "plan files")
    one_line(run_cli(["report", "--corpus", "stdlib", "--column", "n", "--out", tmp_path / "r", *quiet]), "--corpus")
    run = run_cli(["simulate", "--column", "n", "--world", 8, "--cp", 2, "--out", tmp_path / "s", *quiet])
    one_line(run, "--column n", "drawn lengths")


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--samples", 100], ["--samples", "--lengths"]),
        (["--dist", "lognormal", "--median", 100], ["--dist", "--median"]),
    ],
)
def test_simulate_refuses_drawing_flags_with_lengths(inputs, tmp_path, flags, words):
    argv = ["simulate", "--lengths", inputs["root"] / "lengths.npy", "--world", 8, "--cp", 2, *flags]
    one_line(run_cli([*argv, "--out", tmp_path / "s", "--no-plots", "--quiet"]), *words)


def test_simulate_refuses_log_normal_shape_for_the_corpus(tmp_path):
    run = run_cli(["simulate", "--sigma", 2, "--world", 8, "--cp", 2, "--out", tmp_path / "s", "--no-plots", "--quiet"])
    one_line(run, "--sigma", "--dist stdlib")


# ------------------------------------------------------------------------------------------ --split
@pytest.mark.parametrize("source", ["ids", "folder", "saved"])
def test_shard_refuses_a_split_for_a_source_without_splits(inputs, tmp_path, source):
    path = inputs[source] if source == "ids" else inputs["root"] / source
    argv = ["shard", path, "--out", tmp_path / "out", *MESH, "--split", "test", "--cache-dir", inputs["cache"]]
    one_line(run_cli([*argv, "--quiet"]), "--split test does not apply", path)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"split='train' does not apply"):
        load_source(path, split="train", cache_dir=inputs["cache"])


def test_a_split_picks_a_split_where_there_are_splits(inputs, tmp_path):
    saved = inputs["root"] / "saved_dict"
    assert len(load_source(saved)) == 6 and len(load_source(saved, split="train")) == 6
    with pytest.raises(DataError, match="not 'test'"):
        load_source(saved, split="test")
    run = run_cli(["shard", saved, "--out", tmp_path / "out", *MESH, "--split", "train", "--quiet"])
    assert run.code == 0, run.err
    assert len(load_source(inputs["ids"], cache_dir=inputs["cache"])) == 12


# ------------------------------------------------------------------------------------ tokenizing
def test_shard_refuses_every_tokenizing_flag_a_dataset_with_ids_does_not_use(inputs, tmp_path):
    argv = ["shard", inputs["ids"], "--out", tmp_path / "out", *MESH, "--cache-dir", inputs["cache"], "--quiet"]
    run = run_cli([*argv, "--vocab-size", 100, "--num-proc", 2])
    one_line(run, "--vocab-size 100, --num-proc 2 do not apply to a dataset with token ids")
    assert not (tmp_path / "out").exists()


def test_shard_refuses_a_vocab_size_for_a_tokenizer_file(inputs, tmp_path):
    tokenizer = inputs["root"] / "not_a_tokenizer.json"
    argv = ["shard", inputs["text"], "--out", tmp_path / "out", *MESH, "--cache-dir", inputs["cache"], "--quiet"]
    one_line(run_cli([*argv, "--tokenizer", tokenizer, "--vocab-size", 100]), "--vocab-size", tokenizer)
