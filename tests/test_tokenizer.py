"""Tokenizers from a tokenizer.json, a save_pretrained folder or a Hub name (from the cache offline), no special tokens.

Every tokenizer is built here with the ``tokenizers`` library and saved as ``transformers`` saves one;
a Hub name is served from a Hugging Face cache laid out in a temporary folder. Nothing touches the network.
"""

from __future__ import annotations

import json
import shutil

import datasets
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ringpack.data.shard_reader import ShardReader
from ringpack.data.sources import tokenize_dataset
from ringpack.errors import DataError
from ringpack.lengths import lengths_from_dataset
from ringpack.tokenizer import load_tokenizer, make_counter, token_encoder, tokenizer_vocab_size
from tests.helpers.cli import assert_clean, run_cli, write_jsonl

TEXTS = ["the quick brown fox", "jumps over the lazy dog", "the dog", "a fox and a dog jump", "quick quick quick"]
NAME = "ringpack-test/tiny"
MESH = ["--dp", 1, "--cp", 1, "--tokens-per-rank", 64]


def _word_level() -> Tokenizer:
    """A word-level tokenizer whose post-processor would wrap every text in <s> ... </s>."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))]
    )
    return tok


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The raw tokenizer, a save_pretrained folder, a GPT-2 style folder without tokenizer.json, a Hub cache."""
    root = tmp_path_factory.mktemp("tokenizers")
    raw = _word_level()
    saved = root / "saved"
    PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="[UNK]").save_pretrained(
        saved
    )
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        TEXTS * 4,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    gpt2 = root / "gpt2-style"
    gpt2.mkdir()
    bpe.model.save(str(gpt2))  # vocab.json and merges.txt: what save_pretrained writes for a GPT-2 tokenizer
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    (gpt2 / "tokenizer_config.json").write_text(json.dumps(config))
    cache = root / "hub"
    repo = cache / "models--ringpack-test--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in saved.iterdir():
        shutil.copy(f, snapshot / f.name)
    (snapshot / "config.json").write_text('{"model_type": "llama"}')  # a model repo has one
    return {"raw": raw, "saved": saved, "bpe": bpe, "gpt2": gpt2, "cache": cache, "root": root}


