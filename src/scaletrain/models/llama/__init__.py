"""Hugging Face Llama / Mistral-style decoders (``*ForCausalLM``: ``model.embed_tokens / layers / norm /
rotary_emb`` + ``lm_head``), used unmodified: how they are recognised, their ``hf:llama`` / ``hf:mistral``
defaults, their blocks, Megatron's split as data, and their shape on paper (RMSNorm, no biases, SwiGLU
MLP, grouped-query attention, rotary positions, untied head)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.catalog import LISTED
from scaletrain.models.chain import Seq, causal_mask
from scaletrain.models.external import HFFamily
from scaletrain.models.spec import ModelSpec, ShardingPlan, is_transformers, positive, register

_DECODER = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, max_position_embeddings=256, attention_dropout=0.0, loss_type="ForCausalLM",
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
"""CPU-sized defaults: byte vocabulary, 4 x 128, no dropout."""

HF = {
    "llama": HFFamily("LlamaForCausalLM", "LlamaConfig", dict(_DECODER), LISTED["hf:llama"].description),
    "mistral": HFFamily("MistralForCausalLM", "MistralConfig", dict(_DECODER, sliding_window=None),
                        LISTED["hf:mistral"].description),
}


def is_hf_llama(model: nn.Module) -> bool:
    """A ``transformers`` Llama/Mistral-style causal LM: ``model.{embed_tokens, layers, norm}`` + ``lm_head``."""
    body = getattr(model, "model", None)
    return (is_transformers(model) and body is not None and hasattr(model, "lm_head")
            and all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm")))


class RotaryLayer(nn.Module):
    """A Llama/Mistral decoder layer as a single-tensor block: hidden [b, s, h] -> hidden [b, s, h],
    positions 0..s-1, the rotary embedding of the model's own ``rotary_emb``."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, eager: bool):
        super().__init__()
        self.layer, self.eager = layer, eager
        self.rotary = rotary  # shared by every layer; no parameters (its inv_freq buffer is not saved)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        pe = self.rotary(x, position_ids=pos)
        mask = causal_mask(x.shape[1], x.dtype, x.device) if self.eager else None
        out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, (tuple, list)) else out


def llama_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """embed_tokens, each layer (given the model-level rotary embedding), norm + lm_head."""
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "rotary_emb"):
        return None
    eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
    blocks: list[tuple[str, nn.Module]] = [("embed", body.embed_tokens)]
    blocks += [(f"model.layers.{i}", RotaryLayer(layer, body.rotary_emb, eager)) for i, layer in enumerate(body.layers)]
    blocks.append(("head", Seq(body.norm, model.lm_head)))
    return blocks


def shape(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Fields of the planner's ``Shape`` for ``hf:llama`` / ``hf:mistral`` with config ``overrides`` (the
    small defaults above, then ``overrides``, checked against the transformers config class when
    transformers is installed)."""
    fam = HF[name[3:]]
    a: dict[str, Any] = {"tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
                         "head_dim": None, **fam.defaults}
    try:
        import transformers

        known = set(getattr(transformers, fam.config_class)().to_dict()) | set(a)
    except ImportError:
        known = set(a)
    bad = sorted(set(overrides) - known)
    if bad:
        raise UserError(f"model {name!r} has no config option {bad[0]!r}; e.g. "
                        f"{', '.join(sorted(k for k in a if not k.endswith('_id'))[:12])}")
    a.update(overrides)
    if a.get("num_key_value_heads") in (None, 0):
        a["num_key_value_heads"] = a["num_attention_heads"]
    positive(name, a, ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                       "vocab_size", "intermediate_size", "max_position_embeddings"),
             "hidden_size", "num_attention_heads")
    if a["num_attention_heads"] % a["num_key_value_heads"]:
        raise UserError(f"model {name!r}: num_key_value_heads={a['num_key_value_heads']} must divide "
                        f"num_attention_heads={a['num_attention_heads']}")
    hd = a.get("head_dim")
    if hd not in (None, a["hidden_size"] // a["num_attention_heads"]):
        raise UserError(f"model {name!r}: head_dim={hd} is priced only as hidden_size / num_attention_heads "
                        f"= {a['hidden_size'] // a['num_attention_heads']}")
    if bool(a["attention_bias"]) != bool(a["mlp_bias"]):
        raise UserError(f"model {name!r}: attention_bias and mlp_bias must agree (both true or both false)")
    return dict(layers=a["num_hidden_layers"], hidden=a["hidden_size"], heads=a["num_attention_heads"],
                vocab=a["vocab_size"], positions=a["max_position_embeddings"], ffn=a["intermediate_size"],
                dropout=float(a.get("attention_dropout", 0.0) or 0.0), kv_heads=a["num_key_value_heads"],
                gated=True, rmsnorm=True, bias=bool(a["attention_bias"]), rotary=True,
                tied=bool(a["tie_word_embeddings"]))


SPEC = register(ModelSpec(
    name="llama",
    matches=is_hf_llama,
    hf=HF,
    blocks=llama_blocks,
    # Megatron's split (Shoeybi et al. 2019): q/k/v and the SwiGLU's gate/up by columns (heads / t query and
    # kv_heads / t key/value heads per rank), o and down by rows; the embedding by vocabulary rows; the head
    # by vocabulary columns with loss_parallel. HF's attention reshapes with -1 heads: nothing is replaced.
    tp=ShardingPlan(layers="model.layers",
                    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                             "mlp.up_proj"),
                    rowwise=("self_attn.o_proj", "mlp.down_proj"),
                    embedding="model.embed_tokens", head="lm_head",
                    divides=("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")),
    shape=shape,
    decoder=True,
))
