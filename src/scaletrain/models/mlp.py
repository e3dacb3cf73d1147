"""A chain of fully connected layers of configurable (possibly very unequal) widths.

Input is flattened, so it also classifies small images ([batch, C, H, W] -> [batch, classes]).
Heterogeneous widths make it the simplest test bed for memory planners.
"""

from __future__ import annotations

import torch
from torch import nn

from scaletrain.models.spec import ModelSpec, listed, register


class Dense(nn.Module):
    """Linear, then GELU and dropout unless it is the last layer. Flattens its input if asked."""

    def __init__(self, in_f: int, out_f: int, last: bool, dropout: float, flatten: bool):
        super().__init__()
        self.flatten = flatten
        self.fc = nn.Linear(in_f, out_f)
        self.act = nn.Identity() if last else nn.GELU()
        self.drop = nn.Identity() if last or dropout == 0 else nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.flatten:
            x = torch.flatten(x, 1)
        return self.drop(self.act(self.fc(x)))


class MLP(nn.Module):
    """widths = (in_features, hidden..., classes); one block per linear layer."""

    task = "classify"

    def __init__(self, widths: tuple[int, ...] = (192, 512, 512, 512, 10), dropout: float = 0.0,
                 image_size: int = 8, channels: int = 3):
        super().__init__()
        if len(widths) < 2:
            raise ValueError("mlp widths need at least (in_features, out_features)")
        self.widths = tuple(widths)
        self.image_size = image_size
        self.channels = channels
        self.num_classes = widths[-1]
        n = len(widths) - 1
        self.layers = nn.ModuleList(
            Dense(widths[i], widths[i + 1], i == n - 1, dropout, flatten=(i == 0)) for i in range(n)
        )

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"layers.{i}", b) for i, b in enumerate(self.layers)]

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        if self.channels * self.image_size**2 == self.widths[0]:
            return torch.zeros(batch, self.channels, self.image_size, self.image_size, device="meta")
        return torch.zeros(batch, self.widths[0], device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


SPEC = register(ModelSpec(name="mlp", classes=(MLP,), models={
    "mlp": listed("mlp", MLP, widths=(192, 512, 512, 512, 10), dropout=0.0, image_size=8, channels=3)}))
"""The ``mlp`` family: its blocks are its own (``chain_blocks``); priced by its trace."""
