"""``--config`` (TOML, JSON, YAML) holds the flags' keys, flags override it; ``plan --write-config`` round-trips."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from ringpack.shard_plan import Plan
from tests.helpers.cli import assert_clean, run_cli, token_rows

LENGTHS = np.random.default_rng(5).integers(1, 3000, size=200)
FLAGS = ["--dp", "2", "--cp", "2", "--tokens-per-rank", "4096", "--samples-per-step", "30", "--model", "tiny"]
SETTINGS = {"dp": 2, "cp": 2, "tokens_per_rank": 4096, "samples_per_step": 30, "model": "tiny"}


@pytest.fixture
def lengths(tmp_path):
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    return path


def write(path, settings: dict) -> str:
    """``settings`` as a config file of ``path``'s kind."""
    if path.suffix == ".json":
        path.write_text(json.dumps(settings))
    elif path.suffix == ".toml":
        path.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items()))
    else:
        import yaml

        path.write_text(yaml.safe_dump(settings))
    return str(path)


def plan_hash(argv: list) -> str:
    run = run_cli(["plan", *argv, "--json", "--quiet"])
    assert run.code == 0, run.err
    return json.loads(run.out)["hash"]


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml", ".yml"])
def test_a_config_file_plans_what_its_flags_plan(lengths, tmp_path, suffix):
    want = plan_hash(["--lengths", lengths, *FLAGS, "--out", tmp_path / "a.json"])
    config = write(tmp_path / f"run{suffix}", {"lengths": str(lengths), **SETTINGS})
    assert plan_hash(["--config", config, "--out", tmp_path / "b.json"]) == want


def test_flags_on_the_command_line_override_the_file(lengths, tmp_path):
    want = plan_hash(["--lengths", lengths, *FLAGS, "--seed", "3", "--out", tmp_path / "a.json"])
    config = write(tmp_path / "run.toml", {"lengths": str(lengths), **SETTINGS, "seed": 1, "dp": 4})
    assert plan_hash(["--config", config, "--seed", "3", "--dp", "2", "--out", tmp_path / "b.json"]) == want


