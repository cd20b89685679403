"""``examples/train.py --dataset``: a real (tiny, local) JSON-lines dataset, tokenized with the regex
tokenizer, trains for one epoch on 2 gloo processes (DP=1 x CP=2), every token of it exactly once."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ringpack._spawn import run_ranks
from ringpack.tokenizer import regex_token_count
from tests.helpers.training import load_example

WORDS = [
    "def",
    "return",
    "class",
    "import",
    "self",
    "value",
    "for",
    "in",
    "range",
    "if",
    "else",
    "while",
    "yield",
    "lambda",
]


def write_dataset(path, rows: int = 24) -> list[str]:
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=int(n))) + "(x)" for n in rng.integers(3, 40, size=rows)]
    path.write_text("".join(json.dumps({"text": t, "id": k}) + "\n" for k, t in enumerate(texts)))
    return texts


def worker(rank: int, world: int, argv: list[str]) -> list[dict] | None:
    example = load_example()
    args = example.parser().parse_args(argv)
    records = example.train(args, example.make_grid(args.cp), example.samples_for(args))
    return records if rank == 0 else None


@pytest.mark.slow
def test_training_on_a_jsonl_dataset(tmp_path):
    texts = write_dataset(tmp_path / "data.jsonl")
    argv = ["--dataset", str(tmp_path / "data.jsonl"), "--cache-dir", str(tmp_path / "cache"), "--cp", "2"]
    argv += ["--tokens-per-rank", "64", "--samples-per-step", "8", "--lr", "1e-2", "--no-learn-cost", "--quiet"]
    records = run_ranks(
        worker,
        2,
        (argv,),
        timeout_s=60.0,
        join_s=120.0,
        start_method="forkserver",
        preload=["torch", "torch.distributed", __name__],
    )[0]
    assert len(records) == 3  # 24 rows, 8 per step, one epoch
    assert sum(r["global_tokens"] for r in records) == sum(regex_token_count(t) for t in texts)
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)


def test_a_dataset_with_ids_beyond_the_vocabulary_is_refused(tmp_path):
    (tmp_path / "ids.jsonl").write_text(json.dumps({"input_ids": [1, 2, 500]}) + "\n")
    example = load_example()
    args = example.parser().parse_args(["--dataset", str(tmp_path / "ids.jsonl"), "--cache-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="token id 500, beyond the model's vocabulary of 97"):
        example.samples_for(args)
