"""Flags are built from the config dataclasses, one per field; shared flags mean the same on every subcommand."""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ringpack._hints import command_line_hints, option
from ringpack.analysis.demo import DemoConfig
from ringpack.calibration.run import KernelCalibrationConfig
from ringpack.calibration.step import StepCalibrationConfig
from ringpack.cli import build_parser, flags, parse
from ringpack.cli.flags import EXPLORE_MESH, REQUIRED
from ringpack.shard_plan import PlanConfig
from tests.helpers.cli import assert_clean, run_cli

COMMANDS = ("plan", "shard", "report", "simulate", "calibrate", "demo")
ROOT = Path(__file__).resolve().parents[2]


def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if a.dest == "command").choices


def shown(action: argparse.Action) -> bool:
    return action.help is not argparse.SUPPRESS


def field_actions(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The shown actions built from a config field, by field."""
    out: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if hasattr(action, "field") and shown(action):
            out.setdefault(action.field, []).append(action)
    return out


def base_help(action: argparse.Action) -> str:
    """An action's help without the ``(default: ...)`` / ``(required)`` the command adds, nor what
    ``--cp auto`` and ``--world`` add to ``--cp`` and ``--dp`` (:mod:`ringpack.cli.layout`)."""
    text = re.sub(r" \((default: [^()]*(\([^()]*\))?[^()]*|required)\)$", "", action.help)
    return text.replace(" (required unless --world is given)", "").split("; auto: the fastest layout")[0]


# ------------------------------------------------------------------------------ one flag per field
def test_plan_config_is_keyword_only_and_every_field_has_a_help():
    with pytest.raises(TypeError):
        PlanConfig(2, 2, 512)
    for f in dataclasses.fields(PlanConfig):
        assert f.kw_only and f.metadata["help"] and "type" in f.metadata, f.name


@pytest.mark.parametrize("command", ["plan", "shard", "report", "simulate"])
def test_every_plan_config_field_is_exactly_one_flag_of_its_name(command):
    parser = commands()[command]
    actions = field_actions(parser)
    skipped = {"plan": set(), "shard": set(), "report": {"strategy", "packing"}}.get(
        command, {"strategy", "packing", "dp"}
    )
    assert set(actions) == {f.name for f in dataclasses.fields(PlanConfig)} - skipped
    for name, found in actions.items():
        assert len(found) == 1, (name, found)
        flag = "--model" if name == "cost" else "--" + name.replace("_", "-")
        assert found[0].option_strings[0] == flag and found[0].dest == name
    group = next(g for g in parser._action_groups if g.title == "planning (PlanConfig fields)")
    extra = [a.option_strings[0] for a in group._group_actions if shown(a) and not hasattr(a, "field")]
    assert extra == ["--global-batch-tokens"]  # every other planning flag is a field


def test_the_old_solver_flag_is_a_hidden_alias():
    argv = ["plan", "--lengths", "x.npy", "--dp", "1", "--cp", "1", "--tokens-per-rank", "8", "--out", "p.json"]
    assert parse([*argv, "--solver-time-limit", "0.5"]).solver_time_limit_s == 0.5
    assert parse([*argv, "--solver-time-limit-s", "0.25"]).solver_time_limit_s == 0.25
    text = commands()["plan"].format_help()
    assert "--solver-time-limit-s" in text and "--solver-time-limit " not in text


def test_hints_name_flags_that_exist():
    """A hint spells a field as ``option(name)``: under the command line that is the field's flag."""
    flags = {s for a in commands()["plan"]._actions for s in a.option_strings}
    with command_line_hints():
        for f in dataclasses.fields(PlanConfig):
            if f.name != "cost":
                assert option(f.name) in flags, f.name


def test_calibration_config_fields_are_the_calibrate_flags():
    parser = commands()["calibrate"]
    actions = field_actions(parser)
    names = {f.name for f in dataclasses.fields(KernelCalibrationConfig)} | {
        f.name for f in dataclasses.fields(StepCalibrationConfig)
    }
    assert set(actions) == names and all(len(found) == 1 for found in actions.values())
    own = {"help", "out", "report", "scope", "refit", "quiet"}
    assert {a.dest for a in parser._actions} - own == names  # every other flag is a field of one of them


def test_demo_config_fields_are_the_demo_flags():
    parser = commands()["demo"]
    dests = [a.dest for a in parser._actions if shown(a) and a.dest not in ("help", "quiet")]
    plan_flags = ("dp", "cp", "tokens_per_rank", "samples_per_step", "seed", "cost")
    assert sorted(dests) == sorted({f.name for f in dataclasses.fields(DemoConfig)} - {"plan"} | set(plan_flags))
    defaults = {a.dest: a.fallback for a in parser._actions if hasattr(a, "fallback")}
    demo_plan = DemoConfig().plan
    assert {k: defaults[k] for k in EXPLORE_MESH} == EXPLORE_MESH == {k: getattr(demo_plan, k) for k in EXPLORE_MESH}


# ------------------------------------------------------------------------------ one meaning each
#: Flags that differ per command on purpose: an output file or a folder, a switch or a path, what
#: the lengths are planned for, a tokenizer shard applies only to a dataset without token ids.
OWN_MEANING = {"--out", "--json", "--lengths", "--tokenizer"}
#: The per-command defaults the docs list: plan and shard write what training loads, so the mesh
#: must be given there; simulate and the demo plan epochs of many steps; simulate compares modes
#: and takes several clusters (no --dp, so its --world says what DP becomes itself).
COMMAND_DEFAULTS = {
    ("plan", "--dp"): None,  # or --world
    ("plan", "--cp"): REQUIRED,
    ("plan", "--tokens-per-rank"): REQUIRED,
    ("shard", "--dp"): REQUIRED,
    ("shard", "--cp"): REQUIRED,
    ("shard", "--tokens-per-rank"): REQUIRED,
    ("simulate", "--global-batch-tokens"): "auto",
    ("demo", "--global-batch-tokens"): "auto",
    ("simulate", "--modes"): "ring,allgather",
    ("simulate", "--world"): [1024],
    ("shard", "--column"): "input_ids",
}


def test_shared_flags_have_one_help_and_one_default_on_every_subcommand():
    by_flag: dict[str, dict[str, argparse.Action]] = {}
    for name, parser in commands().items():
        if name == "calibrate":  # its --cp, --seed, --model, ... describe the shards timed, not a plan
            continue
        for action in parser._actions:
            if action.option_strings and shown(action) and action.dest != "help":
                by_flag.setdefault(action.option_strings[0], {})[name] = action
    shared = {flag: found for flag, found in by_flag.items() if len(found) > 1 and flag not in OWN_MEANING}
    assert {"--dp", "--cp", "--tokens-per-rank", "--samples-per-step", "--strategies", "--quiet"} <= set(shared)
    for flag, found in shared.items():
        helps = {name: base_help(a) for name, a in found.items() if (name, flag) not in COMMAND_DEFAULTS}
        assert len(set(helps.values())) == 1, (flag, helps)
        defaults = {name: a.fallback for name, a in found.items() if (name, flag) not in COMMAND_DEFAULTS}
        assert len({repr(v) for v in defaults.values()}) == 1, (flag, defaults)
        for name, action in found.items():
            if (name, flag) in COMMAND_DEFAULTS:
                assert action.fallback == COMMAND_DEFAULTS[name, flag], (name, flag)
    assert {(name, flag) for name, flag in COMMAND_DEFAULTS} <= {(n, f) for f, fs in by_flag.items() for n in fs}


def test_every_long_running_subcommand_takes_no_progress():
    for name in COMMANDS:
        parser = commands()[name]
        action = next(a for a in parser._actions if "--no-progress" in a.option_strings)
        assert action.dest == "quiet" and "--quiet" in action.option_strings, name
        assert parse_quiet(name, parser) is True


def parse_quiet(name: str, parser: argparse.ArgumentParser) -> bool:
    return parser.parse_args(["--no-progress"] + (["data"] if name == "shard" else [])).quiet


def test_strategies_mean_the_same_on_report_and_simulate(tmp_path):
    """``--strategies`` x ``--packings``, every one of both by default, on both commands."""
    runs = {
        "report": ["report", "--corpus", "stdlib", "--out", tmp_path / "r"],
        "simulate": ["simulate", "--out", tmp_path / "s"],
    }
    for name, argv in runs.items():
        args = parse([str(a) for a in argv])
        assert (args.strategies, args.packings) == ("balanced,zigzag,contiguous", "balanced,first_fit"), name


def test_two_spellings_of_the_cost_model_are_refused(tmp_path):
    argv = ["plan", "--lengths", "x.npy", "--dp", "1", "--cp", "1", "--tokens-per-rank", "8", "--out", "p.json"]
    run = run_cli([*argv, "--model", "tiny", "--cost-profile", "p.json"])
    assert_clean(run)
    assert run.code == 2 and "--model and --cost-profile" in run.err
    assert parse([*argv, "--cost-profile", "tiny"]).cost == "tiny"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["plan", "--dp", "2", "--dp", "3"], "--dp given twice (2, 3)"),
        (["report", "--step", "1", "--step", "1"], "--step given twice (1, 1)"),
        (["shard", "data.jsonl", "--quiet", "--quiet"], "--quiet given twice"),
        (["simulate", "--quiet", "--no-progress"], "--quiet and --no-progress both set"),
        (["demo", "--no-ring-check", "--no-ring-check"], "--no-ring-check given twice"),
        (["calibrate", "--scope", "step", "--scope", "kernels"], "--scope given twice (step, kernels)"),
        (["report", "--solver-time-limit", "1", "--solver-time-limit-s", "2"], "--solver-time-limit and"),
    ],
)
def test_a_flag_given_twice_is_refused_in_one_line_naming_it(argv, words):
    run = run_cli(argv)
    assert_clean(run)
    assert run.code == 2 and words in run.err, run.err


