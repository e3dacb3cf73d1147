"""Zero-order training: MeZO's SPSA estimator (Malladi et al., "Fine-Tuning Language Models with Just
Forward Passes", NeurIPS 2023, Algorithm 1; DeepZero, Chen et al. 2024, the same estimator).

Per optimizer step k a seed s_k is drawn from the run's seed and k; z ~ N(0, I) over all parameters is
*regenerated* from s_k whenever needed and never stored. For each micro-batch:

1. θ += ε·z, loss L+ (forward only, no autograd graph);
2. θ −= 2ε·z, loss L−;
3. θ += ε·z (θ restored up to rounding, as in MeZO);
4. projected gradient g += (L+ − L−) / (2ε) · weight (the micro-batch's share of the step's mean loss: with
   the same z for every micro-batch, gradient accumulation averages the projections).

:meth:`ZOSGD.step` then regenerates z once more and updates θ −= lr·(g·z + wd·θ). No backward pass, no
gradient, no optimizer state: the step's memory is inference memory plus one parameter-sized z
tensor at a time. :class:`ZOAdam` (``zo-adam``) runs Adam on the estimate g·z instead, at 8 bytes of
state per parameter. Units: ε and lr in parameter units; seconds nowhere.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch._subclasses.fake_tensor import FakeTensor

ZERO_ORDER = ("zo-sgd", "zo-adam")
"""Optimizer names (``optim.name``) that train without a backward pass."""


def is_zero_order(name: str) -> bool:
    """Whether ``optim.name`` is a zero-order optimizer (the stack runs two forwards, no backward)."""
    return isinstance(name, str) and name.lower() in ZERO_ORDER


class ZOSGD(torch.optim.Optimizer):
    """MeZO's ZO-SGD (module docstring). ``perturbation``: ε (MeZO: 1e-3); ``seed``: base of
    the per-step seeds (same seed, same data → the same trajectory). The step counter lives in the
    first parameter group (``zo_step``) so that a checkpoint carries it."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-6, perturbation: float = 1e-3, weight_decay: float = 0.0,
                 seed: int = 0, **defaults: Any) -> None:
        if lr <= 0 or perturbation <= 0 or weight_decay < 0:
            raise ValueError(f"lr and perturbation must be > 0 and weight_decay >= 0 "
                             f"(got {lr}, {perturbation}, {weight_decay})")
        super().__init__(params, dict(lr=lr, perturbation=perturbation, weight_decay=weight_decay, **defaults))
        self.param_groups[0].setdefault("zo_step", 0)
        self.param_groups[0].setdefault("zo_seed", int(seed))
        self.projected = 0.0
        """Σ over this step's micro-batches of weight · (L+ − L−) / (2ε)."""

    def _seed(self) -> int:
        g = self.param_groups[0]
        return (int(g["zo_seed"]) * 1_000_003 + int(g["zo_step"])) % (2**63 - 1)

    @torch.no_grad()
    def _walk(self, fn: Callable[[torch.Tensor, torch.Tensor, dict], None]) -> None:
        """Call ``fn(param, z, group)`` for every parameter, z regenerated from this step's seed in
        parameter order (one z tensor alive at a time)."""
        gens: dict[torch.device, torch.Generator] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.device not in gens:
                    gens[p.device] = torch.Generator(device=p.device).manual_seed(self._seed())
                z = torch.randn(p.shape, generator=gens[p.device], device=p.device, dtype=p.dtype)
                fn(p, z, group)

    def perturb(self, scale: float) -> None:
        """θ += scale·ε·z (z of this step)."""
        self._walk(lambda p, z, g: p.add_(z, alpha=scale * g["perturbation"]))

    @torch.no_grad()
    def estimate(self, loss_of: Callable[[], torch.Tensor], weight: float = 1.0) -> torch.Tensor:
        """Two forwards of ``loss_of`` at θ ± ε·z; adds weight · (L+ − L−)/(2ε) to :attr:`projected`
        and returns the mean of the two losses (the micro-batch's loss at θ, to second order)."""
        eps = self.param_groups[0]["perturbation"]
        self.perturb(+1.0)
        plus = loss_of().detach().float()
        self.perturb(-2.0)
        minus = loss_of().detach().float()
        self.perturb(+1.0)
        if not isinstance(plus, FakeTensor):  # fake tensors (the estimator's traced step) have no values
            self.projected += weight * float(plus - minus) / (2 * eps)
        return (plus + minus) / 2

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """θ −= lr·(g·z + wd·θ) with this step's z regenerated; then the next step's seed."""
        g_proj = self.projected

        def update(p: torch.Tensor, z: torch.Tensor, group: dict) -> None:
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            self._update(p, z, g_proj, group)

        self._walk(update)
        self.projected = 0.0
        self.param_groups[0]["zo_step"] += 1

    def _update(self, p: torch.Tensor, z: torch.Tensor, g_proj: float, group: dict) -> None:
        """SGD along z: θ −= lr·g·z."""
        p.add_(z, alpha=-group["lr"] * g_proj)


class ZOAdam(ZOSGD):
    """Zero-order Adam (MeZO's appendix variant): Adam's moments over the SPSA gradient estimate ĝ = g·z
    (``betas``, ``eps`` as Adam's), so it keeps 8 bytes of state per parameter (no gradients, no saved
    activations still). ``perturbation``, ``seed``: as :class:`ZOSGD`."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-4, perturbation: float = 1e-3,
                 weight_decay: float = 0.0, seed: int = 0, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1) or eps < 0:
            raise ValueError(f"betas must be in [0, 1) and eps >= 0 (got {betas}, {eps})")
        super().__init__(params, lr, perturbation, weight_decay, seed, betas=tuple(betas), eps=eps)

    @staticmethod
    def state_nbytes(numel: int, element_size: int = 4) -> int:
        """exp_avg and exp_avg_sq in the parameter dtype."""
        return 2 * numel * element_size

    def _update(self, p: torch.Tensor, z: torch.Tensor, g_proj: float, group: dict) -> None:
        st = self.state[p]
        if not st:
            st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        b1, b2 = group["betas"]
        k = int(self.param_groups[0]["zo_step"]) + 1
        z.mul_(g_proj)  # ĝ, in place: z is regenerated, never needed again this step
        st["exp_avg"].lerp_(z, 1 - b1)
        st["exp_avg_sq"].mul_(b2).addcmul_(z, z, value=1 - b2)
        denom = (st["exp_avg_sq"] / (1 - b2**k)).sqrt_().add_(group["eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-group["lr"] / (1 - b1**k))


def forward_backward(model_forward: Callable[[torch.Tensor], torch.Tensor], ctx: Any
                     ) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """The per-micro-batch function of a zero-order run (the stack's step 6): two forwards through
    ``model_forward`` under ``ctx``'s autocast, no backward; the estimate accumulates in the run's
    optimizer (``ctx.optimizer``, a :class:`ZOSGD` or :class:`ZOAdam`), which the trainer's
    ``optimizer.step`` applies."""

    def fb(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:
        def loss_of() -> torch.Tensor:
            with ctx.autocast():
                return ctx.loss_fn(model_forward(x), y)

        return ctx.optimizer.estimate(loss_of, weight)

    return fb
