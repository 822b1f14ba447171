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
from torch.utils.data import Dataset, TensorDataset

from app.checks import seed_value, whole, widths
from app.errors import UserError

log = logging.getLogger(__name__)


class DataModule:
    """What the loop needs from a data object; subclasses fill in `train` and `val`.

    Loader settings: `num_workers` loader processes, `pin_memory` (page-locked batches, with
    CUDA), `persistent_workers` (kept across epochs), `cache` (the decoded data set in shared
    memory, mapped by every loader worker instead of copied into each).
    """

    train: Dataset
    val: TensorDataset
    input_shape: tuple[int, ...]
    num_classes: int

    def __init__(self, batch_size: int, val_batch_size: int | None, num_workers: int,
                 pin_memory: bool = True, persistent_workers: bool = True,
                 cache: bool = False) -> None:
        whole("data.batch_size", batch_size, 1)
        if val_batch_size is not None:
            whole("data.val_batch_size", val_batch_size, 1)
        whole("data.num_workers", num_workers, 0)
        self.batch_size = batch_size
        self.val_batch_size = val_batch_size or batch_size
        self.num_workers = num_workers
        self.pin_memory, self.persistent_workers, self.cache = (
            pin_memory, persistent_workers, cache)

    def set_epoch(self, epoch: int, seed: int) -> None:
        """Called by the loop before each epoch (random augmentations key on it)."""

    def cache_in_memory(self) -> None:
        """Decode every sample once into shared memory (`cache=true`)."""
        self.train = _shared(self.train)
        self.val = _shared(self.val)
        log.info("cached %d + %d samples in shared memory", len(self.train), len(self.val))


def _shared(dataset: Dataset) -> Dataset:
    if isinstance(dataset, TensorDataset):
        for tensor in dataset.tensors:
            tensor.share_memory_()
        return dataset
    if isinstance(dataset, ShiftedImages):
        dataset.images.share_memory_()
        dataset.labels.share_memory_()
        return dataset
    items = [dataset[i] for i in range(len(dataset))]  # any map-style data set of tensors
    return TensorDataset(*(torch.stack([torch.as_tensor(f) for f in field]).share_memory_()
                           for field in zip(*items, strict=True)))


class ShiftedImages(Dataset):
    """Images randomly shifted by up to `shift` pixels (zero fill), labels unchanged.

    The shift of sample i in an epoch comes from (seed, epoch, i) alone: the same whichever
    loader worker draws it, so loader workers never repeat each other's shifts and a resumed
    run sees the same augmented samples.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int) -> None:
        self.images, self.labels, self.shift = images, labels, shift
        self.key = torch.zeros(2, dtype=torch.int64).share_memory_()  # seed, epoch

    def set_epoch(self, epoch: int, seed: int) -> None:
        self.key[0], self.key[1] = seed, epoch

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        seed, epoch = self.key.tolist()
        # Folded into the 64 bits torch's generators take (a large seed overflows them).
        g = torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 10_007 + index) % 2**64)
        dy, dx = (torch.randint(-self.shift, self.shift + 1, (2,), generator=g)).tolist()
        s = self.shift
        padded = torch.nn.functional.pad(self.images[index], (s, s, s, s))
        h, w = self.images.shape[-2:]
        return padded[:, s + dy:s + dy + h, s + dx:s + dx + w], self.labels[index]


def _split(num: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < val_fraction < 1:
        raise UserError(f"data.val_fraction={val_fraction}: must lie strictly between 0 and 1")
    num_val = round(num * val_fraction)
    if not 0 < num_val < num:  # an empty split would divide by zero at the first validation
        split = "no sample for validation" if num_val < 1 else "no sample for training"
        raise UserError(
            f"data.val_fraction={val_fraction} of {num} samples leaves {split}; the minimum is "
            f"{1 / num:.2g} and the maximum {1 - 1 / num:.4g} (one sample in each split)")
    order = torch.randperm(num, generator=torch.Generator().manual_seed(split_seed))
    return order[num_val:], order[:num_val]


def _digits_file() -> Path | None:
    # find_spec locates scikit-learn without importing it (a slow import: docs/measurements.md).
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
        shift: int = 0,
        batch_size: int = 64,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        pin_memory: bool = True,
        persistent_workers: bool = True,
        cache: bool = False,
    ) -> None:
        super().__init__(batch_size, val_batch_size, num_workers, pin_memory,
                         persistent_workers, cache)
        seed_value("data.split_seed", split_seed)
        if not 0 <= shift < 8:
            raise UserError(f"data.shift={shift}: a number of pixels in [0, 8)")
        images, labels = load_digits_arrays()
        x, y = torch.from_numpy(images), torch.from_numpy(labels)
        train_idx, val_idx = _split(len(y), val_fraction, split_seed)
        self.train = (ShiftedImages(x[train_idx], y[train_idx], shift) if shift
                      else TensorDataset(x[train_idx], y[train_idx]))
        self.val = TensorDataset(x[val_idx], y[val_idx])

    def set_epoch(self, epoch: int, seed: int) -> None:
        if isinstance(self.train, ShiftedImages):
            self.train.set_epoch(epoch, seed)


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
        pin_memory: bool = True,
        persistent_workers: bool = True,
        cache: bool = False,
    ) -> None:
        super().__init__(batch_size, val_batch_size, num_workers, pin_memory,
                         persistent_workers, cache)
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
        train_idx, val_idx = _split(num_samples, val_fraction, data_seed)
        self.train = TensorDataset(x[train_idx], y[train_idx])
        self.val = TensorDataset(x[val_idx], y[val_idx])
