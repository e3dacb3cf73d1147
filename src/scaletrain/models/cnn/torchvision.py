"""torchvision's ResNet layout (``conv1 bn1 relu maxpool layer1..4 avgpool fc``), used unmodified: its
blocks are the stem, every block of ``layer1..layer4``, then pooling + classifier."""

from __future__ import annotations

from torch import nn

from scaletrain.models.chain import Seq

_TV_RESNET = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc")


def is_torchvision_resnet(model: nn.Module) -> bool:
    return all(hasattr(model, a) for a in _TV_RESNET)


def torchvision_resnet_blocks(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    if not is_torchvision_resnet(model):
        return None
    blocks: list[tuple[str, nn.Module]] = [("stem", Seq(model.conv1, model.bn1, model.relu, model.maxpool))]
    for li in range(1, 5):
        for j, b in enumerate(getattr(model, f"layer{li}")):
            blocks.append((f"layer{li}.{j}", b))
    blocks.append(("head", Seq(model.avgpool, model.fc, flatten_before_last=True)))
    return blocks
