"""Models that are not from Hugging Face: scaletrain's reference models (they carry ``task`` and
``input_spec``), image classifiers in torchvision's style (a first ``Conv2d``, a last ``Linear``
giving the classes) and any ``nn.Module`` whose forward returns logits or a scalar loss.

What cannot be read off the module may be declared on it as attributes (``task``, ``num_classes``,
``image_size``, ``channels``) or given to :func:`scaletrain.adapt` as keywords.
"""

from __future__ import annotations

from torch import nn

from scaletrain.errors import UserError
from scaletrain.models.adapters.base import Adapter


def _first(model: nn.Module, kind: type) -> nn.Module | None:
    return next((m for m in model.modules() if isinstance(m, kind)), None)


def _last(model: nn.Module, kind: type) -> nn.Module | None:
    found = None
    for m in model.modules():
        if isinstance(m, kind):
            found = m
    return found


def reference_adapter(model: nn.Module) -> Adapter:
    """scaletrain's own models: they declare ``task``, ``input_spec`` and (language models) ``config``."""
    task = getattr(model, "task", "lm")
    cfg = getattr(model, "config", None)
    return Adapter(model, "reference", task=task, vocab_size=getattr(cfg, "vocab_size", None) if task == "lm" else None,
                   num_classes=getattr(model, "num_classes", None), image_size=getattr(model, "image_size", 32),
                   channels=getattr(model, "channels", 3), max_seq=getattr(cfg, "n_positions", None))


def module_adapter(model: nn.Module) -> Adapter:
    """Any other module: an image classifier when its first layer is a ``Conv2d`` (torchvision style),
    a language model when it is an ``nn.Embedding``, else what its attributes declare."""
    task = getattr(model, "task", None)
    conv, emb, head = _first(model, nn.Conv2d), _first(model, nn.Embedding), _last(model, nn.Linear)
    if task is None:
        first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Embedding, nn.Linear))), None)
        if isinstance(first, nn.Embedding):
            task = "lm"
        elif isinstance(first, (nn.Conv2d, nn.Linear)):
            task = "classify"
        else:
            raise UserError(f"cannot adapt {type(model).__name__}: no Conv2d, Embedding or Linear layer to tell its "
                            "task; set model.task = 'lm' or 'classify' (or scaletrain.adapt(model, task=...))")
    if task == "lm":
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or (emb.num_embeddings if emb else None)
        return Adapter(model, "module", task="lm", vocab_size=vocab, max_seq=getattr(model, "max_seq", None))
    num_classes = getattr(model, "num_classes", None) or (head.out_features if head is not None else None)
    channels = getattr(model, "channels", None) or (conv.in_channels if conv is not None else 3)
    first = next((m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))), None)
    return Adapter(model, "image" if conv is not None else "module", task="classify", num_classes=num_classes,
                   image_size=getattr(model, "image_size", 32), channels=channels,
                   knows_input=isinstance(first, nn.Conv2d) or callable(getattr(model, "input_spec", None)))
