"""What image data sets share (`data=image_folder`, `data=hf`): images decoded with Pillow as
grey (`channels=1`) or RGB (`channels=3`), viewed at `image_size`, augmented for training
(random resized crop and flip, drawn from (seed, epoch, index)), and normalised per channel:
by the `mean` and `std` given, or by those of the training images (computed once, from up to
STATS_SAMPLES of them, and kept in every checkpoint, so evaluation and prediction see images
as training did).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from app import dist
from app.checks import seed_value, widths
from app.data import transforms
from app.data.base import Augmented, DataModule
from app.errors import BadImage, UserError

log = logging.getLogger(__name__)

STATS_SAMPLES = 1000  # training images the normalisation is computed from, at most
BAD_FILES = ("fail", "skip")
SKIP_HINT = "; remove or replace it, or skip unreadable images with data.bad_files=skip"


class Decoded:
    """Every image of a set decoded once, in one shared-memory block that loader workers map
    instead of copying (`data.cache=true`); an image comes back exactly as decoding gives it,
    so training is the same with the cache and without."""

    def __init__(self, images: list[Image.Image]) -> None:
        arrays = [np.asarray(image, dtype=np.uint8) for image in images]
        self.shapes = [a.shape for a in arrays]
        self.offsets = [0, *itertools.accumulate(a.size for a in arrays)]
        self.pixels = torch.from_numpy(np.concatenate([a.ravel() for a in arrays])).share_memory_()

    def image(self, index: int) -> Image.Image:
        pixels = self.pixels[self.offsets[index]:self.offsets[index + 1]]
        return Image.fromarray(pixels.view(self.shapes[index]).numpy())  # (its mode: L or RGB)


class ImageSet(Augmented):
    """Images with their labels, decoded when read (`load`, by the subclass, which also takes
    a `subset` of them), viewed as the module's docstring says."""

    def __init__(self, labels: list[int], mode: str) -> None:
        super().__init__()
        self.labels = [int(label) for label in labels]  # (an int a sample: cheaper to batch)
        self.mode = mode
        self.decoded: Decoded | None = None  # (the view: ImageData.use sets it)

    def view(self, size: tuple[int, int], stats: torch.Tensor,
             augment: dict[str, Any] | None) -> None:
        """The view's size, the normalisation (mean and std, a tensor updated in place) and
        the augmentation (None: the evaluation view)."""
        self.size, self.stats, self.augment = size, stats, augment
        self._mean, self._std = stats[0][:, None, None], stats[1][:, None, None]  # (views)

    def __len__(self) -> int:
        return len(self.labels)

    def share_memory(self) -> None:  # data.cache=true
        self.decoded = Decoded([self._loaded(i) for i in range(len(self))])

    def image(self, index: int) -> Image.Image:
        return self._loaded(index) if self.decoded is None else self.decoded.image(index)

    def _loaded(self, index: int) -> Image.Image:
        try:
            return self.load(index)
        except BadImage as e:  # (met while training: say what helps)
            raise BadImage(f"{e}{SKIP_HINT}") from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = None if self.augment is None else random.Random(self.sample_seed(index))
        return self.tensor(self.image(index), rng), self.labels[index]

    def tensor(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        """The image's evaluation view, or with `rng` its augmented one, normalised."""
        if rng is None:
            image = transforms.resize_and_crop(image, self.size)
        else:
            image = transforms.random_resized_crop(image, self.size, rng=rng, **self.augment)
        return transforms.to_tensor(image).sub_(self._mean).div_(self._std)


class ImageData(DataModule):
    """A data module of two ImageSets (its subclass finds them and calls `use`).

    `augment` turns on the training augmentation (a random resized crop with an area share in
    `crop_scale`, and a left-right flip with `flip`); `mean` and `std` fix the normalisation
    (else it comes from the training images).
    """

    def __init__(self, image_size: int | list[int] = 32, channels: int = 3,
                 mean: list[float] | None = None, std: list[float] | None = None,
                 augment: bool = True, crop_scale: list[float] | tuple[float, float] = (0.35, 1.0),
                 flip: bool = True, split_seed: int = 0, bad_files: str = "fail",
                 **loader) -> None:
        super().__init__(**loader)
        if bad_files not in BAD_FILES:
            raise UserError(f"data.bad_files={bad_files}: one of {', '.join(BAD_FILES)}")
        self.bad_files = bad_files
        self.split_seed = seed_value("data.split_seed", split_seed)
        if isinstance(channels, bool) or channels not in (1, 3):
            raise UserError(f"data.channels={channels}: 1 (grey) or 3 (RGB)")
        size = widths("data.image_size", [image_size] * 2 if isinstance(image_size, int)
                      and not isinstance(image_size, bool) else image_size)
        if len(size) != 2:
            raise UserError(f"data.image_size={image_size}: one size, or [height, width]")
        scale = numbers("data.crop_scale", crop_scale, 2)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise UserError(f"data.crop_scale={list(crop_scale)}: [low, high] with "
                            f"0 < low <= high <= 1 (shares of the image's area)")
        if (mean is None) != (std is None):
            raise UserError("data.mean and data.std: give both, or neither (then they are "
                            "computed from the training images)")
        self.mode = "L" if channels == 1 else "RGB"
        self.input_shape = (channels, size[0], size[1])
        self.stats = torch.zeros(2, channels).share_memory_()  # mean, std per channel
        self._given = None
        if mean is not None:
            mean, std = numbers("data.mean", mean, channels), numbers("data.std", std, channels)
            if min(std) <= 0:
                raise UserError(f"data.std={std}: every value must be positive")
            self._given = torch.tensor([mean, std], dtype=torch.float32)
        for key, value in (("data.augment", augment), ("data.flip", flip)):
            if not isinstance(value, bool):  # (Hydra passes `off` or `no` on as strings)
                raise UserError(f"{key}={value}: expected true or false")
        self._augment = {"scale": tuple(scale), "flip": flip} if augment else None
        self._normalised = False  # by `prepare`, or by a checkpoint (`load_state_dict`)

    def use(self, classes: list[str], train: ImageSet, val: ImageSet | None, where: str,
            draw: Callable[[ImageSet], tuple[list[int], list[int]]]) -> None:
        """Take the two sets a subclass found (of `classes`, `where`): with bad_files=skip, the
        images that decode only; without `val`, the training and validation indices that
        `draw(train)` gives (drawn after the skip: it shares out readable images only)."""
        train, val = (images if images is None else self._readable(images, where)
                      for images in (train, val))
        if val is None:
            train, val = (train.subset(indices) for indices in draw(train))
        self.classes, self.num_classes = list(classes), len(classes)
        train.view(self.input_shape[1:], self.stats, self._augment)
        val.view(self.input_shape[1:], self.stats, None)
        self.train, self.val, self.where = train, val, where
        log.info("%s: %d classes (%s), %d training and %d validation images", where,
                 self.num_classes, _listed(self.classes), len(train), len(val))

    def _readable(self, images: ImageSet, where: str) -> ImageSet:
        """bad_files=skip: the images that decode (each decoded once; the others counted in a
        warning)."""
        if self.bad_files == "fail":
            return images
        kept, bad = [], []
        for index in range(len(images)):
            try:
                images.load(index)
                kept.append(index)
            except BadImage as e:
                bad.append(str(e))
        if bad:
            log.warning("data.bad_files=skip: %d unreadable image(s) left out; the first: %s",
                        len(bad), bad[0])
        if not kept:
            raise UserError(f"{where}: none of the {len(images)} images of a split is readable; "
                            f"the first: {bad[0]}")
        return images.subset(kept)

    def prepare(self) -> None:
        """The normalisation: given, or computed from the training images (once: a checkpoint
        that holds one, `load_state_dict`, makes this a no-op)."""
        if self._normalised:
            return
        self._normalised = True
        if self._given is not None:
            self.stats[:] = self._given
            return
        # One rank reads the images, the others receive its result (the same values: the
        # sample is drawn by the seed) instead of each reading them again.
        self.stats[:] = dist.broadcast_object(
            _statistics(self.train, self.split_seed) if dist.is_main() else None)
        mean, std = ([round(v, 4) for v in row] for row in self.stats.tolist())
        log.info("%s: normalised by the training images' mean %s and std %s", self.where, mean,
                 std)

    def cache_in_memory(self) -> None:
        self.train.share_memory()
        self.val.share_memory()
        size = self.train.decoded.pixels.numel() + self.val.decoded.pixels.numel()
        log.info("cached %d + %d decoded images in shared memory (%.1f MB)", len(self.train),
                 len(self.val), size / 1e6)

    def state_dict(self) -> dict[str, Any]:
        return {"classes": list(self.classes), "input_shape": list(self.input_shape),
                "mean": self.stats[0].tolist(), "std": self.stats[1].tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if list(state["classes"]) != self.classes:
            raise UserError(
                f"the data has the classes {_listed(self.classes)}, the checkpoint was trained "
                f"on {_listed(state['classes'])}: its labels would mean other classes here")
        shape = state.get("input_shape")
        if shape is not None and tuple(shape) != self.input_shape:
            raise UserError(
                f"the checkpoint was trained on {'x'.join(map(str, shape))} images, the data "
                f"gives {'x'.join(map(str, self.input_shape))}: use data.channels={shape[0]} "
                f"data.image_size=[{shape[1]},{shape[2]}]")
        self.stats[:] = torch.tensor([state["mean"], state["std"]])
        self._normalised = True

    def decode_file(self, path: Path) -> torch.Tensor:
        return self.val.tensor(transforms.decode(path, self.mode))

    def show(self, inputs: torch.Tensor) -> torch.Tensor:
        return (inputs * self.stats[1][:, None, None] + self.stats[0][:, None, None]).clamp(0, 1)


def numbers(key: str, value: Any, count: int) -> list[float]:
    """`value` as a list of `count` finite numbers."""
    items = None if isinstance(value, str) or not hasattr(value, "__len__") else list(value)
    if items is None or len(items) != count or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            for v in items):
        raise UserError(f"{key}={value}: expected a list of {count} finite number(s)"
                        + (" (one per channel)" if key in ("data.mean", "data.std") else ""))
    return [float(v) for v in items]


def _listed(classes: list[str]) -> str:
    return ", ".join(classes[:8]) + (f" ... ({len(classes)})" if len(classes) > 8 else "")


def _statistics(images: ImageSet, seed: int) -> torch.Tensor:
    """Per-channel mean and std of (up to STATS_SAMPLES of) the training images' evaluation
    views, in float64 (the same on every rank: the sample is drawn by `seed`)."""
    chosen = range(len(images))
    if len(images) > STATS_SAMPLES:
        chosen = sorted(random.Random(seed).sample(range(len(images)), STATS_SAMPLES))
    total = torch.zeros(2, images.stats.shape[1], dtype=torch.float64)
    for index in chosen:  # (an unreadable image raises BadImage, naming it)
        x = transforms.to_tensor(transforms.resize_and_crop(images.image(index),
                                                            images.size)).double()
        total[0] += x.sum((1, 2))
        total[1] += (x * x).sum((1, 2))
    count = len(chosen) * images.size[0] * images.size[1]  # (every view is that size)
    mean = total[0] / count
    std = (total[1] / count - mean * mean).clamp_min(0).sqrt()
    std[std < 1e-6] = 1.0  # a channel of one value everywhere: centred, not scaled
    return torch.stack([mean, std]).float()
