"""The fa4 backend's wrapper on CPU: where auto picks it, its one-line refusals, the arguments it
hands flash-attn-4, and the compile log. The kernels themselves are checked on GPUs
(tests/attention/test_gpu_ring.py, marked gpu)."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from ringpack.attention import fa4, kernels


class FakeCache:
    def __init__(self) -> None:
        self.cache: dict = {}


def fake_interface(calls: list) -> types.SimpleNamespace:
    """Stands in for flash_attn.cute.interface: records each call, 'compiles' one variant per causal flag."""

    def fwd(q, k, v, **kw):
        calls.append(("fwd", kw))
        fwd.compile_cache.cache.setdefault(kw["causal"], True)
        return torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0]), None, None, None

    def bwd(q, k, v, out, dout, lse, scale, causal, **kw):
        calls.append(("bwd", dict(kw, scale=scale, causal=causal)))
        bwd.compile_cache.cache.setdefault(causal, True)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    fwd.compile_cache, bwd.compile_cache = FakeCache(), FakeCache()
    return types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd)


@pytest.fixture
def gpu_with_fa4(monkeypatch):
    """A pretend CUDA device of compute capability 9 with flash-attn-4 importable."""
    calls: list = []
    interface = fake_interface(calls)
    monkeypatch.setattr(fa4, "_interface", lambda: interface)
    monkeypatch.setattr(fa4, "capability", lambda device: 9)
    monkeypatch.setattr(kernels, "_cudnn_usable", lambda: True)
    monkeypatch.setattr(kernels, "_flash_attn_module", lambda: None)
    return calls


def test_auto_puts_fa4_first_wherever_it_runs(gpu_with_fa4, monkeypatch):
    for dtype in (torch.bfloat16, torch.float16):
        for head_dim in (64, 128, 256, None):
            assert kernels.available_backends("cuda", dtype, head_dim)[0] == "fa4", (dtype, head_dim)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[:2] == ["fa4", "cudnn_hybrid"]
    assert "fa4" not in kernels.available_backends("cuda", torch.bfloat16, 100)  # not a multiple of 8
    assert kernels.available_backends("cuda", torch.float32, 128) == ["reference"]
    monkeypatch.setattr(fa4, "capability", lambda device: 10)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "fa4"
    assert "fa4" not in kernels.available_backends("cuda", torch.bfloat16, 192)  # SM100: 8-128 or 256
    monkeypatch.setattr(fa4, "capability", lambda device: 8)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "torch_flash"
    monkeypatch.setattr(fa4, "capability", lambda device: 9)
    monkeypatch.setattr(kernels, "AUTO_FA4", False)
    assert kernels.available_backends("cuda", torch.bfloat16, 128)[0] == "cudnn_hybrid"


def test_asking_for_fa4_where_it_cannot_run_is_one_line(monkeypatch):
    package_missing = isinstance(fa4._interface(), str)
    with pytest.raises(ValueError, match="needs CUDA") as info:
        kernels.resolve_backend("fa4", torch.zeros(2, 1, 64))
    assert "\n" not in str(info.value)
    reasons = {
        "package": fa4.unusable_reason("cuda", torch.bfloat16, 128),
        "dtype": fa4.unusable_reason("cuda", torch.float32, 128),
    }
    interface = fake_interface([])
    monkeypatch.setattr(fa4, "_interface", lambda: interface)
    monkeypatch.setattr(fa4, "capability", lambda device: 8)
    reasons["gpu"] = fa4.unusable_reason("cuda", torch.bfloat16, 128)
    monkeypatch.setattr(fa4, "capability", lambda device: 9)
    reasons["head_dim"] = fa4.unusable_reason("cuda", torch.bfloat16, 260)
    assert reasons["dtype"] and "bfloat16" in reasons["dtype"]
    assert reasons["gpu"] and "8.x" in reasons["gpu"] and "torch_flash" in reasons["gpu"]
    assert reasons["head_dim"] and "260" in reasons["head_dim"]
    assert fa4.unusable_reason("cuda", torch.bfloat16, 128) is None
    if package_missing:
        assert reasons["package"] and "flash-attn-4" in reasons["package"] and "ringpack[gpu]" in reasons["package"]
    assert all("\n" not in r for r in reasons.values() if r)


def test_fa4_calls_bound_seqlens_and_pass_the_contract_arguments(gpu_with_fa4, caplog):
    """Segment-length hints below one tile are raised to MIN_SEQLEN_BOUND (no single-tile variants),
    lse is requested, and the forward/backward argument orders match the package's."""
    q, k = torch.randn(6, 4, 8), torch.randn(6, 2, 8)
    cu = torch.tensor([0, 3, 6], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger=fa4.__name__):
        out, lse = kernels.varlen_attn_fwd(q, k, k, cu, cu, 3, 3, 0.5, True, "fa4")
        kernels.varlen_attn_bwd(out, q, k, k, out, lse, cu, cu, 3, 900, 0.5, True, "fa4")
        kernels.varlen_attn_fwd(q, k, k, cu, cu, 3, 3, 0.5, True, "fa4")  # compiled already: no log line
    (_, fwd), (_, bwd), _ = gpu_with_fa4
    assert fwd["max_seqlen_q"] == fwd["max_seqlen_k"] == fa4.MIN_SEQLEN_BOUND and fwd["return_lse"] is True
    assert fwd["softmax_scale"] == 0.5 and fwd["causal"] is True and fwd["cu_seqlens_q"] is cu
    assert (bwd["max_seqlen_q"], bwd["max_seqlen_k"], bwd["scale"], bwd["causal"]) == (
        fa4.MIN_SEQLEN_BOUND,
        900,
        0.5,
        True,
    )
    compiled = [r.getMessage() for r in caplog.records if "built" in r.getMessage()]
    assert len(compiled) == 2 and "forward" in compiled[0] and "backward" in compiled[1]


