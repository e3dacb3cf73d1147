"""Expert parallelism (GShard, Lepikhin et al. 2020; Switch, Fedus et al. 2021): the E experts
of every MoE layer are split over ``parallel.ep`` ranks (E/ep each); tokens travel to their
experts' rank and back by two all-to-alls.

Each EP rank has its *own* tokens (EP runs inside the data-parallel group). Per MoE layer and
micro-batch, on each rank:

1. route the local T tokens (router replicated): top-k experts, gates, capacity
   ``ceil(cf · k · T / E)`` per expert, slots in priority order (:mod:`scaletrain.models.moe`);
2. **dispatch**: scatter tokens into a buffer [E, cap, h]; its experts are ordered by owner, so
   it is [ep, E/ep, cap, h] and one ``all_to_all_single`` with equal splits sends block j to
   rank j, which receives [ep (source), E/ep, cap, h];
3. run the local experts on [E/ep, ep·cap, h];
4. **combine**: the reverse all-to-all returns [E, cap, h] of outputs for this rank's tokens,
   gathered back per token and weighted by the gates.

The backward of each all-to-all is the reverse all-to-all of the gradients. The Switch
load-balancing statistics (f_e, P_e) are averaged over the EP group before forming the loss
(P_e with a differentiable all-reduce), so the auxiliary loss is the global batch's, as on one
device.

Gradients: non-expert parameters are replicated — average them over the data-parallel group as
usual. An expert's gradient already sums every EP rank's tokens' contributions (through the
all-to-all backward), so it is summed over the ranks holding the *same* experts (the
"expert-data-parallel" group, size dp/ep) and divided by the full data-parallel size:
:func:`reduce_gradients` does both. DDP must not touch expert parameters (:func:`expert_params`).
"""

from __future__ import annotations

import types
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.errors import UserError
from scaletrain.models.moe import (
    MoEFeedForward,
    assign_slots,
    capacity,
    combine,
    dispatch,
    load_balance_stats,
    switch_aux_loss,
    top_k_route,
)

