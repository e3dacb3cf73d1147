"""The runtime's apply faces composed in one place, in a fixed, commented order.

Given a Trainer (model, config, precision), return the function that runs one micro-batch's
forward and backward. Order (outermost first):

1. activation compression — a ``saved_tensors_hooks`` context around everything below, so it
   also compresses what a rematerialization schedule keeps;
2. rematerialization — replaces the plain forward/backward by a schedule executor over the Chain;
3. the plain forward/backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # pragma: no cover
    from scaletrain.train.trainer import Trainer

ForwardBackward = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def build_forward_backward(trainer: "Trainer") -> ForwardBackward:
    mem = trainer.cfg.memory
    fb: ForwardBackward = trainer.plain_forward_backward
    if mem.remat.method != "none":
        from scaletrain.techniques.remat.trainer_hook import remat_forward_backward

        fb = remat_forward_backward(trainer)
    if mem.activation_compression:
        from scaletrain.techniques.act_compress import compressed_saved_tensors

        inner = fb

        def fb(x: torch.Tensor, y: torch.Tensor, weight: float) -> torch.Tensor:  # noqa: F811
            with compressed_saved_tensors():
                return inner(x, y, weight)

    return fb
