"""ringpack.data: lengths, the DataLoader sampler and collator, balanced Parquet shards (docs/data.md).

Importing this package needs neither ``datasets`` nor ortools (both are imported lazily, where used).
"""

from ringpack.data.collator import IGNORE_INDEX, PackedCollator, PackedDataset, PackedSamples
from ringpack.data.sampler import BalancedBatchSampler, MicroBatchTicket
from ringpack.data.shard_reader import ShardReader
from ringpack.data.shard_writer import write_shards
from ringpack.data.sources import load_source, tokenize_dataset
from ringpack.lengths import DataError, lengths_from_dataset, sample_lengths

__all__ = [
    "BalancedBatchSampler",
    "DataError",
    "IGNORE_INDEX",
    "MicroBatchTicket",
    "PackedCollator",
    "PackedDataset",
    "PackedSamples",
    "ShardReader",
    "lengths_from_dataset",
    "load_source",
    "sample_lengths",
    "tokenize_dataset",
    "write_shards",
]
