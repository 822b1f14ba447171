"""A grid of images with their predicted (and true) labels: `predictions.png` of predict mode
and the eval_visuals callback's pictures, drawn with Pillow.

Each image is scaled up by whole pixels (nearest neighbour: an 8x8 digit stays 64 visible
squares). Images are drawn as they are, values in [0, 1] (0 black, 1 white; clipped): what
the data set's `show` gives, the model's view of them.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, PngImagePlugin

from app.files import write_bytes_atomically

COLUMNS = 8  # at most, per row
CELL = (160, 190)  # width, height of one image with its label
TITLE_H = 60  # the band above the cells that holds the title
LABEL_H = 26  # the band above an image that holds its label
GREEN, RED = (0, 128, 0), (220, 0, 0)


def _pixels(image: torch.Tensor) -> Image.Image:
    """(C, H, W) in [0, 1] -> a picture: RGB for 3 or 4 channels (the first 3), grey for
    one; an input of another shape, a user's data that is not an image (2 channels, a
    feature vector), shows its first channel, or its values as a strip, in grey."""
    array = np.clip(np.nan_to_num(image.detach().float().cpu().numpy()), 0, 1)
    array = array.reshape(1, 1, -1) if array.ndim < 2 else array[None] if array.ndim == 2 \
        else array.reshape(-1, *array.shape[-2:])
    pixels = array[:3].transpose(1, 2, 0) if array.shape[0] in (3, 4) else array[0]
    return Image.fromarray(np.round(255 * pixels).astype(np.uint8))  # (H, W, 3): RGB; (H, W): L


# Fonts tried in turn for a label that Pillow's own font cannot draw (it has ASCII only: "café"
# showed as "caf" and a box). Found by file name in the system's font folders, where present.
FALLBACK_FONTS = ("DejaVuSans.ttf", "NotoSans-Regular.ttf", "NotoSansCJK-Regular.ttc",
                  "LiberationSans-Regular.ttf", "Arial Unicode.ttf", "arial.ttf")


@functools.lru_cache(maxsize=8)
def _fonts(size: int) -> tuple[ImageFont.FreeTypeFont | ImageFont.ImageFont, ...]:
    fonts = [ImageFont.load_default(size=size)]
    for name in FALLBACK_FONTS:
        with contextlib.suppress(OSError):
            fonts.append(ImageFont.truetype(name, size))
    return tuple(fonts)


def _draws(font: ImageFont.FreeTypeFont | ImageFont.ImageFont, text: str) -> bool:
    """Whether `font` has a glyph for every character of `text` (a missing one is drawn as
    the font's "missing" box, the same for every missing character)."""
    missing = bytes(font.getmask("\U0010fffd"))
    return all(ch.isspace() or bytes(font.getmask(ch)) != missing for ch in set(text))


def _fitted(text: str, font: ImageFont.ImageFont, width: float) -> str:
    """`text`, shortened with an ellipsis to fit `width` pixels (a long class name would run
    into the next cell); the PNG's Description keeps it whole."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "...") > width:
        text = text[:-1]
    return text + "..."


def _title_lines(title: str, font: ImageFont.ImageFont, width: float) -> list[str]:
    """`title` in lines of `width` pixels, broken between words: two at most (the band's
    room), the second shortened if need be (a narrow grid, of a few images, cut its ends)."""
    lines = [""]
    for word in title.split(" "):
        joined = f"{lines[-1]} {word}".lstrip(" ")
        if font.getlength(joined) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append(word)
    return [lines[0], _fitted(" ".join(lines[1:]), font, width)] if len(lines) > 1 else lines


def save_grid(
    images: torch.Tensor, preds: list[int], labels: list[int] | None, title: str, path: Path,
    classes: list[str] | None = None, indices: list[int] | None = None,
) -> None:
    """Up to COLUMNS images a row, each under "pred P" (or "pred P / true T": green when
    right, red when wrong; P and T the `classes`' names where the data has them; "#I " first
    with `indices`, each image's number among the inputs, where they are not in order), the
    title above. The title and each cell's label also go into the PNG's text fields (Title,
    Description), for tools to read."""
    n = len(images)
    cols = max(1, min(COLUMNS, n))
    rows = max(1, math.ceil(n / cols))
    picture = Image.new("RGB", (CELL[0] * cols, CELL[1] * rows + TITLE_H), "white")
    draw = ImageDraw.Draw(picture)
    title_font = ImageFont.load_default(size=14)
    for row, line in enumerate(_title_lines(title, title_font, picture.width - 16)):
        draw.text((picture.width / 2, 16 + 18 * row), line, fill="black", anchor="mm",
                  font=title_font)
    cells = []
    for i in range(n):
        left, top = (i % cols) * CELL[0], TITLE_H + (i // cols) * CELL[1]
        name = (lambda c: classes[c]) if classes else str  # a class's name, else its index
        number = "" if indices is None else f"#{indices[i]} "
        cell = f"{number}pred {name(preds[i])}" + (
            "" if labels is None else f" / true {name(labels[i])}")
        cells.append(cell)  # (whole, in the PNG's text: drawn, it may be an index or shortened)
        font = next((f for f in _fonts(12) if _draws(f, cell)), None)  # the first that can
        if font is None:  # no font here draws these names: their indices, not boxes
            font = _fonts(12)[0]
            cell = f"{number}pred #{preds[i]}" + (
                "" if labels is None else f" / true #{labels[i]}")
        color = "black" if labels is None else GREEN if preds[i] == labels[i] else RED
        draw.text((left + CELL[0] / 2, top + LABEL_H / 2 - 4), _fitted(cell, font, CELL[0] - 8),
                  fill=color, anchor="mm", font=font)
        shown = _pixels(images[i])
        room_w, room_h = CELL[0] - 16, CELL[1] - LABEL_H - 12
        scale = min(room_w / shown.width, room_h / shown.height)
        if scale >= 1:  # whole pixels: every source pixel the same size
            scale = math.floor(scale)
        size = (max(1, round(shown.width * scale)), max(1, round(shown.height * scale)))
        shown = shown.resize(size, Image.Resampling.NEAREST)
        picture.paste(shown, (left + (CELL[0] - size[0]) // 2,
                              top + LABEL_H + (room_h - size[1]) // 2))
    info = PngImagePlugin.PngInfo()
    info.add_text("Title", title)
    info.add_text("Description", "; ".join(cells))
    out = io.BytesIO()
    picture.save(out, format="PNG", pnginfo=info)
    write_bytes_atomically(path, out.getvalue())
