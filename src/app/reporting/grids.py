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
CELL = (160, 198)  # width, height of one image with its caption
TITLE_H = 60  # the band above the cells that holds a title of two lines (taller for more)
LINE_H = 15  # the caption's line pitch
LABEL_H = 2 * LINE_H + 4  # the band above an image that holds its caption: two lines (or three)
CAPTION_SIZES = (12, 11, 10)  # font sizes tried in turn for a caption too wide for its cell
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


def _font(text: str, size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """The first font that draws `text` (Pillow's own where none does)."""
    return next((f for f in _fonts(size) if _draws(f, text)), _fonts(size)[0])


def _shortened(text: str, font: ImageFont.ImageFont, width: float) -> str:
    """`text`, its middle cut out for "..." to fit `width` pixels: a long file or class name
    keeps its start and its end (a number, the suffix), what tells it from its neighbours;
    the PNG's Description keeps it whole."""
    if font.getlength(text) <= width:
        return text
    head, tail = text[:len(text) // 2], text[len(text) // 2:]
    while (head or tail) and font.getlength(f"{head}...{tail}") > width:
        head, tail = (head[:-1], tail) if len(head) > len(tail) else (head, tail[1:])
    return f"{head}...{tail}"


def _title_lines(title: str, font: ImageFont.ImageFont, width: float) -> list[str]:
    """`title` in lines of `width` pixels, broken between words (inside a word wider than a
    line): as many as it takes, the band above the cells grows for them (two at most cut the
    title of a narrow grid, of a few images)."""
    lines: list[str] = []
    for word in title.split(" "):
        if lines and font.getlength(f"{lines[-1]} {word}") <= width:
            lines[-1] += f" {word}"
            continue
        while len(word) > 1 and font.getlength(word) > width:
            cut = max((k for k in range(1, len(word)) if font.getlength(word[:k]) <= width),
                      default=1)
            lines.append(word[:cut])
            word = word[cut:]
        lines.append(word)
    return lines


def _caption(head: str | None, parts: list[str], width: float) -> tuple[list[str], int]:
    """A cell's caption lines and their font size: `head` (an input's name) on a line of its
    own, then `parts` (pred, true) on one line, or each on its own where they are too wide;
    at the largest of CAPTION_SIZES where they fit, else the smallest; a line still too wide
    (a file name, a long class name: it would run into the next cell) shortened to fit."""
    options = [(size, body) for size in CAPTION_SIZES
               for body in [[" / ".join(parts)]] + ([parts] if len(parts) > 1 else [])]
    size, body = next(((size, body) for size, body in options
                       if all(_font(line, size).getlength(line) <= width for line in body)),
                      options[-1])
    lines = ([] if head is None else [head]) + body
    return [_shortened(line, _font(line, size), width) for line in lines], size


def _captions(preds: list[int], labels: list[int] | None, classes: list[str] | None,
              indices: list[int] | None, names: list[str] | None,
              ) -> list[tuple[str, list[str], int]]:
    """Each cell's caption: whole (for the PNG's text), and as drawn (lines, font size)."""
    said = (lambda c: classes[c]) if classes else str  # a class's name, else its index
    captions = []
    for i, pred in enumerate(preds):
        head = None if names is None else names[i]
        number = "" if indices is None else f"#{indices[i]} "
        parts, by_index = ([f"{number}pred {name(pred)}"]
                           + ([] if labels is None else [f"true {name(labels[i])}"])
                           for name in (said, "#{}".format))
        whole = ("" if head is None else f"{head}: ") + " / ".join(parts)
        if not any(_draws(f, "".join(parts)) for f in _fonts(12)):
            parts = by_index  # no font here draws these class names: their indices, not boxes
        if head is not None and not any(_draws(f, head) for f in _fonts(12)):
            head = head.encode("ascii", "replace").decode()  # a "?" for what no font draws
        captions.append((whole, *_caption(head, parts, CELL[0] - 8)))
    return captions


def save_grid(
    images: torch.Tensor, preds: list[int], labels: list[int] | None, title: str, path: Path,
    classes: list[str] | None = None, indices: list[int] | None = None,
    names: list[str] | None = None,
) -> None:
    """Up to COLUMNS images a row, each under "pred P" (or "pred P / true T": green when
    right, red when wrong; P and T the `classes`' names where the data has them; "#I " first
    with `indices`, each image's number among the inputs, where they are not in order; its
    file name above with `names`), the title above. The title and each cell's caption also go
    into the PNG's text fields (Title, Description), for tools to read."""
    n = len(images)
    cols = max(1, min(COLUMNS, n))
    rows = max(1, math.ceil(n / cols))
    title_font = ImageFont.load_default(size=14)
    title_lines = _title_lines(title, title_font, CELL[0] * cols - 16)
    title_h = TITLE_H + 18 * max(0, len(title_lines) - 2)
    captions = _captions(preds, labels, classes, indices, names)
    label_h = max([LABEL_H] + [LINE_H * len(lines) + 4 for _, lines, _ in captions])
    cell_h = CELL[1] + label_h - LABEL_H  # (a third caption line: taller cells)
    picture = Image.new("RGB", (CELL[0] * cols, cell_h * rows + title_h), "white")
    draw = ImageDraw.Draw(picture)
    for row, line in enumerate(title_lines):
        draw.text((picture.width / 2, 16 + 18 * row), line, fill="black", anchor="mm",
                  font=title_font)
    for i, (_, lines, font_size) in enumerate(captions):
        left, top = (i % cols) * CELL[0], title_h + (i // cols) * cell_h
        color = "black" if labels is None else GREEN if preds[i] == labels[i] else RED
        for j, line in enumerate(lines):
            middle = top + label_h / 2 - 2 + (j - (len(lines) - 1) / 2) * LINE_H
            draw.text((left + CELL[0] / 2, middle), line, fill=color, anchor="mm",
                      font=_font(line, font_size))
        shown = _pixels(images[i])
        room_w, room_h = CELL[0] - 16, CELL[1] - LABEL_H - 12
        scale = min(room_w / shown.width, room_h / shown.height)
        if scale >= 1:  # whole pixels: every source pixel the same size
            scale = math.floor(scale)
        size = (max(1, round(shown.width * scale)), max(1, round(shown.height * scale)))
        shown = shown.resize(size, Image.Resampling.NEAREST)
        picture.paste(shown, (left + (CELL[0] - size[0]) // 2,
                              top + label_h + (room_h - size[1]) // 2))
    info = PngImagePlugin.PngInfo()
    info.add_text("Title", title)
    info.add_text("Description", "; ".join(whole for whole, _, _ in captions))
    out = io.BytesIO()
    picture.save(out, format="PNG", pnginfo=info)
    write_bytes_atomically(path, out.getvalue())
