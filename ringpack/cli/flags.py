"""The flags commands share, and the flags built from a config dataclass's fields (docs/planner.md).

A config dataclass (:class:`~ringpack.shard_plan.PlanConfig`, the calibration configs, the demo's)
declares each field once: its ``help``, ``type``, ``choices`` and bounds sit in the field's
metadata, its default in the dataclass. :func:`add_config_flags` turns every field into one flag
of the same name (``solver_time_limit_s`` -> ``--solver-time-limit-s``) with that help, type and
default. Every flag is declared with :func:`flag`: argparse sees :data:`UNSET`, the real default
is kept on the action, so the command line knows what was given and ``--config`` files fill the
rest (:mod:`ringpack.cli.config_file`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ringpack.comm_model import LINKS
from ringpack.cost import MAX_SAMPLE_TOKENS, CostModel
from ringpack.shard_plan import MAX_CP, PACKINGS, STRATEGIES, PlanConfig


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


#: What argparse stores for a flag that was not given (its real default is the action's ``fallback``).
UNSET: Any = _Marker("UNSET")
#: A ``fallback`` for a flag that must be given (on the command line or in ``--config``).
REQUIRED: Any = _Marker("REQUIRED")
#: Largest count (samples per step, seeds, steps, ...) a flag accepts: every count stays an int64.
MAX_COUNT = 1 << 62
#: Largest tokens per rank a flag accepts (``PlanConfig`` refuses more than this per CP group).
MAX_TOKENS = MAX_SAMPLE_TOKENS
#: The mesh of the commands that explore plans without writing one for training (report, simulate,
#: demo); ``plan`` and ``shard`` write what a training run loads, so there the sizes must be given.
EXPLORE_MESH = {"dp": 4, "cp": 4, "tokens_per_rank": 32768}


# ------------------------------------------------------------------------------------- flag types
def integer(low: int, high: int | None = None) -> Callable[[str], int]:
    """An ``argparse`` type: an integer in ``[low, high]``; anything else is refused with one line."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {text!r}")
        return value

    return parse


def real(low: float, *, inclusive: bool = True, high: float = math.inf) -> Callable[[str], float]:
    """An ``argparse`` type: a finite number ``>= low`` (``> low`` unless ``inclusive``) and ``<= high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive) or value > high:
            bound = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high < math.inf else "")
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    return parse


def integer_list(low: int) -> Callable[[str], list[int]]:
    """An ``argparse`` type: comma-separated integers, each ``>= low``, at least one."""
    item = integer(low)

    def parse(text: str) -> list[int]:
        values = [item(x.strip()) for x in text.split(",") if x.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
        return values

    return parse


def price_range(text: str) -> tuple[float, float]:
    """``LOW,HIGH``: two finite numbers with ``0 < LOW <= 1 <= HIGH``."""
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two numbers), got {text!r}") from None
    if not (math.isfinite(high) and 0 < low <= 1.0 <= high):
        raise argparse.ArgumentTypeError(f"must satisfy 0 < LOW <= 1 <= HIGH (finite), got {text!r}")
    return low, high


def batch_tokens(text: str) -> int | str:
    """``--global-batch-tokens``: ``auto`` or an integer >= 0."""
    return "auto" if text.strip() == "auto" else integer(0, MAX_COUNT)(text)


POSITIVE = integer(1, MAX_COUNT)
COUNT = integer(0, MAX_COUNT)
PROCESSES = integer(1, 1024)
CP_SIZE = integer(1, MAX_CP)
POSITIVE_REAL = real(0.0, inclusive=False)
NON_NEGATIVE_REAL = real(0.0)
#: Hardware rates and latencies (TFLOP/s, GB/s, microseconds): at most 1e9, beyond any hardware,
#: so their products in FLOP/s or bytes/s stay finite.
RATE = real(0.0, inclusive=False, high=1e9)
LATENCY = real(0.0, high=1e9)


# ------------------------------------------------------------------------------------- declaring
def shown(value: Any) -> str:
    """A default as a user types it: ``0.25,2``, ``llama3-8b``, ``1024``."""
    if isinstance(value, CostModel):
        return value.name
    if isinstance(value, (list, tuple)):
        return ",".join(shown(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flag(
    parser: Any, *names: str, default: Any = None, help: str, default_text: str | None = None, **options: Any
) -> argparse.Action:
    """``parser.add_argument`` that keeps the default aside (see the module docstring).

    ``help`` gets ``(required)`` or ``(default: ...)`` appended, from ``default_text`` or a
    ``default`` other than ``None`` and ``False``. Returns the action, its ``fallback`` set.
    """
    text = default_text
    switch = options.get("action") in ("store_true", "store_false")
    if names[0].startswith("-"):  # an option: given once (a positional is read once anyway)
        options["action"] = _ONCE[options.get("action")]
    if text is None and not switch and default is not None and default is not False and default is not REQUIRED:
        text = shown(default)
    full = help + (" (required)" if default is REQUIRED else f" (default: {text})" if text else "")
    action = parser.add_argument(*names, default=UNSET, help=full.replace("%", "%%"), **options)
    action.fallback = default
    return action


def hidden_alias(parser: Any, name: str, of: argparse.Action, deprecated: bool = False) -> argparse.Action:
    """An old spelling of ``of``, not shown in ``--help``; a ``deprecated`` one says to use ``of`` when used."""
    action = parser.add_argument(name, dest=of.dest, type=of.type, default=UNSET, action=Once, help=argparse.SUPPRESS)
    action.fallback, action.deprecated = of.fallback, deprecated
    action.alias_of = of
    return action


def _refuse_repeat(parser: Any, namespace: Any, dest: str, option_string: str | None, shown_value: str) -> None:
    """A flag set twice (with one spelling or two) is refused in one line: the second would silently win."""
    seen = getattr(namespace, "_given_as", {})
    if dest in seen:
        first, first_value = seen[dest]
        if first != option_string:
            parser.error(f"{first} and {option_string} both set the same option; give one")
        values = f" ({first_value}, {shown_value})" if shown_value else ""
        parser.error(f"{option_string} given twice{values}; give it once")
    namespace._given_as = {**seen, dest: (option_string, shown_value)}


class Once(argparse._StoreAction):
    """A flag that takes a value, given once; ``--dp 2 --dp 3`` (or two spellings of it) is a usage error."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        _refuse_repeat(parser, namespace, self.dest, option_string, str(values))
        if getattr(self, "deprecated", False):  # one line on stderr, before any output of the command
            instead = self.alias_of.option_strings[0]
            parser._print_message(f"{parser.prog}: warning: {option_string} is deprecated; use {instead}\n")
        super().__call__(parser, namespace, values, option_string)


