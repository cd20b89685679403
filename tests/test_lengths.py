"""Sample lengths: files of every format (integer and list columns), Arrow arrays, datasets (offsets, length
column, tokenizer + num_proc, streaming) and arrays; bad input gets an error that names it."""

from __future__ import annotations

import json
import time

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
import torch

from ringpack.lengths import DataError, lengths_from_arrow, lengths_from_dataset, read_lengths, sample_lengths

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
    with pytest.raises(ValueError, match=r"t.feather, column 'text' holds text, not lengths: count its tokens"):
        read_lengths(files / "t.feather", "text")
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        read_lengths(files / "missing.parquet")
    (files / "x.csv").write_text("1\n2\n")
    with pytest.raises(ValueError, match="unknown lengths format"):
        read_lengths(files / "x.csv")
    pq.write_table(pa.table({"a": [1], "b": [2]}), files / "ambiguous.parquet")
    with pytest.raises(ValueError, match="cannot tell which column"):
        read_lengths(files / "ambiguous.parquet")


def list_dataset(lengths: np.ndarray) -> datasets.Dataset:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = pa.array(np.arange(offsets[-1], dtype=np.int32) % 1000)
    return datasets.Dataset(pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), values)}))


def test_one_million_rows_under_a_second():
    lengths = np.random.default_rng(0).integers(1, 64, 1_000_000)
    ds = list_dataset(lengths)
    t0 = time.perf_counter()
    out = sample_lengths(ds)
    elapsed = time.perf_counter() - t0
    assert np.array_equal(out, lengths)
    assert elapsed < 1.0, f"1M rows took {elapsed:.2f} s"


def test_select_and_shuffle_index_mappings():
    lengths = np.random.default_rng(1).integers(1, 50, 1000)
    ds = list_dataset(lengths)
    assert np.array_equal(sample_lengths(ds.select(range(10, 900, 7))), lengths[10:900:7])
    shuffled = ds.shuffle(seed=3)
    assert np.array_equal(sample_lengths(shuffled), np.array([len(r) for r in shuffled["input_ids"]]))


def test_length_column_text_column_and_streaming():
    ds = datasets.Dataset.from_dict({"text": ["def f(x): return x", "a b", "x = [1, 2]"], "n": [3, 1, 4]})
    assert sample_lengths(ds, length_column="n").tolist() == [3, 1, 4]
    counts = sample_lengths(ds, text_column="text")
    assert counts.tolist() == [8, 2, 7]
    assert sample_lengths(ds, text_column="text", num_proc=2).tolist() == counts.tolist()
    assert sample_lengths(ds, text_column="text", tokenizer=lambda texts: [len(t) for t in texts]).tolist() == [
        18,
        3,
        10,
    ]
    ids = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3], [4, 5, 6]]})
    assert sample_lengths(ids.to_iterable_dataset()).tolist() == [2, 1, 3]
    assert sample_lengths(ds.to_iterable_dataset(), text_column="text").tolist() == counts.tolist()


def test_arrays_and_files(tmp_path):
    assert sample_lengths([3, 4]).tolist() == [3, 4]
    assert sample_lengths(np.array([5], dtype=np.int32)).dtype == np.int64
    assert sample_lengths(torch.tensor([2, 9])).tolist() == [2, 9]
    path = tmp_path / "lengths.npy"
    np.save(path, np.array([7, 8, 9]))
    assert sample_lengths(path).tolist() == [7, 8, 9]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(DataError, match="sample 2 has length 0"):
        sample_lengths(datasets.Dataset.from_dict({"input_ids": [[1], [2, 3], []]}))
    with pytest.raises(DataError, match="no column 'input_ids'.*text_column"):
        sample_lengths(datasets.Dataset.from_dict({"text": ["a"]}))
    with pytest.raises(DataError, match="not a list of token ids"):
        lengths_from_dataset(datasets.Dataset.from_dict({"input_ids": [1, 2]}))
    with pytest.raises(DataError, match="sample 1 has length -2"):
        sample_lengths([3, -2])
    with pytest.raises(DataError, match="1-D"):
        sample_lengths([[1, 2]])


# ------------------------------------------------------------------------------- text files
TEXTS = ["def f(x): return x", "a b", "x = [1, 2]", "one", None, "the end."]


@pytest.fixture
def text_files(tmp_path, monkeypatch):
    """The same texts in every format sample_lengths counts, and a saved dataset of them; ``datasets``
    (which reads the CSV file) caches under ``tmp_path``."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    table = pa.table({"text": TEXTS, "n": list(range(len(TEXTS)))})
    pq.write_table(table, tmp_path / "t.parquet")
    feather.write_feather(table, tmp_path / "t.feather")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t, "n": k}) + "\n" for k, t in enumerate(TEXTS)))
    (tmp_path / "t.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    (tmp_path / "t.csv").write_text("text,n\n" + "".join(f'"{t or ""}",{k}\n' for k, t in enumerate(TEXTS)))
    datasets.Dataset(table).save_to_disk(str(tmp_path / "saved"))
    return tmp_path


def test_sample_lengths_counts_a_text_file_as_a_dataset_of_it(text_files, tmp_path):
    texts = [t for t in TEXTS if t]
    expected = lengths_from_dataset(datasets.Dataset.from_dict({"text": texts}), text_column="text", tokenizer=None)
    kept = pa.table({"text": texts})
    pq.write_table(kept, tmp_path / "kept.parquet")
    assert sample_lengths(tmp_path / "kept.parquet", text_column="text").tolist() == expected.tolist()
    for name in ("t.parquet", "t.feather", "t.jsonl", "t.json", "t.csv", "saved"):  # a null text has no token
        with pytest.raises(DataError, match=f"{name}, column 'text'.*sample 4 has length 0"):
            sample_lengths(text_files / name, text_column="text", cache=False)
    counts = sample_lengths(text_files / "t.jsonl", text_column="text", tokenizer=lambda batch: [7] * len(batch))
    assert counts.tolist() == [7] * len(TEXTS)


def test_sample_lengths_of_a_file_refuses_a_lengths_column_with_a_text_column(text_files):
    with pytest.raises(DataError, match="give one"):
        sample_lengths(text_files / "t.parquet", "n", text_column="text")
    with pytest.raises(DataError, match=r"apply to datasets, not files"):
        sample_lengths(text_files / "t.parquet", text_column="text", num_proc=2)
    with pytest.raises(DataError, match=r"t.parquet, column 'n' holds int64, not text"):
        sample_lengths(text_files / "t.parquet", text_column="n")
    with pytest.raises(DataError, match=r"t.jsonl: record 0 has no column 'body' \(its columns: text, n\)"):
        sample_lengths(text_files / "t.jsonl", text_column="body")


def test_sample_lengths_of_a_text_file_uses_the_length_cache(tmp_path, monkeypatch):
    import ringpack.lengths

    calls = []
    real = ringpack.lengths.make_counter
    monkeypatch.setattr(ringpack.lengths, "make_counter", lambda t: lambda b: calls.append(len(b)) or real(t)(b))
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS if t))
    first = sample_lengths(path, text_column="text", cache=tmp_path / "cache")
    assert calls and len(list((tmp_path / "cache").iterdir())) == 1
    calls.clear()
    assert sample_lengths(path, tokenizer="regex", cache=tmp_path / "cache").tolist() == first.tolist()
    assert calls == []
    assert sample_lengths(path, text_column="text", cache=False).tolist() == first.tolist() and calls
