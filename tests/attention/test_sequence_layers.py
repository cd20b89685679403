"""Sequence-mixing layers on whole samples under any plan (examples/sequence_layers.py).

A causal depthwise convolution and a linear recurrence (a cumulative decayed sum per channel) run
between ``sequence_to_heads`` and ``heads_to_sequence`` must equal single-device per-sample
computation, forward and backward (input and parameter gradients). The reference is a plain
token-by-token loop per sample, sharing no code with the example. One spawn of 8 gloo processes
(``slow``) covers CP groups of 2, 3, 4 and 8 ranks on adversarial plans; single-process tests
check the layers themselves on packed samples and the CP=1 path.
"""

from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ringpack.attention import compile_schedule
from tests.helpers.attention import (
    handmade_microbatches,
    max_abs_error,
    random_microbatch,
    run_processes,
    targeted_microbatches,
    within,
)

TOL = 1e-10
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sequence_layers.py"
CHANNELS = 24  # a multiple of every CP size tested


def example():
    spec = importlib.util.spec_from_file_location("sequence_layers_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One sample ``x (L, C)``: ``out[t] = sum_{i <= t} weight[i] * x[t - i]``, token by token."""
    rows = []
    for t in range(x.shape[0]):
        rows.append(sum(weight[i] * x[t - i] for i in range(min(t + 1, weight.shape[0]))))
    return torch.stack(rows)


def reference_recurrence(x: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """One sample ``x (L, C)``: ``h[t] = decay * h[t - 1] + x[t]`` from ``h = 0``, token by token."""
    h, rows = torch.zeros_like(x[0]), []
    for t in range(x.shape[0]):
        h = decay * h + x[t]
        rows.append(h)
    return torch.stack(rows)


LAYERS = {"conv": ("causal_depthwise_conv", reference_conv), "recurrence": ("decayed_cumsum", reference_recurrence)}


def make_inputs(lengths: dict, seed: int) -> tuple[dict, dict, dict]:
    """Per-sample inputs and output gradients ``(L, CHANNELS)`` by sample id, and each layer's parameter."""
    gen = torch.Generator().manual_seed(seed)
    x = {s: torch.randn(n, CHANNELS, generator=gen, dtype=torch.float64) for s, n in lengths.items()}
    dout = {s: torch.randn(n, CHANNELS, generator=gen, dtype=torch.float64) for s, n in lengths.items()}
    params = {
        "conv": torch.randn(4, CHANNELS, generator=gen, dtype=torch.float64),
        "recurrence": torch.rand(CHANNELS, generator=gen, dtype=torch.float64) * 0.9 + 0.05,
    }
    return x, dout, params


def reference(layer: str, x: dict, dout: dict, param: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
    """Single-device per-sample outputs, input gradients and the parameter's gradient, by sample id."""
    param = param.clone().requires_grad_()
    xs = {s: t.clone().requires_grad_() for s, t in x.items()}
    outs = {s: LAYERS[layer][1](xs[s], param) for s in xs}
    sum((outs[s] * dout[s]).sum() for s in xs).backward()
    return {s: o.detach() for s, o in outs.items()}, {s: t.grad for s, t in xs.items()}, param.grad


def local(mb, rank: int, by_sample: dict) -> torch.Tensor:
    pieces = mb.shards[rank].pieces
    if not pieces:
        return torch.zeros(0, CHANNELS, dtype=torch.float64)
    return torch.cat([by_sample[p.sample][p.start : p.stop] for p in pieces])


def test_the_example_layers_equal_per_sample_loops_on_packed_samples():
    layers = example()
    lengths = [1, 7, 3, 12, 2]
    x, dout, params = make_inputs(dict(enumerate(lengths)), 1)
    cu = torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32)
    for layer, (name, _) in LAYERS.items():
        packed = torch.cat(list(x.values())).requires_grad_()
        weight = params[layer].clone().requires_grad_()
        out = getattr(layers, name)(packed, weight, cu)
        out.backward(torch.cat(list(dout.values())))
        want, want_dx, want_dparam = reference(layer, x, dout, params[layer])
        assert max_abs_error(out, torch.cat(list(want.values()))) < TOL, layer
        assert max_abs_error(packed.grad, torch.cat(list(want_dx.values()))) < TOL, layer
        assert max_abs_error(weight.grad, want_dparam) < TOL, layer


def test_cp1_whole_sample_layers_are_exact():
    layers = example()
    _, mb, lengths = handmade_microbatches()[0]
    x, dout, params = make_inputs(lengths, 2)
    sched = compile_schedule(mb, 0)
    for layer, (name, _) in LAYERS.items():
        xl = local(mb, 0, x).requires_grad_()
        out = layers.whole_sample_layer(getattr(layers, name), xl, params[layer], sched)
        out.backward(local(mb, 0, dout))
        want, want_dx, _ = reference(layer, x, dout, params[layer])
        assert max_abs_error(out, local(mb, 0, want)) < TOL and max_abs_error(xl.grad, local(mb, 0, want_dx)) < TOL


# ------------------------------------------------------------------------------- multi-process

GROUPS = {2: [0, 7], 3: [1, 3, 5], 4: [2, 4, 6, 7], 8: list(range(8))}


def build_cases() -> list[tuple[str, object, dict]]:
    rng = np.random.default_rng(99)
    cases = [(n, mb, lengths) for n, mb, lengths in handmade_microbatches() + targeted_microbatches()]
    cases = [c for c in cases if len(c[1].shards) in GROUPS]
    for cp in GROUPS:
        mb, lengths = random_microbatch(rng, cp, num_samples=4)
        cases.append((f"random:cp{cp}", mb, lengths))
    return cases


def worker(rank: int, world: int) -> list[tuple]:
    layers = example()
    groups = {cp: dist.new_group(ranks) for cp, ranks in GROUPS.items()}
    report = []
    for name, mb, lengths in build_cases():
        cp = len(mb.shards)
        if rank not in GROUPS[cp]:
            continue
        group, cp_rank = groups[cp], dist.get_rank(groups[cp])
        sched = compile_schedule(mb, cp_rank)
        x, dout, params = make_inputs(lengths, zlib.crc32(name.encode()) % 10_000)
        for layer, (fn, _) in LAYERS.items():
            xl = local(mb, cp_rank, x).requires_grad_()
            param = params[layer].clone().requires_grad_()
            out = layers.whole_sample_layer(getattr(layers, fn), xl, param, sched, group)
            out.backward(local(mb, cp_rank, dout))
            dparam = param.grad.clone()
            dist.all_reduce(dparam, group=group)  # each rank's channels' share, summed as data parallelism would
            want, want_dx, want_dparam = reference(layer, x, dout, params[layer])
            errors = {
                "out": max_abs_error(out.detach(), local(mb, cp_rank, want)),
                "dx": max_abs_error(xl.grad, local(mb, cp_rank, want_dx)),
                "dparam": max_abs_error(dparam, want_dparam),
            }
            report.append((name, layer, cp, cp_rank, errors))
    return report


@pytest.mark.slow
def test_sequence_layers_on_whole_samples_are_exact_on_2_to_8_ranks():
    rows = [row for result in run_processes(8, worker) for row in result]
    cases = build_cases()
    assert len(rows) == len(LAYERS) * sum(len(mb.shards) for _, mb, _ in cases), "every rank of every case reported"
    assert {cp for _, _, cp, _, _ in rows} == set(GROUPS)
    bad = [row for row in rows if not within(row[-1], TOL)]
    assert not bad, bad[:5]
