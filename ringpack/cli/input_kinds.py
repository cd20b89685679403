"""Which flags each command uses for each kind of input; a flag given to a kind that does not use it is refused.

A command that takes several kinds of input (``report``: plan files, a shard manifest, lengths or the
corpus) uses some flags for one kind only: a plan file keeps the settings it was planned with, so
``report PLAN --dp 7`` would plan nothing with ``--dp``. :data:`TABLE` holds, for each such command,
every one of its settings and the kinds that use it; :func:`check_flags_apply` refuses, in one line
naming each flag and the kind, every setting given (on the command line or in ``--config``) that the
input's kind does not use. Commands with one kind of input (:data:`ONE_KIND`) use every flag they
have. ``tests/cli/test_input_kinds.py`` walks every flag of every command against this table.

See docs/planner.md, "Flags and inputs".
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping

from ringpack.calibration.config import KernelCalibrationConfig, StepCalibrationConfig
from ringpack.cli.config_file import settings
from ringpack.cli.flags import shown
from ringpack.shard_plan import PlanConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputKind:
    """One kind of input of a command.

    Attributes:
        name: the kind as messages say it (``"plan files"``, ``"--scope step"``).
        why: why the flags it does not use do not apply to it (the end of the refusal).
    """

    name: str
    why: str


#: Commands with one kind of input, which use every flag they have.
ONE_KIND = {"demo": "the standard-library corpus"}

_PLANNING = tuple(f.name for f in dataclasses.fields(PlanConfig)) + ("global_batch_tokens",)
_KERNEL_FIELDS = {f.name for f in dataclasses.fields(KernelCalibrationConfig)}
_STEP_FIELDS = {f.name for f in dataclasses.fields(StepCalibrationConfig)}


#: The flags of a text ``--lengths`` (plan, report, simulate): its column and tokenizer, the length cache.
_TEXT = ["text_column", "tokenizer", "vocab_size", "no_length_cache"]
#: The kinds of ``--lengths``: lengths as they are, or texts whose tokens are counted.
_LENGTHS_KINDS = {
    "lengths": InputKind(
        name="--lengths of lengths", why="the length cache holds token counts of texts (--text-column, --tokenizer)"
    ),
    "text": InputKind(name="--lengths of texts", why="its lengths are the token counts of --text-column"),
}


def _rows(*groups: tuple[Iterable[str], Iterable[str]]) -> dict[str, frozenset[str]]:
    """``{setting: kinds that use it}`` from ``(settings, kinds)`` groups; a setting in two groups is a bug."""
    out: dict[str, frozenset[str]] = {}
    for names, kinds in groups:
        for name in names:
            if name in out:
                raise AssertionError(f"{name} is listed twice")
            out[name] = frozenset(kinds)
    return out


_REPORT_KINDS = {
    "plans": InputKind(name="plan files", why="they are reported as planned, and nothing is planned or run again"),
    "manifest": InputKind(
        name="--manifest", why="its plan is reported as planned, and nothing is planned or run again"
    ),
    **_LENGTHS_KINDS,
    "corpus": InputKind(name="--corpus stdlib", why="the corpus is lengths already, not a file with columns"),
}
_REPORT_LENGTHS = ("lengths", "text", "corpus")
_REPORT = _rows(
    (["plans"], ["plans"]),
    (["manifest"], ["manifest"]),
    (["lengths"], ["lengths", "text"]),
    (["column"], ["lengths"]),
    (_TEXT, ["text"]),
    (["corpus"], ["corpus"]),
    (  # planning: only where the report plans lengths itself
        [n for n in _PLANNING if n not in ("strategy", "packing", "gpus_per_node")]
        + ["world", "partner_memory_gib", "host_time", "strategies", "packings", "peers", "tflops", "jobs"],
        _REPORT_LENGTHS,
    ),
    (  # the communication model, the output: every report
        ["gpus_per_node", "baseline", "link", "inter_link", "bandwidth", "latency_us", "modes"]
        + ["out", "json", "no_plots", "quiet", "step", "steps_shown", "no_advice"],
        _REPORT_KINDS,
    ),
)

_SIMULATE_KINDS = {
    "lengths": InputKind(
        name="--lengths of lengths",
        why="--samples, --dist, --median and --sigma shape drawn lengths, and the length cache holds token counts "
        "of texts (--text-column, --tokenizer)",
    ),
    "text": InputKind(
        name="--lengths of texts",
        why="--samples, --dist, --median and --sigma shape drawn lengths, and its lengths are the token counts of "
        "--text-column",
    ),
    "stdlib": InputKind(
        name="drawn lengths (--dist stdlib)",
        why="--column and the text flags read --lengths, --median and --sigma shape --dist lognormal",
    ),
    "lognormal": InputKind(name="drawn lengths (--dist lognormal)", why="--column and the text flags read --lengths"),
}
_SIMULATE = _rows(
    (["lengths"], ["lengths", "text"]),
    (["column"], ["lengths"]),
    (_TEXT, ["text"]),
    (["samples", "dist"], ["stdlib", "lognormal"]),
    (["median", "sigma"], ["lognormal"]),
    (
        [n for n in _PLANNING if n not in ("dp", "strategy", "packing")]
        + [
            "world",
            "partner_memory_gib",
            "host_time",
            "strategies",
            "packings",
            "baseline",
            "peers",
            "tflops",
            "link",
            "inter_link",
            "bandwidth",
        ]
        + ["latency_us", "modes", "out", "json", "no_plots", "quiet", "jobs", "chunk_steps", "sample_steps"]
        + ["no_advice"],
        _SIMULATE_KINDS,
    ),
)

_SHARD_KINDS = {
    "ids": InputKind(name="a dataset with token ids", why="they tokenize a dataset without its token-id column"),
    "text": InputKind(name="a text dataset", why="every flag applies"),
}
_SHARD = _rows(
    (["text_column", "tokenizer", "vocab_size", "num_proc", "no_length_cache"], ["text"]),
    (
        [
            *("dataset", "out", *_PLANNING, "split", "column", "steps_per_file", "write_threads", "cache_dir"),
            *("overwrite", "json"),
            *("quiet", "engine", "ray_address"),
        ],
        _SHARD_KINDS,
    ),
)

_CALIBRATE_KINDS = {
    "kernels": InputKind(name="--scope kernels", why="they time the whole model's step: --scope step"),
    "step": InputKind(name="--scope step", why="they time the attention kernels: --scope kernels"),
    "refit": InputKind(name="--refit", why="it fits the timings of its report again and times nothing"),
}
_CALIBRATE = _rows(
    (sorted(_KERNEL_FIELDS - _STEP_FIELDS), ["kernels"]),
    (sorted(_STEP_FIELDS - _KERNEL_FIELDS), ["step"]),
    (sorted(_KERNEL_FIELDS & _STEP_FIELDS), ["kernels", "step"]),
    (["refit"], ["refit"]),
    (["out", "report", "scope", "quiet"], _CALIBRATE_KINDS),
)

_PLAN = _rows(
    (["lengths"], _LENGTHS_KINDS),
    (["column"], ["lengths"]),
    (_TEXT, ["text"]),
    (
        [*_PLANNING, "world", "partner_memory_gib", "host_time", "out", "json", "quiet", "no_advice"],
        _LENGTHS_KINDS,
    ),
)

#: ``{command: (its kinds of input by key, {setting: keys of the kinds that use it})}``; every setting
#: of each command is a row (commands of :data:`ONE_KIND` use every setting).
TABLE: dict[str, tuple[Mapping[str, InputKind], Mapping[str, frozenset[str]]]] = {
    "plan": (_LENGTHS_KINDS, _PLAN),
    "report": (_REPORT_KINDS, _REPORT),
    "simulate": (_SIMULATE_KINDS, _SIMULATE),
    "shard": (_SHARD_KINDS, _SHARD),
    "calibrate": (_CALIBRATE_KINDS, _CALIBRATE),
}


def unused_flags(command: str, kind: str) -> list[str]:
    """The settings (destinations) of ``command`` that input kind ``kind`` does not use."""
    _, rows = TABLE[command]
    return [name for name, kinds in rows.items() if kind not in kinds]


def check_flags_apply(args: argparse.Namespace, command: str, kind: str) -> None:
    """Refuse every setting given (command line or ``--config``) that input kind ``kind`` of ``command`` does not use.

    Args:
        args: the resolved flags (``args.given``, ``args.from_file`` and ``args.command_parser`` set).
        command: a command of :data:`TABLE`.
        kind: the key of the input's kind in the command's row of :data:`TABLE`.

    Raises:
        ValueError: one line naming each flag given (its value, or the ``--config`` file it came from)
            and the kind that does not use it.
    """
    kinds, _ = TABLE[command]
    unused = set(unused_flags(command, kind)) & set(getattr(args, "given", ()))
    # in --help's order, each by its shown flag (not an old alias)
    given = [action for action in settings(args.command_parser) if action.dest in unused]
    if not given:
        return
    names = ", ".join(_as_given(args, action) for action in given)
    verb = "does" if len(given) == 1 else "do"
    them = "it" if len(given) == 1 else "them"
    raise ValueError(f"{names} {verb} not apply to {kinds[kind].name}: {kinds[kind].why}; leave {them} out")


def _as_given(args: argparse.Namespace, action: argparse.Action) -> str:
    """A setting as the user gave it: ``--dp 7``, ``--no-plots``, ``PLAN``, ``--seed (from --config run.toml)``."""
    name = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
    if action.dest in getattr(args, "from_file", ()):
        return f"{name} (from --config {args.config})"
    value = getattr(args, action.dest)
    if action.nargs == 0 or not action.option_strings:
        return name
    return f"{name} {shown(value)}"
