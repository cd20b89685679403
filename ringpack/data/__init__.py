"""ringpack.data: lengths, the DataLoader sampler and collator, balanced Parquet shards (docs/data.md).

Names load on first use, so importing the package, or a torch-free part of it (:mod:`~ringpack.data.corpus`,
:mod:`~ringpack.data.sources`, :mod:`~ringpack.data.shard_writer`), needs neither torch, ``datasets`` nor
ortools; the collator, sampler and shard reader need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringpack._lazy import lazy_face

_EXPORTS = {
    "IGNORE_INDEX": "ringpack.data.shard_format",
    "PackedCollator": "ringpack.data.collator",
    "PackedDataset": "ringpack.data.collator",
    "PackedSamples": "ringpack.data.collator",
    "BalancedBatchSampler": "ringpack.data.sampler",
    "MicroBatchTicket": "ringpack.data.sampler",
    "ShardReader": "ringpack.data.shard_reader",
    "write_shards": "ringpack.data.shard_writer",
    "load_source": "ringpack.data.sources",
    "tokenize_dataset": "ringpack.data.sources",
    "DataError": "ringpack.lengths",
    "lengths_from_dataset": "ringpack.lengths",
    "sample_lengths": "ringpack.lengths",
}
__all__ = sorted(_EXPORTS, key=str.lower)

if TYPE_CHECKING:
    from ringpack.data.collator import PackedCollator, PackedDataset, PackedSamples  # noqa: F401
    from ringpack.data.sampler import BalancedBatchSampler, MicroBatchTicket  # noqa: F401
    from ringpack.data.shard_format import IGNORE_INDEX  # noqa: F401
    from ringpack.data.shard_reader import ShardReader  # noqa: F401
    from ringpack.data.shard_writer import write_shards  # noqa: F401
    from ringpack.data.sources import load_source, tokenize_dataset  # noqa: F401
    from ringpack.lengths import DataError, lengths_from_dataset, sample_lengths  # noqa: F401

__getattr__, __dir__ = lazy_face(__name__, _EXPORTS)
