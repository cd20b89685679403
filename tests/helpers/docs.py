"""The code blocks of the Markdown pages, and a runner that executes one page's as a reader would.

A block's role is set by an HTML comment on the line before its fence (invisible when rendered):

* a ```` ```python ```` block without one runs, in page order, in one namespace per page, in a
  scratch folder; a top-level expression with a value comment (``mb.loss_tokens  # 5396 = ...``, or
  comment lines right below it) must give that value (its ``repr`` or ``str``; ``...`` in the
  comment stands for any text);
* ``<!-- not-run: why -->``: a fragment, with the reason (it needs a GPU, the reader's model, ...);
* ``<!-- excerpt: PATH -->``: lines of the runnable file ``PATH``: each line of the block, stripped,
  is one of the file's, in the file's order (comment-only lines and ``...`` aside);
* ``<!-- run -->`` before a ```` ```bash ```` block: it runs in the page's scratch folder, with
  ``ringpack`` and ``python`` meaning this interpreter (as after ``source .venv/bin/activate``);
* ``<!-- output -->`` before a block: the standard output of the ``run`` block before it, line
  for line (``...`` for text that changes between runs, such as times).

``python -m tests.helpers.docs PAGE`` runs one page's blocks and prints ``ok``; an error names the
page and the line.
"""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = ("not-run", "excerpt", "run", "output")

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_MARKER = re.compile(r"^<!--\s*([\w-]+)\s*(?::\s*(.*?))?\s*-->\s*$")
#: A comment that states a value: a number, a bracket, a quote, a call-like repr, a constant.
_VALUE_COMMENT = re.compile(r"^(-?\d|[(\[{'\"]|[A-Za-z_][\w.]*\(|(True|False|None)\b)")
_PRELUDE = 'set -e\nringpack() { "$PYTHON" -m ringpack "$@"; }\npython() { "$PYTHON" "$@"; }\n'


@dataclass(frozen=True)
class Block:
    """One fenced block: its page, the line of its opening fence, language, text and marker."""

    page: Path
    line: int
    lang: str
    code: str
    marker: str | None
    arg: str | None

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"


def _name(page: Path) -> str:
    """``page`` relative to the repository (as is when outside it)."""
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order, with the marker on the line before it (if any)."""
    text = page.read_text(encoding="utf-8")
    out = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = _MARKER.match(before)
        name, arg = (marker.group(1), marker.group(2)) if marker else (None, None)
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(page, line, m.group(1), m.group(2), name, arg))
    return out


# ------------------------------------------------------------------------------------------ checks
def excerpt_problem(block: Block) -> str | None:
    """Why ``block`` is not an excerpt of its file, or ``None``: every code line, stripped, is a line of
    the file, in the file's order."""
    path = ROOT / (block.arg or "")
    if not block.arg or not path.is_file():
        return f"{block.where}: excerpt of {block.arg!r}, which is not a file of the repository"
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    at = 0
    for want in (line.strip() for line in block.code.splitlines()):
        if not want or want.startswith("#") or want == "...":
            continue
        try:
            at = lines.index(want, at) + 1
        except ValueError:
            return f"{block.where}: {want!r} is not a line of {block.arg} (after its line {at})"
    return None


def value_matches(comment: str, value: Any) -> bool:
    """Whether ``comment`` opens with ``value`` rendered (``repr`` or ``str``), ``...`` matching any text."""
    text = " ".join(comment.split())
    candidates = [" ".join(repr(value).split()), " ".join(str(value).split())]
    cuts = [k for k, c in enumerate(text) if c in " :;,="] + [len(text)]
    for k in cuts:
        pattern = ".*".join(re.escape(part) for part in text[:k].strip().split("..."))
        if pattern and any(re.fullmatch(pattern, c, re.S) for c in candidates):
            return True
    return False


