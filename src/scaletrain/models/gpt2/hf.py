"""Hugging Face GPT-2 (``transformers`` ``GPT2LMHeadModel``), used unmodified: how it is recognised, its
blocks and its ``hf:gpt2`` defaults.

Blocks: the token + position embedding, each layer of ``transformer.h`` (its tuple output reduced to the
hidden state), the final norm + head.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.models.chain import FirstOutput, Seq
from scaletrain.models.catalog import LISTED
from scaletrain.models.external import HFFamily

_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)

HF_GPT2 = HFFamily("GPT2LMHeadModel", "GPT2Config",
                   dict(vocab_size=256, n_positions=256, n_embd=128, n_layer=4, n_head=4, loss_type="ForCausalLM",
                        bos_token_id=None, eos_token_id=None, **_NO_DROPOUT), LISTED["hf:gpt2"].description)
"""``hf:gpt2``: CPU-sized, byte vocabulary, no dropout (any world size gives the same losses)."""


def is_hf_gpt2(model: nn.Module) -> bool:
    """A GPT-2 LM in Hugging Face's layout: ``transformer.{wte, wpe, h, ln_f}`` and ``lm_head``."""
    tr = getattr(model, "transformer", None)
    return tr is not None and all(hasattr(tr, a) for a in ("wte", "wpe", "h", "ln_f")) and hasattr(model, "lm_head")


class HFEmbedding(nn.Module):
    """HF GPT-2 glue: token + position embedding, then dropout. ids [b, s] -> [b, s, h]."""

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[-1], device=ids.device).unsqueeze(0)
        return self.drop(self.wte(ids) + self.wpe(pos))


def hf_gpt2_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """Embedding, every layer (an explicit causal mask under "eager" attention), final norm + head."""
    if not is_hf_gpt2(model):
        return None
    t = model.transformer
    blocks: list[tuple[str, nn.Module]] = [("embed", HFEmbedding(t.wte, t.wpe, getattr(t, "drop", nn.Identity())))]
    eager = getattr(getattr(model, "config", None), "_attn_implementation", "sdpa") == "eager"
    blocks += [(f"transformer.h.{i}", FirstOutput(layer, causal_mask=eager)) for i, layer in enumerate(t.h)]
    blocks.append(("head", Seq(t.ln_f, model.lm_head)))
    return blocks
