"""``attn_implementation="ringpack"`` needs no explicit ``register()``: importing ringpack (before or after
transformers) or its transformers integration is enough, and ``import ringpack`` still imports neither
torch nor transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: Builds a one-layer Llama with ringpack attention and runs a forward on two packed samples.
BUILD = """
import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
import ringpack
from ringpack.integrations.transformers import ringpack_attention_forward

assert AttentionInterface()["ringpack"] is ringpack_attention_forward
config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.0)
model = LlamaForCausalLM._from_config(config, attn_implementation="ringpack", dtype=torch.float64)
microbatch = ringpack.plan([5, 3], dp=1, cp=1, tokens_per_rank=8).steps[0].microbatches[0][0]
positions = torch.cat([torch.arange(p.start, p.stop) for p in microbatch.shards[0].pieces])
logits = model(input_ids=torch.arange(8)[None], position_ids=positions[None],
               ringpack_schedule=ringpack.compile_schedule(microbatch, 0)).logits
assert logits.shape == (1, 8, 97) and torch.isfinite(logits).all()
print("ok")
"""


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_import_ringpack_registers_when_transformers_loads_later():
    code = (
        "import sys\nimport ringpack\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'import ringpack imported them'\n"
        "from ringpack.integrations import autoregister\n"
        "ringpack.integrations.autoregister.install()  # idempotent: still one finder\n"
        "assert sum(f is autoregister._finder for f in sys.meta_path) == 1\n"
        + BUILD
        + "assert autoregister._finder not in sys.meta_path  # it answered once and left\n"
    )
    assert run(code).split() == ["ok"]


@pytest.mark.slow
def test_import_ringpack_after_transformers_registers_at_once():
    assert run("import transformers.modeling_utils\nimport ringpack\n" + BUILD).split() == ["ok"]


@pytest.mark.slow
def test_importing_the_integration_registers_and_register_is_idempotent():
    code = (
        "from ringpack.integrations.transformers import register\n"
        "assert register() == register() == 'ringpack'\n" + BUILD
    )
    assert run(code).split() == ["ok"]


@pytest.mark.slow
def test_without_ringpack_transformers_refuses_the_name():
    """What registration changes: a process that never imported ringpack cannot build the model."""
    code = (
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, "
        "num_attention_heads=4, num_key_value_heads=2)\n"
        "try:\n"
        "    LlamaForCausalLM._from_config(config, attn_implementation='ringpack')\n"
        "except ValueError as exc:\n"
        "    print('refused' if 'ringpack' in str(exc) else exc)\n"
    )
    assert run(code).split() == ["refused"]
