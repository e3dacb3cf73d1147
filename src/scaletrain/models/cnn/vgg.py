"""VGG-16 (Simonyan & Zisserman 2015, configuration D, no batch norm) as torchvision's ``vgg16``
(138,357,544 parameters at 1000 classes), plus a narrow variant for CPU.

Blocks of the chain: each 3x3 conv + ReLU (with the following max-pool folded in), then the three
classifier layers — a deliberately heterogeneous chain (conv blocks heavy in activations, the
first classifier layer heavy in parameters).
"""

from __future__ import annotations

import torch
from torch import nn

CFG_D = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class ConvBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, pool: bool):
        super().__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(2, 2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.conv(x)))


class FCBlock(nn.Module):
    """Optional (adaptive-avg-pool to pool_hw x pool_hw + flatten) -> linear -> optional ReLU+dropout."""

    def __init__(self, in_f: int, out_f: int, last: bool, dropout: float, pool_hw: int | None = None):
        super().__init__()
        self.pool_hw = pool_hw
        self.fc = nn.Linear(in_f, out_f)
        self.act = nn.Identity() if last else nn.Sequential(nn.ReLU(inplace=True), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pool_hw is not None:
            x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, self.pool_hw), 1)
        return self.act(self.fc(x))


class VGG(nn.Module):
    """VGG: images [batch, 3, H, W] -> logits [batch, classes]."""

    task = "classify"

    def __init__(self, width_div: int = 1, hidden: int = 4096, num_classes: int = 1000,
                 image_size: int = 224, pool_hw: int = 7, dropout: float = 0.5):
        super().__init__()
        self.image_size = image_size
        self.num_classes = num_classes
        convs: list[nn.Module] = []
        in_ch = 3
        cfg = list(CFG_D)
        for i, c in enumerate(cfg):
            if c == "M":
                continue
            out_ch = c // width_div
            pool = i + 1 < len(cfg) and cfg[i + 1] == "M"
            convs.append(ConvBlock(in_ch, out_ch, pool))
            in_ch = out_ch
        self.features = nn.ModuleList(convs)
        self.classifier = nn.ModuleList([
            FCBlock(in_ch * pool_hw * pool_hw, hidden, False, dropout, pool_hw=pool_hw),
            FCBlock(hidden, hidden, False, dropout),
            FCBlock(hidden, num_classes, True, dropout),
        ])
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        return [(f"features.{i}", b) for i, b in enumerate(self.features)] + [
            (f"classifier.{i}", b) for i, b in enumerate(self.classifier)
        ]

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        return torch.zeros(batch, 3, self.image_size, self.image_size, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.features:
            x = b(x)
        for b in self.classifier:
            x = b(x)
        return x
