"""Hugging Face masked language models (BERT: ``bert.embeddings / encoder.layer`` + ``cls``) and
sequence classifiers (``*ForSequenceClassification``), used unmodified.

Masked LM on the shipped text (byte tokens): each sample's input has 15 % of its positions (the
same count in every sample) replaced by the mask token (id ``vocab_size - 1``, so the vocabulary
must be at least 257), chosen deterministically from the sample (so every process and every run
sees the same masks), and its targets are the original bytes there and -100 elsewhere — BERT's
objective without the 10 % random / 10 % kept replacements. The loss is BERT's own (cross-entropy
ignoring -100). An equal count per sample makes every micro-batch's mean over its targets average
to the global batch's mean, so data-parallel runs equal one process.
"""

from __future__ import annotations


import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.adapters.base import Adapter

MASK_PERCENT = 15
"""Share of positions masked per sample, percent."""


def is_masked_lm(model: nn.Module) -> bool:
    return type(model).__module__.startswith("transformers") and type(model).__name__.endswith("ForMaskedLM")


def is_seq_classifier(model: nn.Module) -> bool:
    return (type(model).__module__.startswith("transformers")
            and type(model).__name__.endswith("ForSequenceClassification"))


def mask_tokens(x: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input, targets) of one sample x [seq]: ``max(1, 15 % of seq)`` positions, drawn by a
    generator seeded with ``sum(x)``, become ``mask_id`` and are the only targets (the rest -100)."""
    n = x.shape[-1]
    g = torch.Generator().manual_seed(int(x.sum()))
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[torch.randperm(n, generator=g)[:max(1, n * MASK_PERCENT // 100)]] = True
    y = torch.where(chosen, x, torch.full_like(x, -100))
    return torch.where(chosen, torch.full_like(x, mask_id), x), y


def masked_adapter(model: nn.Module) -> Adapter:
    vocab = int(model.config.vocab_size)

    def transform(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if vocab <= 256:
            raise UserError(f"{type(model).__name__}: masked LM on byte tokens needs vocab_size >= 257 (a mask "
                            f"token after the 256 bytes); got {vocab}: set model.overrides.vocab_size=257")
        return mask_tokens(x, vocab - 1)

    max_seq = getattr(model.config, "max_position_embeddings", None)
    return Adapter(model, "hf-masked", task="lm", vocab_size=vocab, max_seq=max_seq,
                   sample_transform=transform)


def seqcls_adapter(model: nn.Module) -> Adapter:
    """Sequence classification: token ids in, ``.logits`` [batch, num_labels] out, class targets."""
    cfg = model.config
    a = Adapter(model, "hf-seqcls", task="classify", vocab_size=int(cfg.vocab_size), num_classes=int(cfg.num_labels),
                max_seq=getattr(cfg, "max_position_embeddings", None))
    a.input_spec = lambda batch, seq=None: torch.zeros(batch, seq or a.max_seq or 128, dtype=torch.long,  # type: ignore[method-assign]
                                                       device="meta")
    return a
