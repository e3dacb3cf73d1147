"""The reference GPT-2 in Hugging Face's layout (``checkpoint export --to hf``): the same architecture as
``GPT2LMHeadModel`` (pre-LN blocks, fused QKV, tanh GELU = HF's ``gelu_new``, tied head), with other
names and ``nn.Linear`` weights where HF's ``Conv1D`` stores their transpose."""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from scaletrain.errors import UserError

_LINEARS = re.compile(r"^h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")



def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def rename(name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None:
    """Reference GPT-2 name -> GPT2LMHeadModel name (Linear -> Conv1D: transposed); the tied head is left out."""
    if name == "head.lm_head.weight":
        return None  # tied to transformer.wte.weight, which from_pretrained re-ties
    if _LINEARS.match(name):
        return "transformer." + name, _transpose
    for ours, theirs in (("embed.", "transformer."), ("head.ln_f.", "transformer.ln_f."), ("h.", "transformer.h.")):
        if name.startswith(ours):
            return theirs + name[len(ours):], _same
    raise UserError(f"tensor {name!r} has no GPT2LMHeadModel counterpart")


def hf_config(cfg: Any) -> dict[str, Any]:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
                      n_head=cfg.n_head, activation_function="gelu_new", resid_pdrop=cfg.dropout,
                      embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, layer_norm_epsilon=cfg.layer_norm_eps,
                      bos_token_id=None, eos_token_id=None, tie_word_embeddings=True,
                      architectures=["GPT2LMHeadModel"]).to_dict()




def export(module: Any) -> tuple[dict[str, Any], Callable[[str], Any]]:
    """(HF config dict, tensor rename) of a reference GPT-2 (``ModelSpec.export``)."""
    return hf_config(module.config), rename
