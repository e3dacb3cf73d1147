"""Hugging Face BERT (``BertForMaskedLM``: ``bert.embeddings / encoder.layer`` + ``cls``), used unmodified:
how it is recognised, its ``hf:bert`` defaults and its blocks (embeddings, each encoder layer —
bidirectional, no mask —, the ``cls`` head). How it trains (masked LM on bytes) is its adapter's
(:mod:`scaletrain.models.adapters.hf_masked`). No tensor-parallel plan; priced by its trace."""

from __future__ import annotations

from torch import nn

from scaletrain.models.catalog import LISTED
from scaletrain.models.chain import FirstOutput
from scaletrain.models.external import HFFamily
from scaletrain.models.spec import ModelSpec, register

HF = {"bert": HFFamily("BertForMaskedLM", "BertConfig",
                       dict(vocab_size=257, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=4, max_position_embeddings=256, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, pad_token_id=0),
                       LISTED["hf:bert"].description, extra_tokens=1)}
"""``hf:bert``: 257 tokens (the 256 bytes and one mask id), 4 x 128, no dropout."""


def is_bert(model: nn.Module) -> bool:
    """BERT's layout: ``bert.encoder.layer`` and a ``cls`` head."""
    bert = getattr(model, "bert", None)
    return bert is not None and hasattr(model, "cls") and hasattr(getattr(bert, "encoder", None), "layer")


def bert_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    if not is_bert(model):
        return None
    bert = model.bert
    blocks: list[tuple[str, nn.Module]] = [("embed", bert.embeddings)]
    blocks += [(f"bert.encoder.layer.{i}", FirstOutput(layer)) for i, layer in enumerate(bert.encoder.layer)]
    blocks.append(("head", model.cls))
    return blocks


SPEC = register(ModelSpec(name="bert", matches=is_bert, hf=HF, blocks=bert_blocks))
