"""A plan whose one step holds a whole large epoch (``samples_per_step=0``) is called out once."""

from __future__ import annotations

import logging

import numpy as np

import ringpack
from ringpack.planner import epoch


def test_a_whole_epoch_in_one_step_is_called_out(caplog):
    lengths = np.full(epoch.ONE_STEP_SAMPLES_PER_RANK * 2 + 1, 16)
    with caplog.at_level(logging.WARNING, logger=epoch.__name__):
        ringpack.plan(lengths, dp=2, cp=1, tokens_per_rank=4096, packing="first_fit")
    warned = [r.getMessage() for r in caplog.records if "one optimizer step" in r.getMessage()]
    assert len(warned) == 1 and "2,049 samples" in warned[0] and "samples_per_step" in warned[0]


def test_a_stated_global_batch_or_a_small_epoch_is_not(caplog):
    with caplog.at_level(logging.WARNING, logger=epoch.__name__):
        ringpack.plan(np.full(5000, 16), dp=2, cp=1, tokens_per_rank=4096, samples_per_step=512, packing="first_fit")
        ringpack.plan(np.full(100, 16), dp=2, cp=1, tokens_per_rank=4096, packing="first_fit")
    assert not [r for r in caplog.records if "one optimizer step" in r.getMessage()]
