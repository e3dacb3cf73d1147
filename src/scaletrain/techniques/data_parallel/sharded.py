"""The row layout ZeRO shards use, and the strict-load check every runtime's state dicts share.

Rank ``r`` of ``n`` owns rows ``[r c, (r+1) c)`` of a tensor, ``c = ceil(rows / n)``: the
``torch.chunk`` / DTensor ``Shard(0)`` layout, so ZeRO's shards, FSDP2's and DTensor's agree.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn


def check_state_keys(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise as ``load_state_dict(strict=True)`` would when ``state``'s keys are not the model's."""
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict: missing keys {missing[:3]}, unexpected keys "
                           f"{unexpected[:3]}")


def shard_rows(rows: int, n: int, r: int) -> tuple[int, int, int]:
    """(chunk, start, length) of rank ``r``'s rows: torch.chunk / DTensor ``Shard(0)`` layout."""
    chunk = max(1, math.ceil(rows / n))
    start = min(rows, r * chunk)
    return chunk, start, max(0, min(chunk, rows - start))
