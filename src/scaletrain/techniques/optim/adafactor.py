"""Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost").

For a matrix G [n, m] the second moment is kept as its row and column means only
(Algorithm 4): ``R <- b2 R + (1-b2) mean_cols(G^2 + e1)``, ``C <- b2 C + (1-b2) mean_rows(G^2 + e1)``,
``V_hat = R C^T / mean(R)`` (the rank-1 KL-optimal factorisation of §3; means instead of the
paper's sums give the same V_hat), so the state is n + m floats instead of n*m. Then
  ``U = G / sqrt(V_hat)``, clipped ``U_hat = U / max(1, RMS(U)/d)`` (§5, update clipping),
  optional first moment ``M <- b1 M + (1-b1) U_hat`` (§7; off by default, as in the paper),
  ``X <- X - alpha_t U_hat`` (or ``M``) with the *relative step* (§8)
  ``alpha_t = max(e2, RMS(X_{t-1})) * rho_t``, ``rho_t = min(lr, 1/sqrt(t))`` and the increasing
  decay ``b2_t = 1 - t^decay_rate`` (§7.2, decay_rate = -0.8), which needs no bias correction.
Vectors (and every tensor when ``factored=False``) keep an unfactored V (Algorithm 5). Tensors
with more than two dims are factored over their last two dims (the others are batch dims).

Why not wrap ``torch.optim.Adafactor`` (torch 2.13): it matches the paper's relative step,
update clipping, parameter scaling and beta2 schedule, and with ``eps1 = 0`` it computes the
same update as this class (asserted in tests/test_optim.py), but it
  * has no first moment (the paper's optional b1), which the brief requires;
  * cannot turn off the relative step (``lr`` only caps rho_t) or the parameter scaling;
  * applies e1 as a clamp on V_hat and on sqrt(V_hat) instead of adding it to G^2 (§5, Alg. 4);
  * couples weight decay to ``lr`` (the cap of rho_t) rather than to the step actually taken.
So it is re-implemented here; the defaults reproduce the paper's recommended configuration.

State bytes (fp32, any parameter dtype): factored [..., n, m] -> 4 * batch * (n + m);
unfactored -> 4 * numel; plus 4 * numel when ``beta1`` is set. ``step`` is a Python int.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from scaletrain.techniques.optim._common import (
    DtypePreservingOptimizer, check_beta, check_nonneg, grad_fp32, rms,
)


def _factored_shapes(shape: torch.Size | tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the row and column statistics of a tensor factored over its last two dims."""
    *batch, n, m = shape
    return (*batch, n), (*batch, m)


