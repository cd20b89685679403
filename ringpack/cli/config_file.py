"""``--config FILE``: a command's flags from a TOML, JSON or YAML file; ``plan --write-config`` writes one.

A file holds the same keys as the command's flags (the destination, a field name such as
``tokens_per_rank``, or any spelling of the flag, with underscores or dashes). Each value goes
through the flag's own type and choices, so a file is checked as the command line is; flags given
on the command line override the file, and the file overrides the defaults. TOML needs Python 3.11
(``tomllib``) or the ``tomli`` package, YAML the ``PyYAML`` package; JSON always works.

See docs/planner.md, "Config files".
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from ringpack.cli.flags import REQUIRED, UNSET, flag
from ringpack.errors import DataError

#: What ``--config`` reads and ``--write-config`` writes, by suffix.
SUFFIXES = {".toml": "TOML", ".json": "JSON", ".yaml": "YAML", ".yml": "YAML"}
#: Destinations that are not settings (never read from or written to a file).
_NOT_SETTINGS = {"help", "config", "write_config", "handler", "command", "command_parser"}


def add_config_file_flag(parser: Any) -> None:
    """``--config FILE`` on ``parser`` (given once, as every flag)."""
    flag(
        parser,
        "--config",
        metavar="FILE",
        help="read flags from a .toml, .json or .yaml file (keys: the flags' names, e.g. tokens_per_rank); "
        "flags on the command line win",
    )


def settings(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The actions whose values are a command's settings, one per destination (hidden aliases left out)."""
    seen: set[str] = set()
    out = []
    for action in parser._actions:
        if action.dest in _NOT_SETTINGS or action.dest in seen or not hasattr(action, "fallback"):
            continue
        seen.add(action.dest)
        out.append(action)
    return out


def _keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a file may use for each setting: its destination and each of its flags' names."""
    canonical = {a.dest: a for a in settings(parser)}
    keys: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest not in canonical:
            continue
        for name in (action.dest, *action.option_strings):
            keys[name.lstrip("-").replace("-", "_")] = canonical[action.dest]
    return keys


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill every setting not given on the command line: from ``--config`` if it holds it, else the default.

    Sets ``args.given``: the destinations given on the command line or in the file, and
    ``args.from_file``: those of them the file gave.

    Raises:
        DataError: the file cannot be read or holds an unknown key or a bad value (the file and key named).
        SystemExit: a required flag given nowhere (a usage error, exit 2).
    """
    path = getattr(args, "config", UNSET)
    loaded = read_config(path, parser) if path not in (UNSET, None) else {}
    given, from_file, missing = set(), set(), []
    for action in settings(parser):
        if getattr(args, action.dest, UNSET) is not UNSET:
            given.add(action.dest)
        elif action.dest in loaded:
            setattr(args, action.dest, loaded[action.dest])
            given.add(action.dest)
            from_file.add(action.dest)
        elif action.fallback is REQUIRED:
            missing.append(action.option_strings[0] if action.option_strings else action.metavar or action.dest)
        else:
            setattr(args, action.dest, action.fallback)
    if missing:
        parser.error("the following arguments are required: " + ", ".join(missing))
    for action in parser._actions:  # --config, --write-config: not settings, yet filled alike
        if getattr(args, action.dest, None) is UNSET:
            setattr(args, action.dest, action.fallback)
    args.given, args.from_file = frozenset(given), frozenset(from_file)


def read_config(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The settings a config file holds, by destination, each checked by its flag's type.

    Raises:
        DataError: a missing reader (TOML on Python 3.10 without ``tomli``, YAML without PyYAML), a
            file that does not parse or is not a mapping, an unknown key, two keys of one setting,
            or a value its flag refuses; one line naming the file and the key.
        FileNotFoundError: no file at ``path``.
    """
    data = _load(Path(path))
    keys = _keys(parser)
    command = parser.prog
    out: dict[str, Any] = {}
    named: dict[str, str] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        action = keys.get(name)
        if action is None:
            raise DataError(f"--config {path}: unknown key {key!r} ({command} has no such flag)")
        if action.dest in named:
            raise DataError(f"--config {path}: keys {named[action.dest]!r} and {key!r} set the same flag; give one")
        named[action.dest] = str(key)
        if value is not None:  # null: as if the key were absent
            out[action.dest] = _value(action, value, f"--config {path}: key {key!r}")
    return out


