"""Every module of ``ringpack/`` has a short docstring that links the docs page saying the rest.

A module docstring says what the module promises in at most 16 lines and names its page as
``docs/PAGE.md``, a page that exists. Only ``__init__.py`` of a subpackage and private modules
(``_name.py``, ``__main__.py``) may go without a link, and only while their docstring is under 5
lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ringpack"
DOCS = ROOT / "docs"
MAX_LINES = 16
UNLINKED_MAX_LINES = 4
DOCS_LINK = re.compile(r"docs/([A-Za-z0-9_-]+)\.md")
MODULES = sorted(PACKAGE.rglob("*.py"))


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))) or ""


def _may_go_unlinked(path: Path) -> bool:
    subpackage_init = path.name == "__init__.py" and path.parent != PACKAGE
    return subpackage_init or path.name.startswith("_") and path.name != "__init__.py"


def test_modules_found():
    assert len(MODULES) > 50
    assert (DOCS / "plan.md").is_file()


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_docstring_is_short_and_links_its_page(path: Path):
    doc = _docstring(path)
    lines = doc.splitlines()
    assert doc.strip(), f"{path.relative_to(ROOT)} has no module docstring"
    assert len(lines) <= MAX_LINES, (
        f"{path.relative_to(ROOT)}: module docstring has {len(lines)} lines (at most {MAX_LINES})"
    )
    pages = DOCS_LINK.findall(doc)
    missing = [page for page in pages if not (DOCS / f"{page}.md").is_file()]
    assert not missing, f"{path.relative_to(ROOT)} links docs pages that do not exist: {missing}"
    if not pages:
        assert _may_go_unlinked(path) and len(lines) <= UNLINKED_MAX_LINES, (
            f"{path.relative_to(ROOT)}: module docstring links no docs/PAGE.md page"
        )
