"""Fixtures of the training-layer tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group in this process (the world of a single-GPU run), destroyed afterwards."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
