"""Data sets, built from `conf/data/*.yaml` by `_target_`.

A data object owns its train and validation data sets and the loader settings; the loop
builds the loaders (it owns samplers and their position, for exact resume). Models are built
with the `input_shape` and `num_classes` a data object reports.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from app.config import UserError

log = logging.getLogger(__name__)


class DataModule:
    """What the loop needs from a data object; subclasses fill in `train` and `val`."""

    train: TensorDataset
    val: TensorDataset
    input_shape: tuple[int, ...]
    num_classes: int

    def __init__(self, batch_size: int, val_batch_size: int | None, num_workers: int) -> None:
        if batch_size <= 0:
            raise UserError(f"data.batch_size={batch_size}: must be positive")
        if num_workers < 0:
            raise UserError(f"data.num_workers={num_workers}: must be 0 or more")
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers


def _split(num: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < val_fraction < 1:
        raise UserError(f"data.val_fraction={val_fraction}: must lie strictly between 0 and 1")
    order = torch.randperm(num, generator=torch.Generator().manual_seed(split_seed))
    num_val = round(num * val_fraction)
    return order[num_val:], order[:num_val]


def _digits_file() -> Path | None:
    # find_spec locates scikit-learn without importing it (an import costs about a second).
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "digits.csv.gz")
    return path if path.is_file() else None


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits of scikit-learn as (images in [0, 1], labels)."""
    path = _digits_file()
    if path is not None:
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:  # a scikit-learn that stores the file elsewhere: use its public loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, labels = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    return (images / 16.0).reshape(-1, 1, 8, 8), labels


class Digits(DataModule):
    """scikit-learn's handwritten digits (1,797 grey 8x8 images, 10 classes).

    The validation split is fixed by `split_seed`, not by the run's `seed`, so that runs of a
    seed sweep, and the evaluation of any checkpoint, all use the same validation images.
    """

    input_shape = (1, 8, 8)
    num_classes = 10

    def __init__(
        self,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, num_workers)
        images, labels = load_digits_arrays()
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        train_idx, val_idx = _split(len(y), val_fraction, split_seed)
        self.train = TensorDataset(x[train_idx], y[train_idx])
        self.val = TensorDataset(x[val_idx], y[val_idx])


class Synthetic(DataModule):
    """Random inputs of any shape, labelled by a fixed random linear rule (so it can be learnt).

    Generated once from `data_seed`; meant for speed tests and models of any input size.
    """

    def __init__(
        self,
        num_samples: int = 4096,
        input_shape: tuple[int, ...] | list[int] = (1, 8, 8),
        num_classes: int = 10,
        val_fraction: float = 0.2,
        data_seed: int = 0,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, val_batch_size, num_workers)
        if num_samples < 2 or num_classes < 2 or any(int(d) <= 0 for d in input_shape):
            raise UserError(
                f"data: num_samples={num_samples}, num_classes={num_classes} and "
                f"input_shape={list(input_shape)} must be at least 2, 2 and positive"
            )
        self.input_shape = tuple(int(d) for d in input_shape)
        self.num_classes = num_classes
        g = torch.Generator().manual_seed(data_seed)
        x = torch.randn(num_samples, *self.input_shape, generator=g)
        rule = torch.randn(x[0].numel(), num_classes, generator=g)
        y = (x.flatten(1) @ rule).argmax(1)
        train_idx, val_idx = _split(num_samples, val_fraction, data_seed)
        self.train = TensorDataset(x[train_idx], y[train_idx])
        self.val = TensorDataset(x[val_idx], y[val_idx])
