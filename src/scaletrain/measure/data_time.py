"""Host seconds the run's input pipeline takes per training sample.

The trainer fetches each micro-batch from its loader in the training process, before the forward
(:func:`scaletrain.data.build_loader`, no worker processes), so on a CPU the loader's own work —
indexing, decoding, augmenting and collating every sample — is part of every step. Measured here
(2026-11-28, one thread): vgg-mini's images 2.6 ms per batch of 32 (~5 % of its step at 2 processes),
hf:bert's and gpt2-mini's token windows 0.1-0.4 ms per batch of 4. ``plan=auto`` measures it on the
run's own data (:attr:`scaletrain.platform.Platform.data_seconds_per_sample`). Units: seconds.
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any


def seconds_per_sample(dataset: Any, micro_batch: int, batches: int = 12, warmup: int = 2) -> float:
    """Median seconds per sample of fetching ``batches`` micro-batches of ``micro_batch`` samples from
    ``dataset`` (pairs, as the trainer iterates them) through the trainer's loader, after ``warmup``."""
    from scaletrain.data import build_loader

    loader = build_loader(dataset, micro_batch, shuffle=True, seed=0, infinite=True)
    it = iter(loader)
    for _ in itertools.islice(it, warmup):
        pass
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        next(it)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / micro_batch
