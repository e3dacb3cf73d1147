"""Mixture-of-experts feed-forward (Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021) and ``gpt2-moe``: GPT-2 with every ``moe_every``-th MLP replaced by
one. Plain PyTorch: nothing here knows about expert parallelism (that lives in
:mod:`scaletrain.techniques.experts`, which reuses the routing functions below).

Routing, per token: router logits -> softmax probabilities over E experts -> the top-k experts;
their gates are the probabilities, renormalised to sum to 1 when k > 1 (GShard). Each expert
processes at most ``capacity = ceil(capacity_factor · k · T / E)`` of the T tokens of a forward
(GShard's expert capacity); slots are given in priority order — every token's first choice
before any second choice, tokens in order within a choice — and a choice past capacity is
dropped (that token gets no output from that expert; the residual connection carries it).

Load balancing (Switch eq. 4): ``aux = E · Σ_e f_e · P_e`` with f_e the fraction of the T·k
choices routed to expert e (before capacity) and P_e the mean router probability of e; it is 1
for a uniform router. The model's :meth:`GPT2MoE.aux_loss` returns ``aux_loss_coef`` times the
sum over MoE layers of the last forward; add it to the training loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.models.gpt2.model import GPT2, GPT2Config


@dataclass
class GPT2MoEConfig(GPT2Config):
    n_experts: int = 4
    """Experts E per MoE layer."""
    top_k: int = 2
    """Experts each token is sent to."""
    capacity_factor: float = 1.25
    """Expert capacity as a multiple of the even share k·T/E of a forward's T tokens."""
    moe_every: int = 2
    """Every moe_every-th block (1-based: blocks moe_every-1, 2·moe_every-1, ...) gets a MoE MLP."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss (Switch Transformer uses 0.01)."""


# --------------------------------------------------------------------------- routing (pure functions)


