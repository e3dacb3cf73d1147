"""Parameters stored in 16 bits with fp32 master weights kept by the optimizer (``train.params_dtype``).

Mixed-precision training as in Micikevicius et al. 2018 and ZeRO section 3: the model's
parameters and gradients are bf16/fp16 (2 + 2 bytes per parameter), the optimizer updates fp32
master copies (4 bytes) with fp32 states (K bytes: Adam 8) — ZeRO's 2 + 2 + 12 = 16 bytes per
parameter with Adam, against 4 + 4 + 8 for fp32 parameters. Compute dtype is ``train.precision``:
with 16-bit parameters the matmuls run in that dtype whether or not autocast is on.

Cost face: :func:`scaletrain.techniques.data_parallel.cost.bytes_per_param` with precision "bf16"/"fp16"
(the same numbers; with ``parallel.zero=1/2`` the masters and states are sharded by
:class:`~scaletrain.techniques.data_parallel.zero.GradSync`, which takes the same ``param_dtype``).

Apply face (one process): :class:`MasterWeightsStrategy`. Order in a step: backward fills the
16-bit ``.grad``; ``prepare_step`` copies each into an fp32 master gradient; the loss scaler
unscales / checks those (fp16), clipping and the optimizer run on the masters; ``after_step``
rounds the masters back into the 16-bit parameters. Checkpoints hold the fp32 masters, in the
plain single-process layout, so they load into an fp32 run and back.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
from torch import nn

from scaletrain.errors import ConfigError
from scaletrain.techniques.runtime import Strategy

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def param_dtype(name: str) -> torch.dtype | None:
    """The storage dtype of ``train.params_dtype`` (None for fp32)."""
    if name == "fp32":
        return None
    if name not in DTYPES:
        raise ConfigError(f"train.params_dtype={name!r} is not allowed; allowed: fp32, bf16, fp16")
    return DTYPES[name]


class MasterWeightsStrategy(Strategy):
    """One process, 16-bit parameters and gradients, fp32 masters in the optimizer (module docstring)."""

    name = "master-weights"

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        super().__init__(model)
        self.dtype = dtype
        self.master = copy.deepcopy(model).float()  # fp32 masters (ties kept: deepcopy preserves sharing)
        self.pairs = list(zip(model.parameters(), self.master.parameters()))
        for p, _ in self.pairs:
            if p.is_floating_point():
                p.data = p.data.to(dtype)

    def build_optimizer(self, build: Callable[[nn.Module], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        return build(self.master)

    def prepare_step(self, optimizer: torch.optim.Optimizer) -> None:
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()

    def clip_grad_norm(self, optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        return float(nn.utils.clip_grad_norm_(self.master.parameters(), max_norm, foreach=True))

    @torch.no_grad()
    def after_step(self) -> None:
        for p, m in self.pairs:
            p.copy_(m)  # round to the storage dtype
            m.grad = None  # the fp32 master gradients exist only around the update (the estimator's model)

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def model_state_dict(self) -> dict[str, Any]:
        state = self.model.state_dict()  # buffers as the model has them
        state.update({k: v for k, v in self.master.state_dict().items() if k in dict(self.master.named_parameters())})
        return state

    @torch.no_grad()
    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        self.master.load_state_dict(state)
        self.model.load_state_dict(state)  # copies cast to the parameters' 16-bit dtype
        for p, m in self.pairs:
            p.copy_(m)

    def state_tensors(self) -> list[torch.Tensor]:
        """The fp32 master weights (optimizer-side model states: ZeRO's M)."""
        return [m for _, m in self.pairs]

    def describe(self) -> str:
        return f"single process, {str(self.dtype).replace('torch.', '')} parameters with fp32 master weights"
