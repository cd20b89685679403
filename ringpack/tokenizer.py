"""Token counts and token ids from text: the dependency-free regex tokenizer or a Hugging Face one (docs/data.md).

The default is a regex pre-tokenizer, one token per run of word characters and one per other
non-space character (``\\w+|[^\\w\\s]``): on source code it comes within roughly +-30% of a
byte-level BPE's count, which is all the planner needs, and :func:`regex_token_ids` gives its tokens
stable hashed ids. :func:`load_tokenizer` reads a real model's tokenizer: a ``tokenizer.json`` file
or a folder holding one (the ``tokenizers`` library), or a ``save_pretrained`` folder or Hub name
(``transformers.AutoTokenizer``; offline, from local files only). Whatever the tokenizer, ids and
counts are of the text alone: no BOS, EOS or other special token is added.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ringpack._hints import option
from ringpack.errors import DataError

__all__ = [
    "NO_SPECIAL_TOKENS",
    "REGEX",
    "TOKENIZERS",
    "load_tokenizer",
    "load_tokenizer_counter",
    "make_counter",
    "regex_token_count",
    "regex_token_ids",
    "regex_tokenize",
    "token_encoder",
    "tokenizer_vocab_size",
]

#: The regex tokenizer's pattern.
REGEX = r"\w+|[^\w\s]"
_TOKEN_RE = re.compile(REGEX)
#: What :func:`load_tokenizer` reads (help texts and errors quote it).
TOKENIZERS = (
    "a tokenizer.json file or a folder holding one, a folder saved by save_pretrained, "
    "or a Hugging Face Hub name (transformers.AutoTokenizer; offline, from the local cache only)"
)
#: How a tokenizer turns a text into ids, whichever it is (help texts and docs state it).
NO_SPECIAL_TOKENS = "no BOS, EOS or other special token is added (add_special_tokens=False)"
#: Texts :func:`load_tokenizer` encodes to check a tokenizer: a working one gives ids for at least one.
PROBE_TEXTS = ("the quick brown fox", "Hello, world!", "def f(x): return x + 1", "0 1 2 3 a b c")
#: Environment variables that keep the Hugging Face libraries off the network.
_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


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


def load_tokenizer(spec: str | os.PathLike) -> Any:
    """A real model's tokenizer, from a file, a folder or a Hugging Face Hub name.

    Args:
        spec: a ``tokenizer.json`` file, or a folder holding one (read by the ``tokenizers``
            library); a folder written by ``save_pretrained`` without a ``tokenizer.json``, or a
            name that is no local path (``org/model``), loaded by ``transformers.AutoTokenizer``. A
            folder is read from its files only; a Hub name too when ``HF_HUB_OFFLINE`` or
            ``TRANSFORMERS_OFFLINE`` is set, and otherwise from the Hub, falling back to the local
            cache when the Hub cannot be reached.

    Returns:
        A ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer (:func:`token_encoder` encodes with either).

    Raises:
        FileNotFoundError: a local-looking path (``.``, ``/``, ``~`` or ``.json``) that does not exist,
            a folder with neither a ``tokenizer.json`` nor a ``tokenizer_config.json``, or a Hub name
            neither the Hub nor the local cache has (offline: the cache); the message says what to pass.
        DataError: a file or folder its library cannot read, or a tokenizer that cannot encode
            (:func:`_check_tokenizer`: it fails on plain text, or gives no ids for any of
            :data:`PROBE_TEXTS`); one line naming it and what is wrong.
        ValueError: the ``tokenizers`` or ``transformers`` package it needs is not installed.
    """
    tokenizer = _read_tokenizer(spec)
    _check_tokenizer(tokenizer, _where(spec))
    return tokenizer


def _where(spec: str | os.PathLike) -> str:
    """How errors name the tokenizer of ``spec``: its file, its folder or its Hub name."""
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return f"tokenizer file {path / 'tokenizer.json'}"
    if path.is_file():
        return f"tokenizer file {path}"
    return f"tokenizer folder {path}" if path.is_dir() else f"tokenizer {str(spec)!r}"


def _check_tokenizer(tokenizer: Any, where: str) -> None:
    """Refuse a tokenizer that cannot turn text into ids, before any data meets it.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer.
        where: how the message names it (``"tokenizer file x/tokenizer.json"``).

    Raises:
        DataError: encoding :data:`PROBE_TEXTS` fails (a WordLevel model whose unknown token is not
            in its vocabulary, ...), or gives no id for any of them (a folder holding only a
            ``tokenizer_config.json``: a vocabulary of special tokens alone); the reason and the
            vocabulary size, in one line.
    """
    unknown = getattr(getattr(tokenizer, "model", None), "unk_token", None)  # a tokenizers model's
    if isinstance(unknown, str) and hasattr(tokenizer, "token_to_id") and tokenizer.token_to_id(unknown) is None:
        raise DataError(
            f"{where}: its {type(tokenizer.model).__name__} model's unknown token {unknown!r} is not in its vocabulary "
            f"({tokenizer_vocab_size(tokenizer)} tokens), so any text it does not know fails to encode"
        )
    encode = token_encoder(tokenizer)
    try:
        ids = encode(PROBE_TEXTS)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a broken model
        raise DataError(f"{where} cannot encode text: {_one_line(exc)}") from None
    if not any(len(row) for row in ids):
        raise DataError(
            f"{where} encodes every text to no token ids (e.g. {PROBE_TEXTS[0]!r}; its vocabulary holds "
            f"{tokenizer_vocab_size(tokenizer)} tokens): it lacks its vocabulary files (tokenizer.json, "
            "tokenizer.model or vocab.json and merges.txt)"
        )


def tokenizer_vocab_size(tokenizer: Any) -> int:
    """The number of token ids of a ``tokenizers`` or ``transformers`` tokenizer, added tokens included:
    every id it gives is below it (a model's embedding needs at least this many rows).

    Raises:
        DataError: ``tokenizer`` is neither.
    """
    if hasattr(tokenizer, "get_vocab_size"):  # a `tokenizers.Tokenizer`
        return int(tokenizer.get_vocab_size(with_added_tokens=True))
    if callable(tokenizer) and hasattr(tokenizer, "pad_token_id"):  # a transformers tokenizer
        return len(tokenizer)
    raise DataError(f"tokenizer must be a tokenizers or transformers tokenizer, got {type(tokenizer).__name__}")


def _read_tokenizer(spec: str | os.PathLike) -> Any:
    """The tokenizer of ``spec``, unchecked (:func:`load_tokenizer`)."""
    path = Path(spec)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        return _tokenizer_json(path)
    if path.is_dir():
        if not (path / "tokenizer_config.json").is_file():
            raise FileNotFoundError(
                f"no tokenizer in the folder {path}: it holds neither a tokenizer.json nor the tokenizer_config.json "
                "that save_pretrained writes"
            )
        return _auto_tokenizer(str(path), local=True)
    name = str(spec)
    if name.startswith((".", "/", "~")) or name.endswith(".json") or name.count("/") > 1:
        raise FileNotFoundError(f"no tokenizer at {name}: want {TOKENIZERS}")
    return _auto_tokenizer(
        name, local=any(os.environ.get(v, "").upper() in ("1", "ON", "YES", "TRUE") for v in _OFFLINE)
    )


def _tokenizer_json(path: Path) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``tokenizer.json`` file."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # optional dependency: pip install ringpack[hf]
        raise ValueError(f"{option('tokenizer')} needs the 'tokenizers' package (pip install 'ringpack[hf]')") from exc
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises a bare Exception for any file it cannot parse
        raise DataError(f"tokenizer file {path} is not a Hugging Face tokenizer.json: {_one_line(exc)}") from None


def _auto_tokenizer(name: str, local: bool) -> Any:
    """``AutoTokenizer.from_pretrained(name)``: local files only when ``local``, else online, then the cache."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # optional dependency: pip install ringpack[hf]
        raise ValueError(
            f"{option('tokenizer', name)}: a save_pretrained folder or a Hub name needs the 'transformers' package "
            "(pip install 'ringpack[hf]'); a tokenizer.json needs only 'tokenizers'"
        ) from exc
    problem = None
    for local_only in (True,) if local else (False, True):
        try:
            return AutoTokenizer.from_pretrained(name, local_files_only=local_only)
        except Exception as exc:  # OSError when not found or offline, ValueError or others for unreadable files
            problem = problem or exc
    if Path(name).is_dir():
        raise DataError(f"tokenizer folder {name} cannot be loaded by transformers.AutoTokenizer: {_one_line(problem)}")
    given = option("tokenizer", name)
    if local:
        variable = next(v for v in _OFFLINE if os.environ.get(v))
        raise FileNotFoundError(
            f"{given} is no local file or folder, and the Hugging Face cache has no tokenizer {name!r} ({variable} is "
            "set: offline): pass a tokenizer.json file or its folder, or a folder saved by save_pretrained, or cache "
            "the name by loading it once online"
        )
    raise FileNotFoundError(
        f"{given} is no local file or folder, and neither the Hugging Face Hub nor its cache gave a tokenizer "
        f"{name!r} ({_one_line(problem)}): pass a tokenizer.json file or its folder, a folder saved by "
        "save_pretrained, or a Hub name the Hub has (without network: set HF_HUB_OFFLINE=1 and pass a cached one)"
    )


def _one_line(exc: BaseException | None) -> str:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return f"{reason:.200}"


def token_encoder(tokenizer: Any) -> Callable[[Sequence[str]], list[list[int]]]:
    """A batch encoder ``texts -> token ids`` of a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer.

    No special token is added (``add_special_tokens=False``): the ids are the text's alone.

    Raises:
        DataError: ``tokenizer`` is neither.
    """
    if callable(tokenizer) and hasattr(tokenizer, "pad_token_id"):  # a transformers tokenizer
        return lambda texts: [
            list(ids) for ids in tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        ]
    if hasattr(tokenizer, "encode_batch"):  # a `tokenizers.Tokenizer`
        return lambda texts: [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    raise DataError(f"tokenizer must be a tokenizers or transformers tokenizer, got {type(tokenizer).__name__}")


def load_tokenizer_counter(spec: str | os.PathLike) -> Callable[[Sequence[str]], list[int]]:
    """A batch token counter of the tokenizer :func:`load_tokenizer` reads from ``spec``."""
    encode = token_encoder(load_tokenizer(spec))
    return lambda texts: [len(ids) for ids in encode(texts)]


def _regex_counter(texts: Sequence[str]) -> list[int]:
    return [regex_token_count(t or "") for t in texts]


def make_counter(tokenizer: Any) -> Callable[[Sequence[str]], list[int]]:
    """A batch token counter: ``None``/"regex", what :func:`load_tokenizer` reads, a tokenizer object, or a callable."""
    if tokenizer is None or tokenizer == "regex":
        return _regex_counter
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer_counter(tokenizer)
    if hasattr(tokenizer, "encode_batch") or (callable(tokenizer) and hasattr(tokenizer, "pad_token_id")):
        encode = token_encoder(tokenizer)
        return lambda texts: [len(ids) for ids in encode(texts)]
    if callable(tokenizer):
        return tokenizer
    raise DataError(
        "tokenizer must be None, 'regex', a tokenizer path or name, a tokenizer or a callable, "
        f"got {type(tokenizer).__name__}"
    )
