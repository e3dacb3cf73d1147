"""Megatron tensor parallelism for Hugging Face Llama / Mistral-style decoders (``*ForCausalLM`` with
``model.embed_tokens / layers / norm`` + ``lm_head``), HF's own forward unchanged.

The split (Shoeybi et al. 2019) on DTensor: in every layer ``q_proj``, ``k_proj``, ``v_proj`` and the
MLP's ``gate_proj``, ``up_proj`` column-parallel (each rank: ``heads / t`` query heads and ``kv_heads / t``
key/value heads, ``intermediate / t`` MLP columns); ``o_proj`` and ``down_proj`` row-parallel (one
all-reduce each in the forward); the embedding vocabulary-parallel (rows), the LM head column-parallel
over the vocabulary with ``loss_parallel``'s cross-entropy (no full logits on any rank). HF's attention
reshapes with ``-1`` heads and repeats key/value heads by the unchanged ratio, so nothing of its code
is replaced. RMSNorm weights and the rotary embedding are replicated.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from scaletrain.errors import UserError

from .megatron import _TP_ATTR, TPInfo, _reduce_partial_grads_eagerly, _replicate_leftovers


def is_hf_llama(model: nn.Module) -> bool:
    """A ``transformers`` Llama/Mistral-style causal LM: ``model.{embed_tokens, layers, norm}`` + ``lm_head``."""
    body = getattr(model, "model", None)
    return (type(model).__module__.startswith("transformers") and body is not None and hasattr(model, "lm_head")
            and all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm")))


def apply_tensor_parallel_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard a Llama/Mistral-style ``*ForCausalLM`` over ``tp_mesh`` in place (see the module docstring)."""
    t = tp_mesh.size()
    cfg = model.config
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % t or kv % t or cfg.vocab_size % t or cfg.intermediate_size % t:
        raise UserError(f"parallel.tp={t} must divide num_attention_heads={heads}, num_key_value_heads={kv}, "
                        f"intermediate_size={cfg.intermediate_size} and vocab_size={cfg.vocab_size}")
    body = model.model
    parallelize_module(body, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=Replicate())})
    for layer in body.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
        })
    tied = model.lm_head.weight is body.embed_tokens.weight
    parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    if tied:
        model.lm_head.weight = body.embed_tokens.weight  # re-tie: both Shard(0) over the vocabulary
    _replicate_leftovers(model, tp_mesh)
    _reduce_partial_grads_eagerly(model)
    setattr(model, _TP_ATTR, TPInfo(t, False, tp_mesh, False))
    return model
