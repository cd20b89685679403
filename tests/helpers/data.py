"""Data test helpers: small datasets and an exact coverage check."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

IGNORE = -100


def random_samples(n: int, seed: int = 0, max_len: int = 300, vocab: int = 1000) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len, n)
    return [rng.integers(0, vocab, int(k)) for k in lens]


def corpus_jsonl(path: Path, n_files: int = 200) -> Path:
    """The first ``n_files`` documents of the stdlib corpus (every 5th file, for a varied mix) as JSON lines."""
    from ringpack.data.corpus import stdlib_corpus

    corpus = stdlib_corpus()
    names = corpus.names[:: max(1, len(corpus.names) // n_files)][:n_files]
    with open(path, "w") as f:
        for name in names:
            text = (corpus.root / name).read_bytes().decode("utf-8", errors="replace")
            f.write(json.dumps({"name": name, "text": text}) + "\n")
    return path


class Coverage:
    """Records every (sample, position) a batch holds, with its token and label, and checks them."""

    def __init__(self, tokens: list[np.ndarray]) -> None:
        self.tokens = [np.asarray(t, dtype=np.int64) for t in tokens]
        self.seen: dict[int, np.ndarray] = {}

    def add(self, batch: dict[str, Any]) -> None:
        cu = batch["cu_seqlens"].numpy().astype(np.int64)
        ids = batch["input_ids"].numpy()
        labels = batch["labels"].numpy()
        pos = batch["position_ids"].numpy()
        assert batch["cu_seqlens"].dtype.is_floating_point is False and str(batch["cu_seqlens"].dtype) == "torch.int32"
        assert len(ids) == len(labels) == len(pos) == cu[-1]
        assert batch["num_loss_tokens"] == int((labels != IGNORE).sum())
        for k, sample in enumerate(batch["sample_ids"].tolist()):
            a, b = cu[k], cu[k + 1]
            p = pos[a:b]
            assert np.array_equal(p, np.arange(p[0], p[0] + (b - a))), "positions of a piece are consecutive"
            ref = self.tokens[sample]
            assert np.array_equal(ids[a:b], ref[p]), f"tokens of sample {sample} at {p[0]}.. differ"
            want = np.where(p + 1 < len(ref), ref[np.minimum(p + 1, len(ref) - 1)], IGNORE)
            assert np.array_equal(labels[a:b], want), f"labels of sample {sample} at {p[0]}.. differ"
            counts = self.seen.setdefault(sample, np.zeros(len(ref), dtype=np.int64))
            np.add.at(counts, p, 1)

    def add_all(self, batches: Iterable[dict[str, Any]]) -> int:
        n = 0
        for batch in batches:
            self.add(batch)
            n += 1
        return n

    def check_exactly_once(self, dropped: Iterable[int] = ()) -> None:
        dropped = set(dropped)
        for sample in range(len(self.tokens)):
            counts = self.seen.get(sample)
            if sample in dropped:
                assert counts is None, f"dropped sample {sample} was yielded"
                continue
            assert counts is not None, f"sample {sample} never yielded"
            bad = np.flatnonzero(counts != 1)
            assert bad.size == 0, f"sample {sample} token {bad[0]} seen {counts[bad[0]]} times"


def batch_signature(batch: dict[str, Any]) -> tuple:
    """Everything tensor-valued in a batch, for bit-exact comparisons."""
    return (
        batch["input_ids"].tolist(),
        batch["labels"].tolist(),
        batch["position_ids"].tolist(),
        batch["cu_seqlens"].tolist(),
        batch["sample_ids"].tolist(),
        batch["step"],
        batch["microbatch_index"],
        batch["step_loss_tokens"],
        batch["num_loss_tokens"],
    )
