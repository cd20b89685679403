"""Fuzz every ``ringpack`` command's flags and input files: each run ends in a valid result or a clean error.

A clean error is exit 1 (bad input) or 2 (usage) with exactly one ``ringpack CMD: error: ...`` line
and no traceback; a valid result is checked for the wrong answers bad input can lead to (a plan
that does not validate or loses tokens, zero or non-finite throughput, lengths that ignore
``--median``, shards that do not read back, a file in ``--out`` that the run did not write).
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import datasets
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringpack.data.shard_reader import ShardReader
from ringpack.data.shard_writer import write_shards
from ringpack.lengths import lengths_from_file
from ringpack.shard_plan import Plan, PlanConfig
from tests.helpers.cli import (
    CP,
    DP,
    TOKENS,
    assert_clean,
    cost_profiles,
    dataset_inputs,
    lengths_inputs,
    run_cli,
    small_plan,
    token_rows,
)

BAD_NUMBERS = ("0", "-1", "nan", "inf", "-inf", "1e400", "abc", "", "1.5", "9" * 40, "0x10", "1,2")
_counter = itertools.count()


class Inputs(dict):
    """The fixture's files by kind and name; a short repr, so a failing example's report stays readable."""

    def __repr__(self) -> str:
        return f"Inputs({self['root']})"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "runs").mkdir()
    plans = root / "plans"
    plans.mkdir()
    plan = small_plan()
    plan.save(plans / "good.json")
    plan.save(plans / "good.parquet")
    doc = json.loads((plans / "good.json").read_text())
    del doc["hash"]
    (plans / "no_hash.json").write_text(json.dumps(doc))
    (plans / "truncated.parquet").write_bytes((plans / "good.parquet").read_bytes()[:-50])
    (plans / "list.json").write_text("[]")
    shards = root / "shards"
    rows = token_rows(30)
    config = PlanConfig(dp=DP, cp=CP, tokens_per_rank=TOKENS, samples_per_step=10)
    write_shards(datasets.Dataset.from_dict({"input_ids": rows}), shards, config, progress=False)
    edited = root / "edited"
    shutil.copytree(shards, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["files"].pop()
    (edited / "manifest.json").write_text(json.dumps(manifest))
    return Inputs(
        root=root,
        lengths=lengths_inputs(root / "lengths"),
        profiles=cost_profiles(root / "profiles"),
        plans={p.name: p for p in sorted(plans.iterdir())} | {"missing.json": plans / "missing.json"},
        datasets=dataset_inputs(root / "datasets"),
        manifests={"good": shards, "edited": edited, "file": shards / "manifest.json", "missing": root / "nope"},
        cache=root / "hf-cache",
    )


def fresh(inputs, name: str = "out", suffix: str = "") -> Path:
    """A path in the fixture's ``runs`` folder that no earlier example used."""
    return inputs["root"] / "runs" / f"{name}-{next(_counter)}{suffix}"


def weighted(good: st.SearchStrategy, bad: st.SearchStrategy, good_in_ten: int = 8) -> st.SearchStrategy:
    """``good`` about ``good_in_ten`` times in ten, else ``bad``."""
    return st.integers(0, 9).flatmap(lambda k: good if k < good_in_ten else bad)


def numbers(*good: str, low: int = 0, high: int = 64, good_in_ten: int = 8) -> st.SearchStrategy[str]:
    """A flag value: one of ``good`` or an integer in ``[low, high]``, else one of :data:`BAD_NUMBERS`."""
    fine = st.one_of(st.sampled_from(good), st.integers(low, high).map(str))
    return weighted(fine, st.sampled_from(BAD_NUMBERS), good_in_ten)


def options(data, flags: dict[str, st.SearchStrategy], most: int = 4) -> list[str]:
    """Up to ``most`` of ``flags``, each with a drawn value (``None``: a switch without one)."""
    chosen = data.draw(st.lists(st.sampled_from(sorted(flags)), max_size=most, unique=True))
    argv: list[str] = []
    for flag in chosen:
        value = data.draw(flags[flag]) if flags[flag] is not None else None
        argv += [flag] if value is None else [flag, value]
    return argv


