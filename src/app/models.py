"""Models, built from `conf/model/*.yaml` by `_target_`.

Every model takes `input_shape` and `num_classes` keyword arguments, passed in by the loop
from the data object, so a model config never repeats facts about the data.
"""

from __future__ import annotations

import math

from torch import Tensor, nn

from app.checks import widths
from app.errors import UserError


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
