"""The flags of sample lengths, of texts and their tokenizer, and the lengths they name (docs/planner.md).

``plan``, ``report`` and ``simulate`` read ``--lengths`` (:func:`add_lengths_flags`): a file of
lengths or token ids, or, with the text flags (:func:`add_text_flags`, ``shard``'s too), a file of
texts whose tokens :func:`lengths_from_args` counts as ``ringpack shard`` tokenizes them, once: the
counts are kept in the length cache (:mod:`ringpack.length_cache`) and read from it next time.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np

from ringpack.cli.flags import REQUIRED, flag, integer
from ringpack.cli.inputs import lengths_from_flag, progress
from ringpack.errors import DataError
from ringpack.lengths import DEFAULT_TEXT_COLUMN, TEXT_FORMATS, text_lengths
from ringpack.lengths import FORMATS as LENGTHS_FORMATS

logger = logging.getLogger("ringpack.cli")
#: ``--lengths`` of every command that plans lengths.
LENGTHS_HELP = (
    f"sample lengths: {LENGTHS_FORMATS}; with --text-column or --tokenizer, texts ({TEXT_FORMATS}) "
    "whose tokens are counted"
)
COLUMN_HELP = (
    "column of lengths or token-id lists (default: a file's only column, else the first there is of "
    "length, lengths, num_tokens, n_tokens, input_ids, tokens; a saved dataset's input_ids or tokens first)"
)
#: The regex tokenizer's id range when ``--vocab-size`` is not given.
DEFAULT_VOCAB = 65536
#: Where the length cache is (``--no-length-cache``'s help).
LENGTH_CACHE_DIR = "$RINGPACK_CACHE/lengths, else ~/.cache/ringpack/lengths"
#: The flags that say a command counts the tokens of a text column (:func:`counts_text`).
TEXT_FLAGS = ("text_column", "tokenizer", "vocab_size")


def add_lengths_flags(parser: Any, *, required: bool, what: str = "") -> None:
    """``--lengths`` and ``--column``, then the text flags (:func:`add_text_flags`): the same sources and
    help on every command that plans lengths."""
    flag(parser, "--lengths", default=REQUIRED if required else None, metavar="PATH", help=LENGTHS_HELP + what)
    flag(parser, "--column", help=COLUMN_HELP + "; not with --text-column")
    add_text_flags(parser)


def add_text_flags(parser: Any) -> None:
    """``--text-column``, ``--tokenizer``, ``--vocab-size``, ``--no-length-cache``: texts and their tokenizer,
    with one help on ``shard`` (which writes their token ids) and the commands that plan lengths (which
    count their tokens)."""
    flag(
        parser,
        "--text-column",
        help=f"tokenize this text column (default: {DEFAULT_TEXT_COLUMN}); shard: only for a dataset without "
        "its token-id column",
    )
    flag(
        parser,
        "--tokenizer",
        help="Hugging Face tokenizer.json (or its folder), a save_pretrained folder or a Hub name; "
        "default: the regex tokenizer",
    )
    flag(
        parser,
        "--vocab-size",
        type=integer(1, 1 << 31),
        help=f"id range of the regex tokenizer's hashed ids (default: {DEFAULT_VOCAB}; not with --tokenizer; "
        "no token count depends on it)",
    )
    flag(
        parser,
        "--no-length-cache",
        default=False,
        action="store_true",
        help=f"neither read nor write token counts in the length cache ({LENGTH_CACHE_DIR})",
    )


def counts_text(args: argparse.Namespace) -> bool:
    """Whether ``--lengths`` holds texts whose tokens are counted (``--text-column``, ``--tokenizer`` or
    ``--vocab-size`` given)."""
    return any(getattr(args, name, None) is not None for name in TEXT_FLAGS)


def lengths_kind(args: argparse.Namespace) -> str:
    """The kind of ``--lengths`` (:data:`~ringpack.cli.input_kinds.TABLE`): ``"text"`` or ``"lengths"``."""
    return "text" if counts_text(args) else "lengths"


def text_column(args: argparse.Namespace) -> str:
    """The text column of ``--text-column``, else ``text`` (as ``ringpack shard`` tokenizes)."""
    return args.text_column or DEFAULT_TEXT_COLUMN


def check_text_flags(args: argparse.Namespace) -> None:
    """Refuse ``--vocab-size`` with ``--tokenizer`` (``ValueError``): a real tokenizer has its own ids."""
    if args.tokenizer and args.vocab_size is not None:
        raise ValueError(
            "--vocab-size sets the id range of the regex tokenizer's hashed ids; "
            f"--tokenizer {args.tokenizer} has its own vocabulary (leave --vocab-size out)"
        )


def lengths_from_args(args: argparse.Namespace, flag: str = "--lengths") -> np.ndarray:
    """The sample lengths of ``--lengths``: read as they are, or the token counts of its text column.

    With the text flags (:func:`counts_text`) the tokens of :func:`text_column` are counted by
    ``--tokenizer`` (default: the regex tokenizer), or read from the length cache unless
    ``--no-length-cache``; a line on stderr says when they came from the cache.

    Raises:
        DataError: an unreadable file, a bad length or row (named, never quoted), or no samples.
        FileNotFoundError: no file at ``--lengths`` or ``--tokenizer``.
        ValueError: ``--vocab-size`` with ``--tokenizer``.
    """
    if not counts_text(args):
        return lengths_from_flag(args.lengths, args.column, flag)
    check_text_flags(args)
    column = text_column(args)
    with progress(args, f"counting tokens of column {column!r}", "rows") as bar:
        lengths, cached = text_lengths(
            args.lengths, column, args.tokenizer, cache=not args.no_length_cache, progress=bar.advance_to
        )
    if not lengths.size:
        raise DataError(f"{flag} {args.lengths} holds no samples")
    if cached and not getattr(args, "quiet", False):
        logger.info(
            "token counts of column %r of %s from the length cache (--no-length-cache counts them again)",
            column,
            args.lengths,
        )
    return lengths
