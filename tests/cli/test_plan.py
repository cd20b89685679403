"""``ringpack plan`` writes the plan format its ``--out`` names, and refuses a name it has no format for."""

from __future__ import annotations

import numpy as np
import pytest

from ringpack.shard_plan import Plan
from tests.helpers.cli import assert_clean, run_cli

FLAGS = ["--dp", "2", "--cp", "2", "--tokens-per-rank", "4096", "--samples-per-step", "30", "--model", "tiny"]


@pytest.fixture
def lengths(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, np.random.default_rng(5).integers(1, 3000, size=100))
    return path


@pytest.mark.parametrize("name", ["plan.csv", "plan", "plan.JSON", "plan.parquet.tmp"])
def test_an_out_name_of_no_plan_format_is_refused_naming_the_flag_and_the_formats(lengths, tmp_path, name):
    run = run_cli(["plan", "--lengths", lengths, *FLAGS, "--out", tmp_path / name, "--quiet"])
    assert_clean(run)
    assert run.code == 1 and f"--out {tmp_path / name}" in run.err and ".parquet or .json" in run.err, run.err
    assert list(tmp_path.iterdir()) == [lengths]


@pytest.mark.parametrize("name", ["plan.parquet", "plan.json"])
def test_out_writes_the_format_its_suffix_names(lengths, tmp_path, name):
    assert run_cli(["plan", "--lengths", lengths, *FLAGS, "--out", tmp_path / name, "--quiet"]).code == 0
    head = (tmp_path / name).read_bytes()[:4]
    assert head == b"PAR1" if name.endswith(".parquet") else head.lstrip()[:1] == b"{"
    assert Plan.load(tmp_path / name).num_steps > 0


def test_the_partner_budget_is_a_flag_its_line_printed_and_a_bad_one_refused_in_one_line(lengths, tmp_path):
    out = tmp_path / "plan.json"
    run = run_cli(["plan", "--lengths", lengths, *FLAGS, "--max-partners", "8", "--host-time", "--out", out, "--quiet"])
    assert run.code == 0 and Plan.load(out).config.max_partners == 8
    assert "max_partners 8: partners per GPU and micro-batch median 1, max 1" in run.out, run.out
    assert "host time to compile one rank's schedule" in run.out
    bad = run_cli(["plan", "--lengths", lengths, *FLAGS, "--max-partners", "1", "--out", out, "--quiet"])
    assert_clean(bad)
    assert bad.code != 0 and "--max-partners" in bad.err and len(bad.err.strip().splitlines()) == 1, bad.err
