"""Every flag of every command is used or refused for each kind of input: the table, walked flag by flag."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ringpack.cli.config_file import settings
from ringpack.cli.flags import REQUIRED, shown
from ringpack.cli.input_kinds import ONE_KIND, TABLE, unused_flags
from tests.cli.test_flags import COMMANDS, commands
from tests.helpers.cli import assert_clean, run_cli, token_rows, write_jsonl

#: Flags whose presence decides the kind of input: giving one to another kind changes the kind
#: (or is refused as a second input), so they are not walked as unused flags of a kind.
#: The text flags make --lengths a text file, so they select its kind too.
TEXT = {"text_column", "tokenizer", "vocab_size"}
SELECTORS = {
    "plan": TEXT,
    "report": {"plans", "manifest", "lengths", "corpus", *TEXT},
    "simulate": {"lengths", *TEXT},
    "calibrate": {"refit"},
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    rows = token_rows(12)
    np.save(root / "lengths.npy", np.array([len(r) for r in rows]))
    plan = root / "plan.json"
    mesh = ["--dp", 1, "--cp", 1, "--tokens-per-rank", 512]
    assert run_cli(["plan", "--lengths", root / "lengths.npy", *mesh, "--out", plan, "--quiet"]).code == 0
    (root / "calibration.json").write_text("{}")
    return {
        "root": root,
        "plan": plan,
        "ids": write_jsonl(root / "ids.jsonl", [{"input_ids": r} for r in rows]),
        "text": write_jsonl(root / "text.jsonl", [{"text": " ".join(map(str, r))} for r in rows]),
        "mesh": mesh,
    }


def base_argv(command: str, kind: str, inputs) -> list:
    """A command line of ``command`` with an input of ``kind``, refused only for the flag added to it."""
    root, out = inputs["root"], inputs["root"] / "out"
    text = [inputs["text"], "--text-column", "text"]
    return {
        ("plan", "lengths"): ["plan", "--lengths", root / "lengths.npy", *inputs["mesh"], "--out", root / "p.json"],
        ("plan", "text"): ["plan", "--lengths", *text, *inputs["mesh"], "--out", root / "p.json"],
        ("report", "plans"): ["report", inputs["plan"], "--out", out],
        ("report", "manifest"): ["report", "--manifest", root / "no-shards", "--out", out],
        ("report", "lengths"): ["report", "--lengths", root / "lengths.npy", "--out", out],
        ("report", "text"): ["report", "--lengths", *text, "--out", out],
        ("report", "corpus"): ["report", "--corpus", "stdlib", "--out", out],
        ("simulate", "lengths"): ["simulate", "--lengths", root / "lengths.npy", "--out", out],
        ("simulate", "text"): ["simulate", "--lengths", *text, "--out", out],
        ("simulate", "stdlib"): ["simulate", "--out", out],
        ("simulate", "lognormal"): ["simulate", "--dist", "lognormal", "--out", out],
        ("shard", "ids"): ["shard", inputs["ids"], *inputs["mesh"], "--out", out],
        ("calibrate", "kernels"): ["calibrate", "--out", root / "p.json"],
        ("calibrate", "step"): ["calibrate", "--scope", "step", "--model", "tiny", "--out", root / "p.json"],
        ("calibrate", "refit"): ["calibrate", "--refit", root / "calibration.json", "--out", root / "p.json"],
    }[command, kind]


#: A value each flag accepts, where its default is none to copy.
VALUES = {"column": "n", "median": "100", "sigma": "1", "samples": "10", "bandwidth": "100", "latency_us": "1",
          "step": "0", "world": "8", "dp": "2", "gpus_per_node": "8", "text_column": "text", "tokenizer": "t.json",
          "vocab_size": "100", "num_proc": "1", "report": "r.json", "baseline": "zigzag/balanced", "peers": "none",
          "json": "-", "cp_token_slack": "0.1", "pair_price_range": "0.5,2", "model": "tiny", "cost": "tiny",
          "tokens_per_rank": "1024", "heads": "4", "kv_heads": "2", "head_dim": "64", "layers": "2",
          "microbatches": "2", "partner_memory_gib": "2"}  # fmt: skip


def flag_argv(action) -> list[str]:
    """``action``'s flag with a value it accepts."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    if action.dest in VALUES:
        value = VALUES[action.dest]
    elif action.choices:
        value = sorted(action.choices)[-1]
    else:
        assert action.fallback not in (None, REQUIRED), f"give {action.dest} a value in VALUES"
        value = shown(action.fallback)
    return [action.option_strings[0], value]


def test_every_flag_of_every_command_is_in_the_table():
    assert set(TABLE) | set(ONE_KIND) == set(COMMANDS) and not set(TABLE) & set(ONE_KIND)
    for command, (kinds, rows) in TABLE.items():
        dests = {a.dest for a in settings(commands()[command])}
        assert set(rows) == dests, (command, set(rows) ^ dests)
        for name, using in rows.items():
            assert using and using <= set(kinds), (command, name)  # each flag used by some kind, kinds known
        for kind in kinds:
            assert set(unused_flags(command, kind)) | {n for n, using in rows.items() if kind in using} == dests


CASES = [
    (command, kind, name)
    for command, (kinds, _) in TABLE.items()
    for kind in kinds
    for name in unused_flags(command, kind)
    if name not in SELECTORS.get(command, ())
]


@pytest.mark.parametrize("command, kind, name", CASES, ids=["-".join(case) for case in CASES])
def test_a_flag_a_kind_of_input_does_not_use_is_refused_naming_it(inputs, command, kind, name):
    parser = commands()[command]
    action = next(a for a in settings(parser) if a.dest == name)
    run = run_cli([*base_argv(command, kind, inputs), *flag_argv(action), "--quiet"])
    assert_clean(run)
    error = run.err.splitlines()[-1]
    assert run.code == 1 and action.option_strings[0] in error and TABLE[command][0][kind].name in error, error
    assert "not apply to" in error


def test_the_planning_flags_of_a_report_of_plan_files_are_refused(inputs):
    run = run_cli(["report", inputs["plan"], "--dp", 7, "--batch-window", 5, "--seed", 9, "--out", inputs["root"]])
    assert_clean(run)
    assert run.code == 1 and "--dp 7, --batch-window 5, --seed 9 do not apply to plan files" in run.err, run.err


def test_a_config_file_key_that_does_not_apply_is_named_with_its_file(inputs):
    config = inputs["root"] / "run.json"
    config.write_text(json.dumps({"tokens_per_rank": 5}))
    run = run_cli(["report", inputs["plan"], "--config", config, "--out", inputs["root"] / "r", "--quiet"])
    assert_clean(run)
    assert run.code == 1 and f"--tokens-per-rank (from --config {config}) does not apply" in run.err, run.err


def test_a_kind_that_uses_a_flag_still_takes_it(inputs):
    argv = [*base_argv("report", "plans", inputs), "--steps-shown", 1, "--link", "ib", "--no-plots", "--quiet"]
    assert run_cli(argv).code == 0
    text = write_jsonl(inputs["root"] / "text.jsonl", [{"text": "a b c"}] * 6)
    argv = ["shard", text, *inputs["mesh"], "--out", inputs["root"] / "text-shards", "--vocab-size", 50, "--quiet"]
    assert run_cli(argv).code == 0
