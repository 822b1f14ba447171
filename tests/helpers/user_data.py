"""A user's own data set: plain Python lists behind a map-style Dataset (no tensors attribute,
no app base class for the data set itself), normalised, with `show` undoing it: what
`data._target_=user_data.ListDigits` gives the modes and callbacks to work with."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from app.data import DataModule, load_digits_arrays

MEAN, STD = 0.3, 0.4


class Pairs(Dataset):
    def __init__(self, images: list, labels: list) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return (torch.tensor(self.images[index]) - MEAN) / STD, self.labels[index]


class ListDigits(DataModule):
    input_shape = (1, 8, 8)
    num_classes = 10

    def __init__(self, **loader) -> None:
        super().__init__(**loader)
        images, labels = load_digits_arrays()
        images, labels = images[:600].tolist(), labels[:600].tolist()
        self.train, self.val = Pairs(images[:500], labels[:500]), Pairs(images[500:], labels[500:])

    def show(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * STD + MEAN
