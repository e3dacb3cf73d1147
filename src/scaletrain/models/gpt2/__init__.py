"""The GPT-2 family: scaletrain's reference GPT-2 (:mod:`.model`, ``gpt2-*``), Hugging Face's
``GPT2LMHeadModel`` (:mod:`.hf`, ``hf:gpt2``), its export to HF's layout (:mod:`.export`); two
:class:`~scaletrain.models.spec.ModelSpec` registrations (Megatron's split differs: scaletrain's fused QKV
and sequence parallelism, HF's ``Conv1D``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from scaletrain.models.gpt2 import export, hf
from scaletrain.models.gpt2.model import (MLP, CausalSelfAttention, GPT2, GPT2Block, GPT2Config, GPT2Embedding,
                                          GPT2Head, ReZeroBlock)
from scaletrain.models.spec import ModelEntry, ModelSpec, ShardingPlan, listed, positive, register

__all__ = ["MLP", "CausalSelfAttention", "GPT2", "GPT2Block", "GPT2Config", "GPT2Embedding", "GPT2Head",
           "ReZeroBlock"]

OPTIONS = {f.name: f.default for f in dataclasses.fields(GPT2Config)}
"""Every GPT2Config field may be overridden (``model.overrides``), with its default."""


def build(**kw: Any) -> GPT2:
    return GPT2(GPT2Config(**kw))


def entry(name: str, **defaults: Any) -> ModelEntry:
    """A gpt2-* model (every GPT2Config field overridable)."""
    return listed(name, build, OPTIONS, **defaults)


def shape(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Fields of the planner's ``Shape`` for gpt2-* model ``name`` with config ``overrides`` (GPT-2's choices:
    LayerNorm, biases, GELU MLP of 4h, learned positions, tied head)."""
    from scaletrain.models import registry

    a = {**OPTIONS, **registry.resolve_args(name, **overrides)}
    positive(name, a, ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"), "n_embd", "n_head")
    return dict(layers=a["n_layer"], hidden=a["n_embd"], heads=a["n_head"], vocab=a["vocab_size"],
                positions=a["n_positions"], dropout=float(a.get("dropout", 0.0) or 0.0))


SPEC = register(ModelSpec(
    name="gpt2",
    classes=(GPT2,),
    models={
        "gpt2-tiny": entry("gpt2-tiny", vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4),
        "gpt2-mini": entry("gpt2-mini", vocab_size=256, n_positions=512, n_embd=256, n_layer=6, n_head=8),
        "gpt2-small": entry("gpt2-small", n_embd=768, n_layer=12, n_head=12),
        "gpt2-medium": entry("gpt2-medium", n_embd=1024, n_layer=24, n_head=16),
        "gpt2-large": entry("gpt2-large", n_embd=1280, n_layer=36, n_head=20),
        "gpt2-xl": entry("gpt2-xl", n_embd=1600, n_layer=48, n_head=25),
    },
    tp=ShardingPlan(style="megatron", divides=("n_head", "vocab_size"), sequence_parallel=True),
    shape=shape,
    export=export.export,
    decoder=True,
))

HF_SPEC = register(ModelSpec(
    name="hf-gpt2",
    matches=hf.is_hf_gpt2,
    hf={"gpt2": hf.HF_GPT2},
    blocks=hf.hf_gpt2_blocks,
    tp=ShardingPlan(style="hf-gpt2", divides=("n_head", "vocab_size")),
    decoder=True,
))
