"""Hugging Face causal language models: GPT-2 (``transformer.h``) and Llama / Mistral-style decoders
(``model.embed_tokens / layers / norm / rotary_emb`` + ``lm_head``), used unmodified.

- Outputs: ``CausalLMOutput.logits`` ([batch, seq, vocab]); the loss is the model's own
  ``loss_function`` (HF's ``ForCausalLMLoss``) given the already shifted targets as
  ``shift_labels`` — the shipped text's targets are the next bytes — so it equals HF's
  ``labels=`` loss and ignores -100 (padding). When the model returned a loss (a batch with
  ``labels``), that loss is used as is.
- ``attention_mask`` of a dict batch is passed to the model (padding is masked out).
- Tied embeddings (``lm_head.weight is wte.weight``) stay tied: nothing is copied.
- Blocks: the embedding, every decoder layer, the final norm + head. A Llama layer is given the
  rotary position embeddings HF computes at model level (recomputed per layer: no parameters).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from scaletrain.models.adapters.base import Adapter, cross_entropy


def is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return _from_transformers(model) and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _from_transformers(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers")


def _causal_mask(s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask [1, 1, s, s]: 0 on and below the diagonal, the dtype's minimum above
    (what HF builds at model level for "eager" attention; SDPA is causal without a mask)."""
    upper = torch.ones(s, s, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(s, s, dtype=dtype, device=device).masked_fill(upper, torch.finfo(dtype).min)[None, None]


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
        mask = _causal_mask(x.shape[1], x.dtype, x.device) if self.eager else None
        out = self.layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
        return out[0] if isinstance(out, (tuple, list)) else out


def llama_chain(model: nn.Module) -> Any:
    """Blocks of a Llama/Mistral-style ``*ForCausalLM``: embed_tokens, each layer, norm + lm_head."""
    from scaletrain.chain import Chain, _Seq

    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not hasattr(model, "lm_head"):
        return None
    eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
    blocks: list[tuple[str, nn.Module]] = [("embed", body.embed_tokens)]
    blocks += [(f"model.layers.{i}", RotaryLayer(layer, body.rotary_emb, eager)) for i, layer in enumerate(body.layers)]
    blocks.append(("head", _Seq(body.norm, model.lm_head)))
    return Chain(blocks, source=model)


def causal_adapter(model: nn.Module) -> Adapter:
    cfg = model.config
    vocab = int(cfg.vocab_size)

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fn = getattr(model, "loss_function", None)
        if fn is None:
            return cross_entropy(logits, y)
        # targets already shifted (next token): HF's own causal loss, fp32, ignore_index -100
        return fn(logits, None, vocab_size=vocab, shift_labels=y)

    max_seq = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    return Adapter(model, "hf-causal", task="lm", vocab_size=vocab, max_seq=max_seq, logits_loss=loss,
                   chain_finder=lambda m: llama_chain(m))