class Adafactor(DtypePreservingOptimizer):
    """Adafactor as in Shazeer & Stern 2018 (see the module docstring for the algorithm).

    Args:
        params: parameters or parameter groups.
        lr: with ``relative_step`` (default) the cap of the relative step size
            rho_t = min(lr, 1/sqrt(t)) — the paper uses 1e-2, the default; without it, the
            constant step size (schedulers apply as usual).
        beta1: first-moment decay, or None for no first moment (paper default; saves n*m floats).
        decay_rate: exponent c of beta2_t = 1 - t^c (default -0.8).
        eps: (e1, e2): e1 = 1e-30 is added to G^2 (regularises V_hat), e2 = 1e-3 is the floor
            of the parameter scale RMS(X).
        clip_threshold: d of the update clipping (default 1.0).
        weight_decay: decoupled decay X <- X (1 - alpha_t * weight_decay), scaled by the step
            alpha_t actually taken (the paper has no weight decay).
        relative_step: use rho_t = min(lr, 1/sqrt(t)) (True) or the constant ``lr`` (False).
        scale_parameter: multiply the step by max(e2, RMS(X)) (§8).
        factored: factor the second moment of tensors with >= 2 dims.
        maximize: maximize the objective instead.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | None = None,
        beta1: float | None = None,
        decay_rate: float = -0.8,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        weight_decay: float = 0.0,
        *,
        relative_step: bool = True,
        scale_parameter: bool = True,
        factored: bool = True,
        maximize: bool = False,
    ) -> None:
        if lr is None:
            if not relative_step:
                raise ValueError("Adafactor: lr is required when relative_step=False")
            lr = 1e-2
        check_nonneg("lr", float(lr))
        if beta1 is not None:
            check_beta("beta1", beta1)
        if decay_rate > 0:
            raise ValueError(f"invalid decay_rate: {decay_rate} (must be <= 0)")
        check_nonneg("eps1", eps[0])
        check_nonneg("eps2", eps[1])
        if clip_threshold < 1.0:
            raise ValueError(f"invalid clip_threshold: {clip_threshold} (must be >= 1)")
        check_nonneg("weight_decay", weight_decay)
        defaults = dict(lr=lr, beta1=beta1, decay_rate=decay_rate, eps=tuple(eps),
                        clip_threshold=clip_threshold, weight_decay=weight_decay,
                        relative_step=relative_step, scale_parameter=scale_parameter,
                        factored=factored, maximize=maximize)
        super().__init__(params, defaults)

    # ---- cost face ---------------------------------------------------------------------
    @staticmethod
    def state_nbytes(shape: tuple[int, ...], beta1: float | None = None,
                     factored: bool = True) -> int:
        """Exact state bytes for one parameter of ``shape`` (fp32 statistics, any param dtype)."""
        numel = math.prod(shape)
        if factored and len(shape) >= 2:
            rows, cols = _factored_shapes(tuple(shape))
            second = math.prod(rows) + math.prod(cols)
        else:
            second = numel
        return 4 * (second + (numel if beta1 is not None else 0))

    # ---- apply face --------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adafactor step over all parameters that have a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(group, p)
        return loss

    def _init_state(self, group: dict[str, Any], p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = 0
        kw = dict(dtype=torch.float32, device=p.device)
        if group["factored"] and p.ndim >= 2:
            rows, cols = _factored_shapes(p.shape)
            state["exp_avg_sq_row"] = torch.zeros(rows, **kw)
            state["exp_avg_sq_col"] = torch.zeros(cols, **kw)
        else:
            state["exp_avg_sq"] = torch.zeros(p.shape, **kw)
        if group["beta1"] is not None:
            state["exp_avg"] = torch.zeros(p.shape, **kw)
        return state

    def _update(self, group: dict[str, Any], p: Tensor) -> None:
        state = self.state[p] or self._init_state(group, p)
        state["step"] += 1
        t = state["step"]
        eps1, eps2 = group["eps"]
        g = grad_fp32(p, group["maximize"])
        x = p if p.dtype == torch.float32 else p.float()

        rho = min(float(group["lr"]), 1.0 / math.sqrt(t)) if group["relative_step"] else float(group["lr"])
        # alpha_t stays a 0-d tensor: no host sync (and it runs under FakeTensorMode).
        if group["scale_parameter"]:
            alpha = rms(x).clamp(min=eps2) * rho
        else:
            alpha = torch.tensor(rho, device=p.device)
        one_minus_beta2 = t ** group["decay_rate"]  # 1 - beta2_t (= 1 at t = 1: V_1 = G^2)

        g2 = g * g + eps1
        if "exp_avg_sq_row" in state:
            row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
            row.lerp_(g2.mean(dim=-1), one_minus_beta2)
            col.lerp_(g2.mean(dim=-2), one_minus_beta2)
            # U = G / sqrt(R C^T / mean(R)) without materialising V_hat: two broadcast scalings.
            r_factor = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            c_factor = col.rsqrt().unsqueeze(-2)
            update = g * r_factor * c_factor
        else:
            v = state["exp_avg_sq"]
            v.lerp_(g2, one_minus_beta2)
            update = g * v.rsqrt()
        del g2
        update.div_((rms(update) / group["clip_threshold"]).clamp(min=1.0))  # U_hat (§5)
        if group["beta1"] is not None:
            m = state["exp_avg"]
            m.lerp_(update, 1.0 - group["beta1"])
            step_dir = m * alpha
        else:
            step_dir = update.mul_(alpha)
        if group["weight_decay"] != 0:
            x.mul_(1.0 - alpha * group["weight_decay"])
        x.sub_(step_dir)
        if x is not p:
            p.copy_(x)
