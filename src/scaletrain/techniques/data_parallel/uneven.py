"""Uneven per-rank batches: data parallelism over devices of different speeds (HetPipe / Whale).

A rank r of a data-parallel group runs ``split[r]`` of the global batch's B samples (the heterogeneous
planner's per-replica split, :mod:`scaletrain.planner.hetero`). The mathematics must stay the global-batch
mean: the gradient of (1/B)·Σ over all samples. Each rank's loss is the mean over its own b_r samples, so
it is weighted by b_r/B before the gradients are summed across ranks — or by b_r·world/B when the
reduction averages (torch DDP divides the sum by the world size). With an even split the weight is 1,
the usual DDP; the weights of all ranks sum to 1 (sum) or to world (average).
"""

from __future__ import annotations

from scaletrain.errors import ConfigError


def check_split(split: list[int], world: int) -> None:
    """One-line ConfigError unless ``split`` has one positive count per rank."""
    if len(split) != world or any(int(b) != b or b < 1 for b in split):
        raise ConfigError(f"per-rank batch split {split} must give one integer >= 1 per data-parallel rank "
                          f"({world} ranks)")


def rank_slice(split: list[int], rank: int) -> slice:
    """The samples of the global batch rank ``rank`` runs: ranks take consecutive runs, in rank order."""
    start = sum(split[:rank])
    return slice(start, start + split[rank])


def loss_weight(split: list[int], rank: int, averaged: bool = True) -> float:
    """Factor on rank ``rank``'s local-mean loss so the reduced gradient is the global-batch mean's:
    b_r·world/B when the reduction averages over ranks (``averaged``, torch DDP), b_r/B when it sums."""
    total = sum(split)
    return split[rank] * (len(split) if averaged else 1) / total
