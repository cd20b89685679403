"""The embedded default corpus: the running interpreter's standard library, one document per file (docs/data.md).

It exists on every machine with Python, is real text with a heavy-tailed length distribution
(a few huge modules, many small ones), and needs no download, which makes it the default for
``make demo``, the planner benchmark and the end-to-end dataloader tests. Token counts come from
:mod:`ringpack.tokenizer`: by default its regex pre-tokenizer, which is all the planner needs (it
balances relative costs); ``tokenizer=`` takes what :func:`~ringpack.tokenizer.load_tokenizer`
reads, for exact counts of a real model's tokenizer.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringpack.tokenizer import load_tokenizer_counter, regex_token_count

__all__ = ["Corpus", "stdlib_corpus", "stdlib_files"]


@dataclass(frozen=True)
class Corpus:
    """Documents by name with their token counts (``lengths[i]`` tokens for ``names[i]``)."""

    names: tuple[str, ...]
    lengths: np.ndarray
    root: Path
    counter: str


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``*.py`` file of the standard library (site-packages excluded), sorted by path."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts]
    return sorted(files)


def stdlib_corpus(tokenizer: str | Path | None = None, root: Path | None = None) -> Corpus:
    """Load the standard-library corpus; empty files are skipped (a document needs >= 1 token)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    texts = [_read(f) for f in files]
    if tokenizer is None:
        counts = [regex_token_count(t) for t in texts]
        counter = "regex \\w+|[^\\w\\s]"
    else:
        counts = load_tokenizer_counter(tokenizer)(texts)
        counter = f"tokenizer {tokenizer}"
    keep = [i for i, c in enumerate(counts) if c > 0]
    if not keep:
        raise FileNotFoundError(f"no non-empty Python files under {root}")
    names = tuple(str(files[i].relative_to(root)) for i in keep)
    return Corpus(names=names, lengths=np.array([counts[i] for i in keep], dtype=np.int64), root=root, counter=counter)


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")
