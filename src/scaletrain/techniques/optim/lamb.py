"""LAMB: layer-wise adaptive moments for large-batch training (You et al., ICLR 2020).

Algorithm 2 of the paper, per parameter tensor ("layer") x:
  m = b1 m + (1-b1) g,   v = b2 v + (1-b2) g^2
  r = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)          (Adam direction, bias-corrected)
  u = r + wd * x                                          (decoupled weight decay term)
  x = x - lr * phi(||x||) / ||u|| * u                      (layer-wise trust ratio)
with phi the identity (or a clamp, ``trust_clamp``) and the ratio set to 1 when ||x|| or ||u||
is 0 (a zero-initialised layer would otherwise never move).

Exclusions (the paper's BERT setup; ``_common.excluded``): 1-D parameters — biases and
LayerNorm/BatchNorm gains and offsets — get no weight decay and no trust ratio (plain AdamW
step). Override per param group with ``exclude_from_weight_decay`` and
``exclude_from_layer_adaptation`` (True: exclude all of the group, False: none, None: 1-D rule).

State: fp32 m and v, 8 bytes/parameter (like Adam); ``step`` is a Python int.
Vectorised with torch._foreach_* over all tensors of a group (norms with _foreach_norm).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scaletrain.techniques.optim._common import (
    DtypePreservingOptimizer, check_beta, check_nonneg, excluded,
)


def trust_ratios(w_norms: list[Tensor], u_norms: list[Tensor],
                 clamp: tuple[float, float] | None = None) -> list[Tensor]:
    """phi(||w||) / ||u|| per tensor, 1 where either norm is 0; 0-d tensors, no host sync."""
    if not w_norms:
        return []
    w = torch.stack(w_norms)
    u = torch.stack(u_norms)
    phi = w.clamp(*clamp) if clamp is not None else w
    ratio = torch.where((w > 0) & (u > 0), phi / u, torch.ones_like(w))
    return list(ratio.unbind())


class LAMB(DtypePreservingOptimizer):
    """LAMB (You et al. 2020); see the module docstring.

    Args:
        params: parameters or parameter groups (keys ``exclude_from_weight_decay`` and
            ``exclude_from_layer_adaptation`` may be set per group).
        lr: learning rate (default 1e-3).
        betas: (b1, b2) (default (0.9, 0.999)).
        eps: added to sqrt(v_hat) (default 1e-6, the paper's).
        weight_decay: decoupled decay coefficient lambda (default 0.01).
        bias_correction: divide m, v by 1 - b^t (Algorithm 2; default True).
        trust_clamp: (low, high) clamp of ||x|| in phi, or None for the identity.
        maximize: maximize the objective instead.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        trust_clamp: tuple[float, float] | None = None,
        exclude_from_weight_decay: bool | None = None,
        exclude_from_layer_adaptation: bool | None = None,
        maximize: bool = False,
    ) -> None:
        check_nonneg("lr", float(lr))
        check_beta("beta1", betas[0])
        check_beta("beta2", betas[1])
        check_nonneg("eps", eps)
        check_nonneg("weight_decay", weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clamp=trust_clamp,
                        exclude_from_weight_decay=exclude_from_weight_decay,
                        exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                        maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def state_nbytes(numel: int) -> int:
        """Exact state bytes for one parameter tensor: fp32 m and v."""
        return 8 * numel

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step over all parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._update_group(group, params)
        return loss

    def _update_group(self, group: dict[str, Any], params: list[Tensor]) -> None:
        b1, b2 = group["betas"]
        xs = [p if p.dtype == torch.float32 else p.float() for p in params]
        gs = []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("LAMB does not support sparse gradients")
            gs.append(p.grad.float())
        if group["maximize"]:
            gs = torch._foreach_neg(gs)
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = 0
                st["exp_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                st["exp_avg_sq"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["step"] += 1
            states.append(st)
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        torch._foreach_lerp_(m, gs, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, gs, gs, value=1.0 - b2)
        if group["bias_correction"]:
            bc1 = [1.0 / (1.0 - b1 ** s["step"]) for s in states]
            bc2 = [1.0 / math.sqrt(1.0 - b2 ** s["step"]) for s in states]
        else:
            bc1 = bc2 = [1.0] * len(states)
        denom = torch._foreach_sqrt(v)
        torch._foreach_mul_(denom, bc2)
        torch._foreach_add_(denom, group["eps"])
        r = torch._foreach_div(m, denom)
        torch._foreach_mul_(r, bc1)  # r = m_hat / (sqrt(v_hat) + eps)

        wd = group["weight_decay"]
        decay = [i for i, p in enumerate(params)
                 if wd != 0 and not excluded(group, "exclude_from_weight_decay", p)]
        if decay:
            torch._foreach_add_([r[i] for i in decay], [xs[i] for i in decay], alpha=wd)
        adapt = [i for i, p in enumerate(params)
                 if not excluded(group, "exclude_from_layer_adaptation", p)]
        if adapt:
            ratios = trust_ratios(torch._foreach_norm([xs[i] for i in adapt]),
                                  torch._foreach_norm([r[i] for i in adapt]), group["trust_clamp"])
            torch._foreach_mul_([r[i] for i in adapt], ratios)
        torch._foreach_add_(xs, r, alpha=-float(group["lr"]))
        for p, x in zip(params, xs):
            if x is not p:
                p.copy_(x)
