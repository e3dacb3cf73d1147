"""Bytes of model states (parameters, gradients, optimizer states) on one rank, measured.

:func:`measure_model_state_bytes` counts the storages a module and its optimizer hold, the quantity
every data-parallel cost face (:mod:`scaletrain.techniques.data_parallel.cost`) predicts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states on one rank."""

    params: float
    grads: float
    optimizer: float
    """Optimizer states plus fp32 master weights."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def measure_model_state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer,
                              extra_params: Iterable[torch.Tensor] = (),
                              extra_grads: Iterable[torch.Tensor] = ()) -> ModelStateBytes:
    """Bytes of the storages holding parameters, gradients and optimizer states on this rank.

    Each storage is counted once (views, tied weights, proxies sharing a parameter's rows), in
    the first category that holds it (parameters > gradients > optimizer). DTensors count their
    local shard. Call it after backward and before the optimizer step, when all three exist.
    """
    seen: set[int] = set()

    def size(ts: Iterable[Any]) -> int:
        total = 0
        for t in ts:
            if not isinstance(t, torch.Tensor):
                continue
            t = getattr(t, "_local_tensor", t)
            st = t.untyped_storage()
            key = st.data_ptr() if st.nbytes() else id(st)
            if key in seen:
                continue
            seen.add(key)
            total += st.nbytes()
        return total

    params = list(module.parameters()) + list(extra_params)
    opt_params = [p for g in optimizer.param_groups for p in g["params"]]
    p_bytes = size(params)
    g_bytes = size([p.grad for p in params + opt_params] + list(extra_grads))
    # fp32 master copies (optimizer parameters that are not views of the model's) count as
    # optimizer states, as in ZeRO's K = 12 for mixed-precision Adam.
    o_bytes = size(opt_params) + size(v for st in optimizer.state.values() for v in st.values())
    return ModelStateBytes(p_bytes, g_bytes, o_bytes)
