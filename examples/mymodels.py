"""A model of your own, trained by name: `scaletrain train model.name=py:mymodels:make_classifier ...`
(README, "Bring your own model"). Any module works; run scaletrain from this directory or put it on
PYTHONPATH so that `mymodels` imports.

The factory gets `model.overrides.*` as keyword arguments and returns a plain `nn.Module`: here a
small CNN for the shipped 8x8 digits (1 channel, 10 classes). Nothing in it knows scaletrain; the
attributes below only say what cannot be read off the layers (the input's side and channels).
"""

from __future__ import annotations

from torch import nn


def make_classifier(width: int = 16, num_classes: int = 10) -> nn.Module:
    """Two 3x3 convolutions of ``width`` channels, global average pooling, a linear head."""
    model = nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(width, num_classes),
    )
    model.image_size, model.channels, model.num_classes = 8, 1, num_classes
    return model
