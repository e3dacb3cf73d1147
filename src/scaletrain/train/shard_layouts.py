"""Each runtime's local tensors as :class:`~scaletrain.train.shards.View` s of the single-process state.

Three families cover every runtime that can write sharded checkpoints:

- whole-model runtimes (one process, DDP): every tensor is whole (DDP's replicas are split by
  :func:`~scaletrain.train.shards.assign`);
- :class:`~scaletrain.techniques.spmd.MeshRuntime` (ZeRO-1/2 owned rows, FSDP2 shards, TP / CP / EP
  DTensors and expert slices): the optimizer's proxies are the unit;
- :class:`~scaletrain.techniques.pipeline.strategy.PipelineStrategy`: this rank's stages only (TP
  shards inside them; ZeRO-1 owned rows for the optimizer; ZeRO-3's FSDP2 shards, DTensors like TP's).

Runtimes whose state is not a set of parameter-shaped pieces (the offload runtime's host/disk
states, 16-bit parameters with separate masters on one process, 8-bit or factored optimizer
states) are refused by :func:`unsupported`, and the trainer writes them consolidated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from scaletrain.train.shards import View, canonical_groups, canonical_names, local_of, view_of


@dataclass
class Layout:
    """What this rank holds: model values, and for each optimizer parameter its name and view."""

    values: list[tuple[View, torch.Tensor]] = field(default_factory=list)
    optim: dict[int, tuple[str, View]] = field(default_factory=dict)
    """id(optimizer parameter) -> (canonical parameter name, view of its state tensors)."""
    aliases: dict[str, str] = field(default_factory=dict)
    """Tied parameters' other names -> the canonical name."""


def unsupported(rt: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """Why this rank's state cannot be written as sharded pieces (None: it can). Every rank must
    agree: the caller takes the reason of any rank."""
    kind = type(rt).__name__
    if kind == "OffloadStrategy":
        return "the offload runtime keeps parameters and optimizer states on the host/disk in its own layout"
    if kind == "MasterWeightsStrategy":
        return "16-bit parameters with fp32 masters on one process"
    if getattr(getattr(rt, "sync", None), "offload", False):
        return "ZeRO-Offload keeps its masters and states on the host"
    if kind not in ("Strategy", "DDPStrategy", "MeshRuntime", "PipelineStrategy"):
        return f"runtime {kind} has no sharded layout"
    try:
        lay = layout(rt, optimizer)
    except (KeyError, AttributeError) as e:
        return f"runtime {kind}: {type(e).__name__} {e}"
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in lay.optim:
                return "an optimizer parameter that is not a model parameter"
            for k, v in optimizer.state.get(p, {}).items():
                if torch.is_tensor(v) and v.ndim > 0 and tuple(local_of(v).shape) != tuple(local_of(p).shape):
                    return (f"optimizer state {k!r} of shape {tuple(local_of(v).shape)} is not shaped like its "
                            f"parameter (8-bit or factored states)")
    return None


def layout(rt: Any, optimizer: torch.optim.Optimizer) -> Layout:
    """The :class:`Layout` of runtime ``rt`` (see the module docstring)."""
    kind = type(rt).__name__
    if kind == "MeshRuntime":
        return _mesh(rt)
    if kind == "PipelineStrategy":
        return _pipeline(rt)
    return _whole(rt.model, optimizer)


def _buffers(model: nn.Module, lay: Layout, tp: int, keep: set[int] | None = None) -> None:
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    for n, t in model.state_dict(keep_vars=True).items():
        if n in params or (keep is not None and id(t) not in keep):
            continue
        lay.values.append((view_of(model, n, t, tp), local_of(t)))


def _whole(model: nn.Module, optimizer: torch.optim.Optimizer) -> Layout:
    first, aliases = canonical_names(model)
    lay = Layout(aliases=aliases)
    for p in model.parameters():
        v = view_of(model, first[id(p)], p, 1)
        lay.values.append((v, p.data))
        lay.optim[id(p)] = (first[id(p)], v)
    _buffers(model, lay, 1)
    return lay


def _mesh(rt: Any) -> Layout:
    from scaletrain.techniques.experts import is_expert_param

    model, mp = rt.model, rt.mp
    _, aliases = canonical_names(model)
    lay = Layout(aliases=aliases)
    er = (mp.mesh["dp_in"].get_local_rank(), mp.ep) if mp.ep > 1 else None
    for e in rt.entries:
        v = view_of(model, e.name, e.param, mp.tp, er if is_expert_param(e.param) else None)
        if rt.fsdp:
            data = e.local
        else:  # ZeRO-0/1/2: the proxy is the owned rows (the fp32 masters with 16-bit parameters)
            v = v.rows(e.start, e.length)
            data = e.proxy.detach()
            if not v.tp_shape:
                data = data.reshape(())
        lay.values.append((v, data))
        lay.optim[id(e.proxy)] = (e.name, v)
    _buffers(model, lay, mp.tp)
    return lay


def _pipeline(st: Any) -> Layout:
    rt = st.runtime
    model = st.model
    tp = rt.tp.tp if rt.tp is not None else 1
    mine = {id(t) for t in rt.plan.local_tensors}
    first, aliases = canonical_names(model)
    lay = Layout(aliases=aliases)
    plan = rt.plan
    er = (plan.ep_ranks.index(plan.global_rank(plan.pp_rank)), plan.ep) if plan.ep > 1 else None
    for p in model.parameters():
        if id(p) not in mine:
            continue
        v = view_of(model, first[id(p)], p, tp, er if id(p) in plan.experts else None)
        v.transposed = False  # the pipeline's TP (native GPT-2) only permutes the fused QKV rows
        lay.values.append((v, local_of(p).detach()))
        e = st._param_entry.get(id(p)) if st.zero is not None else None
        if e is not None and st.zero.stage == 3:  # ZeRO-3 (FSDP2): the proxy is the local shard (the view's box)
            lay.optim[id(e.proxy)] = (first[id(p)], v)
        elif e is not None:  # ZeRO-1: the optimizer updates the owned rows
            lay.optim[id(e.proxy)] = (first[id(p)], v.rows(e.start, e.length))
        else:
            lay.optim[id(p)] = (first[id(p)], v)
    _buffers(model, lay, tp, keep=mine)
    return lay


def group_hyper(model: nn.Module, lay: Layout, optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """This rank's optimizer groups' hyperparameters by canonical group index (merged over ranks)."""
    index = {n: g for g, names in enumerate(canonical_groups(model)) for n in names}
    out: dict[int, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        if g["params"]:
            name = lay.optim[id(g["params"][0])][0]
            out[index[name]] = {k: v for k, v in g.items() if k != "params"}
    return out
