"""Data loaders that shard like ``DistributedSampler``, reshuffle per epoch and resume exactly.

The order, per rank, is the one ``torch.utils.data.DistributedSampler`` gives for the same
``(num_replicas=world_size, rank, shuffle, seed, drop_last)`` after ``set_epoch(epoch)``:
epoch ``e`` permutes the dataset with ``torch.randperm(n, generator=manual_seed(seed + e))``
(or keeps it in order without shuffle), pads by wrapping (``drop_last=False``) or truncates
(``drop_last=True``) to a multiple of ``world_size``, and rank ``r`` takes every
``world_size``-th index from ``r``. With ``drop_last=True`` each rank's share is further cut to
whole batches, exactly what a ``DataLoader(drop_last=True)`` would drop.

Positions are counted in *global samples* (all ranks together), the number a trainer knows as
``steps_done * global_batch``. With ``n`` samples, ``W = world_size`` and ``b = batch_size``
(per rank):

* samples per rank per epoch ``m = n // W`` (drop_last) or ``ceil(n / W)`` (padded);
* samples used per rank per epoch ``u = (m // b) * b`` (drop_last) or ``m``; with an
  ``epoch_multiple`` ``E`` (the trainer's global batch) ``u = (n // E) * E / W``, the same
  ``G`` under every ``W x b`` that divides ``E`` (the first ``G`` positions of the epoch's order);
* global samples per epoch ``G = u * W`` (``sampler.samples_per_epoch``);
* ``start_sample = p`` (a multiple of ``W``) means epoch ``p // G`` and, inside it, per-rank
  offset ``(p % G) // W``: rank ``r`` resumes at its own ``(p % G) // W``-th index of that epoch.

Because every rank consumes ``b`` samples per step, after ``k`` steps the ranks together have
consumed exactly the first ``k * b * W`` positions of the interleaved epoch order, so resuming
from ``p = k * b * W`` yields the very batches an uninterrupted run would have seen next.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from scaletrain.errors import UserError


class ResumableDistributedSampler(Sampler[int]):
    """Per-rank sample indices over successive epochs, starting at a global sample position.

    Finite mode (default): one pass over the rest of the current epoch; when that pass ends the
    sampler stands at the start of the next epoch, so the next ``for batch in loader`` gets the
    next epoch, reshuffled, with no ``set_epoch`` call needed. Infinite mode: epochs follow each
    other forever (``next(iterator)`` style training loops). The position advances as indices
    are drawn; with ``num_workers > 0`` the loader draws ahead, so a trainer should count the
    samples it actually consumed and pass that as ``start_sample`` when it resumes.
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        start_sample: int = 0,
        drop_last: bool = True,
        infinite: bool = False,
        epoch_multiple: int = 0,
    ) -> None:
        """``epoch_multiple`` (samples, with ``drop_last``): each epoch is cut to a multiple of it
        instead of ``batch_size x world_size``; a trainer passes its global batch, so that an epoch
        holds the same samples under every layout that splits that batch (an elastic re-plan
        continues the same sample stream). 0, or more than the dataset holds: ``batch_size x world_size``."""
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(
                f"rank must be in 0..world_size-1 with world_size >= 1, "
                f"got rank {rank}, world_size {world_size}"
            )
        if batch_size < 1:
            raise UserError(f"batch_size must be a positive number of samples, got {batch_size}")
        if start_sample < 0 or start_sample % world_size:
            raise UserError(
                f"start_sample must be a non-negative multiple of world_size {world_size}, "
                f"got {start_sample}"
            )
        self.n = len(dataset)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.drop_last, self.infinite = drop_last, infinite
        self.num_replicas = world_size  # DistributedSampler's name for it
        self.per_rank = self.n // world_size if drop_last else math.ceil(self.n / world_size)
        self.used_per_rank = self.per_rank
        if drop_last:  # whole batches only, as DataLoader(drop_last=True) would keep
            self.used_per_rank = (self.per_rank // batch_size) * batch_size
            if epoch_multiple and epoch_multiple <= self.n:
                if epoch_multiple % (batch_size * world_size):
                    raise UserError(f"epoch_multiple {epoch_multiple} must be a multiple of batch_size {batch_size} "
                                    f"x world_size {world_size}")
                self.used_per_rank = (self.n // epoch_multiple) * epoch_multiple // world_size
        if self.used_per_rank == 0:
            raise UserError(
                f"dataset of {self.n} samples is too small for batch_size {batch_size} on "
                f"{world_size} rank(s) with drop_last={drop_last}; "
                f"need at least {batch_size * world_size}"
            )
        self._rank_pos = start_sample // world_size  # samples this rank has consumed in the stream

    # -- positions ---------------------------------------------------------------------------
    @property
    def samples_per_epoch(self) -> int:
        """Global samples (all ranks) one epoch yields: ``G`` in the module docstring."""
        return self.used_per_rank * self.world_size

    @property
    def position(self) -> int:
        """Global samples drawn so far in the stream (what ``start_sample`` would resume from)."""
        return self._rank_pos * self.world_size

    @property
    def epoch(self) -> int:
        """Epoch the next index comes from."""
        return self._rank_pos // self.used_per_rank

    @property
    def offset(self) -> int:
        """Index, within this rank's share of the current epoch, of the next sample."""
        return self._rank_pos % self.used_per_rank

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler compatibility: move to the start of ``epoch``; a no-op when the
        sampler is already inside ``epoch`` (so a resumed run keeps its offset)."""
        if epoch != self.epoch:
            self._rank_pos = epoch * self.used_per_rank

    # -- order -------------------------------------------------------------------------------
    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for ``epoch`` (length ``used_per_rank``), as described above."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        total = self.per_rank * self.world_size
        if total > self.n:  # pad by wrapping around, as DistributedSampler does
            pad = total - self.n
            order += (order * math.ceil(pad / self.n))[:pad]
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size][: self.used_per_rank]

    def __iter__(self) -> Iterator[int]:
        while True:
            epoch, offset = self.epoch, self.offset
            for index in self.epoch_indices(epoch)[offset:]:
                self._rank_pos += 1
                yield index
            if not self.infinite:
                return

    def __len__(self) -> int:
        if self.infinite:
            raise TypeError("an infinite sampler has no length")
        return self.used_per_rank - self.offset


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    start_sample: int = 0,
    drop_last: bool = True,
    infinite: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
    epoch_multiple: int = 0,
) -> DataLoader:
    """A ``DataLoader`` of per-rank batches of ``batch_size`` samples (see the module docstring).

    ``start_sample`` is the global number of samples already consumed (``steps * global_batch``);
    the loader continues from there. ``loader.sampler`` is the :class:`ResumableDistributedSampler`
    (``position``, ``epoch``, ``samples_per_epoch``, ``set_epoch``). An ``IterableDataset`` is sharded
    and resumed by stream position instead (:mod:`.iterable`); a ``collate_fn`` attribute of the
    dataset (set by the trainer from ``Trainer(collate_fn=...)``) batches the samples.
    ``epoch_multiple``: see :class:`ResumableDistributedSampler` (not for an ``IterableDataset``).
    """
    collate = getattr(dataset, "collate_fn", None)  # the user's (Trainer(collate_fn=...)), else the default
    if isinstance(dataset, IterableDataset):  # the user's stream: sharded and resumed by position
        from .iterable import RankShard

        shard = RankShard(dataset, rank, world_size, start_sample, infinite)
        return DataLoader(shard, batch_size=batch_size, drop_last=drop_last, num_workers=num_workers,
                          pin_memory=pin_memory, collate_fn=collate)
    sampler = ResumableDistributedSampler(
        dataset,  # type: ignore[arg-type]
        batch_size,
        shuffle=shuffle,
        seed=seed,
        rank=rank,
        world_size=world_size,
        start_sample=start_sample,
        drop_last=drop_last,
        infinite=infinite,
        epoch_multiple=epoch_multiple,
    )
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        collate_fn=collate,
        persistent_workers=False,
        # Its own generator: creating an iterator otherwise draws a worker seed from the global
        # RNG, which would shift dropout masks after a resume and break bitwise continuation.
        generator=torch.Generator().manual_seed(seed),
    )
