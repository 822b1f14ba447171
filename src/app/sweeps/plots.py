"""The picture of a sweep: `summary.png` (a run's curves are app.reporting.curves').

Drawn with Pillow, as every picture of app is: the best value of the monitored metric per
job as bars, and beside them a heat map when the sweep is a full 2-D grid of two keys. A job
without a value (failed, still running, killed) gets no bar and an empty cell, with its
status written where the value would be.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from app.files import write_bytes_atomically
from app.reporting.curves import Axis, linear_axis

HEIGHT = 450  # at least; more for a sweep of many jobs (one row of text each)
ROW_MIN = 18
BLUE, RED, GRAY = (31, 119, 180), (214, 39, 40), (90, 90, 90)
# matplotlib's viridis at 17 points, interpolated between (dark blue: low, yellow: high).
VIRIDIS = [(68, 1, 84), (72, 24, 106), (71, 45, 123), (66, 64, 134), (59, 82, 139),
           (51, 99, 141), (44, 114, 142), (38, 130, 142), (33, 145, 140), (31, 160, 136),
           (40, 174, 128), (63, 188, 115), (94, 201, 98), (132, 212, 75), (173, 220, 48),
           (216, 226, 25), (253, 231, 37)]
Box = tuple[int, int, int, int]  # left, top, right, bottom


def viridis(fraction: float) -> tuple[int, int, int]:
    at = min(max(fraction, 0.0), 1.0) * (len(VIRIDIS) - 1)
    i = min(int(at), len(VIRIDIS) - 2)
    a, b, t = VIRIDIS[i], VIRIDIS[i + 1], at - i
    return tuple(round(x + (y - x) * t) for x, y in zip(a, b, strict=True))  # type: ignore


def _grid(jobs: list[dict[str, Any]]) -> tuple[str, str, list, list] | None:
    """The two swept keys when the jobs form a full 2-D grid of them."""
    values: dict[str, list] = {}
    for job in jobs:
        for key, value in job["params"].items():
            if value not in values.setdefault(key, []):
                values[key].append(value)
    swept = [k for k, v in values.items() if len(v) > 1]
    if len(swept) != 2 or len(jobs) != len(values[swept[0]]) * len(values[swept[1]]):
        return None
    return swept[0], swept[1], values[swept[0]], values[swept[1]]


def _fonts(size: int) -> ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _vertical(picture: Image.Image, center: tuple[float, float], text: str,
              font: ImageFont.ImageFont) -> None:
    """`text` read bottom to top, centred on `center` (an axis label beside a plot)."""
    width = int(ImageDraw.Draw(picture).textlength(text, font=font)) + 4
    label = Image.new("RGBA", (width, 20), (255, 255, 255, 0))
    ImageDraw.Draw(label).text((width / 2, 10), text, fill="black", font=font, anchor="mm")
    label = label.rotate(90, expand=True)
    picture.paste(label, (round(center[0] - label.width / 2),
                          round(center[1] - label.height / 2)), label)


def _value_axis(values: list[float]) -> Axis:
    """From 0 (bars start there) to the largest value, on round ticks (0 to 1: none)."""
    lo, hi = min([0.0, *values]), max([0.0, *values]) if values else 1.0
    return linear_axis(lo, hi, min_span=max(1e-3, 0.05 * (hi - lo)), target=6)


def _bars(draw: ImageDraw.ImageDraw, box: Box, jobs: list[dict[str, Any]], best: list[float],
          monitor: str) -> None:
    left, top, right, bottom = box
    small, font = _fonts(12), _fonts(13)
    labels = [f"#{j['job']} " + " ".join(f"{k}={v}" for k, v in j["params"].items())
              for j in jobs]
    # The labels take what they need, up to 45% of the panel (longer ones are cut).
    room = int(0.45 * (right - left))
    shown = []
    for label in labels:
        while draw.textlength(label, font=small) > room - 10 and len(label) > 4:
            label = label[:-2] + "…"
        shown.append(label)
    x0 = left + max(draw.textlength(s, font=small) for s in shown) + 12
    draw.text(((x0 + right) / 2, top - 18), f"Best {monitor} per job (red: not completed)",
              fill="black", font=font, anchor="mm")
    axis = _value_axis([b for b in best if not math.isnan(b)])

    def x_of(value: float) -> float:
        return x0 + axis.fraction(value) * (right - x0)

    for tick, label in zip(axis.ticks, axis.labels, strict=True):
        x = x_of(tick)
        draw.line((x, top + 1, x, bottom - 1), fill=(230, 230, 230))
        draw.line((x, bottom, x, bottom + 4), fill="black")
        draw.text((x, bottom + 6), label, fill="black", font=small, anchor="ma")
    draw.text(((x0 + right) / 2, bottom + 26), f"best {monitor}", fill="black", font=font,
              anchor="ma")
    row = (bottom - top) / len(jobs)
    for i, (job, value, label) in enumerate(zip(jobs, best, shown, strict=True)):
        middle = top + (i + 0.5) * row
        draw.text((x0 - 6, middle), label, fill="black", font=small, anchor="rm")
        if math.isnan(value):  # no bar to colour: say why there is none
            draw.text((x_of(0) + 4, middle), job["status"], fill=RED, font=small, anchor="lm")
            continue
        ends = sorted((x_of(0), x_of(value)))
        draw.rectangle((ends[0], middle - 0.4 * row, ends[1], middle + 0.4 * row),
                       fill=BLUE if job["status"] == "completed" else RED)
    draw.rectangle((x0, top, right, bottom), outline="black")


def _heat(picture: Image.Image, box: Box, grid: tuple[str, str, list, list],
          jobs: list[dict[str, Any]], best: list[float], monitor: str) -> None:
    draw = ImageDraw.Draw(picture)
    small, font = _fonts(12), _fonts(13)
    row_key, col_key, row_values, col_values = grid
    table = [[math.nan] * len(col_values) for _ in row_values]
    status = [[""] * len(col_values) for _ in row_values]
    for job, value in zip(jobs, best, strict=True):
        r = row_values.index(job["params"][row_key])
        c = col_values.index(job["params"][col_key])
        table[r][c], status[r][c] = value, job["status"]
    found = [v for row in table for v in row if not math.isnan(v)]
    low, high = (min(found), max(found)) if found else (0.0, 1.0)
    span = high - low or 1.0
    left, top, right, bottom = box
    x0 = left + max(draw.textlength(str(v), font=small) for v in row_values) + 34
    x1 = right - 100  # the colour bar and its labels
    draw.text(((x0 + x1) / 2, top - 18), f"Best {monitor}", fill="black", font=font,
              anchor="mm")
    width, height = (x1 - x0) / len(col_values), (bottom - top) / len(row_values)
    for r, row in enumerate(table):
        y = top + r * height
        draw.text((x0 - 6, y + height / 2), str(row_values[r]), fill="black", font=small,
                  anchor="rm")
        for c, value in enumerate(row):
            x = x0 + c * width
            middle = (x + width / 2, y + height / 2)
            if math.isnan(value):  # an empty (white) cell: what became of that job
                draw.text(middle, status[r][c] or "n/a", fill=RED, font=small, anchor="mm")
                continue
            fraction = (value - low) / span
            draw.rectangle((x, y, x + width, y + height), fill=viridis(fraction))
            draw.text(middle, f"{value:.4f}", fill="black" if fraction > 0.6 else "white",
                      font=small, anchor="mm")
    for c, value in enumerate(col_values):
        x = x0 + (c + 0.5) * width
        draw.line((x, bottom, x, bottom + 4), fill="black")
        draw.text((x, bottom + 6), str(value), fill="black", font=small, anchor="ma")
    draw.text(((x0 + x1) / 2, bottom + 26), col_key, fill="black", font=font, anchor="ma")
    _vertical(picture, (left + 10, (top + bottom) / 2), row_key, font)
    draw.rectangle((x0, top, x1, bottom), outline="black")
    # The colour bar: low at the bottom, high at the top, ticked at round values.
    bar = (x1 + 22, top, x1 + 40, bottom)
    for y in range(bar[1], bar[3] + 1):
        draw.line((bar[0], y, bar[2], y), fill=viridis((bar[3] - y) / (bar[3] - bar[1])))
    draw.rectangle(bar, outline="black")
    axis = linear_axis(low, high, min_span=max(1e-9, 1e-3 * abs(high)))
    for tick, label in zip(axis.ticks, axis.labels, strict=True):
        if low - 1e-12 <= tick <= high + 1e-12:
            y = bar[3] - (tick - low) / span * (bar[3] - bar[1])
            draw.line((bar[2], y, bar[2] + 4, y), fill="black")
            draw.text((bar[2] + 7, y), label, fill="black", font=small, anchor="lm")
    _vertical(picture, (bar[2] + 52, (top + bottom) / 2), f"best {monitor}", font)


def draw_summary(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Path | None:
    """The monitored metric per job (bars), and a heat map when the sweep is a 2-D grid."""
    if not jobs:
        return None
    grid = _grid(jobs)
    width = 1300 if grid else 800
    height = max(HEIGHT, 130 + ROW_MIN * len(jobs))
    picture = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(picture)
    draw.text((width / 2, 14), str(sweep_dir), fill=GRAY, font=_fonts(11), anchor="mm")
    best = [j["best"] if j["best"] is not None else math.nan for j in jobs]
    top, bottom = 65, height - 60
    _bars(draw, (10, top, 730 if grid else width - 25, bottom), jobs, best, monitor)
    if grid:
        _heat(picture, (750, top, width - 10, bottom), grid, jobs, best, monitor)
    out = sweep_dir / "summary.png"
    png = io.BytesIO()
    picture.save(png, format="PNG")
    write_bytes_atomically(out, png.getvalue())
    return out