def mesh(data, cp_high: int = 8) -> list[str]:
    """``--dp``, ``--cp`` and ``--tokens-per-rank``, each good about nine times in ten."""
    return [
        "--dp",
        data.draw(numbers("1", "2", "3", low=1, high=8, good_in_ten=9)),
        "--cp",
        data.draw(numbers("1", "2", "4", low=1, high=cp_high, good_in_ten=9)),
        "--tokens-per-rank",
        data.draw(numbers("64", "256", "4096", str(2**30), low=1, high=100_000, good_in_ten=9)),
    ]


def pick(good: list, bad: list) -> st.SearchStrategy:
    """One of ``good`` about eight times in ten, else one of ``bad``."""
    return weighted(st.sampled_from(good), st.sampled_from(bad))


def planning_flags(inputs) -> dict[str, st.SearchStrategy]:
    """The planner's optional flags, each with good and bad values."""
    profiles = [str(p) for name, p in inputs["profiles"].items() if name != "profile.json"]
    good_profile = str(inputs["profiles"]["profile.json"])
    return {
        "--samples-per-step": numbers("0", "8", "20"),
        "--microbatches-per-rank": numbers("0", "1", "2", high=4),
        "--seed": numbers("0", "7", str(10**30)),
        "--epoch": numbers("0", "1", str(10**18)),
        "--overflow": pick(["error", "split", "drop"], ["bogus"]),
        "--solver-time-limit": pick(["0", "0.02"], ["nan", "-1", "inf", "x"]),
        "--cp-token-slack": pick(["0", "0.02", "1e300"], ["nan", "inf", "-0.1", "y"]),
        "--pair-price-range": pick(["1,1", "0.25,2", "1e-300,3"], ["2,1", "0,1", "nan,2", "1", "a,b", "1,inf"]),
        "--model": pick(["tiny", "llama3-8b", good_profile], ["nope", "nope.json", *profiles]),
        "--cost-profile": pick([good_profile], [*profiles, str(inputs["root"] / "missing.json")]),
    }


# ------------------------------------------------------------------------------------------- plan
@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_plan(inputs, data):
    names = sorted(inputs["lengths"])
    name = data.draw(pick([n for n in names if n.startswith("good")], [n for n in names if not n.startswith("good")]))
    source = inputs["lengths"][name]
    outputs = [fresh(inputs, "plan", ".parquet"), fresh(inputs, "plan", ".json"), source, inputs["root"]]
    out = data.draw(pick(outputs[:2], [*outputs[2:], inputs["root"] / "no-folder" / "p.json"]))
    flags = planning_flags(inputs) | {
        "--strategy": pick(["balanced", "zigzag", "contiguous"], ["best"]),
        "--packing": pick(["balanced", "first_fit"], ["worst"]),
        "--column": pick(["length"], ["lengths", "nope"]),
        "--json": None,
    }
    before = source.read_bytes() if source.is_file() else None
    run = run_cli(["plan", "--lengths", source, *mesh(data), "--out", out, *options(data, flags)])
    assert_clean(run)
    if before is not None:
        assert source.read_bytes() == before, "the input was overwritten"
    if run.code == 0:
        plan = Plan.load(out)  # validates
        assert sum(plan.lengths) == int(lengths_from_file(source).sum()), "tokens lost or invented"


