"""Megatron tensor parallelism for Hugging Face GPT-2 (``transformers`` ``GPT2LMHeadModel``).

The same split as :mod:`scaletrain.techniques.tensor_parallel` — column-parallel fused QKV and
MLP-in, row-parallel attention-out and MLP-out, vocabulary-parallel ``wte`` / tied ``lm_head``
with ``loss_parallel`` — adapted to HF's layout:

- HF's ``Conv1D`` (weight [in, out], ``x @ W + b``) is not a layer DTensor's styles know, so each
  is first replaced by the equivalent ``nn.Linear`` (weight transposed; same function);
- the fused ``c_attn`` rows are permuted head-aligned (:func:`qkv_permutation`) and the module's
  ``split_size`` set to h/t, so HF's own forward — which splits the fused output by
  ``split_size`` and reshapes with ``-1`` heads — runs unchanged on this rank's ``n_head / t``
  heads; nothing of HF's code is replaced.

Sequence parallelism is not offered for HF models (their position handling is inside
``GPT2Model.forward``). :func:`hf_full_state_dict` gathers a plain HF state dict (Conv1D layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scaletrain.errors import UserError
from .megatron import (
    _TP_ATTR,
    TPInfo,
    _reduce_partial_grads_eagerly,
    _replicate_leftovers,
    qkv_permutation,
)


def _conv1d_to_linear(conv: nn.Module, rows: torch.Tensor | None = None) -> nn.Linear:
    """HF Conv1D (weight [in, out]) -> nn.Linear (weight [out, in]); optionally permute outputs."""
    w = conv.weight.detach().t()
    b = conv.bias.detach()
    if rows is not None:
        w, b = w[rows], b[rows]
    lin = nn.Linear(w.shape[1], w.shape[0], device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        lin.bias.copy_(b)
    return lin


def apply_tensor_parallel_hf(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard a ``transformers`` GPT-2 LM over ``tp_mesh`` in place (see the module docstring)."""
    t = tp_mesh.size()
    cfg = model.config
    h, a, V = cfg.n_embd, cfg.n_head, cfg.vocab_size
    if a % t or V % t:
        raise UserError(f"parallel.tp={t} must divide n_head={a} and vocab_size={V}")
    if getattr(cfg, "add_cross_attention", False):
        raise UserError("tensor parallelism of HF GPT-2 with cross-attention is not supported")
    tr = model.transformer
    parallelize_module(tr, tp_mesh, {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())})
    perm = qkv_permutation(h, a, t)
    for block in tr.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = _conv1d_to_linear(attn.c_attn, perm)
        attn.c_proj = _conv1d_to_linear(attn.c_proj)
        mlp.c_fc = _conv1d_to_linear(mlp.c_fc)
        mlp.c_proj = _conv1d_to_linear(mlp.c_proj)
        attn.split_size = h // t  # HF splits the fused output by this; reshapes use -1 heads
        attn.num_heads = a // t
        attn.embed_dim = h // t
        parallelize_module(block, tp_mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })
    parallelize_module(model, tp_mesh, {
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    model.lm_head.weight = tr.wte.weight  # re-tie: both Shard(0) over the vocabulary
    _replicate_leftovers(model, tp_mesh)
    _reduce_partial_grads_eagerly(model)
    setattr(model, _TP_ATTR, TPInfo(t, False, tp_mesh, False))
    return model


def hf_full_state_dict(model: nn.Module) -> dict[str, Any]:
    """The plain HF state dict (Conv1D layout, QKV un-permuted) of a TP model. Collective."""
    info = getattr(model, _TP_ATTR)
    h, a = model.config.n_embd, model.config.n_head
    inv = torch.argsort(qkv_permutation(h, a, info.tp))
    out: dict[str, Any] = {}
    for k, v in model.state_dict().items():
        v = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        if k.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            v = v[inv]
        if k.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) and v.dim() == 2:
            v = v.t().contiguous()  # back to Conv1D's [in, out]
        out[k] = v
    return out
