"""Learning-rate schedule: linear warm-up, then cosine / linear decay or constant."""

from __future__ import annotations

import math


def lr_factor(step: int, *, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based).

    Warm-up rises linearly to 1 over ``warmup`` steps (step 0 already gets 1/warmup, so the
    first update is never zero); then cosine goes 1 -> ``min_ratio`` over the remaining steps
    (Loshchilov & Hutter 2017), linear likewise, constant stays 1.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    if schedule == "cosine":
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - (1 - min_ratio) * progress
