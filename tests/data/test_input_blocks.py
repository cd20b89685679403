"""A source cut into blocks of any size (the Ray engine's reads) gives the rows and token ids the local engine
reads, in the same order: Parquet row groups over several files, JSON lines, Arrow files and streams, CSV,
a saved DatasetDict, and text through the regex tokenizer. No Ray needed."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringpack.data.input_blocks import TokenSpec, block_token_ids, list_blocks
from ringpack.data.shard_writer import sample_digests
from ringpack.data.sources import load_source, source_files, tokenize_dataset
from ringpack.errors import DataError

ROWS = [[(7 * i + j) % 50 for j in range(1 + i % 5)] for i in range(23)]
TEXTS = [f"row {i} says: " + "word " * (i % 4) for i in range(23)]


def write_kind(kind, root):
    """The rows as a source of ``kind``; the path to pass."""
    table = pa.table({"input_ids": ROWS, "text": TEXTS})
    if kind == "parquet":
        (root / "p").mkdir()
        pq.write_table(table.slice(0, 10), root / "p" / "a.parquet", row_group_size=3)
        pq.write_table(table.slice(10), root / "p" / "b.parquet", row_group_size=4)
        return root / "p"
    if kind == "jsonl":
        path = root / "d.jsonl"
        path.write_text("".join(json.dumps({"input_ids": r, "text": t}) + "\n" for r, t in zip(ROWS, TEXTS)))
        return path
    if kind == "feather":
        import pyarrow.feather as feather

        feather.write_feather(table, root / "d.feather", chunksize=5)
        return root / "d.feather"
    if kind == "csv":
        path = root / "d.csv"
        path.write_text("text\n" + "".join(json.dumps(t) + "\n" for t in TEXTS))
        return path
    if kind == "saved":
        import datasets

        datasets.DatasetDict({"train": datasets.Dataset(table)}).save_to_disk(str(root / "saved"))
        return root / "saved"
    raise AssertionError(kind)


def blocks_ids(path, spec, block_bytes):
    blocks = list_blocks(source_files(path), block_bytes)
    parts = [block_token_ids(b, spec) for b in blocks]
    lengths = np.concatenate([p.lengths for p in parts])
    ids = np.concatenate([p.ids for p in parts])
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return len(blocks), [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])], sample_digests(ids, lengths)


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "feather", "csv", "saved"])
def test_blocks_of_any_size_read_the_local_engines_rows_in_its_order(kind, tmp_path):
    path = write_kind(kind, tmp_path)
    local = load_source(path, cache_dir=str(tmp_path / "hf"))
    if kind == "csv":
        spec = TokenSpec(text_column="text")
        want = tokenize_dataset(local, "text")["input_ids"]
    else:
        spec = TokenSpec()
        want = [list(map(int, r)) for r in local["input_ids"]]
    assert want != [] and (kind == "csv" or want == ROWS)
    n_small, small, digests_small = blocks_ids(path, spec, 1)
    n_big, big, digests_big = blocks_ids(path, spec, 1 << 30)
    assert small == big == want
    assert digests_small == digests_big
    if kind == "parquet":
        assert n_small == 4 + 4 and n_big == 2, "a block per row group when groups exceed the size, else runs"
    elif kind != "csv":
        assert n_small > n_big == 1, "small blocks cut the file"


def test_a_bad_block_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n{"input_ids": [3, -4]}\n{"input_ids": [5]\n')
    blocks = list_blocks(source_files(path), 10)
    assert block_token_ids(blocks[0], TokenSpec()).bad is None
    assert block_token_ids(blocks[1], TokenSpec()).bad == (0, -4)
    with pytest.raises(DataError, match=rf"cannot read {path} \(block 2: bytes 45-63\)"):
        block_token_ids(blocks[2], TokenSpec())
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="dataset file .*empty.jsonl is empty"):
        list_blocks(source_files(empty))


def test_tokenizing_a_dataset_held_in_memory_writes_the_ids_to_a_mapped_file(tmp_path):
    """An Arrow IPC file loads as a dataset without cache files; its token ids go to a memory-mapped file, not RAM."""
    path = write_kind("feather", tmp_path)
    loaded = load_source(path)
    assert not loaded.cache_files
    tokenized = tokenize_dataset(loaded, "text")
    assert tokenized.cache_files and type(tokenized.data).__name__ == "MemoryMappedTable"
    assert (
        tokenized["input_ids"]
        == tokenize_dataset(load_source(write_kind("jsonl", tmp_path), cache_dir=str(tmp_path / "hf")), "text")[
            "input_ids"
        ]
    )


@pytest.mark.parametrize("chunk_tokens", [1, 7, 1 << 23])
def test_the_local_engine_reads_ids_in_bounded_chunks_with_the_same_fingerprint(chunk_tokens, monkeypatch):
    """However few ids the local engine reads at a time, the fingerprint is the one of blocks of any size."""
    import datasets

    from ringpack.data import shard_writer
    from ringpack.data.shard_writer import DatasetFingerprint
    from ringpack.progress import Progress

    monkeypatch.setattr(shard_writer, "CHUNK_TOKENS", chunk_tokens)
    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    lengths = np.array([len(r) for r in ROWS])
    with Progress("checking", "samples", enabled=False) as bar:
        got = shard_writer._content_fingerprint(ds, "input_ids", lengths, bar)
    want = DatasetFingerprint()
    want.add(sample_digests(np.concatenate([np.asarray(r) for r in ROWS]), lengths))
    assert got == want.hexdigest(lengths)
    bad = datasets.Dataset.from_dict({"input_ids": [*ROWS[:20], [1, 2**31]]})
    with Progress("checking", "samples", enabled=False) as bar, pytest.raises(DataError, match="sample 20: token id"):
        shard_writer._content_fingerprint(bad, "input_ids", np.append(lengths[:20], 2), bar)
