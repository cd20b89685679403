"""Which sections of BENCHMARKS.md measured code that has changed since their commit.

    python benchmarks/stale.py [--write] [--file BENCHMARKS.md]

Every ``## `` section of the page ends with one provenance paragraph (it may wrap over lines)::

    Provenance: commit <hash> [(<rows>)] [and <hash> (<rows>) ...], <date>, <machine>;
    measured code: `<path>`, `<path>`, ...; <where the commands are>.

A section is stale when ``git diff <commit> HEAD -- <paths>`` is not empty for any of its commits
(a moved or deleted file counts as changed). Prints one row per section; ``--write`` rewrites the
list of stale sections between ``<!-- stale:begin -->`` and ``<!-- stale:end -->`` and leaves every
other byte of the page as it was. Exits 0, or 2 with one line naming the section when the page
cannot be parsed, a section has no provenance block, a commit is unknown or a measured path names
no file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- stale:begin -->"
END = "<!-- stale:end -->"
FORMAT = (
    "Provenance: commit <hash> [(<rows>)] [and <hash> (<rows>)], <date>, <machine>; "
    "measured code: `<path>`, ...; <where the commands are>."
)

_ITEM = r"[0-9a-f]{7,40}(?: \([^()]*\))?"
_DATE = r"\d{4}-\d{2}-\d{2}"
_BLOCK = re.compile(
    rf"Provenance: commits? (?P<commits>{_ITEM}(?:(?:, and |, | and ){_ITEM})*), "
    rf"(?P<date>{_DATE}(?: and {_DATE})?), "
    r"(?P<machine>[^;]+); "
    r"measured code: (?P<paths>`[^`]+`(?:, `[^`]+`)*); "
    r"(?P<how>[^;]+)\."
)
_HASH = re.compile(r"(?:^|, and |, | and )([0-9a-f]{7,40})")


class ProvenanceError(ValueError):
    """The page or a section's provenance block cannot be used; the message is one line."""


@dataclass(frozen=True)
class Provenance:
    """One section's provenance block: the commits that ran, when, where, and the code measured."""

    commits: tuple[str, ...]
    date: str
    machine: str
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Section:
    """A ``## `` section: its title, its in-page anchor and its provenance."""

    title: str
    anchor: str
    provenance: Provenance


@dataclass(frozen=True)
class Verdict:
    """Whether a section's measured code changed since its commits.

    ``commits_since``: commits since the section's oldest commit that touch its measured paths.
    """

    section: Section
    stale: bool
    commits_since: int


def anchor(title: str) -> str:
    """The in-page anchor a Markdown renderer gives a heading (GitHub's rule, no duplicates)."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """Split ``text`` into (title, body lines) per ``## `` heading outside code fences."""
    found: list[tuple[str, list[str]]] = []
    fenced = False
    for line in text.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("## "):
            found.append((line[3:].strip(), []))
        elif found:
            found[-1][1].append(line)
    return found


def parse_block(title: str, body: list[str]) -> Provenance:
    """The provenance block of one section: the paragraph that ends ``body``.

    Raises:
        ProvenanceError: no block, more than one, a block that is not the last paragraph, or one
            that does not follow :data:`FORMAT`.
    """
    fenced = False
    starts = []
    for i, line in enumerate(body):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("Provenance:"):
            starts.append(i)
    if not starts:
        raise ProvenanceError(f'section "{title}" has no provenance block (a last paragraph "{FORMAT}")')
    if len(starts) > 1:
        raise ProvenanceError(f'section "{title}" has {len(starts)} provenance blocks; it needs exactly one')
    paragraph = [line.strip() for line in body[starts[0] :]]
    while paragraph and not paragraph[-1]:
        paragraph.pop()
    if "" in paragraph:
        raise ProvenanceError(f'section "{title}": the provenance block is not its last paragraph')
    joined = " ".join(paragraph)
    match = _BLOCK.fullmatch(joined)
    if match is None:
        raise ProvenanceError(f'section "{title}": provenance block does not read "{FORMAT}": {joined}')
    return Provenance(
        commits=tuple(_HASH.findall(re.sub(r" \([^()]*\)", "", match["commits"]))),
        date=match["date"],
        machine=match["machine"].strip(),
        paths=tuple(re.findall(r"`([^`]+)`", match["paths"])),
    )


def parse_page(text: str) -> list[Section]:
    """Every ``## `` section of ``text`` with its provenance block.

    Raises:
        ProvenanceError: no section, two sections of one title, or a section's block as in
            :func:`parse_block`.
    """
    sections = [Section(title, anchor(title), parse_block(title, body)) for title, body in _sections(text)]
    if not sections:
        raise ProvenanceError('no "## " section')
    titles = [section.title for section in sections]
    for title in titles:
        if titles.count(title) > 1:
            raise ProvenanceError(f'section "{title}" appears {titles.count(title)} times')
    return sections


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)


def repository_root(path: Path) -> Path:
    """The top of the git work tree holding ``path``.

    Raises:
        ProvenanceError: ``path`` is not inside a git work tree, or git cannot run.
    """
    try:
        done = _git(path, "rev-parse", "--show-toplevel")
    except FileNotFoundError:
        raise ProvenanceError("git is not installed") from None
    if done.returncode != 0:
        raise ProvenanceError(f"{path} is not inside a git work tree")
    return Path(done.stdout.strip())


