"""The examples as a newcomer runs them: ``--help`` shows their commands as written, ``--steps`` runs that
many steps across epochs, and ``hf_trainer.py`` leaves nothing behind unless asked to save."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers.training import ROOT, load_example

#: Each example and the function that builds its argument parser.
PARSERS = {"train": "parser", "train_fsdp": "fsdp_parser", "recipe": "recipe_parser", "hf_trainer": "parser"}


def docstring_commands(doc: str) -> list[str]:
    """The indented command lines of a module docstring (``torchrun ...`` and their ``\\`` continuations)."""
    lines, out, going = doc.splitlines(), [], False
    for line in lines:
        start = re.match(r"\s+(torchrun|python|accelerate) ", line)
        if start or going:
            out.append(line.rstrip())
        going = (start or going) and line.rstrip().endswith("\\")
    return out


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_help_shows_the_example_commands_as_written(name):
    module = load_example(name)
    commands = docstring_commands(module.__doc__)
    assert len(commands) >= 2, commands
    text = getattr(module, PARSERS[name])().format_help()
    for line in commands:
        assert line in text.splitlines(), f"{name}.py --help mangles: {line!r}"


def _loader(steps_per_epoch_samples: int):
    from ringpack.data import BalancedBatchSampler, PackedCollator, PackedDataset

    lengths = np.random.default_rng(0).integers(5, 40, steps_per_epoch_samples)
    samples = [np.arange(n) for n in lengths]
    sampler = BalancedBatchSampler(lengths, 0, 1, 1, 64, samples_per_step=8)
    return torch.utils.data.DataLoader(PackedDataset(samples), batch_sampler=sampler, collate_fn=PackedCollator(0, 1))


def test_steps_beyond_an_epoch_continue_into_the_next_and_say_so():
    train = load_example("train")
    loader = _loader(20)  # 3 steps an epoch
    per_epoch = loader.batch_sampler.num_steps
    assert per_epoch == 3
    lines = []
    steps = list(train.planned_steps(loader, 7, lines.append))
    assert [s[0]["epoch"] for s in steps] == [0, 0, 0, 1, 1, 1, 2]
    assert lines == [
        "epoch 0 ended after 3 steps; continuing with epoch 1 (3 of --steps 7 done)",
        "epoch 1 ended after 3 steps; continuing with epoch 2 (6 of --steps 7 done)",
    ]
    assert all(b["microbatch_index"] + 1 == b["microbatches_in_step"] for s in steps for b in s[-1:])
    one_epoch = list(train.planned_steps(_loader(20), 0))
    assert len(one_epoch) == per_epoch and {s[0]["epoch"] for s in one_epoch} == {0}
    assert len(list(train.planned_steps(_loader(20), 2))) == 2


def test_a_resumed_run_counts_its_steps_against_the_whole_run():
    train = load_example("train")
    lines = []
    steps = list(train.planned_steps(_loader(20), 6, lines.append, done=2))  # 3 steps an epoch
    assert len(steps) == 4
    assert lines == ["epoch 0 ended after 3 steps; continuing with epoch 1 (5 of --steps 6 done)"]
    assert list(train.planned_steps(_loader(20), 6, done=6)) == []


def test_a_sampler_resumed_at_its_epochs_end_continues_with_the_next_epoch():
    train = load_example("train")
    loader = _loader(20)
    loader.batch_sampler.load_state_dict(loader.batch_sampler.state_dict(cursor=len(loader.batch_sampler)))
    steps = list(train.planned_steps(loader, 2))
    assert [s[0]["epoch"] for s in steps] == [1, 1]


@pytest.mark.slow
def test_hf_trainer_leaves_no_folder_behind_and_saves_where_asked(tmp_path):
    script = ROOT / "examples" / "hf_trainer.py"
    small = ["--max-steps", "1", "--samples", "24", "--tokens-per-rank", "256", "--samples-per-step", "8"]
    env_run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=240)
    done = subprocess.run([sys.executable, str(script), *small], **env_run)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
    done = subprocess.run([sys.executable, str(script), *small, "--output-dir", "model"], **env_run)
    assert done.returncode == 0, done.stderr[-2000:]
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (tmp_path / "model" / "config.json").is_file()


def _tokenizer_of(tmp_path, ids: int):
    """A WordLevel tokenizer.json of ``ids`` token ids (``w0 ... w{ids-1}``), saved under ``tmp_path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(ids)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_trainer_sizes_the_vocabulary_by_the_tokenizer_or_refuses(tmp_path):
    module = load_example("hf_trainer")
    args = module.parser().parse_args(["--dataset", str(tmp_path), "--tokenizer", str(_tokenizer_of(tmp_path, 8192))])
    assert args.overflow == "split"
    assert module.vocabulary(args) == 8192
    assert module.build_model(None, torch.float32, 8192).get_input_embeddings().num_embeddings == 8192
    with pytest.raises(SystemExit):  # ids a --dataset holds, and nothing to size the model's vocabulary by
        module.vocabulary(module.parser().parse_args(["--dataset", str(tmp_path)]))


@pytest.mark.slow
def test_hf_trainer_trains_a_tokenized_dataset_with_a_long_document(tmp_path):
    """Ids up to 8,191 from an 8,192-id tokenizer, and one document longer than a micro-batch: no error."""
    import datasets

    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 8192, int(n)).tolist() for n in rng.integers(8, 60, 23)] + [[8191] * 700]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "data"))
    script = ROOT / "examples" / "hf_trainer.py"
    small = ["--max-steps", "1", "--tokens-per-rank", "256", "--samples-per-step", "8", "--dataset", "data"]
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=240)
    tokenizer = str(_tokenizer_of(tmp_path, 8192))
    done = subprocess.run([sys.executable, str(script), *small, "--tokenizer", tokenizer], **run)
    assert done.returncode == 0, done.stderr[-2000:]
    done = subprocess.run([sys.executable, str(script), *small], **run)
    assert done.returncode == 2 and "--dataset needs --tokenizer" in done.stderr, done.stderr[-2000:]