_EXPERT_FLAG = "_scaletrain_expert_parallel"


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all along dim 0 whose backward is the same all-to-all of the grads."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous()
        out = torch.empty_like(g)
        dist.all_to_all_single(out, g, group=ctx.group)
        return out, None


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; backward sums the gradients (each rank's loss uses the sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _AllToAll.apply(x, group)


def _ep_moe_forward(self: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    group, ep, E = self._ep_group, self._ep_size, self.n_experts
    b, s, h = x.shape
    T = b * s
    xf = x.reshape(T, h)
    idx, gates, probs = top_k_route(self.router(xf), self.top_k)
    cap = capacity(T, E, self.top_k, self.capacity_factor)
    slots = assign_slots(idx, E, cap)
    self._dropped = (slots < 0).sum()
    f, p = load_balance_stats(idx, probs, E)
    f = f.clone()
    aux_group = self._aux_group
    if aux_group is None:  # this rank's tokens only (per micro-batch, as Megatron's default)
        self.aux_loss = switch_aux_loss(f, p)
    else:
        n_aux = dist.get_world_size(aux_group)
        dist.all_reduce(f, group=aux_group)  # no gradient flows through f (Switch: it counts choices)
        self.aux_loss = switch_aux_loss(f / n_aux, _AllReduceSum.apply(p, aux_group) / n_aux)
    buf = dispatch(xf, idx, slots, E, cap).view(ep, E // ep, cap, h)  # [dest rank, local expert, cap, h]
    recv = all_to_all(buf, group)  # [source rank, my experts, cap, h]
    out = self.experts(recv.transpose(0, 1).reshape(E // ep, ep * cap, h))
    back = all_to_all(out.view(E // ep, ep, cap, h).transpose(0, 1), group)  # [owner rank, its experts, cap, h]
    return self.drop(combine(back.reshape(E, cap, h), idx, slots, gates, T).view(b, s, h))


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh, aux_group: dist.ProcessGroup | None = None
                          ) -> nn.Module:
    """Keep only this rank's E/ep experts of every MoE layer and route through all-to-alls.

    ``ep_mesh``: 1-D mesh of the EP group (a sub-mesh of the data-parallel ranks). Every rank
    must start from the same weights; rank r keeps experts r·E/ep ... (r+1)·E/ep - 1.
    ``aux_group``: the ranks whose tokens the load-balancing statistics are averaged over
    (default the EP group; the whole data-parallel × CP group gives the global batch's loss,
    exactly as on one device — 2·E floats per MoE layer, negligible). With ep = 1 this still
    applies (no experts move; only the statistics are shared), e.g. under context parallelism.
    """
    group = ep_mesh.get_group()
    return shard_experts(model, group, rank=ep_mesh.get_local_rank(), size=ep_mesh.size(),
                         aux_group=aux_group if aux_group is not None else group)


def shard_experts(model: nn.Module, group: dist.ProcessGroup | None, *, rank: int, size: int,
                  aux_group: dist.ProcessGroup | None) -> nn.Module:
    """:func:`apply_expert_parallel` over a process group: rank ``rank`` of ``size`` keeps experts
    rank·E/size ... (rank+1)·E/size - 1. ``aux_group`` None: each rank's load-balancing loss from
    its own tokens (a pipeline's per-micro-batch loss)."""
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    if not layers:
        raise UserError(f"parallel.ep needs a model with mixture-of-experts layers (e.g. gpt2-moe); "
                        f"{type(model).__name__} has none")
    ep = size
    for moe in layers:
        if moe.n_experts % ep:
            raise UserError(f"parallel.ep={ep} must divide the number of experts ({moe.n_experts})")
        n = moe.n_experts // ep
        for name, p in list(moe.experts.named_parameters()):
            local = nn.Parameter(p.detach()[rank * n:(rank + 1) * n].clone(), requires_grad=p.requires_grad)
            setattr(local, _EXPERT_FLAG, True)
            moe.experts.register_parameter(name, local)
        moe._ep_group, moe._ep_size, moe._ep_rank = group, ep, rank
        moe._aux_group = aux_group
        moe.forward = types.MethodType(_ep_moe_forward, moe)
    return model


def is_expert_param(p: torch.Tensor) -> bool:
    """True for a parameter holding this rank's slice of the experts (made by :func:`apply_expert_parallel`)."""
    return bool(getattr(p, _EXPERT_FLAG, False))


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters sharded by expert parallelism (to exclude from the plain DP all-reduce)."""
    return [p for p in model.parameters() if getattr(p, _EXPERT_FLAG, False)]


def _flat_all_reduce(grads: list[torch.Tensor], group: dist.ProcessGroup | None, scale: float) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(flat, group=group)
    flat *= scale
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def reduce_gradients(model: nn.Module, dp_group: dist.ProcessGroup,
                     expert_dp_group: dist.ProcessGroup | None = None) -> None:
    """Data-parallel gradient reduction of an expert-parallel model.

    Non-expert gradients: mean over ``dp_group``. Expert gradients: sum over
    ``expert_dp_group`` (ranks holding the same experts; ``None`` when dp == ep) divided by the
    data-parallel size D — each already holds the sum over its EP group's tokens.
    """
    D = dist.get_world_size(dp_group)
    experts = {id(p) for p in expert_params(model)}
    dense = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in experts]
    sparse = [p.grad for p in model.parameters() if p.grad is not None and id(p) in experts]
    _flat_all_reduce(dense, dp_group, 1.0 / D)
    _flat_all_reduce(sparse, expert_dp_group, 1.0 / D)


def gather_expert_state(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, torch.Tensor]:
    """The single-device state dict: every expert tensor all-gathered over the EP group."""
    group = ep_mesh.get_group()
    out: dict[str, torch.Tensor] = {}
    for name, v in model.state_dict().items():
        mod_name, _, pname = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = getattr(mod, pname, None)
        if getattr(p, _EXPERT_FLAG, False):
            parts = [torch.empty_like(v) for _ in range(ep_mesh.size())]
            dist.all_gather(parts, v.contiguous(), group=group)
            v = torch.cat(parts)
        out[name] = v.detach().clone()
    return out


# --------------------------------------------------------------------------- cost face


def ep_comm_bytes_per_step(n_moe_layers: int, tokens: int, n_embd: int, n_experts: int, top_k: int,
                           capacity_factor: float, ep: int, *, act_bytes: int = 4,
                           shared_aux: bool = True) -> dict[str, Any]:
    """All-to-alls of one EP rank per micro-batch of ``tokens`` local tokens (forward+backward).

    Per MoE layer: dispatch and combine in the forward, their transposes in the backward — 4
    all-to-alls of the buffer E·cap·h·act_bytes, of which (ep-1)/ep leaves the rank; plus the
    load-balancing statistics: 2 all-reduces of E fp32 in the forward, 1 in the backward
    (``shared_aux``; none when each rank's loss is its own, as inside pipeline stages).
    """
    cap = capacity(tokens, n_experts, top_k, capacity_factor)
    buf = n_experts * cap * n_embd * act_bytes
    a2a = 4 * n_moe_layers
    ar = 3 * n_moe_layers if shared_aux else 0
    f = (ep - 1) / ep
    return {"all_to_all": {"count": a2a, "payload_bytes": a2a * buf},
            "all_reduce": {"count": ar, "payload_bytes": ar * n_experts * 4},
            "wire_bytes": f * a2a * buf + 2 * f * ar * n_experts * 4}


def expert_param_ids(model: nn.Module) -> set[int]:
    """ids of every mixture-of-experts layer's expert parameters (what expert parallelism slices)."""
    return {id(q) for m in model.modules() if isinstance(m, MoEFeedForward) for q in m.experts.parameters()}


def ep_param_elements(model_or_layers: nn.Module | Iterable[MoEFeedForward], ep: int) -> dict[str, int]:
    """Parameter elements per EP rank: experts / ep + everything else."""
    mods = model_or_layers.modules() if isinstance(model_or_layers, nn.Module) else model_or_layers
    layers = [m for m in mods if isinstance(m, MoEFeedForward)]
    expert = sum(p.numel() for m in layers for p in m.experts.parameters())
    total = sum(p.numel() for p in model_or_layers.parameters()) if isinstance(model_or_layers, nn.Module) else expert
    return {"experts": expert // ep, "other": total - expert, "total": total - expert + expert // ep}
