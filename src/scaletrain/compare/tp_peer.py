"""The tensor-parallel peer of a study (``torch-tp``): torch's own TP as its tutorial shows it, on scaletrain's GPT-2.

:func:`torch_tp_split` is Megatron's split written with nothing but ``torch.distributed.tensor.parallel``:
per block ``c_attn`` / ``c_fc`` ``ColwiseParallel`` and both ``c_proj`` ``RowwiseParallel`` over this rank's
``n_head / t`` heads (the fused QKV rows reordered so a rank's contiguous rows are its heads' q, k and v), the
token embedding vocabulary-parallel (``RowwiseParallel`` of its rows), the tied head ``ColwiseParallel`` with
its output left vocabulary-sharded for ``loss_parallel``'s cross-entropy; norms and position embeddings stay
plain modules (their input is replicated, so their gradients agree on every rank without a collective).
AdamW and clipping then meet DTensor and plain parameters: the foreach kernels take one kind a list, so every
optimizer group is split in two and the global norm is summed from the two kinds' norms (:func:`clip_mixed`).

:func:`tp_engine` is the :class:`~scaletrain.compare.peer_engine.PeerEngine` of ``parallel.tp`` = every process
(the TP ranks read the same samples, as scaletrain's ``tp`` cell's do). It is also the ``torch-tp`` engine of
``benchmarks/speed/run.py``. Units: none (seconds and bytes are the loop's).
"""

from __future__ import annotations

import contextlib
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scaletrain.errors import ConfigError


def _attention(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The block's attention over its local heads: ``c_attn``'s local output is ``[q_r | k_r | v_r]``."""
    b, s, _ = x.shape
    q, k, v = (t.view(b, s, self.n_head, -1).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=2))
    p = self.attn_dropout if self.training else 0.0
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
    return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(b, s, -1)))


def torch_tp_split(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split scaletrain's GPT-2 ``model`` over the 1-D ``mesh`` in place with torch's TP styles (module
    docstring). Every rank must hold the same initial weights. ConfigError for another model."""
    t = mesh.size()
    cfg = getattr(model, "config", None)
    if not (hasattr(model, "h") and hasattr(model, "embed") and hasattr(model, "head") and cfg is not None
            and all(hasattr(b, "attn") and hasattr(b.mlp, "c_fc") for b in model.h)):
        raise ConfigError(f"the torch-tp peer splits scaletrain's GPT-2 (embed, h, head); {type(model).__name__} "
                          "is not one; allowed: model.name=gpt2-*")
    if cfg.n_head % t or cfg.vocab_size % t:
        raise ConfigError(f"the torch-tp peer needs parallel.tp={t} to divide n_head={cfg.n_head} and "
                          f"vocab_size={cfg.vocab_size}")
    h, local = cfg.n_embd, cfg.n_embd // t  # rows of q (k, v) per rank
    perm = torch.cat([torch.arange(part * h + r * local, part * h + (r + 1) * local)
                      for r in range(t) for part in range(3)])  # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    for block in model.h:
        a = block.attn
        with torch.no_grad():
            a.c_attn.weight.copy_(a.c_attn.weight[perm])
            a.c_attn.bias.copy_(a.c_attn.bias[perm])
        a.n_head //= t
        a.forward = types.MethodType(_attention, a)
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    parallelize_module(model.embed, mesh, {"wte": RowwiseParallel(input_layouts=Replicate())})
    parallelize_module(model.head, mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1),
                                                                     use_local_output=False)})
    model.head.lm_head.weight = model.embed.wte.weight  # tied again: both Shard(0) over the vocabulary
    return model


def split_groups(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Split each of ``opt``'s (stateless, not yet stepped) groups into its DTensor and its plain parameters,
    same hyperparameters: the foreach kernels refuse a list mixing the two kinds."""
    groups = []
    for g in opt.param_groups:
        for kind in (True, False):
            ps = [p for p in g["params"] if isinstance(p, DTensor) is kind]
            if ps:
                groups.append({**g, "params": ps})
    opt.param_groups = groups
    return opt


@torch.no_grad()
def clip_mixed(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the gradients of DTensor and plain ``params`` by their global 2-norm (each element once: a
    sharded DTensor's norm is reduced over its mesh, replicated ones and plain tensors count their local
    copy); returns the norm, a plain scalar."""
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    kinds = ([p for p in params if p.grad is not None and isinstance(p, DTensor)],
             [p for p in params if p.grad is not None and not isinstance(p, DTensor)])
    sq = torch.zeros((), dtype=torch.float32)
    for ps in kinds:
        if ps:
            n = get_total_norm([p.grad for p in ps], foreach=True)
            sq = sq + (n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2
    norm = sq.sqrt()
    if max_norm > 0:
        for ps in kinds:
            if ps:
                clip_grads_with_norm_(ps, max_norm, norm, foreach=True)
    return norm


def loss_context(strategy: str) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` around the whole ``torch-tp`` run (every loss and its backward on sharded logits;
    plain tensors are untouched by it), a no-op for the other peers."""
    if strategy != "torch-tp":
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def tp_engine(model: nn.Module, cfg: Any, device: torch.device) -> Any:
    """The ``torch-tp`` :class:`~scaletrain.compare.peer_engine.PeerEngine`: :func:`torch_tp_split` over all
    processes, scaletrain's AdamW groups split by kind, its schedule, :func:`clip_mixed`."""
    import math

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from scaletrain.compare.peer_engine import PeerEngine, _optimizer

    world = dist.get_world_size()
    if cfg.parallel.tp != world:
        raise ConfigError(f"parallel.tp={cfg.parallel.tp}: the torch-tp peer splits over every process; "
                          f"allowed: parallel.tp={world}")
    torch_tp_split(model, init_device_mesh(device.type, (world,)))
    opt, factor = _optimizer(cfg, model)
    split_groups(opt)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    params = list(model.parameters())
    clip = cfg.optim.grad_clip

    def step() -> float:
        norm = clip_mixed(params, clip) if clip > 0 else torch.tensor(math.nan)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    return PeerEngine(model, model, opt, lambda loss: loss.backward(), step, lambda: sched.get_last_lr()[0])
