"""scikit-learn's 8x8 handwritten digits, the default data set (shipped with the package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from app.checks import seed_value
from app.data.base import Augmented, DataModule, split
from app.errors import UserError


class ShiftedImages(Augmented):
    """Images randomly shifted by up to `shift` pixels (zero fill), labels unchanged."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int) -> None:
        super().__init__()
        self.images, self.labels, self.shift = images, labels, shift

    def share_memory(self) -> None:
        self.images.share_memory_()
        self.labels.share_memory_()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.sample_seed(index))
        dy, dx = (torch.randint(-self.shift, self.shift + 1, (2,), generator=g)).tolist()
        s = self.shift
        padded = torch.nn.functional.pad(self.images[index], (s, s, s, s))
        h, w = self.images.shape[-2:]
        return padded[:, s + dy:s + dy + h, s + dx:s + dx + w], self.labels[index]


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 8x8 digits of scikit-learn as (images in [0, 1], labels)."""
    # find_spec locates scikit-learn without importing it (a slow import: docs/measurements.md).
    spec = importlib.util.find_spec("sklearn")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0], "datasets", "data", "digits.csv.gz") if folders else None
    if path is not None and path.is_file():
        table = np.loadtxt(path, delimiter=",", dtype=np.float32)
        images, labels = table[:, :-1], table[:, -1].astype(np.int64)
    else:  # a scikit-learn that stores the file elsewhere: use its public loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images, labels = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    return (images / 16.0).reshape(-1, 1, 8, 8), labels


class Digits(DataModule):
    """scikit-learn's handwritten digits (1,797 grey 8x8 images, 10 classes): light strokes
    (high values) on a dark ground (0).

    The validation split is fixed by `split_seed`, not by the run's `seed`, so that runs of a
    seed sweep, and the evaluation of any checkpoint, all use the same validation images.
    """

    input_shape = (1, 8, 8)
    num_classes = 10

    def __init__(self, val_fraction: float = 0.2, split_seed: int = 0, shift: int = 0,
                 **loader) -> None:
        super().__init__(**loader)
        seed_value("data.split_seed", split_seed)
        if not 0 <= shift < 8:
            raise UserError(f"data.shift={shift}: a number of pixels in [0, 8)")
        images, labels = load_digits_arrays()
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        train_idx, val_idx = split(len(y), val_fraction, split_seed)
        self.train = (ShiftedImages(x[train_idx], y[train_idx], shift) if shift
                      else TensorDataset(x[train_idx], y[train_idx]))
        self.val = TensorDataset(x[val_idx], y[val_idx])
