"""``ringpack report PLAN...`` names each plan file's row by its file name (folders only to tell names apart)."""

from __future__ import annotations

import json

from tests.helpers.cli import run_cli, small_plan


def _report_names(tmp_path, paths) -> list[str]:
    out = tmp_path / "rep"
    run = run_cli(["report", *paths, "--out", out, "--no-plots", "--quiet"])
    assert run.code == 0, run.err
    return [p["name"] for p in json.loads((out / "report.json").read_text())["plans"]]


def test_plan_files_are_rows_named_by_file(tmp_path):
    small_plan(strategy="zigzag").save(tmp_path / "zig.parquet")
    small_plan().save(tmp_path / "bal.json")
    assert _report_names(tmp_path, [tmp_path / "zig.parquet", tmp_path / "bal.json"]) == ["zig.parquet", "bal.json"]


def test_equal_file_names_get_their_folders_and_a_file_given_twice_a_number(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        small_plan().save(tmp_path / folder / "plan.json")
    paths = [tmp_path / "a" / "plan.json", tmp_path / "b" / "plan.json", tmp_path / "a" / "plan.json"]
    assert _report_names(tmp_path, paths) == ["a/plan.json#1", "b/plan.json", "a/plan.json#2"]
