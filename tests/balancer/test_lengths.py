"""read_lengths: every format, integer and list columns (from offsets), clear errors."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

from ringpack.lengths import lengths_from_arrow, read_lengths

LENGTHS = np.array([3, 1, 7, 2, 9], dtype=np.int64)


def token_lists(lengths):
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.arange(offsets[-1], dtype=np.int32)))


@pytest.fixture
def files(tmp_path):
    table = pa.table({"input_ids": token_lists(LENGTHS), "text": ["a", "b", "c", "d", "e"], "length": LENGTHS})
    feather.write_feather(table, tmp_path / "t.feather")
    pq.write_table(table, tmp_path / "t.parquet")
    # datasets' cache files are IPC streams
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    np.save(tmp_path / "l.npy", LENGTHS)
    (tmp_path / "l.json").write_text(json.dumps(LENGTHS.tolist()))
    (tmp_path / "o.json").write_text(json.dumps({"lengths": LENGTHS.tolist()}))
    (tmp_path / "l.jsonl").write_text("\n".join(json.dumps({"length": int(x)}) for x in LENGTHS))
    return tmp_path


@pytest.mark.parametrize("name", ["t.feather", "t.parquet", "stream.arrow"])
@pytest.mark.parametrize("column", [None, "length", "input_ids"])
def test_arrow_and_parquet(files, name, column):
    assert read_lengths(files / name, column).tolist() == LENGTHS.tolist()


@pytest.mark.parametrize("name", ["l.npy", "l.json", "o.json", "l.jsonl"])
def test_numpy_and_json(files, name):
    assert read_lengths(files / name).tolist() == LENGTHS.tolist()


def test_sliced_and_chunked_list_arrays():
    lists = token_lists(LENGTHS)
    assert lengths_from_arrow(lists.slice(1, 3)).tolist() == LENGTHS[1:4].tolist()
    chunked = pa.chunked_array([lists.slice(0, 2), lists.slice(2, 3)])
    assert lengths_from_arrow(chunked).tolist() == LENGTHS.tolist()
    large = pa.array([[1, 2], [3]], type=pa.large_list(pa.int64()))
    assert lengths_from_arrow(large).tolist() == [2, 1]


def test_errors_name_file_and_column(files):
    with pytest.raises(ValueError, match=r"t.parquet: no column 'nope'"):
        read_lengths(files / "t.parquet", "nope")
    with pytest.raises(ValueError, match=r"t.feather, column 'text' has type string"):
        read_lengths(files / "t.feather", "text")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_lengths(files / "missing.parquet")
    (files / "x.csv").write_text("1\n2\n")
    with pytest.raises(ValueError, match="unknown lengths format"):
        read_lengths(files / "x.csv")
    pq.write_table(pa.table({"a": [1], "b": [2]}), files / "ambiguous.parquet")
    with pytest.raises(ValueError, match="cannot tell which column"):
        read_lengths(files / "ambiguous.parquet")
