"""Hugging Face causal language models: GPT-2 (``transformer.h``) and Llama / Mistral-style decoders
(``model.embed_tokens / layers / norm / rotary_emb`` + ``lm_head``), used unmodified.

- Outputs: ``CausalLMOutput.logits`` ([batch, seq, vocab]); the loss is the model's own
  ``loss_function`` (HF's ``ForCausalLMLoss``) given the already shifted targets as
  ``shift_labels`` — the shipped text's targets are the next bytes — so it equals HF's
  ``labels=`` loss and ignores -100 (padding). When the model returned a loss (a batch with
  ``labels``), that loss is used as is.
- ``attention_mask`` of a dict batch is passed to the model (padding is masked out).
- Tied embeddings (``lm_head.weight is wte.weight``) stay tied: nothing is copied.
- No key/value cache in training: the adapter sets ``config.use_cache = False`` (as Hugging Face's own
  Trainer does under gradient checkpointing). With the cache on, every layer's forward copies its keys
  and values into a ``DynamicCache`` (``torch.cat``) and attention saves those copies for the
  backward: 2 x batch x seq x hidden x 4 bytes per layer of activations that nothing reads (hf:gpt2,
  4 layers, 4 x 64 tokens: +1 MiB on a 26 MiB step), and the per-block chain the cost model traces
  calls each layer without a cache.
- Blocks: each family's own (``models/gpt2/hf.py``, ``models/llama``), found through its ``ModelSpec``.
"""

from __future__ import annotations


import torch
from torch import nn

from scaletrain.models.adapters.base import Adapter, cross_entropy


def is_causal_lm(model: nn.Module) -> bool:
    name = type(model).__name__
    return _from_transformers(model) and (name.endswith("ForCausalLM") or name.endswith("LMHeadModel"))


def _from_transformers(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers")


def causal_adapter(model: nn.Module) -> Adapter:
    cfg = model.config
    vocab = int(cfg.vocab_size)
    if getattr(cfg, "use_cache", False):  # training keeps no key/value cache (module docstring)
        cfg.use_cache = False

    def loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        fn = getattr(model, "loss_function", None)
        if fn is None:
            return cross_entropy(logits, y)
        # targets already shifted (next token): HF's own causal loss, fp32, ignore_index -100
        return fn(logits, None, vocab_size=vocab, shift_labels=y)

    max_seq = getattr(cfg, "n_positions", None) or getattr(cfg, "max_position_embeddings", None)
    return Adapter(model, "hf-causal", task="lm", vocab_size=vocab, max_seq=max_seq, logits_loss=loss)
