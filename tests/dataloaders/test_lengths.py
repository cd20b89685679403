"""Lengths from datasets (Arrow offsets, length column, tokenizer + num_proc, streaming), files and arrays."""

from __future__ import annotations

import os
import time

import numpy as np
import pyarrow as pa
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
datasets = pytest.importorskip("datasets")

from ringpack.lengths import DataError, lengths_from_dataset, sample_lengths  # noqa: E402


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
    torch = pytest.importorskip("torch")
    assert sample_lengths(torch.tensor([2, 9])).tolist() == [2, 9]
    try:
        import ringpack.lengths  # noqa: F401
    except ImportError:
        pytest.skip("the balancer's file reader has not landed")
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
