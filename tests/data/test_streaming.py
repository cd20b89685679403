"""Streams: their lengths can be read, but ``PackedDataset`` refuses them in one line naming what to do instead.

A plan reorders samples across a whole epoch, so the loader needs random access; the refusal
names the two ways there (materialise the stream, or shard it once), and the first is checked here
to give exactly the tokens of the stream.
"""

from __future__ import annotations

import datasets
import numpy as np
import pytest
import torch

from ringpack.data import BalancedBatchSampler, DataError, PackedCollator, PackedDataset
from ringpack.lengths import sample_lengths
from tests.helpers.data import Coverage, random_samples

DP, CP, T = 2, 2, 256


@pytest.fixture(scope="module")
def samples():
    return random_samples(60, seed=4)


@pytest.fixture(scope="module")
def stream(samples):
    rows = {"input_ids": [s.tolist() for s in samples], "length": [len(s) for s in samples]}
    return datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=3)


def test_a_datasets_stream_is_refused_in_one_line(stream):
    with pytest.raises(DataError) as info:
        PackedDataset(stream)
    message = str(info.value)
    assert "\n" not in message and "datasets.IterableDataset is a stream" in message
    assert "Dataset.from_generator" in message and "ringpack shard" in message and "ShardReader" in message


def test_a_torch_stream_is_refused(samples):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(samples)

    with pytest.raises(DataError, match=r"torch IterableDataset \(Stream\)"):
        PackedDataset(Stream())


def test_the_named_alternative_gives_the_streams_tokens(stream, samples, tmp_path):
    lengths = sample_lengths(stream)  # a stream's lengths read in one pass, token ids first
    assert lengths.tolist() == [len(s) for s in samples]
    assert sample_lengths(stream.select_columns(["length"])).tolist() == lengths.tolist()
    materialised = datasets.Dataset.from_generator(
        lambda: (yield from stream), features=stream.features, cache_dir=str(tmp_path)
    )
    cov = Coverage(samples)
    for d in range(DP):
        for c in range(CP):
            sampler = BalancedBatchSampler(lengths, d, DP, CP, T, samples_per_step=20)
            dataset, collate = PackedDataset(materialised), PackedCollator(c, CP, schedule=False)
            cov.add_all([collate(dataset.__getitems__(ticket)) for ticket in sampler])
    cov.check_exactly_once()
    assert np.array_equal(materialised[7]["input_ids"], samples[7])
