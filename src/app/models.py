"""Models, built from `conf/model/*.yaml` by `_target_`.

Every model takes `input_shape` and `num_classes` keyword arguments, passed in by the loop
from the data object, so a model config never repeats facts about the data.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

from app.checks import widths
from app.errors import UserError, first_line


class CNN(nn.Module):
    """A small convolutional classifier: blocks of two 3x3 convolutions and a 2x2 max-pool,
    then a linear head on the flattened features."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: tuple[int, ...] | list[int] = (32, 64),
        dropout: float = 0.1,
        batch_norm: bool = False,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise UserError(
                f"model=cnn needs images shaped (channels, height, width), the data gives "
                f"{list(input_shape)}; use model=mlp"
            )
        in_channels, height, width = input_shape
        channels = widths("model.channels", channels)
        if min(height, width) < 2 ** len(channels):
            raise UserError(
                f"model.channels={list(channels)}: {len(channels)} blocks halve {height}x{width} "
                f"images below one pixel; use fewer blocks"
            )
        if not 0 <= dropout < 1:
            raise UserError(f"model.dropout={dropout}: must lie in [0, 1)")
        layers: list[nn.Module] = []
        for out_channels in channels:
            layers += [
                nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=not batch_norm),
                nn.BatchNorm2d(out_channels) if batch_norm else nn.Identity(),
                nn.ReLU(inplace=True),
                nn.Conv2d(out_channels, out_channels, 3, padding=1),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            in_channels, height, width = out_channels, height // 2, width // 2
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(
            nn.Flatten(), nn.Dropout(dropout), nn.Linear(in_channels * height * width, num_classes)
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


class MLP(nn.Module):
    """A multi-layer perceptron on flattened inputs."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        hidden: tuple[int, ...] | list[int] = (256, 256),
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if not 0 <= dropout < 1:
            raise UserError(f"model.dropout={dropout}: must lie in [0, 1)")
        hidden = widths("model.hidden", hidden)
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(inplace=True), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class _Block(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a 1x1 convolution where the
    shape changes): ResNet's basic block."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else (
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                          nn.BatchNorm2d(out_channels)))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet for images of any size: a 3x3 stem, one stage of `blocks` basic blocks
    per entry of `channels` (each stage after the first halves the resolution), global
    average pooling and a linear head."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        channels: tuple[int, ...] | list[int] = (16, 32, 64),
        blocks: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise UserError(f"model=resnet needs images shaped (channels, height, width), the "
                            f"data gives {list(input_shape)}; use model=mlp")
        channels = widths("model.channels", channels)
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise UserError(f"model.blocks={blocks}: a whole number of blocks per stage, 1 or more")
        if not 0 <= dropout < 1:
            raise UserError(f"model.dropout={dropout}: must lie in [0, 1)")
        layers: list[nn.Module] = [
            nn.Conv2d(input_shape[0], channels[0], 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels[0]), nn.ReLU(inplace=True)]
        width = channels[0]
        for stage, out_channels in enumerate(channels):
            for block in range(blocks):
                stride = 2 if stage > 0 and block == 0 else 1
                layers.append(_Block(width, out_channels, stride))
                width = out_channels
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout),
                                  nn.Linear(width, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def torchvision_model(input_shape: tuple[int, ...], num_classes: int, name: str = "resnet18",
                      **kwargs: Any) -> nn.Module:
    """Any torchvision classification model by name (`torchvision.models.get_model`), with the
    data's classes, untrained (`weights` loads torchvision's own, where it has them
    locally). torchvision is optional; PyPI's wheels import only with a CUDA build of torch."""
    try:
        import torchvision
    except (ImportError, RuntimeError) as e:  # (the CPU wheel: "operator torchvision::nms")
        raise UserError(f"model=torchvision needs torchvision, which does not import here "
                        f"({first_line(e)}): pip install torchvision for "
                        f"the installed torch") from None
    if input_shape[0] != 3:
        raise UserError(f"model=torchvision: torchvision's models take 3 channels, the data "
                        f"gives {input_shape[0]}; use data.channels=3, or model=timm")
    try:
        return torchvision.models.get_model(name, num_classes=num_classes, **kwargs)
    except ValueError as e:
        raise UserError(f"model.name={name}: {e}") from None


def timm_model(input_shape: tuple[int, ...], num_classes: int, name: str = "resnet18",
               pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Any timm model by name (`timm.create_model`) with the data's classes and channels.
    timm is optional (it needs torchvision)."""
    try:
        import timm
    except (ImportError, RuntimeError) as e:
        raise UserError(f"model=timm needs timm, which does not import here "
                        f"({first_line(e)}): pip install timm") from None
    if not timm.is_model(name):
        raise UserError(f"model.name={name}: not a timm model (timm.list_models() lists them)")
    return timm.create_model(name, pretrained=pretrained, num_classes=num_classes,
                             in_chans=input_shape[0], **kwargs)
