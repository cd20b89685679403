"""The command line starts at once: ``--help`` and ``--version`` import no torch, and ``ringpack CMD``
imports only the module of CMD; plan, report and simulate on lengths import no torch either.

Each check runs a fresh interpreter (``python -c``), whose ``sys.modules`` is what the command
imported and nothing a test before it did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ringpack.cli.app import COMMANDS, build_parser, handler_of, parser_for

ROOT = Path(__file__).resolve().parents[2]
#: Packages a parser, ``--help`` or ``--version`` must not import (seconds each, or optional).
HEAVY = ("torch", "scipy", "transformers", "datasets", "pyarrow", "ortools", "matplotlib")


def imported_after(code: str) -> dict[str, list[str]]:
    """Run ``code`` in a fresh interpreter (its stdout discarded); which of :data:`HEAVY` and of
    ringpack's command modules it imported."""
    probe = (
        "import contextlib, io, json, sys\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        + "".join(f"    {line}\n" for line in code.splitlines())
        + "mods = sorted(sys.modules)\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "cli = [m for m in mods if m.startswith('ringpack.cli.')]\n"
        "print(json.dumps(dict(heavy=heavy, cli=cli)))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def main_of(*argvs: list[str]) -> str:
    """Code that runs ``ringpack.cli.main`` on each of ``argvs``, an exit from ``--help`` included."""
    return "from ringpack.cli import main\n" + "".join(
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" for argv in argvs
    )


def test_every_help_and_the_version_import_no_torch():
    seen = imported_after(main_of(["--help"], ["--version"], *([name, "--help"] for name in COMMANDS)))
    assert seen["heavy"] == []
    assert {f"ringpack.cli.{name}" for name in COMMANDS} <= set(seen["cli"])  # every parser was built


@pytest.mark.parametrize("name", ["plan", "calibrate"])
def test_a_command_imports_its_own_module_alone(name):
    seen = imported_after(main_of([name, "--help"]))
    assert seen["heavy"] == []
    others = {COMMANDS[other] for other in COMMANDS if other != name}
    assert COMMANDS[name] in seen["cli"] and not others & set(seen["cli"]), seen["cli"]


def test_the_package_faces_import_nothing_heavy():
    seen = imported_after("import ringpack, ringpack.calibration, ringpack.cli, ringpack.data")
    assert seen["heavy"] == [] and seen["cli"] == []


def test_a_command_line_with_no_command_or_an_unknown_one_lists_them_all():
    for argv in ([], ["--help"], ["--version"], ["plna", "--help"], ["--quiet"]):
        assert set(parser_for(argv)._subparsers._group_actions[0].choices) == set(COMMANDS)
    assert set(parser_for(["shard", "--help"])._subparsers._group_actions[0].choices) == {"shard"}


@pytest.mark.slow  # imports what every command runs with: torch among it
def test_every_handler_resolves_to_a_function():
    for name in COMMANDS:
        handler = build_parser([name])._subparsers._group_actions[0].choices[name].get_default("handler")
        assert callable(handler_of(argparse.Namespace(handler=handler))), name


@pytest.mark.slow  # plans, reports and simulates
def test_plan_report_and_simulate_on_lengths_import_no_torch(tmp_path):
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.random.default_rng(5).integers(1, 3000, size=60))
    mesh = ["--world", "4", "--cp", "2", "--tokens-per-rank", "4096", "--model", "tiny", "--quiet"]
    seen = imported_after(
        main_of(
            ["plan", "--lengths", str(lengths), *mesh, "--samples-per-step", "30", "--out", str(tmp_path / "p.json")],
            ["report", "--lengths", str(lengths), *mesh, "--out", str(tmp_path / "r"), "--no-plots"],
            ["simulate", "--samples", "60", *mesh, "--out", str(tmp_path / "s"), "--no-plots"],
        )
        + f"import pathlib\nassert pathlib.Path({str(tmp_path / 'p.json')!r}).is_file()\n"
    )
    assert "torch" not in seen["heavy"]