def _comments(source: str) -> dict[int, str]:
    """Line (1-based) -> the text of its comment, ``#`` and spaces stripped."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


def _stated_value(stmt: ast.stmt, lines: list[str], comments: dict[int, str]) -> str | None:
    """The value comment of a one-line expression statement: on its line, or the comment lines below it."""
    if stmt.end_lineno != stmt.lineno:
        return None
    if stmt.lineno in comments:
        text = comments[stmt.lineno]
    else:
        below, n = [], stmt.lineno + 1
        while n <= len(lines) and lines[n - 1].strip().startswith("#"):
            below.append(comments[n])
            n += 1
        text = " ".join(below)
    return text if _VALUE_COMMENT.match(text) else None


def run_python(block: Block, namespace: dict[str, Any]) -> None:
    """Run ``block`` statement by statement in ``namespace``, checking its value comments."""
    source = block.code
    filename = f"{block.where} (python block)"
    tree = ast.parse(source, filename=filename)
    lines, comments = source.splitlines(), _comments(source)
    for stmt in tree.body:
        if isinstance(stmt, ast.Expr):
            value = eval(compile(ast.Expression(stmt.value), filename, "eval"), namespace)
            stated = _stated_value(stmt, lines, comments)
            if stated is not None and value is not None and not value_matches(stated, value):
                raise AssertionError(
                    f"{_name(block.page)}:{block.line + stmt.lineno}: the comment says "
                    f"{stated!r}, the code gives {value!r}"
                )
        else:
            exec(compile(ast.Module([stmt], type_ignores=[]), filename, "exec"), namespace)


def run_bash(block: Block, folder: Path) -> str:
    """Run a ``run`` bash block in ``folder``; its standard output."""
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "MPLBACKEND": "Agg"}
    done = subprocess.run(
        ["bash", "-c", _PRELUDE + block.code], cwd=folder, env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode:
        raise AssertionError(f"{block.where}: the commands exit {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def _line_pattern(line: str) -> str:
    return ".*".join(re.escape(part) for part in line.rstrip().split("..."))


def output_problem(block: Block, stdout: str | None) -> str | None:
    """Why ``block`` is not the output the ``run`` block before it printed, or ``None``. A line ``...``
    alone stands for any number of lines."""
    if stdout is None:
        return f"{block.where}: an output block must follow a run block"
    want, got = block.code.rstrip("\n").splitlines(), stdout.rstrip("\n").splitlines()
    if "..." not in want:  # line for line, to name the first line that differs
        for k, (w, g) in enumerate(zip(want, got)):
            if not re.fullmatch(_line_pattern(w), g.rstrip()):
                where = f"{_name(block.page)}:{block.line + 1 + k}"
                return f"{where}: the page says {w!r}, the command prints {g!r}"
        if len(want) == len(got):
            return None
    pattern = "".join(r"(?:[^\n]*\n)*?" if w == "..." else _line_pattern(w) + r"\n" for w in want)
    if re.fullmatch(pattern, "\n".join(line.rstrip() for line in got) + "\n"):
        return None
    return f"{block.where}: the page shows\n{block.code}the command prints\n{stdout}"


def run_page(page: Path, folder: Path) -> int:
    """Run ``page``'s python blocks and ``run`` bash blocks in order in ``folder``, checking its outputs.

    Returns:
        How many blocks ran or were checked.
    """
    os.chdir(folder)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    stdout, count = None, 0
    for block in blocks(page):
        if block.lang == "python" and block.marker is None:
            run_python(block, namespace)
        elif block.lang == "bash" and block.marker == "run":
            stdout = run_bash(block, folder)
        elif block.marker == "output":
            problem = output_problem(block, stdout)
            if problem:
                raise AssertionError(problem)
        else:
            continue
        count += 1
    return count


def runnable(page: Path) -> bool:
    """Whether ``page`` has blocks :func:`run_page` runs."""
    return any(
        (b.lang == "python" and b.marker is None) or (b.lang == "bash" and b.marker == "run") for b in blocks(page)
    )


if __name__ == "__main__":
    page = Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory(prefix="ringpack-docs-") as scratch:
        print(f"ok {run_page(page, Path(scratch))}")