class OnceTrue(argparse._StoreTrueAction):
    """A switch (``--quiet``), given once."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        _refuse_repeat(parser, namespace, self.dest, option_string, "")
        super().__call__(parser, namespace, values, option_string)


class OnceFalse(argparse._StoreFalseAction):
    """A switch that turns something off (``--no-ring-check``), given once."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        _refuse_repeat(parser, namespace, self.dest, option_string, "")
        super().__call__(parser, namespace, values, option_string)


#: The action of each ``action=`` a flag may name; every one refuses a second setting of its flag.
_ONCE = {None: Once, "store": Once, "store_true": OnceTrue, "store_false": OnceFalse}


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default (its factory's value), or :data:`REQUIRED` when it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return REQUIRED


def field_flag_names(f: dataclasses.Field) -> tuple[str, ...]:
    """The flag (and its other shown spellings) of a config field: its name with dashes unless it says otherwise."""
    meta = f.metadata
    return (meta.get("flag") or "--" + f.name.replace("_", "-"), *meta.get("spellings", ()))


def _field_type(name: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ``add_argument`` options that read a field's value from its metadata's ``type``, bounds and choices."""
    kind = meta.get("type")
    if kind is int:
        return {"type": integer(meta.get("low", 0), meta.get("high", MAX_COUNT))}
    if kind is float:
        return {"type": real(meta.get("low", 0.0), high=meta.get("high", math.inf))}
    if kind is str:
        return {"choices": meta["choices"]} if "choices" in meta else {}
    if kind is tuple:
        return {"type": price_range, "metavar": meta.get("metavar", "LOW,HIGH")}
    if kind is CostModel:  # a preset or a profile file, under either spelling (--model, --cost-profile)
        return {}
    raise TypeError(f"field {name}: no command-line reading for type {kind!r} (set metadata type=)")


def add_field_flag(
    parser: Any, f: dataclasses.Field, default: Any = UNSET, meta: Mapping[str, Any] | None = None
) -> argparse.Action:
    """One flag for config field ``f`` (its metadata holds ``help`` and ``type``).

    ``default``: the field's when :data:`UNSET`; ``meta``: metadata in place of the field's.
    """
    meta = f.metadata if meta is None else meta
    if "help" not in meta:
        raise TypeError(f"field {f.name} has no help= in its metadata")
    default = field_default(f) if default is UNSET else default
    if isinstance(default, CostModel):  # the flag names a preset or a profile file
        default = default.name
    names = field_flag_names(f)
    if meta.get("type") is bool:
        action = "store_false" if default is True else "store_true"
        made = flag(parser, *names, dest=f.name, default=default, help=meta["help"], action=action)
    else:
        text = meta.get("default_text") if default is None else None
        options = _field_type(f.name, meta)
        if "metavar" in meta:
            options["metavar"] = meta["metavar"]
        made = flag(parser, *names, dest=f.name, default=default, help=meta["help"], default_text=text, **options)
    made.field = f.name
    for alias in meta.get("aliases", ()):
        hidden_alias(parser, alias, made)
    return made


def add_config_flags(
    parser: Any, config: type, *, defaults: Mapping[str, Any] = {}, skip: Iterable[str] = ()
) -> list[argparse.Action]:
    """One flag per field of the dataclass ``config`` (in field order), except those named in ``skip``.

    ``defaults``: a command's own default for some fields (the dataclass's otherwise).
    """
    skip = set(skip)
    return [
        add_field_flag(parser, f, defaults.get(f.name, UNSET)) for f in dataclasses.fields(config) if f.name not in skip
    ]


def config_fields(config: type) -> dict[str, dataclasses.Field]:
    """The fields of a config dataclass, by name."""
    return {f.name: f for f in dataclasses.fields(config)}


# ---------------------------------------------------------------------------------- shared flags
def add_plan_flags(parser: Any, *, defaults: Mapping[str, Any] = {}, skip: Iterable[str] = ()) -> None:
    """The planner's flags, one per :class:`~ringpack.shard_plan.PlanConfig` field, then ``--global-batch-tokens``.

    ``defaults``: the command's own defaults (``global_batch_tokens`` too); ``skip``: fields the
    command sets itself (``report`` plans every strategy, ``simulate`` derives ``dp``).
    """
    g = parser.add_argument_group("planning (PlanConfig fields)")
    add_config_flags(g, PlanConfig, defaults=defaults, skip=skip)
    add_global_batch_flag(g, defaults.get("global_batch_tokens", 0))


def add_quiet_flag(parser: Any) -> None:
    """``--quiet`` / ``--no-progress`` on every long-running command: results and errors still print."""
    flag(
        parser,
        "--quiet",
        "--no-progress",
        dest="quiet",
        default=False,
        action="store_true",
        help="no progress on stderr",
    )


def add_global_batch_flag(parser: Any, default: int | str = 0) -> None:
    """``--global-batch-tokens``: the global batch in tokens, the alternative to ``--samples-per-step``."""
    flag(
        parser,
        "--global-batch-tokens",
        type=batch_tokens,
        default=default,
        metavar="TOKENS",
        help="global batch in tokens instead of --samples-per-step: samples per step = max(dp, TOKENS / mean "
        "sample length); auto: dp x cp x tokens-per-rank, one full micro-batch per DP rank; 0: not used",
    )


def add_variant_flags(parser: Any) -> None:
    """The variants of the commands that plan and compare them (``report``, ``simulate``)."""
    flag(parser, "--strategies", default=",".join(STRATEGIES), help="CP strategies to plan, comma-separated")
    flag(parser, "--packings", default=",".join(PACKINGS), help="packings to plan, each crossed with every strategy")
    flag(parser, "--baseline", help="plan the others are compared with (default zigzag/first_fit when present)")
    flag(
        parser,
        "--peers",
        help="other systems run on the same data, as extra rows: megatron-dcp (Megatron-Core dynamic CP), "
        "wlb (WLB-LLM packing), comma-separated, or none (default: both, when planning lengths)",
    )


def add_tflops_flag(parser: Any) -> None:
    flag(parser, "--tflops", type=RATE, default=400.0, help="achieved fwd+bwd TFLOP/s per GPU of a FLOP cost model")


def add_link_flag(parser: Any) -> None:
    flag(parser, "--link", default="nvlink", choices=sorted(LINKS), help="link preset of the CP traffic within a node")


def add_comm_flags(parser: Any, modes: str) -> None:
    """The communication model of ``report`` and ``simulate`` (``modes``: the command's default)."""
    g = parser.add_argument_group("communication model")
    add_link_flag(g)
    flag(
        g, "--inter-link", default="ib", choices=sorted(LINKS), help="link preset between nodes (with --gpus-per-node)"
    )
    flag(g, "--bandwidth", type=RATE, help="link bandwidth in GB/s (overrides --link)")
    flag(g, "--latency-us", type=LATENCY, help="per-message latency in microseconds (overrides --link)")
    flag(
        g,
        "--modes",
        default=modes,
        help="attention modes (ring, allgather, p2p: targeted, ulysses, ulysses+p2p, ulysses+ring), comma-separated; "
        "the first is the headline",
    )


def add_report_output_flags(parser: Any, default_out: str) -> None:
    """``--out`` (a folder), ``--json``, ``--no-plots``, ``--quiet`` of the commands that write a report."""
    g = parser.add_argument_group("output")
    flag(g, "--out", default=default_out, help="folder for report.json, plots and report.html")
    flag(g, "--json", help="also write the JSON document here ('-' prints it to stdout instead of the table)")
    flag(g, "--no-plots", default=False, action="store_true", help="skip the PNG plots")
    add_quiet_flag(g)


class HelpFormatter(argparse.HelpFormatter):
    """Descriptions wrapped to the terminal; the example lines of an epilog kept as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("example"):
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


def new_command(subparsers: Any, name: str, *, help: str, description: str, examples: Iterable[str]) -> Any:
    """A subcommand's parser: its one-line ``help``, ``description`` and a help that ends with ``examples``."""
    lines = list(examples)
    head = "example:" if len(lines) == 1 else "examples:"
    return subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog="\n".join([head, *(f"  {line}" for line in lines)]),
        formatter_class=HelpFormatter,
    )
