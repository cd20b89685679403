"""Spilled token ids (the Ray engine's stage 1 to stage 3): any rows read back as written, in any order, from
the blocks' files; a file of another run refused; the folder's cleanup removes only ringpack's files; a too-long
row refused as soon as its block measures it. No Ray needed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.data.id_spill import SPILL_FOLDER, SpilledRows, SpillFolder, write_block_ids
from ringpack.data.input_blocks import TokenSpec, block_token_ids, list_blocks
from ringpack.data.sources import SampleTooLong, source_files
from ringpack.errors import DataError


def spill_blocks(out, blocks_lengths, seed=0):
    """Blocks of rows of the given lengths spilled into ``out``; the folder, the rows' ids and ``first_rows``."""
    rng = np.random.default_rng(seed)
    folder = SpillFolder(out)
    rows, first = [], [0]
    for k, lengths in enumerate(blocks_lengths):
        lengths = np.asarray(lengths, dtype=np.int64)
        ids = rng.integers(0, 2**31 - 1, size=int(lengths.sum())).astype(np.int32)
        write_block_ids(folder.block_path(k), folder.token, lengths, ids)
        rows += np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else []
        first.append(first[-1] + len(lengths))
    return folder, rows, np.asarray(first, dtype=np.int64)


def test_rows_read_back_in_any_order_across_blocks(tmp_path):
    folder, rows, first = spill_blocks(tmp_path / "out", [[3, 1, 5], [], [2, 7], [1]])
    paths = [folder.block_path(k) for k in range(4)]
    reader = SpilledRows(paths, first, folder.token)
    for wanted in ([0], [5, 0, 3, 3], [4, 2, 1, 0, 3, 5]):
        offsets, ids = reader(np.asarray(wanted, dtype=np.int64))
        assert offsets.dtype == np.int64 and offsets[0] == 0 and len(offsets) == len(wanted) + 1
        assert [ids[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])] == [rows[r].tolist() for r in wanted]
    assert not any(p.name.endswith(".tmp") for p in folder.path.iterdir())


def test_a_file_of_another_run_or_block_is_refused(tmp_path):
    folder, _, first = spill_blocks(tmp_path / "out", [[3, 1], [2]])
    paths = [folder.block_path(k) for k in range(2)]
    with pytest.raises(DataError, match=r"block-000000\.arrow is not this run's token ids"):
        SpilledRows(paths, first, "0" * 16)(np.asarray([0]))
    with pytest.raises(DataError, match=r"block-000001\.arrow is not this run's token ids \(1 rows, expected 2\)"):
        SpilledRows(paths, np.asarray([0, 2, 4]), folder.token)(np.asarray([3]))
    (folder.path / "block-000001.arrow").write_bytes(b"not arrow")
    with pytest.raises(DataError, match=r"cannot read spilled token ids .*block-000001\.arrow"):
        SpilledRows(paths, first, folder.token)(np.asarray([2]))


def test_cleanup_removes_ringpack_files_only(tmp_path, caplog):
    out = tmp_path / "out"
    folder, _, _ = spill_blocks(out, [[1], [2]])
    (folder.path / ".block-000003.arrow.0123456789abcdef.tmp").write_bytes(b"a retried task's leftover")
    again = SpillFolder(out)  # a later run: the old files are gone before it writes its own
    assert sorted(p.name for p in again.path.iterdir()) == []
    spill_blocks(out, [[1]])
    (again.path / "notes.txt").write_text("the user's")
    again.remove()
    assert (again.path / "notes.txt").read_text() == "the user's" and "left in place" in caplog.text
    (again.path / "notes.txt").unlink()
    again.remove()
    assert not again.path.exists() and out.is_dir(), "this run found the shard folder: it stays"
    folder.remove()
    assert not out.exists(), "the first run created the shard folder, left empty: gone too"
    (tmp_path / "kept").mkdir()
    SpillFolder(tmp_path / "kept").remove()
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / SPILL_FOLDER).exists()
    (tmp_path / "kept" / SPILL_FOLDER).write_text("a file")
    with pytest.raises(DataError, match="is in the way"):
        SpillFolder(tmp_path / "kept")


@pytest.mark.parametrize("spec", [TokenSpec(), TokenSpec(text_column="text")])
def test_a_block_refuses_a_row_over_max_tokens_as_soon_as_it_is_measured(tmp_path, spec):
    path = tmp_path / "d.jsonl"
    records = [{"input_ids": [1] * n, "text": " ".join(["w"] * n)} for n in (3, 9, 4, 12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    (block,) = list_blocks(source_files(path))
    with pytest.raises(SampleTooLong) as refused:
        block_token_ids(block, spec, max_tokens=8)
    assert (refused.value.row, refused.value.length) == (1, 9)
    assert len(block_token_ids(block, spec, max_tokens=12).lengths) == 4
