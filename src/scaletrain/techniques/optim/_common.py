"""Pieces shared by scaletrain's optimizers: state loading, the 1-D exclusion rule, gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class DtypePreservingOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer`` whose ``load_state_dict`` keeps every state tensor's dtype.

    Why: the base class casts every floating-point parameter's state tensors to the
    parameter's dtype. That would turn 8-bit codes (uint8) into float32 and round fp32
    statistics kept for bf16 parameters to bf16, so a resumed run would not continue exactly.
    Here state tensors are only moved to the parameter's device (no copy when already there,
    as in torch); non-tensor state (the integer ``step``) is taken as is.
    """

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if not saved:
                continue
            self.state[p] = {
                k: (v.to(device=p.device) if torch.is_tensor(v) else v) for k, v in saved.items()
            }


def excluded(group: dict[str, Any], key: str, p: Tensor) -> bool:
    """The exclusion rule for weight decay / layer adaptation (LAMB, LARS).

    ``group[key]`` is True (exclude every parameter of the group), False (exclude none) or None
    (the papers' rule: exclude 1-D parameters — biases and normalisation gains/offsets; You et
    al. 2017 §3 and the LAMB paper's BERT setup exclude them from both).
    """
    flag = group.get(key)
    if flag is None:
        return p.ndim <= 1
    return bool(flag)


def grad_fp32(p: Tensor, maximize: bool) -> Tensor:
    """The gradient as float32 (a view when already fp32), negated for ``maximize``."""
    if p.grad is None:
        raise RuntimeError("grad_fp32 called on a parameter without a gradient")
    if p.grad.is_sparse:
        raise RuntimeError(f"{type(p).__name__}: sparse gradients are not supported")
    g = p.grad.float()
    return -g if maximize else g


def rms(x: Tensor) -> Tensor:
    """Root mean square ||x||_2 / sqrt(numel) (Shazeer & Stern 2018 §5), a 0-d tensor."""
    return x.norm(2) / (x.numel() ** 0.5)


def check_nonneg(name: str, value: float) -> None:
    """Reject negative hyperparameters with a ValueError naming them (torch.optim's habit)."""
    if value < 0.0:
        raise ValueError(f"invalid {name}: {value} (must be >= 0)")


def check_beta(name: str, value: float) -> None:
    """Betas are decay rates in [0, 1)."""
    if not 0.0 <= value < 1.0:
        raise ValueError(f"invalid {name}: {value} (must be in [0, 1))")
