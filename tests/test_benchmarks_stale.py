"""benchmarks/stale.py: a BENCHMARKS.md section is stale exactly when the code it measured changed.

Each test builds a small git repository with its own page; the last tests read the real page.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load():
    spec = importlib.util.spec_from_file_location("ringpack_benchmarks_stale", ROOT / "benchmarks" / "stale.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


stale = _load()


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def commit(repo: Path, message: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", message)
    return git(repo, "rev-parse", "--short=7", "HEAD")


def page(alpha: str, beta_old: str, beta_new: str) -> str:
    """A two-section page: Alpha measures one file, Beta a folder at two commits (a wrapped block)."""
    return f"""# Benchmarks

Intro.

| figure | value | section | commit |
| --- | --- | --- | --- |
| speed | 1.5x | [Alpha](#alpha-one-file) | {alpha} |

<!-- stale:begin -->
<!-- stale:end -->

## Alpha: one file

| x | y |
| --- | --- |
| 1 | 2 |

```
## not a heading: inside a code fence
```

Provenance: commit {alpha}, 2026-11-30, 2-core CPU; measured code: `alpha.py`; command above.

## Beta (`beta/`)

- a bullet

Provenance: commit {beta_old} (the first row) and {beta_new} (the second row), 2026-11-30
and 2026-12-01, 1 x H200; measured code: `beta/`,
`notes.txt`; commands above.
"""


@pytest.fixture
def repo(tmp_path: Path):
    """A repository whose page cites its first two commits; returns (repo, page path, first, second)."""
    git(tmp_path, "init", "-q")
    (tmp_path / "alpha.py").write_text("a = 1\n")
    (tmp_path / "beta").mkdir()
    (tmp_path / "beta" / "x.py").write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("notes\n")
    (tmp_path / "other.txt").write_text("other\n")
    first = commit(tmp_path, "code")
    (tmp_path / "notes.txt").write_text("notes, revised\n")
    second = commit(tmp_path, "notes")
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(page(first, first, second))
    commit(tmp_path, "page")
    return tmp_path, path, first, second


def verdicts(path: Path) -> dict[str, tuple[bool, int]]:
    sections = stale.parse_page(path.read_text())
    return {v.section.title: (v.stale, v.commits_since) for v in stale.check(path.parent, sections)}


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = stale.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_section_is_stale_exactly_when_its_measured_paths_changed(repo):
    root, path, _, _ = repo
    beta = "Beta (`beta/`)"
    # notes.txt changed after Beta's older commit: stale from that commit on, counted once
    assert verdicts(path) == {"Alpha: one file": (False, 0), beta: (True, 1)}
    (root / "other.txt").write_text("other, revised\n")
    commit(root, "an unmeasured file")
    assert verdicts(path) == {"Alpha: one file": (False, 0), beta: (True, 1)}
    (root / "alpha.py").write_text("a = 2\n")
    commit(root, "alpha")
    assert verdicts(path) == {"Alpha: one file": (True, 1), beta: (True, 1)}
    (root / "beta" / "x.py").write_text("x = 2\n")
    commit(root, "beta")
    assert verdicts(path) == {"Alpha: one file": (True, 1), beta: (True, 2)}


def test_a_section_is_fresh_when_its_code_is_as_measured(repo):
    root, path, first, second = repo
    path.write_text(page(first, second, second))
    assert verdicts(path) == {"Alpha: one file": (False, 0), "Beta (`beta/`)": (False, 0)}
    git(root, "mv", "alpha.py", "alpha_moved.py")
    commit(root, "move")
    assert verdicts(path)["Alpha: one file"] == (True, 1), "a moved file counts as changed"


def test_the_blocks_are_parsed_with_every_commit_and_path(repo):
    _, path, first, second = repo
    alpha, beta = stale.parse_page(path.read_text())
    assert (alpha.anchor, beta.anchor) == ("alpha-one-file", "beta-beta")
    assert alpha.provenance == stale.Provenance((first,), "2026-11-30", "2-core CPU", ("alpha.py",))
    assert beta.provenance.commits == (first, second)
    assert beta.provenance.date == "2026-11-30 and 2026-12-01"
    assert beta.provenance.paths == ("beta/", "notes.txt")


def test_write_rewrites_the_marked_block_and_nothing_else(repo, capsys):
    _, path, _, _ = repo
    before = path.read_bytes()
    code, out, err = run(capsys, "--file", str(path), "--write")
    assert (code, err) == (0, "")
    assert re.search(r"^Beta \(`beta/`\)\s+\S+, \S+\s+yes\s+1$", out, re.M), out
    assert re.search(r"^Alpha: one file\s+\S+\s+no\s+0$", out, re.M), out
    after = path.read_bytes()
    head, tail = before.split(stale.BEGIN.encode())[0], before.split(stale.END.encode())[1]
    assert after.startswith(head + stale.BEGIN.encode()) and after.endswith(stale.END.encode() + tail)
    block = after[len(head) : len(after) - len(tail)].decode()
    assert "[Beta (`beta/`)](#beta-beta)" in block
    assert "Alpha" not in block
    run(capsys, "--file", str(path), "--write")
    assert path.read_bytes() == after, "a second --write changes nothing"


def test_without_write_the_page_is_not_touched(repo, capsys):
    _, path, _, _ = repo
    before = path.read_bytes()
    assert run(capsys, "--file", str(path))[0] == 0
    assert path.read_bytes() == before


def _one_line_error(capsys, path: Path, *extra: str) -> str:
    code, out, err = run(capsys, "--file", str(path), *extra)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_a_section_without_provenance_block_is_one_line_and_exit_2(repo, capsys):
    _, path, _, _ = repo
    text = path.read_text()
    path.write_text(text[: text.index("Provenance: commit", text.index("## Beta"))])
    err = _one_line_error(capsys, path)
    assert "Beta (`beta/`)" in err and "no provenance block" in err


def test_an_unknown_commit_is_one_line_and_exit_2(repo, capsys):
    _, path, first, _ = repo
    path.write_text(path.read_text().replace(f"commit {first},", "commit 0123abc,"))
    err = _one_line_error(capsys, path)
    assert "Alpha: one file" in err and "unknown or ambiguous commit 0123abc" in err


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace("; command above.", "; command above.\n\nMore text."), "not its last paragraph"),
        (lambda t: t.replace("- a bullet", "Provenance: none"), "2 provenance blocks"),
        (lambda t: t.replace("2-core CPU; measured code", "2-core CPU; code"), "does not read"),
        (lambda t: t.replace("`alpha.py`", "`alpha.pyc`"), "measured path alpha.pyc names no file"),
        (lambda t: t + "\n## Alpha: one file\n\n" + re.search(r"^Provenance: .*CPU.*$", t, re.M)[0], "appears 2 times"),
    ],
)
def test_a_malformed_page_is_one_line_naming_the_section_and_exit_2(repo, capsys, edit, message):
    _, path, _, _ = repo
    path.write_text(edit(path.read_text()))
    err = _one_line_error(capsys, path)
    assert message in err and "section " in err, err


def test_write_needs_the_markers(repo, capsys):
    _, path, _, _ = repo
    path.write_text(path.read_text().replace(stale.END + "\n", ""))
    before = path.read_bytes()
    assert "needs exactly one" in _one_line_error(capsys, path, "--write")
    assert path.read_bytes() == before


def test_a_page_outside_a_repository_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(page("0123abc", "0123abc", "0123abc"))
    assert "not inside a git work tree" in _one_line_error(capsys, path)


# ----------------------------------------------------------------------------------- the real page

REAL = ROOT / "BENCHMARKS.md"


def test_the_real_page_has_one_provenance_block_per_section():
    text = REAL.read_text()
    sections = stale.parse_page(text)
    headings = [line[3:].strip() for line in text.split("\n") if line.startswith("## ")]
    assert [s.title for s in sections] == headings
    stale.rewrite(text, "")  # exactly one pair of stale markers
    anchors = {s.anchor for s in sections}
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert links <= anchors, f"in-page links to no section: {sorted(links - anchors)}"


def test_the_real_page_cites_commits_of_this_repository():
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-inside-work-tree"], capture_output=True)
    if inside.returncode != 0:
        pytest.skip("not a git checkout: the page's commits cannot be looked up")
    sections = stale.parse_page(REAL.read_text())
    missing = [c for s in sections for c in s.provenance.commits if stale.resolve(ROOT, c) is None]
    if missing and stale.is_shallow(ROOT):
        pytest.skip(f"shallow clone: commits {', '.join(missing)} are outside its history (fetch with --unshallow)")
    assert not missing, f"BENCHMARKS.md cites commits this repository lacks: {missing}"
    assert len(stale.check(ROOT, sections)) == len(sections)  # every measured path names a file