def _load(path: Path) -> dict[str, Any]:
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"--config {path}: give a .toml, .json, .yaml or .yml file")
    if not path.exists():
        raise FileNotFoundError(f"--config {path}: no such file")
    if not path.is_file():
        raise DataError(f"--config {path} is a folder, not a file")
    text = path.read_text(encoding="utf-8")
    try:
        if kind == "JSON":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        elif kind == "TOML":  # TOML itself refuses a key given twice
            data = _toml_reader().loads(text)
        else:
            data = _yaml().load(text, Loader=_unique_key_loader())
    except _DuplicateKey as exc:
        raise DataError(f"--config {path}: key {exc.key!r} is given twice; give it once") from None
    except DataError:
        raise
    except Exception as exc:  # each reader has its own error type (JSONDecodeError, TOMLDecodeError, YAMLError)
        raise DataError(f"--config {path} is not valid {kind}: {' '.join(str(exc).split())}") from None
    if data is None and kind == "YAML":
        data = {}
    if not isinstance(data, dict):
        raise DataError(f"--config {path} holds a {type(data).__name__}, not a mapping of flags to values")
    return data


class _DuplicateKey(Exception):
    def __init__(self, key: Any) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict; a key given twice raises :class:`_DuplicateKey` (``json`` keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _unique_key_loader() -> Any:
    """PyYAML's safe loader, except that a mapping holding a key twice raises :class:`_DuplicateKey`."""
    yaml = _yaml()

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, Hashable):
                    break  # the safe loader's own error names an unhashable key
                if key in seen:
                    raise _DuplicateKey(key)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _toml_reader() -> Any:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise DataError(
                "reading a TOML --config needs Python 3.11+ or the tomli package (pip install tomli); "
                "or give a .json file"
            ) from None
    return tomllib


def _yaml() -> Any:
    try:
        import yaml
    except ImportError:
        raise DataError(
            "reading a YAML --config needs PyYAML (pip install pyyaml); or give a .toml or .json file"
        ) from None
    return yaml


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """A file's value for ``action``, checked and converted as the command line would."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise DataError(f"{where}: expected true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(value, dict):
        raise DataError(f"{where}: expected a value, got a table")
    if action.nargs in ("*", "+"):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, _text(item, where), where) for item in items]
    text = ",".join(_text(v, where) for v in value) if isinstance(value, list) else _text(value, where)
    return _convert(action, text, where)


def _text(value: Any, where: str) -> str:
    if isinstance(value, (bool, dict, list)):
        raise DataError(f"{where}: expected a number or a string, got {value!r}")
    return str(value)


def _convert(action: argparse.Action, text: str, where: str) -> Any:
    value = text
    if action.type is not None:
        try:
            value = action.type(text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as exc:
            raise DataError(f"{where}: {exc}") from None
    if action.choices is not None and value not in action.choices:
        raise DataError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


# ------------------------------------------------------------------------------------------ write
def written_settings(
    args: argparse.Namespace, parser: argparse.ArgumentParser, leave_out: Sequence[str] = ()
) -> dict[str, Any]:
    """The resolved settings of a run, by destination, as a config file holds them.

    Settings that are ``None`` and the destinations in ``leave_out`` are not written.
    """
    out = {}
    for action in settings(parser):
        value = getattr(args, action.dest, None)
        if value is None or value is UNSET or action.dest in leave_out:
            continue
        out[action.dest] = list(value) if isinstance(value, tuple) else value
    return out


def write_config(path: str, values: dict[str, Any]) -> None:
    """Write ``values`` (a flat mapping of numbers, strings, booleans and lists) as TOML, JSON or YAML by suffix.

    Raises:
        DataError: another suffix, or YAML without PyYAML.
    """
    target = Path(path)
    kind = SUFFIXES.get(target.suffix.lower())
    if kind is None:
        raise DataError(f"--write-config {path}: give a .toml, .json, .yaml or .yml file")
    if kind == "JSON":
        text = json.dumps(values, indent=1) + "\n"
    elif kind == "YAML":
        text = _yaml().safe_dump(values, sort_keys=False)
    else:
        text = "".join(f"{key} = {_toml(value)}\n" for key, value in values.items())
    target.write_text(text, encoding="utf-8")


def _toml(value: Any) -> str:
    """A TOML value: a boolean, number, basic string or array of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # a JSON string is a TOML basic string once DEL, which TOML wants escaped, is escaped too
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