# ------------------------------------------------------------------------------------------ report
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_report(inputs, data):
    lengths = {name: str(p) for name, p in inputs["lengths"].items()}
    plans = {name: str(p) for name, p in inputs["plans"].items()}
    manifests = {name: str(p) for name, p in inputs["manifests"].items()}
    good_lengths = [p for name, p in lengths.items() if name.startswith("good")]
    bad_lengths = [p for name, p in lengths.items() if not name.startswith("good")]
    good_plans = [plans["good.json"], plans["good.parquet"]]
    source = data.draw(
        st.one_of(
            pick(good_lengths, bad_lengths).map(lambda p: ["--lengths", p]),
            st.lists(pick(good_plans, list(plans.values())), min_size=1, max_size=2),
            pick([manifests["good"], manifests["file"]], list(manifests.values())).map(lambda p: ["--manifest", p]),
            st.sampled_from([["--lengths", good_lengths[0], "--corpus", "stdlib"], []]),
        )
    )
    out = data.draw(pick([fresh(inputs, "report")], [inputs["lengths"]["good.npy"]]))
    flags = planning_flags(inputs) | {
        "--tflops": pick(["400", "1e-3"], ["0", "nan", "-5", "inf", "1e308"]),
        "--link": pick(["nvlink", "ib"], ["carrier-pigeon"]),
        "--bandwidth": pick(["100"], ["0", "nan", "-1", "1e308"]),
        "--latency-us": pick(["0", "5"], ["nan", "-1", "1e308"]),
        "--modes": pick(["ring", "ring,allgather"], ["tree", ","]),
        "--strategies": pick(["balanced", "zigzag,balanced"], ["nope", ""]),
        "--packings": pick(["first_fit", "balanced,first_fit"], ["nope"]),
        "--baseline": pick(["zigzag/first_fit", "balanced/balanced"], ["nope"]),
        "--step": numbers("0", "1", high=50),
        "--steps-shown": numbers("0", "3"),
        "--json": pick(["-", str(fresh(inputs, "report-json", ".json"))], [str(inputs["root"])]),
    }
    argv = ["report", *source, *mesh(data, cp_high=4), "--out", out, "--no-plots", "--quiet", *options(data, flags)]
    run = run_cli(argv)
    assert_clean(run)
    if run.code == 0:
        to_stdout = "--json" in argv and argv[argv.index("--json") + 1] == "-"
        doc = json.loads(run.out if to_stdout else (Path(out) / "report.json").read_text())
        for plan in doc["plans"]:
            rate = plan["summary"]["tokens_per_second_comm"]
            assert math.isfinite(rate) and rate > 0, plan["summary"]
            if "--lengths" in argv and "drop" not in argv:
                assert plan["summary"]["tokens"] == doc["lengths"]["tokens"], "tokens lost or invented"


# ---------------------------------------------------------------------------------------- simulate
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_simulate(inputs, data):
    lengths = inputs["lengths"]
    flags = {
        "--world": pick(["4", "4,8", "8"], ["3", "0", "a", "", "4,,8", "-4"]),
        "--dist": pick(["stdlib", "lognormal"], ["uniform"]),
        "--median": pick(["400", "20", "3000"], ["-1", "0", "nan", "inf", "1e30"]),
        "--sigma": pick(["0", "0.5", "1.3"], ["-1", "nan", "60", "1e300"]),
        "--lengths": pick([str(lengths["good.npy"])], [str(p) for p in lengths.values()]),
        "--global-batch-tokens": numbers("0", "2000", high=100_000),
        "--jobs": pick(["1"], ["-1", "x"]),
        "--chunk-steps": numbers("1", "8", low=1, high=16),
        "--strategies": pick(["balanced", "zigzag"], ["nope"]),
        "--packings": pick(["first_fit"], ["nope"]),
        "--modes": pick(["ring", "allgather"], ["tree"]),
        "--tflops": pick(["400"], ["0", "nan"]),
        "--overflow": pick(["split", "drop"], ["error"]),
    }
    samples = data.draw(numbers("50", "200", low=1, high=300, good_in_ten=9))
    cp = data.draw(st.sampled_from(["2", "1", "4", "2", "1", "4", "0", "x"]))
    out = fresh(inputs, "sim")
    extra = options(data, flags, most=5)
    argv = ["simulate", "--samples", samples, "--cp", cp, "--tokens-per-rank", "2048", "--out", out, *extra]
    fixed = (("--world", "4"), ("--jobs", "1"), ("--dist", "lognormal"))  # lognormal: no corpus to load
    defaults = [part for flag, value in fixed if flag not in extra for part in (flag, value)]
    run = run_cli([*argv, "--no-plots", "--quiet", *defaults])
    assert_clean(run)
    if run.code == 0:
        for report in Path(out).rglob("report.json"):
            doc = json.loads(report.read_text())
            assert all(math.isfinite(p["summary"]["tokens_per_second_comm"]) for p in doc["plans"])
            assert all(p["summary"]["tokens_per_second_comm"] > 0 for p in doc["plans"])
            median = float(extra[extra.index("--median") + 1]) if "--median" in extra else 2048.0
            sigma = float(extra[extra.index("--sigma") + 1]) if "--sigma" in extra else 1.3
            lognormal = "stdlib" not in extra and "--lengths" not in extra
            if lognormal and int(samples) >= 50 and sigma <= 2 and median >= 10:
                assert median / 4 <= doc["lengths"]["median"] <= median * 4, "lengths ignore --median"


