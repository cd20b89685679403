"""A tokenizer.json the tokenizers library cannot read is one line naming the file, wherever it is loaded."""

from __future__ import annotations

import pytest

from ringpack.data.sources import load_source, tokenize_dataset
from ringpack.errors import DataError
from ringpack.tokenizer import load_tokenizer, load_tokenizer_counter, make_counter
from tests.helpers.cli import assert_clean, run_cli, token_rows, write_jsonl

MESH = ["--dp", 1, "--cp", 1, "--tokens-per-rank", 512]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    text = write_jsonl(root / "text.jsonl", [{"text": " ".join(map(str, r))} for r in token_rows(12)])
    (root / "broken_tokenizer").mkdir()
    (root / "broken_tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    (root / "not_a_tokenizer.json").write_text('{"version": "1.0"}')
    return {"root": root, "text": text, "cache": root / "cache"}


@pytest.mark.parametrize("name", ["broken_tokenizer", "broken_tokenizer/tokenizer.json", "not_a_tokenizer.json"])
def test_a_broken_tokenizer_is_one_line_naming_the_file(inputs, tmp_path, name):
    path = inputs["root"] / name
    file = path / "tokenizer.json" if path.is_dir() else path
    argv = ["shard", inputs["text"], "--out", tmp_path / "out", *MESH, "--cache-dir", inputs["cache"], "--quiet"]
    run = run_cli([*argv, "--tokenizer", path])
    assert_clean(run)
    assert run.code == 1 and f"tokenizer file {file} is not a Hugging Face tokenizer.json" in run.err, run.err
    assert not (tmp_path / "out").exists()
    for load in (load_tokenizer, load_tokenizer_counter, make_counter):
        with pytest.raises(DataError, match=f"tokenizer file {file}"):
            load(path)
    ds = load_source(inputs["text"], cache_dir=inputs["cache"])
    with pytest.raises(DataError, match=f"tokenizer file {file}"):
        tokenize_dataset(ds, "text", str(path))
