"""Token counts and token ids from text: the dependency-free regex tokenizer or a Hugging Face one (docs/data.md).

The default is a regex pre-tokenizer, one token per run of word characters and one per other
non-space character (``\\w+|[^\\w\\s]``): on source code it comes within roughly +-30% of a
byte-level BPE's count, which is all the planner needs, and :func:`regex_token_ids` gives its tokens
stable hashed ids. :func:`load_tokenizer` reads a Hugging Face ``tokenizer.json`` (or a folder
holding one) for exact counts and ids of a real model's tokenizer; :func:`make_counter` turns any
of these, or a tokenizer object, into the batch counter the length readers use.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ringpack.errors import DataError

__all__ = [
    "REGEX",
    "load_tokenizer",
    "load_tokenizer_counter",
    "make_counter",
    "regex_token_count",
    "regex_token_ids",
    "regex_tokenize",
]

#: The regex tokenizer's pattern.
REGEX = r"\w+|[^\w\s]"
_TOKEN_RE = re.compile(REGEX)


def regex_token_count(text: str) -> int:
    """Number of ``\\w+|[^\\w\\s]`` matches: the default, dependency-free token counter."""
    return len(_TOKEN_RE.findall(text))


def regex_tokenize(text: str) -> list[str]:
    """The default tokenizer's tokens (used where real ids are needed, e.g. sharding the corpus)."""
    return _TOKEN_RE.findall(text)


def regex_token_ids(text: str, vocab_size: int = 65536) -> list[int]:
    """Token ids for the regex tokenizer: ``blake2b-64(token) mod vocab_size``.

    A stable hash (identical on every machine and Python version, unlike ``hash()``); distinct
    tokens may share an id (a hashed vocabulary). Use ``--tokenizer tokenizer.json`` for a real
    model's ids.
    """
    cache: dict[str, int] = {}
    out = []
    for tok in regex_tokenize(text or ""):
        tid = cache.get(tok)
        if tid is None:
            digest = hashlib.blake2b(tok.encode("utf-8", "surrogatepass"), digest_size=8).digest()
            tid = cache[tok] = int.from_bytes(digest, "little") % vocab_size
        out.append(tid)
    return out


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


def _regex_counter(texts: Sequence[str]) -> list[int]:
    return [regex_token_count(t or "") for t in texts]


def make_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]]:
    """A batch token counter: ``None``/"regex", a tokenizer.json path, a tokenizer object, or a callable."""
    if tokenizer is None or tokenizer == "regex":
        return _regex_counter
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer_counter(Path(tokenizer))
    if hasattr(tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
        return lambda texts: [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    if callable(tokenizer) and hasattr(tokenizer, "pad_token_id"):  # a transformers tokenizer
        return lambda texts: [len(x) for x in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    if callable(tokenizer):
        return tokenizer
    raise DataError(
        f"tokenizer must be None, 'regex', a tokenizer.json path or a callable, got {type(tokenizer).__name__}"
    )
