"""The replay test's injected faults (user components, as in faults.py): Digits with one
poisoned training sample, and a model whose backward, not its forward, goes NaN at a value.

From epoch `poison_epoch` on (after the first epoch's checkpoint) the sample at
`poison_index` has its first pixel set to `poison_value`: inf makes the first layer's output
non-finite there; `FragileCNN`'s marker value makes only the gradient NaN."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from app.data import Digits
from app.models import CNN

MARKER = -3.25  # a pixel value digits never have


class _Poisoned(Dataset):
    def __init__(self, inner: Dataset, index: int, value: float) -> None:
        self.inner, self.index, self.value, self.armed = inner, index, value, False

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        x, y = self.inner[i]
        if self.armed and i == self.index:
            x = x.clone()
            x.view(-1)[0] = self.value
        return x, y


class PoisonedDigits(Digits):
    def __init__(self, poison_index: int, poison_epoch: int = 1,
                 poison_value: float = float("inf"), **kwargs) -> None:
        super().__init__(**kwargs)
        self.poison_epoch = poison_epoch
        self.train = _Poisoned(self.train, poison_index, poison_value)

    def set_epoch(self, epoch: int, seed: int) -> None:
        super().set_epoch(epoch, seed)
        self.train.armed = epoch >= self.poison_epoch


class Fragile(nn.Module):
    """The identity in the forward; in the backward, NaN for its scale at a MARKER input (the
    derivative of sqrt at 0, times 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * torch.sqrt((x * self.scale - MARKER).abs())


class FragileCNN(CNN):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fragile = Fragile()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.fragile(x))