def test_an_empty_call_needs_no_kernel(gpu_with_fa4):
    q = torch.randn(0, 4, 8)
    out, lse = fa4.fa4_fwd(q, q[:, :2], q[:, :2], None, None, 0, 0, 0.5, True)
    assert out.shape == (0, 4, 8) and lse.shape == (4, 0) and lse.dtype == torch.float32 and not gpu_with_fa4


def test_warm_up_refuses_what_cannot_run():
    with pytest.raises(ValueError, match="kv_heads"):
        fa4.warm_up(6, 4, 128)
    with pytest.raises(ValueError, match="needs CUDA"):
        fa4.warm_up(8, 2, 128, device="cpu")


def test_the_gpu_extra_pins_the_tested_range():
    """pyproject's gpu extras install exactly the flash-attn-4 range the GPU checks ran on."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    pins = re.findall(r'"flash-attn-4(?:\[cu13\])?([^"]*)"', text)
    assert pins and all(pin == fa4.TESTED_VERSIONS for pin in pins), pins


def test_warm_up_kernels_builds_only_for_fa4(gpu_with_fa4, monkeypatch):
    built = []
    monkeypatch.setattr(fa4, "warm_up", lambda *args: built.append(args) or 8)
    assert kernels.warm_up_kernels(8, 2, 64, torch.float32, "cpu") == 0  # auto on the CPU: reference
    monkeypatch.setattr(
        torch,
        "empty",
        lambda *a, device=None, dtype=None: types.SimpleNamespace(device=torch.device(device), dtype=dtype, shape=a),
    )  # a CUDA probe without a GPU
    assert kernels.warm_up_kernels(8, 2, 64, torch.bfloat16, "cuda", backend="torch_flash") == 0
    assert kernels.warm_up_kernels(8, 2, 64, torch.bfloat16, "cuda") == 8
    assert built == [(8, 2, 64, torch.bfloat16, "cuda")]
