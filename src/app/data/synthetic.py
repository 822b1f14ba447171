"""Random tensors of any shape, for speed tests and models of any input size."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from app.checks import seed_value, whole, widths
from app.data.base import DataModule, split
from app.errors import UserError


class Synthetic(DataModule):
    """Random inputs of any shape, labelled by a fixed random linear rule (so it can be learnt).

    Generated once from `data_seed`; meant for speed tests and models of any input size.
    """

    def __init__(self, num_samples: int = 4096,
                 input_shape: tuple[int, ...] | list[int] = (1, 8, 8), num_classes: int = 10,
                 val_fraction: float = 0.2, data_seed: int = 0, **loader) -> None:
        super().__init__(**loader)
        whole("data.num_samples", num_samples, 2)
        whole("data.num_classes", num_classes, 2)
        seed_value("data.data_seed", data_seed)
        self.input_shape = tuple(widths("data.input_shape", input_shape))
        if not self.input_shape:
            raise UserError("data.input_shape=[]: give at least one dimension")
        self.num_classes = num_classes
        g = torch.Generator().manual_seed(data_seed)
        x = torch.randn(num_samples, *self.input_shape, generator=g)
        rule = torch.randn(x[0].numel(), num_classes, generator=g)
        y = (x.flatten(1) @ rule).argmax(1)
        train_idx, val_idx = split(num_samples, val_fraction, data_seed)
        self.train = TensorDataset(x[train_idx], y[train_idx])
        self.val = TensorDataset(x[val_idx], y[val_idx])
