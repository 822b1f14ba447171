"""Image transforms with Pillow and NumPy: decoding, the evaluation view (resize, centre
crop), the training augmentation (random resized crop, flip) and the tensor of an image.

The augmentation draws from a `random.Random` seeded per sample (`base.Augmented`), never
from a global generator: a sample's crop depends on (seed, epoch, index) only.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image, ImageOps

from app.errors import BadImage, first_line

# What Pillow raises for a file it cannot read as an image (DecompressionBombError: a file
# that claims to be far larger than any photo; Image.MAX_IMAGE_PIXELS).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def decode(path: Path | BinaryIO, mode: str, name: str | None = None) -> Image.Image:
    """The image at `path` (or in a file object, called `name`), fully decoded, turned upright
    as its EXIF orientation says (as a photo viewer shows it), in `mode` ("L" or "RGB")."""
    try:
        with Image.open(path) as image:
            return as_mode(ImageOps.exif_transpose(image), mode)
    except DECODE_ERRORS as e:
        raise BadImage(f"{name or path} is not a readable image ({first_line(e)})") from None


def as_mode(image: Image.Image, mode: str) -> Image.Image:
    """`image` in `mode`, every pixel loaded (a truncated file fails here). Pillow's convert
    clips 16-bit and 32-bit values to 8 bits (a 16-bit scan turns white): those are scaled.
    Transparent pixels are shown on white, as a page or a viewer shows a logo (Pillow's
    convert drops the alpha channel, and what lies under it is often black)."""
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        values = np.asarray(image, dtype=np.float64)
        top = 1.0 if image.mode == "F" and values.max(initial=0) <= 1 else (
            255.0 if image.mode == "F" else 65535.0)
        image = Image.fromarray(np.round(np.clip(values / top, 0, 1) * 255).astype(np.uint8))
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (
            image.mode in ("P", "L", "RGB") and "transparency" in image.info):
        image = Image.alpha_composite(Image.new("RGBA", image.size, (255, 255, 255, 255)),
                                      image.convert("RGBA"))
    return image.convert(mode)


def resize_and_crop(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """The evaluation view: the image's centre with the aspect ratio of `size` (height,
    width), resized (bilinear) to it. Cut out before resizing: a 20000x1 strip costs what its
    view costs, not a 1,280,000-pixel-wide copy."""
    height, width = size
    scale = max(height / image.height, width / image.width)  # source pixels -> view pixels
    w, h = min(image.width, width / scale), min(image.height, height / scale)
    left, top = (image.width - w) / 2, (image.height - h) / 2
    return image.resize((width, height), Image.Resampling.BILINEAR,
                        box=(left, top, left + w, top + h))


def random_resized_crop(image: Image.Image, size: tuple[int, int], scale: tuple[float, float],
                        flip: bool, rng: random.Random) -> Image.Image:
    """A random part of the image (an area share in `scale`, an aspect ratio in [3/4, 4/3],
    drawn up to ten times, else the centred evaluation view) resized to `size`, mirrored
    left-right with probability 1/2 when `flip`: the augmentation of ImageNet training."""
    height, width = size
    area = image.width * image.height
    for _ in range(10):
        target = area * rng.uniform(*scale)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= image.width and 0 < h <= image.height:
            left, top = rng.randint(0, image.width - w), rng.randint(0, image.height - h)
            out = image.resize((width, height), Image.Resampling.BILINEAR,
                               box=(left, top, left + w, top + h))
            break
    else:
        out = resize_and_crop(image, size)
    if flip and rng.random() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return out


def to_tensor(image: Image.Image) -> torch.Tensor:
    """(C, H, W) float32 in [0, 1]."""
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(array[None] if array.ndim == 2 else array.transpose(2, 0, 1).copy())
