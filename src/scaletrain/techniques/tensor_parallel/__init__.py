"""Tensor parallelism: Megatron's column/row split (Shoeybi et al. 2019) on PyTorch DTensor.

One family, one folder:

- :mod:`.megatron` — the apply face for scaletrain's GPT-2 family (fused QKV permuted head-aligned,
  vocabulary-parallel embedding and loss), TP state dicts in the single-process layout;
- :mod:`.hf` — the same split for Hugging Face's GPT-2 layout (``Conv1D`` → ``Linear``);
- :mod:`.hf_llama` — the same split for Hugging Face's Llama / Mistral layout;
- :mod:`.sequence` — Megatron sequence parallelism's activation saving;
- :mod:`.cost` — parameter elements, activation bytes, per-rank memory and traffic.

:func:`apply_tensor_parallel` and :func:`full_state_dict` choose the layout's implementation.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.errors import UserError

from .cost import tp_activation_bytes, tp_comm_bytes_per_step, tp_memory_per_rank, tp_param_elements
from .hf import apply_tensor_parallel_hf, hf_full_state_dict, is_hf_gpt2
from .megatron import (TPInfo, apply_megatron, check_model, local_numel, loss_context, megatron_full_state_dict,
                       qkv_permutation, qkv_row_permutation, replicate_module, tp_info, vocab_parallel_cross_entropy)

__all__ = ["TPInfo", "apply_tensor_parallel", "check_model", "full_state_dict", "local_numel", "loss_context",
           "qkv_permutation", "qkv_row_permutation", "replicate_module", "tp_activation_bytes",
           "tp_comm_bytes_per_step", "tp_info", "tp_memory_per_rank", "tp_param_elements",
           "vocab_parallel_cross_entropy", "is_hf_gpt2", "conv1d_transposed"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          regather: bool = True) -> nn.Module:
    """Shard a GPT-2 — scaletrain's (:func:`.megatron.apply_megatron`, with optional sequence
    parallelism) or Hugging Face's (:func:`.hf.apply_tensor_parallel_hf`) — over the 1-D
    ``tp_mesh`` in place. Every rank must hold the same initial weights."""
    if is_hf_gpt2(model):  # Hugging Face GPT-2: same split, HF's own forward
        if sequence_parallel:
            raise UserError("sequence parallelism is not supported for Hugging Face GPT-2; use parallel.tp alone")
        return apply_tensor_parallel_hf(model, tp_mesh)
    from .hf_llama import apply_tensor_parallel_llama, is_hf_llama

    if is_hf_llama(model):  # Hugging Face Llama / Mistral: the same split on q/k/v/o and the SwiGLU MLP
        if sequence_parallel:
            raise UserError("sequence parallelism is not supported for Hugging Face models; use parallel.tp alone")
        return apply_tensor_parallel_llama(model, tp_mesh)
    return apply_megatron(model, tp_mesh, sequence_parallel, regather)


def full_state_dict(model: nn.Module) -> dict:
    """The single-process state dict of a TP model (shards gathered; collective over the TP group)."""
    if tp_info(model) is not None and is_hf_gpt2(model):
        return hf_full_state_dict(model)
    return megatron_full_state_dict(model)


def conv1d_transposed(model: nn.Module, name: str) -> bool:
    """True when parameter ``name`` of a tensor-parallel Hugging Face GPT-2 is stored transposed
    relative to the single-process (``Conv1D``, [in, out]) layout: TP swapped those for Linear."""
    return (tp_info(model) is not None and is_hf_gpt2(model)
            and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")))
