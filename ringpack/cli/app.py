"""The ``ringpack`` parser and :func:`main`: one line on stderr and a non-zero exit for bad input.

:data:`COMMANDS` names the module of each command; :func:`main` imports only the module of the
command it runs (every module, for ``ringpack --help`` or a command it does not know), and building
a command's parser imports no torch, so ``--help`` and ``--version`` answer at once.

See docs/planner.md, "`ringpack plan`".
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from importlib import import_module
from typing import Any, NoReturn

from ringpack import __version__
from ringpack._hints import command_line_hints
from ringpack.cli.config_file import resolve

#: Each command -> the module whose ``add_command(subparsers)`` adds its parser, in the order of
#: ``ringpack --help``. The command's ``handler`` is a function of that module, or the
#: ``"module:function"`` path of one where running needs imports that building the parser must not
#: pay for (torch, for the timing of ``calibrate`` and the ring check of ``demo``).
COMMANDS = {
    "plan": "ringpack.cli.plan",
    "shard": "ringpack.cli.shard",
    "report": "ringpack.cli.report",
    "simulate": "ringpack.cli.simulate",
    "calibrate": "ringpack.cli.calibrate",
    "demo": "ringpack.cli.demo",
}


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line: the flag, what is wrong, where to look."""

    def error(self, message: str) -> NoReturn:
        message = " ".join(message.split())  # an argument holding a line break or separator stays on the line
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(commands: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The ``ringpack`` parser with the subcommands ``commands`` (default: all of :data:`COMMANDS`).

    Only the modules of ``commands`` are imported; ``--version`` works with any of them.

    Raises:
        KeyError: a name that is not a command of :data:`COMMANDS`.
    """
    parser = OneLineErrorParser(
        prog="ringpack",
        description="Cost-balanced packing and DP x CP sharding of variable-length samples, and its analysis.",
    )
    parser.add_argument("--version", action="version", version=f"ringpack {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in commands:
        import_module(COMMANDS[name]).add_command(subparsers)
    return parser


def parser_for(argv: Sequence[str]) -> argparse.ArgumentParser:
    """The parser :func:`main` parses ``argv`` with: the named command's alone, else every command's.

    The command is the first argument that is not an option (``ringpack`` itself takes no option
    with a value); ``ringpack``, ``ringpack --help`` and a command that does not exist get the
    parser of every command, which lists them or says which exist.
    """
    name = next((arg for arg in argv if not arg.startswith("-")), None)
    return build_parser([name] if name in COMMANDS else COMMANDS)


def handler_of(args: argparse.Namespace) -> Callable[[argparse.Namespace], Any]:
    """The function that runs the parsed command: its ``handler``, imported first where it is a path."""
    handler = args.handler
    if isinstance(handler, str):
        module, _, name = handler.partition(":")
        handler = getattr(import_module(module), name)
    return handler


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed as :func:`main` parses it: every setting not given filled from ``--config`` or its default."""
    args = parser_for(argv).parse_args(argv)
    if getattr(args, "command_parser", None) is not None:
        resolve(args, args.command_parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ringpack COMMAND ...``; the exit code (0 done, 1 bad input or a file error, 2 a usage error).

    Bad input (a ``ValueError``: :class:`~ringpack.errors.PlanError`, :class:`~ringpack.errors.DataError`,
    ...) and file-system errors (``OSError``: a missing file, a directory where a file is expected,
    no permission, a closed pipe) end in one line on stderr naming the file, flag, sample or key.
    Running out of memory (``MemoryError``) is one line naming the command's input files and
    their sizes. Anything else is a bug and keeps its traceback. SIGTERM (``kill``, ``timeout``, a CI limit)
    ends the command as Ctrl-C does once the running call returns: its workers stopped and
    temporary files removed, one line, exit code 143; a command still running :data:`TERM_GRACE_S`
    later, or a second SIGTERM, ends the process at once.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = parser_for(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        with command_line_hints(), _log_to_stderr(args.command), _sigterm_unwinds(args.command):
            resolve(args, args.command_parser)
            return int(handler_of(args)(args) or 0)
    except Terminated:
        print(f"ringpack {args.command}: terminated (SIGTERM)", file=sys.stderr, flush=True)
        _told.set()
        return 128 + signal.SIGTERM
    except BrokenPipeError:  # stdout closed early, e.g. piped to `head`
        _silence_stdout()
        return _fail(args.command, "output closed before it was all written (broken pipe)")
    except (ValueError, OSError) as exc:
        return _fail(args.command, exc)
    except MemoryError as exc:  # numpy's allocation failures too: more samples than memory holds
        return _fail(args.command, _out_of_memory(args, exc))
    except KeyboardInterrupt:
        print(f"ringpack {args.command}: interrupted", file=sys.stderr)
        return 130


class Terminated(BaseException):
    """The command got SIGTERM: raised where it runs, so every ``finally`` (workers, temporary files) runs."""


#: Seconds a command has, after SIGTERM, to unwind before the process ends without it.
TERM_GRACE_S = 10.0
_told = threading.Event()  # the "terminated" line is printed


def _end_after_grace(command: str) -> None:
    time.sleep(TERM_GRACE_S)
    if not _told.is_set():
        os.write(2, f"ringpack {command}: terminated (SIGTERM)\n".encode())
    os._exit(128 + signal.SIGTERM)


@contextlib.contextmanager
def _sigterm_unwinds(command: str):
    """While a command runs (in the main thread), SIGTERM raises :class:`Terminated` instead of ending at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
        # the exception can be lost (raised inside an at-fork hook or a finalizer, which swallow it) or
        # its unwinding stall: the process then ends anyway, TERM_GRACE_S later
        threading.Thread(target=_end_after_grace, args=(command,), daemon=True).start()
        raise Terminated

    saved = signal.signal(signal.SIGTERM, terminated)
    _HANDLERS.add(terminated)
    try:
        yield
    finally:
        _HANDLERS.discard(terminated)
        signal.signal(signal.SIGTERM, saved)


#: The SIGTERM handlers :func:`_sigterm_unwinds` installed and that are still in place.
_HANDLERS: set = set()


def _default_sigterm_in_child() -> None:
    """A process forked while a command runs (``datasets``' tokenizing workers, say) ends on SIGTERM
    at once, as a process should: the command's handler unwinds the command, and a worker stuck in a
    lock a thread of the parent held at the fork could never run it, so stopping its pool would wait
    for it forever."""
    if signal.getsignal(signal.SIGTERM) in _HANDLERS:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


class _CommandFormatter(logging.Formatter):
    """``ringpack COMMAND: message``; warnings say so (``ringpack shard: warning: ...``)."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command

    def format(self, record: logging.LogRecord) -> str:
        kind = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"ringpack {self.command}: {kind}{record.getMessage()}"


@contextlib.contextmanager
def _log_to_stderr(command: str):
    """Show the ``ringpack`` loggers' notes, warnings and progress (INFO and up) on stderr while a command runs.

    The handler writes to the ``sys.stderr`` of this call and is removed afterwards, and the
    records stop at the ``ringpack`` logger, so a program that calls :func:`main` keeps its own
    logging as it was.
    """
    root = logging.getLogger("ringpack")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_CommandFormatter(command))
    saved = root.level, root.propagate
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(saved[0])
        root.propagate = saved[1]


def _fail(command: str, problem: Any) -> int:
    """Print ``problem`` as one line on stderr; exit code 1."""
    text = " ".join(str(problem).split()) or type(problem).__name__
    print(f"ringpack {command}: error: {text}", file=sys.stderr)
    return 1


#: Where a command's input files are (the parsed setting, and how the out-of-memory line names it).
_INPUTS = (("lengths", "--lengths"), ("manifest", "--manifest"), ("dataset", "DATASET"), ("plans", "plan file"))


def _out_of_memory(args: argparse.Namespace, exc: MemoryError) -> str:
    """What ran out of memory: the inputs given (each with its size on disk) and numpy's allocation, in one line."""
    inputs = []
    for dest, name in _INPUTS:
        value = getattr(args, dest, None)
        for path in value if isinstance(value, list) else [value]:
            if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
                inputs.append(f"{name} {path} ({os.path.getsize(path) / 2**20:,.1f} MiB)")
            elif isinstance(path, (str, os.PathLike)) and os.path.isdir(path):
                inputs.append(f"{name} {path} (a folder)")
    what = ", ".join(inputs) or "its input"
    reason = " ".join(str(exc).split()) or "an allocation failed"
    return f"out of memory on {what}: {reason}; run with more memory (ulimit -v, a container's limit) or fewer samples"


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's final flush of a closed pipe raises nothing."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    # stdout may be an object without a descriptor (tests, notebooks): then there is nothing to redirect
    with contextlib.suppress(OSError, ValueError, AttributeError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
