"""Dropout under tensor parallelism, as Megatron does it: a model-parallel RNG.

The regions TP *replicates* (the embedding output, the row-parallel layers' outputs before the
residual, LayerNorms) must draw the same dropout mask on every rank of a TP group, or the values
DTensor treats as ``Replicate`` silently diverge; the regions TP *shards* (the attention
probabilities of this rank's heads; with sequence parallelism, this rank's s/t positions) must
draw different masks on each rank, or heads / positions of different ranks would share one
pattern. Megatron keeps two generators (the default one, seeded alike within a TP group, and a
"model-parallel" one forked per TP rank: ``get_cuda_rng_tracker().fork()``).

Here the default generator is seeded per *model replica* (the trainer: ``seed`` + data-parallel and
pipeline position, never the TP rank), so replicated regions agree. :func:`sharded_region` forks
for a sharded region: it draws one 62-bit seed from the default stream (the same draw on every TP
rank, so the default streams stay aligned), seeds a forked generator with it and the TP rank, runs
the region, and restores the default state. Because the fork is a function of the default stream,
a recomputation under ``torch.utils.checkpoint`` (which restores the default RNG state of the
segment) redraws exactly the same masks — no tracker state to stash.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def sharded_region(tp_rank: int, active: bool = True) -> Iterator[None]:
    """Run a TP-sharded region's randomness on a per-rank stream derived from the default one
    (see the module docstring). ``active=False`` (no dropout in this call) draws nothing."""
    if not active:
        yield
        return
    base = int(torch.randint(0, 2**62, (1,), dtype=torch.int64))  # advances the shared stream alike
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((base + 0x9E3779B97F4A7C15 * (tp_rank + 1)) % 2**63)
        yield


def replica_seed(seed: int, rank: int, tp: int) -> int:
    """The default generator's seed of global ``rank`` with TP innermost in the mesh: equal within a
    TP group (ranks ``rank // tp``), different across replicas and pipeline stages."""
    return seed + 1_000_003 * (rank // max(tp, 1))
