"""`plots/curves.png` of a run: training loss, validation loss and accuracy against step.

Every training process draws it at its end, so it is drawn with Pillow (about 5 MB of
memory) rather than matplotlib (about 35 MB: a tenth of a small CPU training process's peak).
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from app.results import read_metrics

WIDTH, HEIGHT, MARGIN = 1100, 440, (70, 50, 20, 60)  # left, top, right, bottom of a panel
COLORS = {"train/loss": (31, 119, 180), "val/loss": (255, 127, 14), "val/acc": (44, 160, 44)}


def _series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for row in read_metrics(run_dir):
        for name in ("loss", "acc"):
            value = row.get(name)
            if value and math.isfinite(float(value)):
                series.setdefault(f"{row['split']}/{name}", []).append(
                    (int(row["step"]), float(value)))
    return series


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _panel(draw: ImageDraw.ImageDraw, box: tuple[int, int, int, int], title: str,
           ylabel: str, lines: dict[str, list[tuple[int, float]]],
           font: ImageFont.ImageFont) -> None:
    x0, y0, x1, y1 = box[0] + MARGIN[0], box[1] + MARGIN[1], box[2] - MARGIN[2], box[3] - MARGIN[3]
    draw.text(((x0 + x1) / 2, box[1] + 18), title, fill="black", font=font, anchor="mm")
    draw.rectangle((x0, y0, x1, y1), outline="black")
    points = [p for line in lines.values() for p in line]
    if not points:
        return
    sx = (min(p[0] for p in points), max(p[0] for p in points))
    sy = (min(p[1] for p in points), max(p[1] for p in points))
    sx = sx if sx[1] > sx[0] else (sx[0] - 1, sx[1] + 1)
    sy = sy if sy[1] > sy[0] else (sy[0] - 0.5, sy[1] + 0.5)

    def at(step: float, value: float) -> tuple[float, float]:
        return (x0 + (step - sx[0]) / (sx[1] - sx[0]) * (x1 - x0),
                y1 - (value - sy[0]) / (sy[1] - sy[0]) * (y1 - y0))

    for v in _ticks(*sy):
        y = at(sx[0], v)[1]
        draw.line((x0, y, x1, y), fill=(225, 225, 225))
        draw.text((x0 - 6, y), f"{v:.3g}", fill="black", font=font, anchor="rm")
    for s in _ticks(*sx):
        x = at(s, sy[0])[0]
        draw.text((x, y1 + 6), f"{s:.0f}", fill="black", font=font, anchor="ma")
    draw.text(((x0 + x1) / 2, y1 + 28), "optimizer step", fill="black", font=font, anchor="ma")
    draw.text((box[0] + 4, y0 - 30), ylabel, fill="black", font=font)
    for i, (key, line) in enumerate(sorted(lines.items())):
        color = COLORS.get(key, (100, 100, 100))
        xy = [at(s, v) for s, v in line]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=2)
        if key.startswith("val"):
            for x, y in xy:
                draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=color)
        draw.line((x1 - 120, y0 + 14 + 18 * i, x1 - 100, y0 + 14 + 18 * i), fill=color, width=3)
        draw.text((x1 - 94, y0 + 14 + 18 * i), key, fill="black", font=font, anchor="lm")


def draw_curves(run_dir: Path) -> Path | None:
    """Training loss, validation loss and accuracy against step -> plots/curves.png."""
    series = _series(run_dir)
    if not series:
        return None
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=13)
    half = WIDTH // 2
    _panel(draw, (0, 20, half, HEIGHT), "Loss", "cross-entropy",
           {k: v for k, v in series.items() if k.endswith("loss")}, font)
    _panel(draw, (half, 20, WIDTH, HEIGHT), "Validation accuracy", "accuracy",
           {k: v for k, v in series.items() if k.endswith("acc")}, font)
    draw.text((WIDTH / 2, 10), str(run_dir), fill=(90, 90, 90), font=font, anchor="mm")
    out = run_dir / "plots" / "curves.png"
    out.parent.mkdir(exist_ok=True)
    image.save(out)
    return out
