"""Train a causal LM with Hugging Face ``Trainer`` on ringpack's plan (:class:`RingpackTrainer`).

    torchrun --nproc_per_node=4 examples/hf_trainer.py --cp 2 --max-steps 20            # DP=2 x CP=2
    accelerate launch --num_processes 4 examples/hf_trainer.py --cp 2 --max-steps 20
    python examples/hf_trainer.py --max-steps 5 --output-dir my-model                     # one process, saved
    python examples/hf_trainer.py --dataset tokenized/ --tokenizer tokenizer.json --overflow split

Without arguments: a small Llama initialised from a config and synthetic token sequences with
heavy-tailed lengths (no download). ``--config`` takes any causal LM's ``AutoConfig`` name or path
(its attention must go through transformers' ``AttentionInterface``: Llama, Qwen, Mistral, Gemma,
...), ``--dataset`` a ``datasets.save_to_disk`` folder with an ``input_ids`` column of token ids and
``--tokenizer`` the tokenizer that made them: the small Llama's vocabulary is the tokenizer's id
count, and a ``--config`` model whose vocabulary is smaller is refused (a row holding an id the
model cannot embed is refused by the collator, naming the row). ``--overflow split`` (the default)
cuts a document longer than a CP group's micro-batch into several, ``drop`` leaves it out and
``error`` stops before training.

Everything ringpack-specific is in :class:`~ringpack.integrations.trainer.RingpackConfig`: the CP
size, one CP rank's token budget, the split strategy and plan options. The rest is plain Trainer:
optimizer, scheduler, clipping, logging and saving come from ``TrainingArguments``. Keep
``gradient_accumulation_steps=1``: the plan decides each step's micro-batches.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ringpack.attention import MODES
from ringpack.integrations.trainer import RingpackConfig, RingpackTrainer
from ringpack.shard_plan import OVERFLOW_POLICIES, PlanConfig
from ringpack.tokenizer import load_tokenizer, tokenizer_vocab_size

#: The small Llama's vocabulary for synthetic ids (a tokenizer sets its own).
SYNTHETIC_VOCAB = 4096


def synthetic_samples(count: int, max_len: int, vocab: int, seed: int) -> list[np.ndarray]:
    """Random token ids with Pareto lengths: many short sequences, a few up to ``max_len``."""
    rng = np.random.default_rng(seed)
    lengths = np.minimum(max_len, (16 * (1 + rng.pareto(1.2, count))).astype(np.int64))
    return [rng.integers(0, vocab, int(n)) for n in lengths]


def vocabulary(args: argparse.Namespace) -> int | None:
    """The token-id count of ``--tokenizer`` (None without one); exits when ``--dataset`` has no way to size it."""
    if args.tokenizer:
        return tokenizer_vocab_size(load_tokenizer(args.tokenizer))
    if args.dataset and not args.config:
        parser().error(
            "--dataset needs --tokenizer (the tokenizer that made its ids sets the model's vocabulary) "
            "or --config (a model whose vocabulary holds them)"
        )
    return None


def build_model(config_name: str | None, dtype: torch.dtype, vocab: int | None = None):
    """A randomly initialised causal LM: ``config_name``'s architecture, or a small Llama of ``vocab`` ids.

    Exits (a usage error) when ``config_name``'s vocabulary holds fewer ids than ``vocab``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if config_name:
        config = AutoConfig.from_pretrained(config_name)
        if vocab is not None and config.vocab_size < vocab:
            parser().error(
                f"--config {config_name} has a vocabulary of {config.vocab_size} ids, but --tokenizer gives ids up to "
                f"{vocab - 1}: pass the model the tokenizer belongs to"
            )
    else:
        config = LlamaConfig(
            vocab_size=vocab or SYNTHETIC_VOCAB,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=1 << 20,
            tie_word_embeddings=False,
        )
    return AutoModelForCausalLM.from_config(config, dtype=dtype)


def train_dataset(args: argparse.Namespace, vocab: int):
    if args.dataset:
        from datasets import load_from_disk

        return load_from_disk(args.dataset)
    return synthetic_samples(args.samples, args.cp * args.tokens_per_rank, vocab, args.seed)


def main() -> int:
    args = parser().parse_args()
    if args.output_dir:
        return train(args, args.output_dir)
    with tempfile.TemporaryDirectory(prefix="ringpack-hf-trainer-") as scratch:  # nothing is kept
        return train(args, scratch)


def train(args: argparse.Namespace, output_dir: str) -> int:
    """Train with ``RingpackTrainer``; with ``--output-dir`` the final model is saved there."""
    from transformers import TrainingArguments

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = build_model(args.config, dtype, vocabulary(args))
    training_args = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.max_steps,
        learning_rate=args.lr,
        warmup_steps=min(10, args.max_steps // 10),
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=args.workers,
    )
    plan = PlanConfig(
        dp=training_args.world_size // args.cp,
        cp=args.cp,
        tokens_per_rank=args.tokens_per_rank,
        strategy=args.strategy,
        samples_per_step=args.samples_per_step,
        overflow=args.overflow,
        seed=args.seed,
    )
    ringpack = RingpackConfig(plan=plan, mode=args.mode)
    trainer = RingpackTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset(args, model.config.vocab_size),
        ringpack=ringpack,
    )
    trainer.train()
    if args.output_dir:
        trainer.save_model(args.output_dir)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (DP = world / cp)")
    p.add_argument("--tokens-per-rank", type=int, default=1024, help="one CP rank's tokens per micro-batch")
    p.add_argument("--strategy", default="balanced", help="CP split: balanced, zigzag or contiguous")
    p.add_argument("--mode", choices=MODES, default="ring")
    p.add_argument("--samples-per-step", type=int, default=64, help="samples in one optimizer step (all ranks)")
    p.add_argument("--config", help="AutoConfig name or path of the model (default: a small Llama)")
    p.add_argument("--dataset", help="datasets.save_to_disk folder with input_ids (default: synthetic)")
    p.add_argument("--tokenizer", help="the tokenizer of --dataset's ids: its id count is the model's vocabulary")
    p.add_argument(
        "--overflow",
        choices=OVERFLOW_POLICIES,
        default="split",
        help="a document longer than a CP group's micro-batch: split it into several, drop it, or stop (error)",
    )
    p.add_argument("--samples", type=int, default=512, help="synthetic samples")
    p.add_argument("--max-steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--bf16", action="store_true", help="bfloat16 weights (GPU)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--output-dir", help="save the trained model here (default: keep nothing, train in a temporary folder)"
    )
    return p


if __name__ == "__main__":
    sys.exit(main())