# ------------------------------------------------------------------------------------------- shard
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_shard(inputs, data):
    names = sorted(inputs["datasets"])
    name = data.draw(pick(["ids.jsonl", "text.jsonl"], [n for n in names if n not in ("ids.jsonl", "text.jsonl")]))
    source = dataset = inputs["datasets"][name]
    out = fresh(inputs, "shards")
    where = data.draw(pick(["fresh", "foreign"], ["the input file", "the input folder", "in the input"]))
    if where == "foreign":
        out.mkdir(parents=True)
        (out / "dp00000-of-00002.parquet").write_bytes(b"someone else's file")
        (out / "notes.parquet").write_bytes(b"also not ours")
    elif where == "the input file":
        out = source
    elif where == "the input folder":
        dataset = out = source.parent
    elif where == "in the input":
        dataset, out = source.parent, source.parent / "shards-here"
    flags = {
        "--samples-per-step": numbers("0", "8"),
        "--steps-per-file": numbers("0", "1", "2"),
        "--vocab-size": numbers("1", "1000", str(2**31)),
        "--column": pick(["input_ids"], ["ids"]),
        "--text-column": pick(["text"], ["body"]),
        "--overflow": pick(["split", "drop"], ["error"]),
        "--tokenizer": st.sampled_from([str(inputs["root"]), str(inputs["root"] / "nope.json")]),
        "--num-proc": st.sampled_from(["0", "-2", "x", "100000"]),
        "--overwrite": None,
    }
    foreign_before = sorted(p.name for p in out.iterdir()) if where == "foreign" else []
    mesh_args = ["--dp", data.draw(numbers("1", "2", low=1, high=3, good_in_ten=9))]
    mesh_args += ["--cp", data.draw(numbers("1", "2", low=1, high=3, good_in_ten=9))]
    tokens = ["--tokens-per-rank", data.draw(numbers("128", "512", low=120, high=512, good_in_ten=9))]
    cache = ["--cache-dir", inputs["cache"], "--no-progress"]
    run = run_cli(["shard", dataset, "--out", out, *mesh_args, *tokens, *cache, *options(data, flags)])
    assert_clean(run)
    assert source.is_file(), "the input was removed"
    if where == "foreign":
        assert {"dp00000-of-00002.parquet", "notes.parquet"} <= set(foreign_before)
        assert (out / "notes.parquet").read_bytes() == b"also not ours"
    if run.code == 0:
        manifest = json.loads((Path(out) / "manifest.json").read_text())
        tokens_read = 0
        for d in range(manifest["dp"]):
            for c in range(manifest["cp"]):
                tokens_read += sum(len(b["input_ids"]) for b in ShardReader(out, d, c, schedule=False))
        assert tokens_read == sum(f["tokens"] for f in manifest["files"])


@settings(max_examples=25, deadline=None)
@given(argv=st.lists(st.text(max_size=12), max_size=6), command=st.sampled_from(["plan", "shard", "report"]))
def test_random_words(inputs, argv, command):
    """Arbitrary words after a command that needs an input: parsed or refused cleanly, never a traceback."""
    quiet = ["--no-plots", "--quiet"] if command == "report" else []
    run = run_cli([command, *argv, "--out", str(fresh(inputs, "words")), *quiet])
    assert_clean(run)
    assert run.code in (1, 2) or command == "report"


