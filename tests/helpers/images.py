"""Image folders the tests make for themselves: three classes of simple shapes (learnable in
a few steps), PNG and JPEG, grey, RGB and palette images of odd sizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("circle", "square", "stripes")


def _shape(kind: str, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    pixels = rng.integers(0, 60, size=(height, width, 3)).astype(np.uint8)
    yy, xx = np.mgrid[:height, :width]
    if kind == "circle":
        mask = (yy - height / 2) ** 2 + (xx - width / 2) ** 2 < (min(height, width) / 3) ** 2
    elif kind == "square":
        mask = (abs(yy - height / 2) < height / 4) & (abs(xx - width / 2) < width / 4)
    else:
        mask = (xx // 4) % 2 == 0
    pixels[mask] = rng.integers(150, 256, size=3)
    return pixels


def make_image_folder(root: Path, per_class: int = 12, seed: int = 0,
                      classes: tuple[str, ...] = CLASSES) -> list[Path]:
    """ROOT/CLASS/N.png|jpg; returns the files. Every third image grey, every fifth a palette
    PNG; sizes from 17 to 47 pixels a side."""
    rng = np.random.default_rng(seed)
    files = []
    for kind in classes:
        (root / kind).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            height, width = (int(v) for v in rng.integers(17, 48, size=2))
            image = Image.fromarray(_shape(kind, height, width, rng))
            if i % 3 == 0:
                image = image.convert("L")
            elif i % 5 == 0:
                image = image.convert("P")
            path = root / kind / f"{i:03d}{'.jpg' if i % 2 and image.mode != 'P' else '.png'}"
            image.save(path)
            files.append(path)
    return files


def corrupt(path: Path) -> Path:
    """A file with an image's name that holds the start of a JPEG only."""
    path.write_bytes(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00 and then nothing")
    return path
