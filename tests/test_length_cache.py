"""The length cache: a key that changes with the file, column and tokenizer; entries read back whole or not at
all (another key's, cut short, altered, not one); atomic writes; a folder that cannot be written is no error."""

from __future__ import annotations

import os

import numpy as np
import pytest

from ringpack import length_cache

LENGTHS = np.array([3, 1, 7, 2, 9], dtype=np.int64)


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"text": "a b"}\n')
    return path


def test_the_key_changes_with_the_file_the_column_and_the_tokenizer(source, tmp_path):
    key = length_cache.entry_key(source, "text", None)
    assert key == length_cache.entry_key(source, "text", "regex")  # the regex tokenizer by any name
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    assert length_cache.entry_key(source, "text", tok) == length_cache.entry_key(source, "text", tmp_path)
    others = [length_cache.entry_key(source, "body", None), length_cache.entry_key(source, "text", tok)]
    stat = source.stat()
    source.write_text('{"text": "a c"}\n')  # the same size, the same modification time: its bytes tell
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    others.append(length_cache.entry_key(source, "text", None))
    assert all(other != key for other in others)
    assert length_cache.entry_key(source, "text", lambda texts: [1] * len(texts)) is None  # a function: not cached
    assert length_cache.entry_key(tmp_path / "missing", "text", None) is None


def test_an_entry_reads_back_under_its_key_only(source, tmp_path):
    key = length_cache.entry_key(source, "text", None)
    assert length_cache.load(key, tmp_path / "c") is None
    entry = length_cache.store(key, LENGTHS, tmp_path / "c")
    assert entry is not None and [p.name for p in (tmp_path / "c").iterdir()] == [entry.name]  # no temporary left
    assert length_cache.load(key, tmp_path / "c").tolist() == LENGTHS.tolist()
    source.write_text('{"text": "a longer text"}\n')
    changed = length_cache.entry_key(source, "text", None)
    assert length_cache.load(changed, tmp_path / "c") is None  # the same entry file, another key
    assert length_cache.store(changed, LENGTHS[:2], tmp_path / "c") == entry  # replaced, not added
    assert length_cache.load(changed, tmp_path / "c").tolist() == LENGTHS[:2].tolist()


@pytest.mark.parametrize("damage", ["cut", "flip", "header", "empty", "magic"])
def test_a_damaged_entry_is_not_read(source, tmp_path, damage):
    key = length_cache.entry_key(source, "text", None)
    entry = length_cache.store(key, LENGTHS, tmp_path)
    data = entry.read_bytes()
    entry.write_bytes(
        {
            "cut": data[:-1],
            "flip": data[:-1] + bytes([data[-1] ^ 1]),
            "header": data.replace(b'"count": 5', b'"count": 4'),
            "empty": b"",
            "magic": b"x" + data,
        }[damage]
    )
    assert length_cache.load(key, tmp_path) is None


def test_a_folder_that_cannot_be_written_is_skipped(source, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    key = length_cache.entry_key(source, "text", None)
    assert length_cache.store(key, LENGTHS, blocker / "cache") is None  # its parent is a file
    assert length_cache.load(key, blocker / "cache") is None


def test_the_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("RINGPACK_CACHE", str(tmp_path))
    assert length_cache.cache_dir() == tmp_path / "lengths"
    monkeypatch.delenv("RINGPACK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert length_cache.cache_dir() == tmp_path / "xdg" / "ringpack" / "lengths"
    assert length_cache.cache_dir(tmp_path / "own") == tmp_path / "own"
