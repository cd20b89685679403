"""The embedded default corpus: the running interpreter's standard library, one document per file.

It exists on every machine with Python, is real text with a heavy-tailed length distribution
(a few huge modules, many small ones), and needs no download, which makes it the default for
``make demo``, the planner benchmark and the end-to-end dataloader tests.

Token counting: by default a documented regex pre-tokenizer, one token per run of word
characters and one per other non-space character (``\\w+|[^\\w\\s]``). On source code that comes
within roughly +-30% of a byte-level BPE's count, which is all the planner needs (it balances
relative costs); pass ``tokenizer=`` a Hugging Face ``tokenizer.json`` (or a folder holding one) for
exact counts of a real model's tokenizer.
"""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ringpack.errors import DataError

__all__ = ["Corpus", "stdlib_corpus", "stdlib_files", "regex_token_count", "load_tokenizer", "load_tokenizer_counter"]

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class Corpus:
    """Documents by name with their token counts (``lengths[i]`` tokens for ``names[i]``)."""

    names: tuple[str, ...]
    lengths: np.ndarray
    root: Path
    counter: str


def regex_token_count(text: str) -> int:
    """Number of ``\\w+|[^\\w\\s]`` matches: the default, dependency-free token counter."""
    return len(_TOKEN_RE.findall(text))


def regex_tokenize(text: str) -> list[str]:
    """The default tokenizer's tokens (used where real ids are needed, e.g. sharding the corpus)."""
    return _TOKEN_RE.findall(text)


def load_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a Hugging Face ``tokenizer.json`` file or a folder holding one.

    Raises:
        FileNotFoundError: no such file (or no ``tokenizer.json`` in the folder).
        DataError: a file the ``tokenizers`` library cannot read (its reason, in one line, naming the file).
        ValueError: the ``tokenizers`` package is not installed.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer file at {path} (want a Hugging Face tokenizer.json or its folder)")
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # optional dependency: pip install ringpack[hf]
        raise ValueError("--tokenizer needs the 'tokenizers' package (pip install 'ringpack[hf]')") from exc
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for any file it cannot parse
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise DataError(f"tokenizer file {path} is not a Hugging Face tokenizer.json: {reason:.200}") from None


def load_tokenizer_counter(path: str | Path) -> Callable[[Sequence[str]], list[int]]:
    """A batch token counter from a Hugging Face ``tokenizer.json`` file or its folder (:func:`load_tokenizer`)."""
    tokenizer = load_tokenizer(path)

    def count(texts: Sequence[str]) -> list[int]:
        return [len(enc.ids) for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    return count


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
