"""What every data object has: the loader settings, the two splits, and the hooks the modes
and pictures use (`decode_file`, `show`, `state_dict`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from app.checks import whole
from app.config import LoaderConfig
from app.errors import UserError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".bmp", ".gif", ".jpeg", ".jpg", ".png", ".tif", ".tiff", ".webp")


def is_image_name(name: str) -> bool:
    """An image file's name by its suffix; hidden files (`.DS_Store`, `._IMG.jpg`) are not."""
    return Path(name).suffix.lower() in IMAGE_SUFFIXES and not name.startswith(".")


class DataModule:
    """What the loop needs from a data object; subclasses fill in `train` and `val` (any
    map-style data sets of `(input, target)`), `input_shape` and `num_classes`.

    Loader settings: `num_workers` loader processes, `pin_memory` (page-locked batches, with
    CUDA), `persistent_workers` (kept across epochs), `cache` (the decoded data set in shared
    memory, mapped by every loader worker instead of copied into each).
    """

    train: Dataset
    val: Dataset
    input_shape: tuple[int, ...]
    num_classes: int
    classes: list[str] | None = None  # the classes' names, where the data has them

    def __init__(self, batch_size: int = LoaderConfig.batch_size,
                 val_batch_size: int | None = LoaderConfig.val_batch_size,
                 num_workers: int = LoaderConfig.num_workers,
                 pin_memory: bool = LoaderConfig.pin_memory,
                 persistent_workers: bool = LoaderConfig.persistent_workers,
                 cache: bool = LoaderConfig.cache) -> None:
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
        if isinstance(self.train, Augmented):
            self.train.set_epoch(epoch, seed)

    def cache_in_memory(self) -> None:
        """Decode every sample once into shared memory (`cache=true`)."""
        self.train = _shared(self.train)
        self.val = _shared(self.val)
        log.info("cached %d + %d samples in shared memory", len(self.train), len(self.val))

    def prepare(self) -> None:
        """Learn from the training set what `state_dict` keeps (a normalisation, say): called
        before training, and by evaluation, prediction and export after the checkpoint's
        state was loaded (which then leaves nothing to learn)."""

    def state_dict(self) -> dict[str, Any]:
        """What the data learnt from the training set (a normalisation, say): kept in every
        checkpoint, so evaluation, prediction and export see inputs as training did."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what `state_dict` gave (from a checkpoint)."""

    def decode_file(self, path: Path) -> torch.Tensor:
        """One input from an image file, as the model takes it (predict on a folder). This
        default: grey or RGB by the input's channels, resized to its height and width,
        scaled to [0, 1]: pixels as they are, light high and dark low."""
        from app.data import transforms

        if len(self.input_shape) != 3 or self.input_shape[0] not in (1, 3):
            raise UserError(f"{path}: images need a 1- or 3-channel image model; the data's "
                            f"inputs have shape {list(self.input_shape)}")
        channels, height, width = self.input_shape
        image = transforms.decode(path, "L" if channels == 1 else "RGB").resize((width, height))
        return transforms.to_tensor(image)

    def show(self, inputs: torch.Tensor) -> torch.Tensor:
        """Inputs as pictures show them: images with values in [0, 1] (a data set that
        normalises its images undoes that here)."""
        return inputs


def first_samples(dataset: Dataset, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `count` samples of any map-style data set of `(input, target)`, batched."""
    return tuple(next(iter(DataLoader(dataset, batch_size=count))))


def _shared(dataset: Dataset) -> Dataset:
    if isinstance(dataset, TensorDataset):
        for tensor in dataset.tensors:
            tensor.share_memory_()
        return dataset
    share = getattr(dataset, "share_memory", None)
    if share is not None:  # a data set that knows its tensors (ShiftedImages)
        share()
        return dataset
    items = [dataset[i] for i in range(len(dataset))]  # any map-style data set of tensors
    return TensorDataset(*(torch.stack([torch.as_tensor(f) for f in field]).share_memory_()
                           for field in zip(*items, strict=True)))


def split(num: int, val_fraction: float, split_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation indices of `num` samples: a `val_fraction` share for validation,
    drawn by `split_seed`."""
    if not 0 < val_fraction < 1:
        raise UserError(f"data.val_fraction={val_fraction}: must lie strictly between 0 and 1")
    num_val = round(num * val_fraction)
    if not 0 < num_val < num:  # an empty split would divide by zero at the first validation
        which = "no sample for validation" if num_val < 1 else "no sample for training"
        raise UserError(
            f"data.val_fraction={val_fraction} of {num} samples leaves {which}; the minimum is "
            f"{1 / num:.2g} and the maximum {1 - 1 / num:.4g} (one sample in each split)")
    order = torch.randperm(num, generator=torch.Generator().manual_seed(split_seed))
    return order[num_val:], order[:num_val]


class Augmented(Dataset):
    """A data set whose random augmentation of a sample is drawn from (seed, epoch, index)
    alone: the same whichever loader worker draws it, so workers never repeat each other and a
    resumed run sees the same augmented samples. The key is in shared memory: persistent
    loader workers see each new epoch."""

    def __init__(self) -> None:
        self.key = torch.zeros(2, dtype=torch.int64).share_memory_()  # seed, epoch

    def set_epoch(self, epoch: int, seed: int) -> None:
        self.key[0], self.key[1] = seed, epoch

    def sample_seed(self, index: int) -> int:
        """Sample `index`'s seed in this epoch, folded into the 64 bits torch's generators take."""
        seed, epoch = self.key.tolist()
        return ((seed * 1_000_003 + epoch) * 10_007 + index) % 2**64