# --------------------------------------------------------------------------------- calibrate, demo
def poisons(root: Path, good_lengths: Path) -> list[tuple[str, list[str]]]:
    """``(command, flags)``: every bad input of ``calibrate`` and ``demo`` the fuzz knows, one per case."""
    calibrate = [
        *(
            [flag, value]
            for flag in ("--heads", "--kv-heads", "--head-dim", "--layers", "--reps")
            for value in BAD_SIZES
        ),
        ["--warmup", "-1"],
        ["--seed", "x"],
        ["--timer", "sundial"],
        ["--device", "tpu"],
        *(["--refit", str(root / name)] for name in ("not-a-report.json", "bad.json", "other-format.json")),
        ["--refit", str(root / "missing.json")],
        ["--refit", str(root)],
        ["--out", str(root), "--refit", str(root / "bad.json")],
    ]
    demo = [
        *([flag, value] for flag in ("--dp", "--cp", "--tokens-per-rank") for value in ("0", "-3", "x", "1e9")),
        ["--tflops", "nan"],
        ["--tflops", "0"],
        ["--samples-per-step", "-1"],
        ["--out", str(good_lengths)],
    ]
    return [("calibrate", p) for p in calibrate] + [("demo", p) for p in demo]


BAD_SIZES = ("0", "-1", "x", "1.5")
POISONS = poisons(Path("ROOT"), Path("ROOT/good.npy"))  # for the case names; the test resolves its own paths


@pytest.mark.parametrize("case", range(len(POISONS)), ids=[f"{c} {' '.join(p)}" for c, p in POISONS])
def test_calibrate_and_demo_refuse_bad_input(inputs, case):
    """Every case carries one poison, so nothing is timed or planned: each ends in exit 1 or 2, one line.
    All of them run (46 cases, well under a second each)."""
    root = inputs["root"]
    (root / "not-a-report.json").write_text("[1, 2]")
    (root / "bad.json").write_text("{nope")
    (root / "other-format.json").write_text('{"format": "something-else"}')
    command, poison = poisons(root, inputs["lengths"]["good.npy"])[case]
    run = run_cli([command, *poison, "--quiet"])
    assert_clean(run)
    assert run.code in (1, 2)


def test_help_and_version_exit_zero():
    for argv in (["--help"], ["--version"], ["plan", "--help"], ["simulate", "--help"]):
        run = run_cli(argv)
        assert run.code == 0 and run.out


def test_broken_pipe_is_one_line(inputs, monkeypatch):
    """stdout closed early (``ringpack plan --json | head -c1``): one line on stderr, exit 1."""
    import io
    import sys

    from ringpack.cli import main

    class ClosedPipe(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    lengths = inputs["lengths"]["good.npy"]
    argv = ["plan", "--lengths", lengths, "--dp", "2", "--cp", "2", "--tokens-per-rank", "512", "--json"]
    err = io.StringIO()
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    monkeypatch.setattr(sys, "stderr", err)
    assert main([str(a) for a in [*argv, "--out", fresh(inputs, "pipe", ".json")]]) == 1
    assert err.getvalue().count("\n") == 1 and "broken pipe" in err.getvalue()


def test_file_system_errors_are_one_line(inputs, monkeypatch):
    """An OSError while writing (no permission, a full disk) ends in one line naming the file, exit 1."""
    out = fresh(inputs, "denied", ".parquet")

    def denied(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Plan, "save", denied)
    lengths = inputs["lengths"]["good.npy"]
    run = run_cli(["plan", "--lengths", lengths, "--dp", "1", "--cp", "1", "--tokens-per-rank", "4096", "--out", out])
    assert_clean(run)
    assert run.code == 1 and "Permission denied" in run.err and out.name in run.err


def test_lengths_fixture_is_what_the_fuzz_plans(inputs):
    """The good lengths files agree with each other, so a plan of any of them must keep their token sum."""
    sums = {name: int(lengths_from_file(p).sum()) for name, p in inputs["lengths"].items() if name.startswith("good")}
    assert len(set(sums.values())) == 1 and np.all(list(sums.values()))
