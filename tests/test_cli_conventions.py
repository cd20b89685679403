"""What every command shares: the same input formats (and the library's too), one overflow default,
hints that name flags on the command line and keywords in Python, progress on stderr (a bar on a
terminal, a few log lines elsewhere, nothing with ``--quiet``), notes through ``logging``, and
``ringpack shard``'s summary."""

from __future__ import annotations

import io
import json
import logging
import re
import sys

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest

import ringpack
import ringpack.progress
from ringpack.cli import LENGTHS_HELP, build_parser, parse
from ringpack.errors import PlanError
from ringpack.lengths import FORMATS
from ringpack.progress import Progress
from ringpack.shard_plan import Plan, PlanConfig
from tests.helpers.cli import assert_clean, run_cli

LENGTHS = np.random.default_rng(3).integers(1, 120, size=40)
ROWS = [np.random.default_rng(int(n)).integers(0, 1000, int(n)).tolist() for n in LENGTHS]
MESH = ["--dp", "2", "--cp", "2", "--tokens-per-rank", "256", "--model", "tiny"]
#: Every source the lengths flags take (FORMATS), by name.
LENGTHS_SOURCES = ("saved", ".arrow", ".feather", ".parquet", ".json", ".jsonl", ".npy")
#: Every token-id source ``ringpack shard`` takes, by name.
SHARD_SOURCES = ("saved", ".arrow", ".feather", ".parquet", ".jsonl")


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("conventions")
    lengths, tokens = {}, {}
    ids = pa.table({"input_ids": pa.array(ROWS, type=pa.list_(pa.int64()))})
    by_length = pa.table({"length": LENGTHS})
    datasets.Dataset(ids).save_to_disk(str(root / "saved"))
    lengths["saved"] = tokens["saved"] = root / "saved"
    for name, table in (("lengths", by_length), ("tokens", ids)):
        with pa.ipc.new_stream(root / f"{name}.arrow", table.schema) as writer:  # as datasets caches are
            writer.write_table(table)
        feather.write_feather(table, root / f"{name}.feather")  # the IPC file format
        pq.write_table(table, root / f"{name}.parquet")
        target = lengths if name == "lengths" else tokens
        for suffix in (".arrow", ".feather", ".parquet"):
            target[suffix] = root / f"{name}{suffix}"
    (root / "lengths.json").write_text(json.dumps(LENGTHS.tolist()))
    (root / "lengths.jsonl").write_text("".join(json.dumps({"length": int(n)}) + "\n" for n in LENGTHS))
    (root / "tokens.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in ROWS))
    np.save(root / "lengths.npy", LENGTHS)
    lengths.update({s: root / f"lengths{s}" for s in (".json", ".jsonl", ".npy")})
    tokens[".jsonl"] = root / "tokens.jsonl"
    return {"root": root, "lengths": lengths, "tokens": tokens, "cache": str(root / "hf-cache")}


# ------------------------------------------------------------------------------------ input formats
def test_the_tested_sources_are_the_documented_ones():
    suffixes = set(re.findall(r"\.\w+", FORMATS))
    assert suffixes == set(LENGTHS_SOURCES) - {"saved"} and "saved `datasets` folder" in FORMATS


@pytest.mark.parametrize("source", LENGTHS_SOURCES)
def test_plan_report_and_simulate_read_every_format(inputs, source, tmp_path):
    path = inputs["lengths"][source]
    run = run_cli(["plan", "--lengths", path, *MESH, "--samples-per-step", "20", "--out", tmp_path / "p.json"])
    assert run.code == 0, run.err
    assert sorted(Plan.load(tmp_path / "p.json").lengths) == sorted(LENGTHS.tolist())
    run = run_cli(["report", "--lengths", path, *MESH, "--out", tmp_path / "r", "--no-plots", "--quiet", "--json", "-"])
    assert run.code == 0, run.err
    assert all(p["summary"]["tokens"] == LENGTHS.sum() for p in json.loads(run.out)["plans"])
    argv = ["simulate", "--lengths", path, "--world", "4", "--cp", "2", "--tokens-per-rank", "256", "--jobs", "1"]
    run = run_cli([*argv, "--out", tmp_path / "s", "--no-plots", "--quiet", "--json", "-"])
    assert run.code == 0, run.err
    assert json.loads(run.out)["lengths"]["samples"] == len(LENGTHS)


@pytest.mark.parametrize("source", LENGTHS_SOURCES)
def test_the_library_reads_every_format(inputs, source):
    want = ringpack.plan(LENGTHS, dp=2, cp=2, tokens_per_rank=256).content_hash
    assert ringpack.plan(inputs["lengths"][source], dp=2, cp=2, tokens_per_rank=256).content_hash == want


def test_the_library_plans_datasets_by_token_ids_or_length_column():
    want = ringpack.plan(LENGTHS, dp=2, cp=2, tokens_per_rank=256).content_hash
    by_ids = datasets.Dataset.from_dict({"input_ids": ROWS, "text": ["x"] * len(ROWS)})
    by_length = datasets.Dataset.from_dict({"num_tokens": LENGTHS.tolist(), "text": ["x"] * len(ROWS)})
    for source in (by_ids, by_length, by_ids.to_iterable_dataset()):
        assert ringpack.plan(source, dp=2, cp=2, tokens_per_rank=256).content_hash == want
    with pytest.raises(ValueError, match="no column 'input_ids'.*text_column"):
        ringpack.plan(datasets.Dataset.from_dict({"text": ["a b"]}), dp=1, cp=1, tokens_per_rank=8)


@pytest.mark.parametrize("source", SHARD_SOURCES)
def test_shard_reads_every_dataset_format(inputs, source, tmp_path):
    argv = ["shard", inputs["tokens"][source], "--out", tmp_path / "shards", *MESH, "--samples-per-step", "20"]
    run = run_cli([*argv, "--cache-dir", inputs["cache"], "--quiet", "--json"])
    assert run.code == 0, run.err
    summary = json.loads(run.out)
    assert summary["samples"] == len(LENGTHS) and summary["tokens"] == LENGTHS.sum()


def test_shard_refuses_lengths_only_files_in_one_line(inputs, tmp_path):
    run = run_cli(["shard", inputs["lengths"][".npy"], "--out", tmp_path / "shards", *MESH, "--quiet"])
    assert_clean(run)
    assert run.code == 1 and "lengths, not token ids" in run.err and "ringpack plan --lengths" in run.err


def test_lengths_help_is_one_string_that_names_no_unread_format():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    helps = {name: next((a.help for a in commands[name]._actions if a.dest == "lengths"), None) for name in commands}
    helps = {name: text for name, text in helps.items() if text}
    assert set(helps) == {"plan", "report", "simulate"}
    assert all(text.startswith(LENGTHS_HELP) for text in helps.values())
    assert all(".txt" not in text for text in helps.values())


def test_a_saved_folder_without_datasets_is_one_clear_line(inputs, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` raises ImportError
    run = run_cli(["plan", "--lengths", inputs["lengths"]["saved"], *MESH, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and "pip install datasets" in run.err


def test_a_dataset_dict_folder_names_its_splits(tmp_path):
    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(tmp_path / "dict"))
    run = run_cli(["plan", "--lengths", tmp_path / "dict", *MESH, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and "['test', 'train']" in run.err and "dict/train" in run.err
    assert run_cli(["plan", "--lengths", tmp_path / "dict" / "train", *MESH, "--out", tmp_path / "p.json"]).code == 0


# ---------------------------------------------------------------------------------------- overflow
@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--lengths", "x", "--dp", "1", "--cp", "1", "--tokens-per-rank", "8", "--out", "p.json"],
        ["report", "--lengths", "x"],
        ["simulate"],
        ["shard", "data", "--out", "o", "--dp", "1", "--cp", "1", "--tokens-per-rank", "8"],
    ],
)
def test_one_overflow_default(argv):
    assert parse(argv).overflow == "error"


def test_hints_name_flags_on_the_command_line_and_keywords_in_python(tmp_path):
    path = tmp_path / "long.json"
    path.write_text(json.dumps([10, 900, 20, 30]))
    runs = {
        "plan": ["plan", "--lengths", path, *MESH, "--out", tmp_path / "p.json"],
        "report": ["report", "--lengths", path, *MESH, "--out", tmp_path / "r", "--no-plots", "--quiet"],
        "simulate": ["simulate", "--lengths", path, "--world", "4", "--cp", "2", "--tokens-per-rank", "256"],
    }
    for command, argv in runs.items():
        run = run_cli(argv + (["--out", tmp_path / "s", "--no-plots", "--quiet"] if command == "simulate" else []))
        assert_clean(run)
        assert run.code == 1 and "--overflow split" in run.err and "overflow=" not in run.err, run.err
    with pytest.raises(PlanError) as info:
        ringpack.plan([10, 900, 20, 30], dp=2, cp=2, tokens_per_rank=256)
    assert "overflow='split'" in str(info.value) and "--" not in str(info.value)


def test_an_ambiguous_column_is_named_by_flag_or_keyword(tmp_path):
    pq.write_table(pa.table({"a": LENGTHS, "b": LENGTHS}), tmp_path / "two.parquet")
    run = run_cli(["plan", "--lengths", tmp_path / "two.parquet", *MESH, "--out", tmp_path / "p.json"])
    assert run.code == 1 and "name it with --column" in run.err
    with pytest.raises(ValueError, match="name it with column$"):
        ringpack.plan(tmp_path / "two.parquet", dp=1, cp=1, tokens_per_rank=512)
    assert ringpack.plan(tmp_path / "two.parquet", column="b", dp=1, cp=1, tokens_per_rank=512).validate()


# ---------------------------------------------------------------------------------------- progress
def test_progress_is_logged_off_a_terminal_and_silenced_by_quiet(inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(ringpack.progress, "LOG_INTERVAL_S", 0.0)
    plan = ["plan", "--lengths", inputs["lengths"][".npy"], *MESH, "--samples-per-step", "10"]
    run = run_cli([*plan, "--out", tmp_path / "p.json"])
    assert run.code == 0 and "\r" not in run.err
    lines = run.err.splitlines()
    assert "ringpack plan: planning 40 samples: 1/4 steps (25%)" in lines[0]
    assert any(line.startswith("ringpack plan: planning 40 samples: 4/4 steps (100%)") for line in lines)
    assert run_cli([*plan, "--out", tmp_path / "q.json", "--quiet"]).err == ""
    shard = ["shard", inputs["tokens"][".jsonl"], *MESH, "--cache-dir", inputs["cache"]]
    err = run_cli([*shard, "--out", tmp_path / "shards"]).err
    assert "planning: " in err and " steps (" in err and " samples (" in err and " micro-batches (" in err
    assert " mb" not in err and "\r" not in err
    assert run_cli([*shard, "--out", tmp_path / "shards2", "--quiet"]).err == ""
    report = ["report", "--lengths", inputs["lengths"][".npy"], *MESH, "--out", tmp_path / "r", "--no-plots"]
    err = run_cli(report).err
    assert "x 6 variants and 2 peers: " in err and " samples (" in err
    simulate = ["simulate", "--lengths", inputs["lengths"][".npy"], "--world", "4", "--cp", "2", "--jobs", "1"]
    err = run_cli([*simulate, "--tokens-per-rank", "256", "--out", tmp_path / "s", "--no-plots"]).err
    assert " samples (" in err


def test_short_work_logs_nothing_and_a_terminal_gets_a_bar(inputs, tmp_path):
    run = run_cli(["plan", "--lengths", inputs["lengths"][".npy"], *MESH, "--out", tmp_path / "p.json"])
    assert run.code == 0 and run.err == ""  # done well within LOG_INTERVAL_S

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    with Progress("writing shards", "micro-batches", 8, stream=screen) as bar:
        bar.update(3)
        bar.update(5)
    assert "\r" in screen.getvalue() and "8/8 micro-batches" in screen.getvalue()


# ---------------------------------------------------------------------------------- logging, output
def test_the_library_logs_instead_of_printing(inputs, tmp_path, capsys, caplog):
    from ringpack.data import write_shards

    ds = datasets.Dataset.from_dict({"input_ids": ROWS})
    config = PlanConfig(dp=2, cp=2, tokens_per_rank=256, samples_per_step=20)
    with caplog.at_level(logging.INFO, logger="ringpack"):
        first = write_shards(ds, tmp_path / "shards", config)
        ringpack.plan(LENGTHS, dp=2, cp=2, tokens_per_rank=256)
        assert write_shards(ds, tmp_path / "shards", config)["plan_hash"] == first["plan_hash"]  # a re-run
    assert capsys.readouterr() == ("", "")
    kept = [r.getMessage() for r in caplog.records if r.name == "ringpack.data.shards"]
    assert kept == [f"{tmp_path / 'shards'}: 2 of 2 shard files already written, kept"]


def test_notes_are_warnings_on_stderr(inputs, tmp_path):
    argv = ["plan", "--lengths", inputs["lengths"][".npy"], "--dp", "2", "--cp", "1", "--tokens-per-rank", "60"]
    run = run_cli([*argv, "--overflow", "drop", "--out", tmp_path / "p.json", "--quiet"])
    assert run.code == 0 and "dropped" not in run.out
    assert run.err.startswith("ringpack plan: warning: dropped ") and "(--overflow drop)" in run.err, run.err


def test_shard_ends_with_a_human_summary(inputs, tmp_path):
    out = tmp_path / "shards"
    run = run_cli(["shard", inputs["tokens"]["saved"], *MESH, "--out", out, "--quiet"])
    assert run.code == 0, run.err
    manifest = json.loads((out / "manifest.json").read_text())
    lines = run.out.splitlines()
    assert len(lines) == 3 and not run.out.lstrip().startswith("{")
    assert f"sharded {len(LENGTHS)} samples ({LENGTHS.sum():,} tokens)" in lines[0] and "dp=2 x cp=2" in lines[0]
    assert f"wrote {len(manifest['files'])} shard files (" in lines[1] and str(out) in lines[1]
    assert manifest["plan_hash"][:16] in lines[2]