def top_k_route(logits: torch.Tensor, k: int,
                normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (expert ids [T, k], gates [T, k], probabilities [T, E]), fp32."""
    probs = torch.softmax(logits.float(), dim=-1)
    gates, idx = torch.topk(probs, k, dim=-1)
    if normalize and k > 1:
        gates = gates / gates.sum(-1, keepdim=True)
    return idx, gates, probs


def capacity(tokens: int, n_experts: int, k: int, capacity_factor: float) -> int:
    """Slots per expert for ``tokens`` tokens (GShard): ceil(cf · k · T / E)."""
    return max(1, math.ceil(capacity_factor * k * tokens / n_experts))


def assign_slots(idx: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """Slot of each (token, choice) in its expert's buffer, or -1 when past capacity.

    idx: [T, k]. Priority: all first choices (in token order), then all second choices, ...
    """
    T, k = idx.shape
    order = idx.t().reshape(-1)  # [k*T], choice-major
    onehot = F.one_hot(order, n_experts)  # [k*T, E]
    pos = (onehot.cumsum(0) - 1).gather(1, order.unsqueeze(1)).squeeze(1)  # position within expert
    pos = torch.where(pos < cap, pos, torch.full_like(pos, -1))
    return pos.view(k, T).t()  # [T, k]


def load_balance_stats(idx: torch.Tensor, probs: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(f [E]: fraction of choices per expert, no gradient; P [E]: mean router probability)."""
    flat = idx.reshape(-1)  # scatter_add, not bincount: the output shape must not depend on the values
    counts = torch.zeros(n_experts, dtype=torch.float32, device=idx.device).scatter_add_(
        0, flat, torch.ones(flat.shape, dtype=torch.float32, device=idx.device))
    return counts / idx.numel(), probs.mean(0)


def switch_aux_loss(f: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Switch Transformer load-balancing loss E · Σ f_e P_e (1.0 when balanced)."""
    return f.numel() * torch.sum(f * p)


def moe_aux_loss(module: nn.Module, coef: float) -> torch.Tensor | None:
    """``coef`` x the summed load-balancing loss of the last forward of every MoE layer inside
    ``module`` (a whole model or any part of it, e.g. one pipeline stage); None when it has none."""
    losses = [m.aux_loss for m in module.modules() if isinstance(m, MoEFeedForward) and m.aux_loss is not None]
    return coef * torch.stack(losses).sum() if losses else None


# Every (token, choice) is moved, a dropped one to (or from) one spare row past the E·cap slots, so
# every shape is static (meta / fake tensors, compile) and the kept values are bitwise those of a
# masked gather: each slot receives exactly one token, and a dropped choice adds 0 · value.


def _flat_slots(idx: torch.Tensor, slots: torch.Tensor, cap: int, spare: int) -> torch.Tensor:
    """Row of each (token, choice) in the flat [E·cap] buffer, ``spare`` for a dropped one: [T·k]."""
    return torch.where(slots >= 0, idx * cap + slots, torch.full_like(slots, spare)).reshape(-1)


def dispatch(x: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor, n_experts: int, cap: int) -> torch.Tensor:
    """Tokens x [T, h] into expert buffers [E, cap, h] (empty slots are zeros)."""
    T, k = idx.shape
    dest = _flat_slots(idx, slots, cap, n_experts * cap)
    src = x.repeat_interleave(k, dim=0)  # row t·k + j is token t (its choice j)
    buf = x.new_zeros(n_experts * cap + 1, x.shape[-1]).index_add(0, dest, src)
    return buf[:-1].view(n_experts, cap, x.shape[-1])


def combine(buf: torch.Tensor, idx: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor, T: int) -> torch.Tensor:
    """Expert outputs [E, cap, h] back to tokens [T, h], weighted by the gates."""
    E, cap, h = buf.shape
    k = idx.shape[1]
    src = _flat_slots(idx, slots, cap, 0)  # a dropped choice reads row 0, weighted 0
    w = torch.where(slots >= 0, gates, torch.zeros_like(gates)).reshape(-1, 1).to(buf.dtype)
    tok = torch.arange(T, device=buf.device).repeat_interleave(k)
    return buf.new_zeros(T, h).index_add(0, tok, buf.reshape(E * cap, h)[src] * w)


# --------------------------------------------------------------------------- modules


class Experts(nn.Module):
    """E independent GELU MLPs (h -> f -> h) applied batched: x [E, n, h] -> [E, n, h]."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.b1 = nn.Parameter(torch.zeros(n_experts, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, n_embd))
        self.b2 = nn.Parameter(torch.zeros(n_experts, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hid = F.gelu(torch.baddbmm(self.b1.unsqueeze(1), x, self.w1), approximate="tanh")
        return torch.baddbmm(self.b2.unsqueeze(1), hid, self.w2)


class MoEFeedForward(nn.Module):
    """Top-k routed experts in place of the MLP: [b, s, h] -> [b, s, h].

    After each forward, ``self.aux_loss`` holds this layer's Switch load-balancing loss and
    ``self.dropped`` the number of (token, choice) pairs dropped for capacity.
    """

    def __init__(self, cfg: GPT2MoEConfig):
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = cfg.n_experts, cfg.top_k, cfg.capacity_factor
        if not 1 <= cfg.top_k <= cfg.n_experts:
            raise ValueError(f"top_k={cfg.top_k} must be between 1 and n_experts={cfg.n_experts}")
        self.router = nn.Linear(cfg.n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.n_embd, 4 * cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.aux_loss: torch.Tensor | None = None
        self._dropped: torch.Tensor | None = None

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``, the estimator's fake copy, pickling) drop the last forward's
        loss and count: the loss is a non-leaf tensor, which torch refuses to deep-copy."""
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        return {**state, "aux_loss": None, "_dropped": None}

    @property
    def dropped(self) -> int:
        """(token, choice) pairs of the last forward dropped for capacity (kept as a tensor until
        asked, so a meta / fake forward never needs its value)."""
        return 0 if self._dropped is None else int(self._dropped)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        xf = x.reshape(b * s, h)
        idx, gates, probs = top_k_route(self.router(xf), self.top_k)
        cap = capacity(b * s, self.n_experts, self.top_k, self.capacity_factor)
        slots = assign_slots(idx, self.n_experts, cap)
        self._dropped = (slots < 0).sum()
        self.aux_loss = switch_aux_loss(*load_balance_stats(idx, probs, self.n_experts))
        out = self.experts(dispatch(xf, idx, slots, self.n_experts, cap))  # [E, cap, h]
        return self.drop(combine(out, idx, slots, gates, b * s).view(b, s, h))


class GPT2MoE(GPT2):
    """GPT-2 whose every ``moe_every``-th block has a :class:`MoEFeedForward` MLP."""

    def __init__(self, cfg: GPT2MoEConfig):
        super().__init__(cfg)
        for i, block in enumerate(self.h):
            if (i + 1) % cfg.moe_every == 0:
                block.mlp = MoEFeedForward(cfg)
                e = block.mlp.experts
                nn.init.normal_(e.w1, std=0.02)
                nn.init.normal_(e.w2, std=0.02 / (2 * cfg.n_layer) ** 0.5)  # as the dense c_proj
                nn.init.normal_(block.mlp.router.weight, std=0.02)

    def moe_layers(self) -> list[MoEFeedForward]:
        return [b.mlp for b in self.h if isinstance(b.mlp, MoEFeedForward)]

    def aux_loss(self, part: nn.Module | None = None) -> torch.Tensor | None:
        """``aux_loss_coef`` x the summed load-balancing loss of the last forward (add to the loss):
        of the whole model (zero when no MoE layer ran), or of the MoE layers inside ``part`` — a
        piece of this model, e.g. one pipeline stage's blocks — None when it holds none."""
        aux = moe_aux_loss(self if part is None else part, self.config.aux_loss_coef)
        return torch.zeros(()) if aux is None and part is None else aux