def test_every_option_of_every_command_refuses_a_second_setting():
    takes_once = (flags.Once, flags.OnceTrue, flags.OnceFalse, argparse._HelpAction)
    for name, parser in commands().items():
        loose = [a.option_strings[0] for a in parser._actions if a.option_strings and not isinstance(a, takes_once)]
        assert not loose, f"{name}: {loose} may be given twice"


# ------------------------------------------------------------------------------------ the package
@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_help_ends_with_an_example(command):
    lines = commands()[command].format_help().rstrip().splitlines()
    head = max(i for i, line in enumerate(lines) if line in ("example:", "examples:"))
    assert lines[head + 1 :] and all(line.startswith(f"  ringpack {command}") for line in lines[head + 1 :])


def test_one_small_module_per_command_and_no_argparse_below_the_command_line():
    package = ROOT / "ringpack" / "cli"
    assert {p.stem for p in package.glob("*.py")} >= set(COMMANDS)
    for path in package.glob("*.py"):
        assert len(path.read_text().splitlines()) < 400, path.name
    library = [p for p in (ROOT / "ringpack").rglob("*.py") if package not in p.parents]
    assert [p.name for p in library if "argparse" in p.read_text()] == []


@pytest.mark.slow
def test_python_m_ringpack_and_the_entry_point_agree():
    assert 'ringpack = "ringpack.cli:main"' in (ROOT / "pyproject.toml").read_text()
    for module in ("ringpack", "ringpack.cli"):
        out = subprocess.run([sys.executable, "-m", module, "plan", "--help"], capture_output=True, text=True)
        assert out.returncode == 0 and "--solver-time-limit-s" in out.stdout, out.stderr


# ---------------------------------------------------------------------------- one word for the GPUs
def test_world_is_the_cluster_s_gpus_on_every_command_that_takes_them():
    for name in ("plan", "report", "simulate"):
        world = next(a for a in commands()[name]._actions if a.dest == "world")  # the shown flag, aliases after it
        assert world.option_strings == ["--world"] and "GPUs of the cluster" in world.help, name
    assert not any(
        "--gpus" in a.option_strings for c in commands().values() for a in c._actions if a.help != "==SUPPRESS=="
    )


def test_the_old_gpus_flag_of_simulate_still_works_and_says_once_to_use_world(capsys):
    assert parse(["simulate", "--gpus", "8,16"]).world == [8, 16] == parse(["simulate", "--world", "8,16"]).world
    assert capsys.readouterr().err == "ringpack simulate: warning: --gpus is deprecated; use --world\n"
    run = run_cli(["simulate", "--gpus", "8", "--world", "8"])
    assert run.code == 2 and "--gpus and --world both set the same option; give one" in run.err
