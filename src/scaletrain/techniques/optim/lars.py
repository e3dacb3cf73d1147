"""LARS: layer-wise adaptive rate scaling (You, Gitman & Ginsburg 2017, arXiv 1708.03888).

Algorithm 1 of the paper, per parameter tensor ("layer") w with gradient g:
  local_lr = eta * ||w|| / (||g|| + beta * ||w|| + eps)     (trust coefficient eta = 0.001)
  v = mu * v + lr * local_lr * (g + beta * w)              (momentum mu, weight decay beta)
  w = w - v
The global learning rate sits inside the momentum buffer, as in the paper (torch.optim.SGD keeps
it outside; the two agree for a constant lr). local_lr is 1 when ||w|| or ||g|| is 0 (a
zero-initialised layer would otherwise never move).

Exclusions (as for LAMB, ``_common.excluded``): 1-D parameters — biases and BatchNorm/LayerNorm
gains and offsets — get no weight decay and local_lr = 1 (plain SGD with momentum); the
large-batch ImageNet recipes that use LARS (You et al. 2017; Goyal et al. 2017 for the linear
scaling rule) exclude them. Override per group with ``exclude_from_weight_decay`` /
``exclude_from_layer_adaptation``.

Nesterov momentum (``nesterov=True``, as ``torch.optim.SGD`` and the LARS wrappers over it offer):
the step is ``mu * v + lr * local_lr * (g + beta * w)`` with v already updated — the look-ahead
of Sutskever et al. 2013 in SGD's form.

State: fp32 momentum buffer (4 bytes/parameter) when momentum > 0, none otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scaletrain.techniques.optim._common import DtypePreservingOptimizer, check_nonneg, excluded


def lars_local_lrs(w_norms: list[Tensor], g_norms: list[Tensor], eta: float, beta: list[float],
                   eps: float) -> list[Tensor]:
    """eta ||w|| / (||g|| + beta ||w|| + eps) per tensor, 1 where a norm is 0 (0-d tensors)."""
    if not w_norms:
        return []
    w = torch.stack(w_norms)
    g = torch.stack(g_norms)
    b = torch.tensor(beta, dtype=w.dtype, device=w.device)
    local = eta * w / (g + b * w + eps)
    return list(torch.where((w > 0) & (g > 0), local, torch.ones_like(w)).unbind())


class LARS(DtypePreservingOptimizer):
    """LARS (You et al. 2017); see the module docstring.

    Args:
        params: parameters or parameter groups (keys ``exclude_from_weight_decay`` and
            ``exclude_from_layer_adaptation`` may be set per group).
        lr: global learning rate gamma (required in spirit; default 0.1).
        momentum: mu (default 0.9).
        weight_decay: beta (default 5e-4, the paper's ImageNet setting).
        trust_coefficient: eta (default 0.001).
        eps: added to the local-lr denominator (default 0).
        nesterov: Nesterov momentum (default False; needs momentum > 0).
        maximize: maximize the objective instead.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 5e-4,
        *,
        trust_coefficient: float = 1e-3,
        eps: float = 0.0,
        exclude_from_weight_decay: bool | None = None,
        exclude_from_layer_adaptation: bool | None = None,
        nesterov: bool = False,
        maximize: bool = False,
    ) -> None:
        check_nonneg("lr", float(lr))
        check_nonneg("momentum", momentum)
        check_nonneg("weight_decay", weight_decay)
        check_nonneg("trust_coefficient", trust_coefficient)
        check_nonneg("eps", eps)
        if nesterov and momentum <= 0:
            raise ValueError("LARS: nesterov needs momentum > 0")
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
                        exclude_from_weight_decay=exclude_from_weight_decay,
                        exclude_from_layer_adaptation=exclude_from_layer_adaptation,
                        maximize=maximize)
        super().__init__(params, defaults)

    @staticmethod
    def state_nbytes(numel: int, momentum: float = 0.9) -> int:
        """Exact state bytes for one parameter tensor: an fp32 momentum buffer if momentum > 0."""
        return 4 * numel if momentum > 0 else 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LARS step over all parameters that have a gradient."""
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
        xs = [p if p.dtype == torch.float32 else p.float() for p in params]
        gs = []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("LARS does not support sparse gradients")
            gs.append(p.grad.float())
        if group["maximize"]:
            gs = torch._foreach_neg(gs)
        wd = group["weight_decay"]
        betas = [0.0 if excluded(group, "exclude_from_weight_decay", p) else wd for p in params]
        adapt = [i for i, p in enumerate(params)
                 if not excluded(group, "exclude_from_layer_adaptation", p)]
        scale: list[Any] = [float(group["lr"])] * len(params)
        if adapt:
            w_norms = torch._foreach_norm([xs[i] for i in adapt])
            g_norms = torch._foreach_norm([gs[i] for i in adapt])
            local = lars_local_lrs(w_norms, g_norms, group["trust_coefficient"],
                                   [betas[i] for i in adapt], group["eps"])
            for i, lr_i in zip(adapt, local):
                scale[i] = lr_i * float(group["lr"])
        # d = g + beta * w  (only where beta != 0)
        d = [torch.add(g, x, alpha=b) if b != 0 else g for g, x, b in zip(gs, xs, betas)]
        d = [di * s for di, s in zip(d, scale)]  # lr * local_lr * (g + beta w)
        mu = group["momentum"]
        if mu > 0:
            bufs = []
            for p, di in zip(params, d):
                st = self.state[p]
                if "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                bufs.append(st["momentum_buffer"])
            torch._foreach_mul_(bufs, mu)
            torch._foreach_add_(bufs, d)
            d = torch._foreach_add(d, bufs, alpha=mu) if group.get("nesterov", False) else bufs
        torch._foreach_sub_(xs, d)
        for p, x in zip(params, xs):
            if x is not p:
                p.copy_(x)
