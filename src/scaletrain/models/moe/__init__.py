"""The mixture-of-experts family: ``gpt2-moe`` (:mod:`.model`: GPT-2 with every ``moe_every``-th MLP a
top-k :class:`MoEFeedForward`, and the routing functions expert parallelism reuses)."""

from __future__ import annotations

from typing import Any

from scaletrain.models.gpt2 import SPEC as GPT2_SPEC
from scaletrain.models.moe.model import (Experts, GPT2MoE, GPT2MoEConfig, MoEFeedForward, assign_slots, capacity,
                                         combine, dispatch, load_balance_stats, moe_aux_loss, switch_aux_loss,
                                         top_k_route)
from scaletrain.models.spec import ModelSpec, ShardingPlan, listed, register

__all__ = ["Experts", "GPT2MoE", "GPT2MoEConfig", "MoEFeedForward", "assign_slots", "capacity", "combine", "dispatch",
           "load_balance_stats", "moe_aux_loss", "switch_aux_loss", "top_k_route"]


def build(**kw: Any) -> GPT2MoE:
    return GPT2MoE(GPT2MoEConfig(**kw))


SPEC = register(ModelSpec(
    name="moe",
    classes=(GPT2MoE,),
    models={"gpt2-moe": listed("gpt2-moe", build, vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4,
                               dropout=0.0, n_experts=4, top_k=2, capacity_factor=1.25, moe_every=2,
                               aux_loss_coef=0.01)},
    # attention split as GPT-2's; a MoE layer's MLP stays whole on every TP rank (its experts are EP's)
    tp=ShardingPlan(style=GPT2_SPEC.tp.style, divides=GPT2_SPEC.tp.divides),
    decoder=True,
    moe=MoEFeedForward,
))
