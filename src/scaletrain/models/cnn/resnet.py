"""ResNet (He et al. 2016) with bottleneck blocks, layer for layer as torchvision's ``resnet50``
(25,557,032 parameters at 1000 classes), plus a scaled-down variant for CPU.

Blocks of the chain: the stem, every bottleneck, and the pooling+classifier head.
"""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (stride here, as torchvision "v1.5") -> 1x1 expand, plus identity/projection."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class Stem(nn.Module):
    """ImageNet stem (7x7/2 conv, max-pool /2) or a small-image stem (3x3/1 conv, no pool)."""

    def __init__(self, out_ch: int, imagenet: bool):
        super().__init__()
        if imagenet:
            self.conv1 = nn.Conv2d(3, out_ch, 7, stride=2, padding=3, bias=False)
            self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        else:
            self.conv1 = nn.Conv2d(3, out_ch, 3, stride=1, padding=1, bias=False)
            self.pool = nn.Identity()
        self.bn1 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.relu(self.bn1(self.conv1(x))))


class ClassifierHead(nn.Module):
    """Global average pool -> flatten -> linear. [b, c, h, w] -> [b, classes]."""

    def __init__(self, in_ch: int, num_classes: int):
        super().__init__()
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class ResNet(nn.Module):
    """Bottleneck ResNet: images [batch, 3, H, W] -> logits [batch, classes]."""

    task = "classify"

    def __init__(self, layers: tuple[int, ...] = (3, 4, 6, 3), base_width: int = 64,
                 num_classes: int = 1000, image_size: int = 224, imagenet_stem: bool = True):
        super().__init__()
        self.image_size = image_size
        self.num_classes = num_classes
        self.stem = Stem(base_width, imagenet_stem)
        blocks: list[nn.Module] = []
        in_ch = base_width
        for stage, n in enumerate(layers):
            width = base_width * 2**stage
            for i in range(n):
                stride = 2 if (i == 0 and stage > 0) else 1
                blocks.append(Bottleneck(in_ch, width, stride))
                in_ch = width * Bottleneck.expansion
        self.layers = nn.ModuleList(blocks)
        self.head = ClassifierHead(in_ch, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def chain_blocks(self) -> list[tuple[str, nn.Module]]:
        return [("stem", self.stem)] + [(f"layers.{i}", b) for i, b in enumerate(self.layers)] + [("head", self.head)]

    def input_spec(self, batch: int, seq: int | None = None) -> torch.Tensor:
        return torch.zeros(batch, 3, self.image_size, self.image_size, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for b in self.layers:
            x = b(x)
        return self.head(x)
