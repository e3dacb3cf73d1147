"""CAME: Confidence-guided Adaptive Memory Efficient optimizer (Luo et al., ACL 2023).

Algorithm 1 of the paper (Algorithm 3 of seed "Training large-scale models with limited GPU
memory"), for a gradient G [n, m]:
  r = b2 r + (1-b2) mean_cols(G^2 + e1),   c = b2 c + (1-b2) mean_rows(G^2 + e1)
  V = r c^T / mean(r)                                    (Adafactor's factored second moment)
  U = G / sqrt(V);  U_hat = U / max(1, RMS(U)/d)          (update clipping)
  M = b1 M + (1-b1) U_hat                                 (first moment of the clipped update)
  I = (U_hat - M)^2 + e2                                  (instability: distance of the update
                                                           from its running mean)
  R = b3 R + (1-b3) mean_cols(I),  C = b3 C + (1-b3) mean_rows(I)
  S = R C^T / mean(R)                                     (factored confidence matrix)
  X = X - lr * M / sqrt(S)
The paper writes sums (1_m, 1_n^T); means give the same V and S. No bias correction (as in the
paper). Decoupled weight decay ``X <- X (1 - lr * weight_decay)`` as in the authors' release.

Vectors (biases, norms) are the degenerate case n x 1 of the factorisation, where r c^T/sum(r)
is exactly the unfactored EMA; they keep unfactored V and S (the authors' code instead skips the
confidence step for vectors and updates with M alone). Tensors with > 2 dims are factored over
their last two dims.

State bytes (fp32): M is full size (4 * numel: the confidence is defined against it); V and S
are factored, 2 * 4 * batch * (n + m) for [..., n, m], or 2 * 4 * numel for vectors.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scaletrain.techniques.optim._common import (
    DtypePreservingOptimizer, check_beta, check_nonneg, grad_fp32, rms,
)


def _factored_inv_sqrt(row: Tensor, col: Tensor) -> tuple[Tensor, Tensor]:
    """Broadcastable factors a [..., n, 1], b [..., 1, m] with a*b = 1/sqrt(row col^T / mean(row))."""
    a = (row / row.mean(dim=-1, keepdim=True)).rsqrt().unsqueeze(-1)
    b = col.rsqrt().unsqueeze(-2)
    return a, b


class CAME(DtypePreservingOptimizer):
    """CAME (Luo et al. 2023); see the module docstring for the algorithm.

    Args:
        params: parameters or parameter groups.
        lr: learning rate eta (default 2e-4, the paper's BERT/GPT setting).
        betas: (b1, b2, b3) = (0.9, 0.999, 0.9999): first moment, second moment, instability.
        eps: (e1, e2) = (1e-30, 1e-16): added to G^2 and to the instability.
        clip_threshold: d of the update clipping (default 1.0).
        weight_decay: decoupled decay coefficient (default 0).
        maximize: maximize the objective instead.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 2e-4,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
    ) -> None:
        check_nonneg("lr", float(lr))
        if len(betas) != 3:
            raise ValueError(f"CAME takes three betas (b1, b2, b3), got {betas}")
        for i, b in enumerate(betas):
            check_beta(f"beta{i + 1}", b)
        check_nonneg("eps1", eps[0])
        check_nonneg("eps2", eps[1])
        if clip_threshold < 1.0:
            raise ValueError(f"invalid clip_threshold: {clip_threshold} (must be >= 1)")
        check_nonneg("weight_decay", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=tuple(eps), clip_threshold=clip_threshold,
                        weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults)

    # ---- cost face ---------------------------------------------------------------------
    @staticmethod
    def state_nbytes(shape: tuple[int, ...]) -> int:
        """Exact state bytes for one parameter of ``shape`` (fp32, any parameter dtype)."""
        numel = math.prod(shape)
        if len(shape) >= 2:
            *batch, n, m = shape
            factored = math.prod(batch) * (n + m)
        else:
            factored = numel
        return 4 * (numel + 2 * factored)

    # ---- apply face --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One CAME step over all parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p)
        return loss

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = 0
        kw = dict(dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros(p.shape, **kw)
        if p.ndim >= 2:
            *batch, n, m = p.shape
            for name in ("exp_avg_sq", "exp_avg_res"):
                state[f"{name}_row"] = torch.zeros((*batch, n), **kw)
                state[f"{name}_col"] = torch.zeros((*batch, m), **kw)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **kw)
            state["exp_avg_res"] = torch.zeros(p.shape, **kw)
        return state

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        state = self.state[p] or self._init_state(p)
        state["step"] += 1
        b1, b2, b3 = group["betas"]
        eps1, eps2 = group["eps"]
        g = grad_fp32(p, group["maximize"])
        x = p if p.dtype == torch.float32 else p.float()
        factored = p.ndim >= 2

        g2 = g * g + eps1
        if factored:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.lerp_(g2.mean(dim=-1), 1.0 - b2)
            col.lerp_(g2.mean(dim=-2), 1.0 - b2)
            a, b = _factored_inv_sqrt(row, col)
            update = g * a * b
        else:
            v = state["exp_avg_sq"]
            v.lerp_(g2, 1.0 - b2)
            update = g * v.rsqrt()
        del g2
        update.div_((rms(update) / group["clip_threshold"]).clamp(min=1.0))  # U_hat, no host sync
        m = state["exp_avg"]
        m.lerp_(update, 1.0 - b1)
        res = (update - m).square_().add_(eps2)  # instability I = (U_hat - M)^2 + e2
        if factored:
            rrow, rcol = state["exp_avg_res_row"], state["exp_avg_res_col"]
            rrow.lerp_(res.mean(dim=-1), 1.0 - b3)
            rcol.lerp_(res.mean(dim=-2), 1.0 - b3)
            a, b = _factored_inv_sqrt(rrow, rcol)
            step_dir = m * a * b
        else:
            s = state["exp_avg_res"]
            s.lerp_(res, 1.0 - b3)
            step_dir = m * s.rsqrt()
        lr = float(group["lr"])
        if group["weight_decay"] != 0:
            x.mul_(1.0 - lr * group["weight_decay"])
        x.add_(step_dir, alpha=-lr)
        if x is not p:
            p.copy_(x)