@pytest.fixture
def offline_hub(tokenizers, monkeypatch):
    """Offline, with the test's Hugging Face cache as the cache."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tokenizers["cache"]))
    return tokenizers


def _ids(raw: Tokenizer, texts=TEXTS) -> list[list[int]]:
    return [e.ids for e in raw.encode_batch(list(texts), add_special_tokens=False)]


def test_a_hub_name_loads_from_the_cache_offline_and_adds_no_special_tokens(offline_hub):
    tok = load_tokenizer(NAME)
    assert type(tok).__module__.startswith("transformers")
    want = _ids(offline_hub["raw"])
    assert token_encoder(tok)(TEXTS) == want
    bos, eos = offline_hub["raw"].token_to_id("<s>"), offline_hub["raw"].token_to_id("</s>")
    assert tok(TEXTS[0])["input_ids"][0] == bos  # the tokenizer would add them ...
    assert all(bos not in ids and eos not in ids for ids in want)  # ... ringpack does not
    assert make_counter(NAME)(TEXTS) == [len(ids) for ids in want]


def test_every_kind_of_tokenizer_gives_the_same_ids(offline_hub):
    want = _ids(offline_hub["raw"])
    saved = offline_hub["saved"]
    for spec in (saved, saved / "tokenizer.json", str(saved), NAME):
        assert token_encoder(load_tokenizer(spec))(TEXTS) == want, spec
    assert token_encoder(AutoTokenizer.from_pretrained(str(saved)))(TEXTS) == want  # a tokenizer object too


def test_a_save_pretrained_folder_without_tokenizer_json_loads_with_auto_tokenizer(tokenizers):
    tok = load_tokenizer(tokenizers["gpt2"])
    assert type(tok).__module__.startswith("transformers")
    assert token_encoder(tok)(TEXTS) == _ids(tokenizers["bpe"])
    ds = datasets.Dataset.from_dict({"text": TEXTS})
    assert lengths_from_dataset(ds, text_column="text", tokenizer=str(tokenizers["gpt2"])).tolist() == [
        len(ids) for ids in _ids(tokenizers["bpe"])
    ]


def test_shard_tokenizes_with_a_hub_name_offline(offline_hub, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    argv = ["shard", data, "--out", tmp_path / "out", *MESH, "--cache-dir", tmp_path / "cache", "--quiet"]
    run = run_cli([*argv, "--tokenizer", NAME])
    assert_clean(run)
    assert run.code == 0, run.err
    reader = ShardReader(tmp_path / "out", 0, 0, schedule=False)
    got = {}
    for batch in reader:
        mb = batch["microbatch"]
        for k, sample in enumerate(mb.samples):
            lo, hi = batch["cu_seqlens"][k].item(), batch["cu_seqlens"][k + 1].item()
            got[sample] = batch["input_ids"][lo:hi].tolist()
    assert [got[i] for i in range(len(TEXTS))] == _ids(offline_hub["raw"])
    ds = datasets.Dataset.from_dict({"text": TEXTS})
    assert tokenize_dataset(ds, "text", NAME)["input_ids"] == _ids(offline_hub["raw"])


def test_an_uncached_hub_name_offline_is_one_line_saying_what_to_pass(offline_hub, tmp_path):
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    argv = ["shard", data, "--out", tmp_path / "out", *MESH, "--cache-dir", tmp_path / "cache", "--quiet"]
    run = run_cli([*argv, "--tokenizer", "ringpack-test/absent"])
    assert_clean(run)
    line = run.err.strip().splitlines()[-1]
    assert run.code == 1 and "--tokenizer ringpack-test/absent" in line and "HF_HUB_OFFLINE" in line, run.err
    assert "pass a tokenizer.json file or its folder, or a folder saved by save_pretrained" in line
    assert not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="tokenizer='ringpack-test/absent' is no local file or folder"):
        load_tokenizer("ringpack-test/absent")


def test_online_a_hub_name_the_hub_cannot_serve_is_read_from_the_cache(monkeypatch):
    """Without the offline switch the Hub is asked first; when it fails, local files only."""
    for variable in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    calls = []
    cached = PreTrainedTokenizerFast(tokenizer_object=_word_level(), unk_token="[UNK]")  # load_tokenizer encodes text

    def from_pretrained(name, local_files_only=False):
        calls.append((name, local_files_only))
        if not local_files_only:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        if name == "org/cached":
            return cached
        raise OSError(f"{name} is not in the cache")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    assert load_tokenizer("org/cached") is cached
    assert calls == [("org/cached", False), ("org/cached", True)]
    with pytest.raises(FileNotFoundError, match=r"couldn't connect .*set HF_HUB_OFFLINE=1 and pass a cached one"):
        load_tokenizer("org/missing")


@pytest.mark.parametrize("spec", ["./missing", "/no/such/tokenizer", "missing.json", "a/b/c"])
def test_a_missing_local_path_is_not_looked_up_on_the_hub(spec, monkeypatch):
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("the Hub was asked"))
    with pytest.raises(FileNotFoundError, match=f"no tokenizer at {spec}: want a tokenizer.json file"):
        load_tokenizer(spec)


def test_a_folder_without_a_tokenizer_or_with_a_broken_one_is_named(tokenizers, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in the folder {empty}: it holds neither"):
        load_tokenizer(empty)
    broken = tmp_path / "broken"
    shutil.copytree(tokenizers["gpt2"], broken)
    (broken / "vocab.json").write_text("{not json")
    with pytest.raises(DataError, match=f"tokenizer folder {broken} cannot be loaded by transformers.AutoTokenizer"):
        load_tokenizer(broken)


def test_a_word_level_tokenizer_whose_unknown_token_is_not_in_its_vocabulary_is_refused_on_load(tmp_path):
    data = json.loads(_word_level().to_str())
    data["model"]["unk_token"] = "<missing>"
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    for spec in (path, tmp_path):
        with pytest.raises(DataError, match=f"tokenizer file {path}: .*unknown token '<missing>' is not in its vocab"):
            load_tokenizer(spec)
    with pytest.raises(DataError, match="unknown token '<missing>'"):
        make_counter(str(path))


def test_a_folder_of_only_a_tokenizer_config_is_refused_on_load_naming_it(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    with pytest.raises(DataError, match=f"tokenizer folder {tmp_path} encodes every text to no token ids") as info:
        load_tokenizer(tmp_path)
    assert "\n" not in str(info.value)
    data = write_jsonl(tmp_path / "text.jsonl", [{"text": t} for t in TEXTS])
    argv = ["shard", data, "--out", tmp_path / "out", *MESH, "--cache-dir", tmp_path / "cache", "--quiet"]
    run = run_cli([*argv, "--tokenizer", tmp_path])
    assert_clean(run)
    assert run.code == 1 and "encodes every text to no token ids" in run.err and "filter empty" not in run.err, run.err


def test_tokenizer_vocab_size_counts_added_tokens(tokenizers):
    raw = tokenizers["raw"]
    assert tokenizer_vocab_size(raw) == raw.get_vocab_size(with_added_tokens=True) > 0
    assert tokenizer_vocab_size(load_tokenizer(tokenizers["saved"])) == raw.get_vocab_size(with_added_tokens=True)
    assert tokenizer_vocab_size(load_tokenizer(tokenizers["gpt2"])) == tokenizers["bpe"].get_vocab_size()
    with pytest.raises(DataError, match="got int"):
        tokenizer_vocab_size(3)
