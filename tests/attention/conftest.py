"""Attention tests run tiny tensors: one intra-op thread is faster (CPU index_add_ with 2 threads is ~1000x slower)."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
