"""Every mode of the table has a runtime and every runtime a row; each mode runs through dispatch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ringpack.attention
from ringpack.attention import compile_schedule, ring_attention
from ringpack.attention.transports import TRANSPORTS, transport_factory
from ringpack.modes import HEAD_PARALLEL_MODES, MODE_TABLE, MODES, SEQUENCE_MODES
from ringpack.shard_plan import Piece, microbatch_from_shards


def test_every_sequence_mode_has_a_transport_and_every_transport_a_row():
    assert set(TRANSPORTS) == set(SEQUENCE_MODES)


@pytest.mark.parametrize("mode", HEAD_PARALLEL_MODES)
def test_a_head_parallel_mode_runs_a_transport_between_nodes_or_none(mode):
    across = MODE_TABLE[mode].across_nodes
    assert across is None or across in TRANSPORTS


def test_the_public_modes_are_the_tables():
    assert ringpack.attention.MODES is MODES


def test_a_mode_without_a_transport_is_refused():
    with pytest.raises(KeyError):
        transport_factory("ulysses", None)


def _run(mode: str) -> list[torch.Tensor]:
    """One rank's out and q/k/v gradients under ``mode`` at CP size 1 (float64, reference kernels)."""
    lengths = [7, 12, 5]
    pieces = [Piece(s, 0, n) for s, n in enumerate(lengths)]
    mb = microbatch_from_shards(list(range(len(lengths))), [pieces], dict(enumerate(lengths)))
    hybrid = MODE_TABLE[mode].across_nodes is not None
    schedule = compile_schedule(mb, 0, gpus_per_node=1 if hybrid else None, hybrid_layout=hybrid)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lengths), h, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = ring_attention(q, k, v, schedule, mode=mode, backend="reference")
    (out * torch.from_numpy(np.linspace(-1, 1, out.numel()).reshape(out.shape))).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_runs_and_agrees_at_cp_1(mode):
    for got, want in zip(_run(mode), _run("ring")):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
