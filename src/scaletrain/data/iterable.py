"""Iterable datasets (``torch.utils.data.IterableDataset``) sharded over ranks and resumed exactly.

The stream is the user's iteration order, epoch after epoch (a new ``iter()`` each pass; a
dataset with ``set_epoch`` is told the epoch first). Positions are global items, as for
map-style sets: rank ``r`` of ``W`` takes the items at global positions ``p`` with ``p % W == r``;
resuming from ``start_sample`` (a multiple of ``W``) skips the stream's first ``start_sample`` items
(read and dropped: a resume costs one pass over them, the price of a stream without random access).
Each pass is cut to whole groups of ``W`` items, so every rank gets the same number of samples and
the collectives of a step never wait for a rank that ran dry. No shuffling: the user's stream order
is the order, as with a ``DataLoader`` on an ``IterableDataset``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset

from scaletrain.errors import UserError


class RankShard(IterableDataset):
    """This rank's items of ``dataset``'s stream from global position ``start_sample`` (see above)."""

    def __init__(self, dataset: IterableDataset, rank: int, world_size: int, start_sample: int,
                 infinite: bool) -> None:
        if start_sample % world_size:
            raise UserError(f"start_sample must be a multiple of world_size {world_size}, got {start_sample}")
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.start_sample, self.infinite = start_sample, infinite

    def _pass(self, epoch: int) -> Iterator[list[Any]]:
        """One pass over the stream in whole groups of ``world_size`` items."""
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        group: list[Any] = []
        for item in self.dataset:
            group.append(item)
            if len(group) == self.world_size:
                yield group
                group = []

    def __iter__(self) -> Iterator[Any]:
        skip, epoch = self.start_sample // self.world_size, 0
        while True:
            seen = 0
            for group in self._pass(epoch):
                seen += 1
                if skip:
                    skip -= 1
                    continue
                yield group[self.rank]
            if seen == 0:
                raise UserError(f"the iterable dataset yields fewer than {self.world_size} items (one per rank)")
            epoch += 1
            if not self.infinite:
                return
