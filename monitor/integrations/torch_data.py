"""Name each micro-batch of a torch DataLoader by the dataset indices it holds.

    from monitor.integrations.torch_data import IndexedBatches

    batches = IndexedBatches(BatchSampler(RandomSampler(dataset), 32, drop_last=False))
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=4)
    for batch in batches.named(loader, mon):  # calls mon.set_batch_ids(indices) per batch
        ...

The DataLoader asks its batch sampler for index lists ahead of time (prefetching, workers) but
hands out the batches in the same order (its default ``in_order=True``), so the wrapper keeps the
index lists it gave out in a queue and takes one per batch the loop receives. Nothing in the
data, the sampler's order or the loader changes.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from typing import Any


class IndexedBatches:
    """A batch sampler that remembers the index lists it handed to a DataLoader, in order."""

    def __init__(self, batch_sampler: Iterable[list[int]]) -> None:
        self.batch_sampler = batch_sampler
        self._given: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        self._given.clear()  # a new epoch: what the last one prefetched is gone
        for indices in self.batch_sampler:
            self._given.append(list(indices))
            yield indices

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def named(self, loader: Any, mon: Any) -> Iterator[Any]:
        """The loader's batches; before each is yielded, ``mon.set_batch_ids(its indices)``.

        Raises:
            ValueError: the loader does not use this sampler, or hands out batches out of order.
        """
        if getattr(loader, "batch_sampler", None) is not self:
            raise ValueError(
                "IndexedBatches.named: loader: expected a DataLoader built with batch_sampler=this"
            )
        if getattr(loader, "in_order", True) is False:
            raise ValueError("IndexedBatches.named: loader: in_order=False hands out batches out of order")
        for batch in loader:
            mon.set_batch_ids(self._given.popleft())
            yield batch
