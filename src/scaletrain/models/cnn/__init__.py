"""Convolutional image classifiers: scaletrain's VGG (:mod:`.vgg`) and bottleneck ResNet (:mod:`.resnet`),
and torchvision's ResNet layout used unmodified (:mod:`.torchvision`). No tensor-parallel plan (data
parallelism, ZeRO, remat, offload and pipelines cut them by their blocks); priced by their trace."""

from __future__ import annotations

from scaletrain.models.cnn.resnet import ResNet
from scaletrain.models.cnn.torchvision import is_torchvision_resnet, torchvision_resnet_blocks
from scaletrain.models.cnn.vgg import VGG
from scaletrain.models.spec import ModelSpec, listed, register

__all__ = ["ResNet", "VGG"]


SPEC = register(ModelSpec(
    name="cnn",
    classes=(VGG, ResNet),
    models={
        "resnet50": listed("resnet50", ResNet, layers=(3, 4, 6, 3), base_width=64, num_classes=1000, image_size=224,
                           imagenet_stem=True),
        "resnet-mini": listed("resnet-mini", ResNet, layers=(1, 1, 1, 1), base_width=8, num_classes=10, image_size=32,
                              imagenet_stem=False),
        "vgg16": listed("vgg16", VGG, width_div=1, hidden=4096, num_classes=1000, image_size=224, pool_hw=7,
                        dropout=0.5),
        "vgg-mini": listed("vgg-mini", VGG, width_div=8, hidden=256, num_classes=10, image_size=32, pool_hw=1,
                           dropout=0.0),
    },
))

TORCHVISION_SPEC = register(ModelSpec(name="torchvision-resnet", matches=is_torchvision_resnet,
                                      blocks=torchvision_resnet_blocks))
