"""Adapters: how scaletrain drives a model it did not write, without changing it (:func:`adapt`).

One module per family: :mod:`.hf_causal` (GPT-2, Llama, Mistral), :mod:`.hf_masked` (BERT masked
LM, sequence classification), :mod:`.generic` (reference models, torchvision-style image
classifiers, any ``nn.Module`` returning logits or a loss). :func:`adapt` picks one by the model's
class and layout; the same model always gets the same adapter object (cached by identity).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.adapters.base import Adapter, cross_entropy, logits_of, own_loss
from scaletrain.models.adapters.generic import module_adapter, reference_adapter
from scaletrain.models.adapters.hf_causal import causal_adapter, is_causal_lm
from scaletrain.models.adapters.hf_masked import is_masked_lm, is_seq_classifier, masked_adapter, seqcls_adapter

__all__ = ["Adapter", "adapt", "cross_entropy", "input_spec", "logits_of", "own_loss", "task_of"]

_CACHE: "weakref.WeakKeyDictionary[nn.Module, Adapter]" = weakref.WeakKeyDictionary()


def adapt(model: nn.Module, **fields: Any) -> Adapter:
    """The :class:`Adapter` of ``model``; keyword ``fields`` override what was read off it
    (e.g. ``task="classify", num_classes=10, image_size=8``) and are remembered for this model."""
    if isinstance(model, Adapter):
        return dataclasses.replace(model, **fields) if fields else model
    if not isinstance(model, nn.Module):
        raise UserError(f"cannot adapt a {type(model).__name__}: scaletrain trains torch.nn.Module objects")
    a = _CACHE.get(model)
    if a is None:
        source = getattr(model, "source", None)  # a Chain: its source model's adapter, driving the chain
        if isinstance(source, nn.Module) and source is not model:
            a = dataclasses.replace(adapt(source), model=model)
        elif callable(getattr(model, "input_spec", None)) and hasattr(model, "task"):
            a = reference_adapter(model)
        elif is_causal_lm(model):
            a = causal_adapter(model)
        elif is_masked_lm(model):
            a = masked_adapter(model)
        elif is_seq_classifier(model):
            a = seqcls_adapter(model)
        else:
            a = module_adapter(model)
    if fields:
        a = dataclasses.replace(a, **fields)
    _CACHE[model] = a
    return a


def task_of(model: nn.Module) -> str:
    """"lm" or "classify" (see :class:`Adapter`)."""
    return adapt(model).task


def input_spec(model: nn.Module, batch: int, seq: int | None = None) -> torch.Tensor:
    """A meta example input of ``model`` for ``batch`` samples of ``seq`` tokens."""
    return adapt(model).input_spec(batch, seq)