def test_keys_are_field_names_or_flag_spellings_with_dashes_or_underscores(lengths, tmp_path):
    want = plan_hash(["--lengths", lengths, *FLAGS, "--solver-time-limit-s", "0.01", "--out", tmp_path / "a.json"])
    settings = {
        "lengths": str(lengths),
        "dp": 2,
        "cp": 2,
        "tokens-per-rank": 4096,
        "samples_per_step": 30,
        "cost_profile": "tiny",  # a spelling of the cost model's flag
        "solver_time_limit": 0.01,  # the old spelling of --solver-time-limit-s
        "no-progress": True,
    }
    assert plan_hash(["--config", write(tmp_path / "run.json", settings), "--out", tmp_path / "b.json"]) == want


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"bogus": 1}, ["unknown key 'bogus'", "run.toml"]),
        ({"dp": 0}, ["run.toml", "key 'dp'", "[1, "]),
        ({"dp": 2.5}, ["key 'dp'", "expected an integer"]),
        ({"dp": True}, ["key 'dp'", "expected a number or a string"]),
        ({"strategy": "best"}, ["key 'strategy'", "'best' is not one of balanced"]),
        ({"json": "yes"}, ["key 'json'", "expected true or false"]),
        ({"pair_price_range": [2, 1]}, ["key 'pair_price_range'", "0 < LOW <= 1 <= HIGH"]),
        ({"model": "tiny", "cost": "tiny"}, ["keys 'model' and 'cost' set the same flag"]),
        ({"config": "other.toml"}, ["unknown key 'config'"]),
    ],
)
def test_bad_keys_and_values_are_one_line_naming_the_file_and_key(lengths, tmp_path, settings, words):
    config = write(tmp_path / "run.toml", {"lengths": str(lengths), **SETTINGS, **settings})
    run = run_cli(["plan", "--config", config, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and not (tmp_path / "p.json").exists()
    for word in words:
        assert word in run.err, (word, run.err)


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("run.toml", "dp = \n", ["run.toml is not valid TOML"]),
        ("run.json", "{nope", ["run.json is not valid JSON"]),
        ("run.yaml", "[1, 2]\n", ["run.yaml holds a list, not a mapping"]),
        ("run.ini", "dp=1\n", ["run.ini: give a .toml, .json, .yaml or .yml file"]),
    ],
)
def test_unreadable_files_are_one_line(tmp_path, name, text, words):
    (tmp_path / name).write_text(text)
    run = run_cli(["plan", "--config", tmp_path / name, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and all(word in run.err for word in words), run.err
    run = run_cli(["plan", "--config", tmp_path / "missing.toml", "--out", tmp_path / "p.json"])
    assert run.code == 1 and "missing.toml: no such file" in run.err


def test_a_required_flag_may_come_from_the_file_and_is_named_when_missing(lengths, tmp_path):
    config = write(tmp_path / "run.toml", {"lengths": str(lengths), "cp": 2, "tokens_per_rank": 4096})
    run = run_cli(["plan", "--config", config, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 2 and "required: --dp" in run.err
    assert run_cli(["plan", "--config", config, "--dp", "2", "--out", tmp_path / "p.json"]).code == 0


def test_toml_without_a_reader_and_yaml_without_pyyaml_say_what_to_install(lengths, tmp_path, monkeypatch):
    toml = write(tmp_path / "run.toml", SETTINGS)
    yaml_file = write(tmp_path / "run.yaml", SETTINGS)
    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.10 without tomli
    monkeypatch.setitem(sys.modules, "tomli", None)
    monkeypatch.setitem(sys.modules, "yaml", None)
    for config, words in ((toml, ["Python 3.11", "tomli"]), (yaml_file, ["PyYAML", "pip install pyyaml"])):
        run = run_cli(["plan", "--config", config, "--lengths", lengths, "--out", tmp_path / "p.json"])
        assert_clean(run)
        assert run.code == 1 and all(word in run.err for word in words), run.err
    json_file = write(tmp_path / "run.json", SETTINGS)
    assert run_cli(["plan", "--config", json_file, "--lengths", lengths, "--out", tmp_path / "p.json"]).code == 0


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yaml"])
@pytest.mark.parametrize("batch", [["--samples-per-step", "30"], ["--global-batch-tokens", "50000"]])
def test_write_config_writes_a_config_that_makes_the_same_plan(lengths, tmp_path, suffix, batch):
    written = tmp_path / f"used{suffix}"
    argv = ["--lengths", lengths, "--dp", "2", "--cp", "2", "--tokens-per-rank", "4096", "--model", "tiny", *batch]
    extra = ["--pair-price-range", "0.5,1.5", "--strategy", "zigzag", "--solver-time-limit", "0.01"]
    first = plan_hash([*argv, *extra, "--out", tmp_path / "a.json", "--write-config", written])
    assert plan_hash(["--config", written, "--out", tmp_path / "b.json"]) == first
    assert Plan.load(tmp_path / "b.json").config == Plan.load(tmp_path / "a.json").config


def test_write_config_refuses_a_path_it_cannot_use(lengths, tmp_path):
    argv = ["plan", "--lengths", lengths, *FLAGS, "--out", tmp_path / "p.json"]
    for target, words in ((tmp_path / "used.ini", "give a .toml"), (lengths, "an input of this command")):
        run = run_cli([*argv, "--write-config", target])
        assert_clean(run)
        assert run.code == 1 and words in run.err, run.err


def test_write_config_keeps_the_planning_settings_only_so_a_rerun_overwrites_nothing(lengths, tmp_path):
    written, first = tmp_path / "used.json", tmp_path / "a.json"
    argv = ["plan", "--lengths", lengths, *FLAGS, "--out", first, "--json", "--quiet", "--write-config", written]
    assert run_cli(argv).code == 0
    keys = set(json.loads(written.read_text()))
    assert not keys & {"out", "json", "quiet", "write_config", "config"}, keys
    assert {"lengths", "dp", "cp", "tokens_per_rank", "samples_per_step", "cost"} <= keys
    before = first.read_bytes()
    run = run_cli(["plan", "--config", written])
    assert_clean(run)
    assert run.code == 2 and "--out" in run.err and first.read_bytes() == before, run.err


def test_write_config_refuses_an_unknown_format_before_planning(lengths, tmp_path):
    run = run_cli(["plan", "--lengths", lengths, *FLAGS, "--out", tmp_path / "p.json", "--write-config", "used.ini"])
    assert_clean(run)
    assert run.code == 1 and "--write-config used.ini" in run.err and ".yml" in run.err, run.err
    assert not (tmp_path / "p.json").exists()


def test_shard_report_and_simulate_read_a_config_file(lengths, tmp_path):
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in token_rows(30)))
    shard = write(
        tmp_path / "shard.toml", {"dataset": str(ids), "dp": 2, "cp": 2, "tokens_per_rank": 256, "quiet": True}
    )
    run = run_cli(
        ["shard", "--config", shard, "--out", tmp_path / "shards", "--cache-dir", tmp_path / "cache", "--json"]
    )
    assert run.code == 0, run.err
    assert json.loads(run.out)["samples"] == 30
    report = write(tmp_path / "report.yaml", {"lengths": str(lengths), **SETTINGS, "no_plots": True, "quiet": True})
    run = run_cli(["report", "--config", report, "--out", tmp_path / "r", "--json", "-", "--peers", "none"])
    assert run.code == 0, run.err
    assert {p["config"]["samples_per_step"] for p in json.loads(run.out)["plans"]} == {30}
    sim = {"samples": 200, "dist": "lognormal", "median": 400, "world": [4, 8], "cp": 2, "tokens_per_rank": 4096}
    config = write(tmp_path / "sim.json", {**sim, "overflow": "split", "jobs": 1, "no_plots": True, "quiet": True})
    run = run_cli(["simulate", "--config", config, "--out", tmp_path / "s", "--strategies", "balanced"])
    assert run.code == 0, run.err
    assert (tmp_path / "s" / "dp2xcp2" / "report.json").is_file() and (tmp_path / "s" / "dp4xcp2").is_dir()
    report_plans = write(tmp_path / "plans.json", {"plans": [str(tmp_path / "shards" / "plan.parquet")]})
    run = run_cli(["report", "--config", report_plans, "--out", tmp_path / "r2", "--no-plots", "--quiet"])
    assert run.code == 0, run.err


@pytest.mark.parametrize(
    "name, text",
    [
        ("run.json", '{"dp": 2, "cp": 2, "dp": 4}'),
        ("run.yaml", "dp: 2\ncp: 2\ndp: 4\n"),
        ("run.toml", "dp = 2\ncp = 2\ndp = 4\n"),
    ],
)
def test_a_key_given_twice_in_a_file_is_refused(lengths, tmp_path, name, text):
    (tmp_path / name).write_text(text)
    run = run_cli(["plan", "--config", tmp_path / name, "--lengths", lengths, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 1 and name in run.err and not (tmp_path / "p.json").exists(), run.err
    if name != "run.toml":  # TOML's reader words its own message
        assert "key 'dp' is given twice" in run.err, run.err


def test_config_given_twice_is_refused(lengths, tmp_path):
    first = write(tmp_path / "a.json", {**SETTINGS, "seed": 1})
    second = write(tmp_path / "b.json", {**SETTINGS, "seed": 2})
    run = run_cli(["plan", "--config", first, "--config", second, "--lengths", lengths, "--out", tmp_path / "p.json"])
    assert_clean(run)
    assert run.code == 2 and "--config given twice" in run.err and "b.json" in run.err, run.err


def test_write_config_refuses_the_plan_s_own_file(lengths, tmp_path):
    target = tmp_path / "same.json"
    run = run_cli(["plan", "--lengths", lengths, *FLAGS, "--out", target, "--write-config", target])
    assert_clean(run)
    assert run.code == 1 and "--write-config" in run.err and "is also --out" in run.err, run.err
    assert not target.exists()