def is_shallow(root: Path) -> bool:
    """Whether the clone at ``root`` lacks part of its history."""
    return _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == "true"


def resolve(root: Path, commit: str) -> str | None:
    """The full hash of ``commit`` in the repository at ``root``; None if unknown or ambiguous."""
    done = _git(root, "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}")
    return done.stdout.strip() if done.returncode == 0 else None


def _files(root: Path, rev: str, cache: dict[str, list[str]]) -> list[str]:
    if rev not in cache:
        cache[rev] = _git(root, "ls-tree", "-r", "--name-only", rev).stdout.split("\n")
    return cache[rev]


def _names_a_file(path: str, files: list[str]) -> bool:
    prefix = path if path.endswith("/") else path + "/"
    return any(name == path or name.startswith(prefix) for name in files)


def check(root: Path, sections: list[Section]) -> list[Verdict]:
    """Judge every section against HEAD of the repository at ``root``.

    Raises:
        ProvenanceError: a section's commit is unknown (or ambiguous), or one of its measured paths
            names no file at its commits or at HEAD.
    """
    listings: dict[str, list[str]] = {}
    verdicts = []
    for section in sections:
        title, prov = section.title, section.provenance
        full = []
        for commit in prov.commits:
            resolved = resolve(root, commit)
            if resolved is None:
                hint = " (this clone is shallow: fetch the full history)" if is_shallow(root) else ""
                raise ProvenanceError(f'section "{title}": unknown or ambiguous commit {commit}{hint}')
            full.append(resolved)
        for path in prov.paths:
            if not any(_names_a_file(path, _files(root, rev, listings)) for rev in (*full, "HEAD")):
                raise ProvenanceError(
                    f'section "{title}": measured path {path} names no file at {", ".join(prov.commits)} or HEAD'
                )
        stale = False
        since = 0
        for commit in full:
            diff = _git(root, "diff", "--quiet", commit, "HEAD", "--", *prov.paths)
            if diff.returncode not in (0, 1):
                raise ProvenanceError(f'section "{title}": git diff failed: {diff.stderr.strip()}')
            stale = stale or diff.returncode == 1
            count = _git(root, "rev-list", "--count", f"{commit}..HEAD", "--", *prov.paths)
            since = max(since, int(count.stdout.strip() or 0))
        verdicts.append(Verdict(section, stale, since))
    return verdicts


def render_block(verdicts: list[Verdict]) -> str:
    """The lines between the stale markers: a table of the stale sections, or a sentence."""
    stale = [v for v in verdicts if v.stale]
    if not stale:
        return f"No section is stale: no section's measured code changed since its commit ({len(verdicts)} checked)."
    lines = [
        f"**Stale: {len(stale)} of {len(verdicts)} sections.** The code they measured has changed since their "
        "commit, so their figures may no longer hold until they are run again "
        "(`python benchmarks/stale.py --write` rewrites this list):",
        "",
        "| stale section | commit | commits since that touch its measured code |",
        "| --- | --- | --- |",
    ]
    for v in stale:
        link = f"[{v.section.title}](#{v.section.anchor})"
        lines.append(f"| {link} | {', '.join(v.section.provenance.commits)} | {v.commits_since} |")
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    """``text`` with the lines between its one pair of stale markers replaced by ``block``.

    Raises:
        ProvenanceError: the markers are missing, repeated or out of order.
    """
    begins, ends = text.count(BEGIN), text.count(END)
    if begins != 1 or ends != 1:
        raise ProvenanceError(f"needs exactly one {BEGIN} and one {END} line (found {begins} and {ends})")
    start = text.index(BEGIN) + len(BEGIN)
    stop = text.index(END)
    if stop < start:
        raise ProvenanceError(f"{END} comes before {BEGIN}")
    return text[:start] + "\n" + block + "\n" + text[stop:]


def table(verdicts: list[Verdict]) -> str:
    """One row per section: title, commits, stale yes/no, commits since touching its code."""
    rows = [("section", "commit", "stale", "commits since")]
    for v in verdicts:
        rows.append(
            (v.section.title, ", ".join(v.section.provenance.commits), "yes" if v.stale else "no", str(v.commits_since))
        )
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--file", type=Path, default=ROOT / "BENCHMARKS.md", help="the page (default: %(default)s)")
    parser.add_argument("--write", action="store_true", help=f"rewrite the list between {BEGIN} and {END}")
    args = parser.parse_args(argv)
    try:
        try:
            text = args.file.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ProvenanceError(f"cannot read it: {err}") from None
        sections = parse_page(text)
        if args.write:
            rewrite(text, "")
        verdicts = check(repository_root(args.file.resolve().parent), sections)
    except ProvenanceError as err:
        print(f"{args.file}: {err}", file=sys.stderr)
        return 2
    print(table(verdicts))
    if args.write:
        new = rewrite(text, render_block(verdicts))
        if new != text:
            args.file.write_bytes(new.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
