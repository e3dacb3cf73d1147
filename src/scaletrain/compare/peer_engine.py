"""What every peer engine of :mod:`.peers` is (:class:`PeerEngine`) and the optimizer all of them step
(:func:`_optimizer`): one place that the peers' loop and each framework's engine builder (:mod:`.tp_peer`
among them) import."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from scaletrain.errors import ConfigError


@dataclass
class PeerEngine:
    """A peer's step, as the loop below drives it."""

    forward: nn.Module
    """What runs the forward (the DDP wrapper, the FSDP root, the DeepSpeed engine)."""
    model: nn.Module
    """The model object whose parameters train (for the memory tracker)."""
    optimizer: torch.optim.Optimizer
    """The torch AdamW the framework steps (DeepSpeed: its basic optimizer, over the fp32 partitions)."""
    backward: Callable[[torch.Tensor], None]
    step: Callable[[], float]
    """Clip, update, schedule the learning rate, zero the gradients; returns the global gradient norm."""
    lr: Callable[[], float]
    extra: list[torch.Tensor] = field(default_factory=list)
    """Tensors the framework keeps outside the module's parameters, counted as parameters by the tracker
    (DeepSpeed ZeRO-3's parameter partitions)."""


def _optimizer(cfg: Any, model: nn.Module) -> tuple[torch.optim.Optimizer, Callable[[int], float]]:
    """scaletrain's AdamW over ``model`` (decay / no-decay groups) and its learning-rate factor per step."""
    from scaletrain.techniques.optim import build_optimizer
    from scaletrain.train.lr import lr_factor

    o = cfg.optim
    if o.name != "adamw":
        raise ConfigError(f"optim.name={o.name!r}: the peers run AdamW only; allowed: optim.name=adamw")
    opt = build_optimizer("adamw", model, lr=o.lr, weight_decay=o.weight_decay, betas=(o.beta1, o.beta2),
                          eps=o.eps, **o.options)
    factor = partial(lr_factor, warmup=o.warmup_steps, total=cfg.train.steps, schedule=o.schedule,
                     min_ratio=o.min_lr_ratio)
    return opt, factor
