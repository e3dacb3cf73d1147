"""Tensor parallelism: Megatron's column/row split (Shoeybi et al. 2019) on PyTorch DTensor.

The split of each model family is its :class:`~scaletrain.models.spec.ShardingPlan` (declared in its
folder under ``models/``); this package applies it:

- :mod:`.plan` — a plan given as data (colwise/rowwise submodules of each layer, vocabulary-parallel
  embedding and head), e.g. Hugging Face's Llama / Mistral;
- :mod:`.megatron` — style ``"megatron"``: scaletrain's GPT-2 (fused QKV permuted head-aligned,
  vocabulary-parallel embedding and loss, sequence parallelism), TP state dicts in the single-process layout;
- :mod:`.hf` — style ``"hf-gpt2"``: the same split for Hugging Face's GPT-2 layout (``Conv1D`` → ``Linear``);
- :mod:`.sequence` — Megatron sequence parallelism's activation saving;
- :mod:`.cost` — parameter elements, activation bytes, per-rank memory and traffic.

:func:`apply_tensor_parallel` and :func:`full_state_dict` ask the model's family which one applies.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from scaletrain.errors import UserError
from scaletrain.models.spec import ShardingPlan, spec_of

from .cost import tp_activation_bytes, tp_comm_bytes_per_step, tp_memory_per_rank, tp_param_elements
from .hf import apply_tensor_parallel_hf, hf_full_state_dict
from .megatron import (TPInfo, apply_megatron, check_model, local_numel, loss_context, megatron_full_state_dict,
                       qkv_permutation, qkv_row_permutation, replicate_module, tp_info, vocab_parallel_cross_entropy)
from .plan import apply_plan

__all__ = ["TPInfo", "apply_tensor_parallel", "check_model", "full_state_dict", "local_numel", "loss_context",
           "qkv_permutation", "qkv_row_permutation", "replicate_module", "tp_activation_bytes",
           "tp_comm_bytes_per_step", "tp_info", "tp_memory_per_rank", "tp_param_elements",
           "vocab_parallel_cross_entropy", "conv1d_transposed", "apply_plan", "costed"]


def _plan(model: nn.Module) -> ShardingPlan:
    """The model's family's sharding plan; one-line UserError when its family declares none."""
    spec = spec_of(model)
    if spec is None or spec.tp is None:
        raise UserError(f"{type(model).__name__} has no tensor-parallel plan (its family's ModelSpec.tp); allowed: "
                        "parallel.tp=1, or register a ModelSpec with a ShardingPlan")
    return spec.tp


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          regather: bool = True) -> nn.Module:
    """Shard ``model`` over the 1-D ``tp_mesh`` in place as its family's :class:`ShardingPlan` says: a
    data plan (:func:`.plan.apply_plan`), or the applier its style names (``"megatron"``, ``"hf-gpt2"``).
    Every rank must hold the same initial weights."""
    plan = _plan(model)
    if sequence_parallel and not plan.sequence_parallel:
        raise UserError(f"sequence parallelism is not supported for {type(model).__name__}; use parallel.tp alone")
    if plan.style == "megatron":
        return apply_megatron(model, tp_mesh, sequence_parallel, regather)
    if plan.style == "hf-gpt2":
        return apply_tensor_parallel_hf(model, tp_mesh)
    return apply_plan(model, tp_mesh, plan)


GPT2_SPLIT = ("megatron", "hf-gpt2")
"""Styles whose cost the cost faces (:mod:`.cost`: ``tp_param_elements``, ``tp_activation_bytes``, ...) model:
GPT-2's split, read off a GPT-2 config (``n_embd``, ``n_head``, ``n_positions``, ``vocab_size``)."""


def costed(model: nn.Module) -> bool:
    """Whether the TP cost faces model ``model``'s split (its family's plan has a :data:`GPT2_SPLIT` style)."""
    spec = spec_of(model)
    return spec is not None and spec.tp is not None and spec.tp.style in GPT2_SPLIT


def _hf_gpt2_tp(model: nn.Module) -> bool:
    spec = spec_of(model)
    return tp_info(model) is not None and spec is not None and spec.tp is not None and spec.tp.style == "hf-gpt2"


def full_state_dict(model: nn.Module) -> dict:
    """The single-process state dict of a TP model (shards gathered; collective over the TP group)."""
    if _hf_gpt2_tp(model):
        return hf_full_state_dict(model)
    return megatron_full_state_dict(model)


def conv1d_transposed(model: nn.Module, name: str) -> bool:
    """True when parameter ``name`` of a tensor-parallel Hugging Face GPT-2 is stored transposed
    relative to the single-process (``Conv1D``, [in, out]) layout: TP swapped those for Linear."""
    return _hf_gpt2_tp(model) and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight"))
