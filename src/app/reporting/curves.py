"""`plots/curves.png` of a run: training loss, validation loss and accuracy against step.

Every training process draws it at its end, so it is drawn with Pillow, a fraction of
matplotlib's memory and import time (figures: docs/measurements.md); so is every picture of app.
Pillow has no axes of its own: `layout` chooses them (round, distinct ticks; accuracy within
[0, 1]; a log loss axis when the loss spans more than a decade) and `draw_curves` draws them.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from app.files import write_bytes_atomically
from app.reporting.results import read_metrics

WIDTH, HEIGHT = 1100, 460
# Inside each half of the picture: left (tick labels), top (title, legend), right, bottom.
MARGIN = (70, 60, 20, 60)
COLORS = {"train/loss": (31, 119, 180), "val/loss": (255, 127, 14), "val/acc": (44, 160, 44)}
MARKERS_UP_TO = 60  # points of a line drawn as dots too: a short run's few rows stay visible

Series = dict[str, list[tuple[int, float]]]


@dataclass
class Axis:
    lo: float
    hi: float
    ticks: list[float]
    labels: list[str]
    log: bool = False

    def fraction(self, value: float) -> float:
        """Where `value` lies between lo (0) and hi (1)."""
        if self.log:
            return (math.log10(value) - math.log10(self.lo)) / (
                math.log10(self.hi) - math.log10(self.lo))
        return (value - self.lo) / (self.hi - self.lo)


def _label(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return "0" if float(text) == 0 else text  # never "-0.0"


def _nice_step(raw: float) -> float:
    """The smallest of 1, 2, 5 x 10^k that is at least `raw`."""
    exponent = math.floor(math.log10(raw))
    for mantissa in (1, 2, 5, 10):
        if mantissa * 10.0 ** exponent >= raw * (1 - 1e-9):
            return mantissa * 10.0 ** exponent
    return 10.0 ** (exponent + 1)


def linear_axis(lo: float, hi: float, *, min_span: float,
                bounds: tuple[float, float] | None = None, target: int = 5) -> Axis:
    """Round ticks (1, 2 or 5 x 10^k apart) covering [lo, hi], labelled with the decimals
    their spacing needs (so labels are distinct), the range widened to `min_span` and kept
    within `bounds`."""
    if hi - lo < min_span:
        middle = (lo + hi) / 2
        lo, hi = middle - min_span / 2, middle + min_span / 2
        if bounds is not None:  # shift the window inside the bounds rather than cut it
            shift = max(0.0, bounds[0] - lo) - max(0.0, hi - bounds[1])
            lo, hi = lo + shift, hi + shift
    step = _nice_step((hi - lo) / (target - 1))
    start, end = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    if bounds is not None:
        start, end = max(start, bounds[0]), min(end, bounds[1])
    count = round((end - start) / step)
    ticks = [round(start + i * step, 12) for i in range(count + 1)]  # 0.85, not 0.850...01
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return Axis(start, end, ticks, [_label(t, decimals) for t in ticks])


def step_axis(last: int) -> Axis:
    """Steps 0 to `last` (a little beyond, so the last point clears the frame), ticked at
    round integers: a picture's width is the run's length."""
    step = max(1.0, _nice_step(last / 5))
    ticks = [i * step for i in range(int(last // step) + 1)]
    return Axis(0, last * 1.02 + 0.02, ticks, [f"{t:.0f}" for t in ticks])


def log_axis(lo: float, hi: float) -> Axis:
    """A log axis from the 1-2-5 value at or below `lo` to the one at or above `hi`, ticked at
    1, 2 and 5 x 10^k (only powers of ten when that would be too many ticks)."""
    def candidates(exponent: int) -> list[float]:
        return [m * 10.0 ** exponent for m in (1, 2, 5)]

    values = [v for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
              for v in candidates(e)]
    start = max(v for v in values if v <= lo * (1 + 1e-9))
    end = min(v for v in values if v >= hi * (1 - 1e-9))
    ticks = [v for v in values if start * (1 - 1e-9) <= v <= end * (1 + 1e-9)]
    if len(ticks) > 9:  # many decades: whole decades only
        start = 10.0 ** math.floor(math.log10(lo) + 1e-9)
        end = 10.0 ** math.ceil(math.log10(hi) - 1e-9)
        ticks = [v for v in values if start * (1 - 1e-9) <= v <= end * (1 + 1e-9)
                 and f"{v:e}".startswith("1")]
    labels = [_label(t, max(0, -math.floor(math.log10(t) + 1e-9))) if 1e-3 <= t < 1e5
              else f"{t:.0e}".replace("e-0", "e-").replace("e+0", "e") for t in ticks]
    return Axis(start, end, ticks, labels, log=True)


def read_series(run_dir: Path) -> Series:
    series: Series = {}
    for row in read_metrics(run_dir):
        for name in ("loss", "acc"):
            value = row.get(name)
            if value and math.isfinite(float(value)):
                series.setdefault(f"{row['split']}/{name}", []).append(
                    (int(row["step"]), float(value)))
    return series


def layout(series: Series) -> dict[str, Axis]:
    """The axes of the picture: `step` (shared by both panels), `loss` and `acc`."""
    steps = [s for line in series.values() for s, _ in line]
    axes = {"step": step_axis(max(steps, default=1))}
    losses = [v for k, line in series.items() if k.endswith("loss") for _, v in line]
    if losses:
        lo, hi = min(losses), max(losses)
        # A loss that falls by more than a decade would be a flat line for most of the run on
        # a linear axis: a log axis shows the second half of training too.
        if lo > 0 and hi / lo > 10:
            axes["loss"] = log_axis(lo, hi)
        else:
            axes["loss"] = linear_axis(lo, hi, min_span=max(0.1 * abs(hi), 1e-3),
                                       bounds=(0, math.inf) if lo >= 0 else None)
    accs = [v for k, line in series.items() if k.endswith("acc") for _, v in line]
    if accs:
        axes["acc"] = linear_axis(min(accs), max(accs), min_span=0.2, bounds=(0, 1))
    return axes


@dataclass
class Panel:
    """Where one panel's plot area lies in the picture."""
    x0: int
    y0: int
    x1: int
    y1: int

    def at(self, x_axis: Axis, y_axis: Axis, step: float, value: float) -> tuple[float, float]:
        return (self.x0 + x_axis.fraction(step) * (self.x1 - self.x0),
                self.y1 - y_axis.fraction(value) * (self.y1 - self.y0))


def panel_areas() -> tuple[Panel, Panel]:
    half, top = WIDTH // 2, 36
    return tuple(Panel(left + MARGIN[0], top + MARGIN[1], right - MARGIN[2], HEIGHT - MARGIN[3])
                 for left, right in ((0, half), (half, WIDTH)))  # type: ignore[return-value]


def _panel(draw: ImageDraw.ImageDraw, area: Panel, title: str, ylabel: str, lines: Series,
           x_axis: Axis, y_axis: Axis | None, font: ImageFont.ImageFont) -> None:
    top = area.y0 - MARGIN[1]
    draw.text(((area.x0 + area.x1) / 2, top + 14), title, fill="black", font=font, anchor="mm")
    draw.rectangle((area.x0, area.y0, area.x1, area.y1), outline="black")
    for s, label in zip(x_axis.ticks, x_axis.labels, strict=True):
        x = area.x0 + x_axis.fraction(s) * (area.x1 - area.x0)
        draw.line((x, area.y1, x, area.y1 + 4), fill="black")
        draw.text((x, area.y1 + 6), label, fill="black", font=font, anchor="ma")
    draw.text(((area.x0 + area.x1) / 2, area.y1 + 28), "optimizer step", fill="black",
              font=font, anchor="ma")
    if y_axis is None or not lines:
        draw.text(((area.x0 + area.x1) / 2, (area.y0 + area.y1) / 2), "nothing logged",
                  fill=(120, 120, 120), font=font, anchor="mm")
        return
    scale = " (log scale)" if y_axis.log else ""
    draw.text((area.x0 - MARGIN[0] + 4, area.y0 - 12), ylabel + scale, fill="black", font=font,
              anchor="ls")
    for v, label in zip(y_axis.ticks, y_axis.labels, strict=True):
        y = area.y1 - y_axis.fraction(v) * (area.y1 - area.y0)
        if area.y0 < y < area.y1:
            draw.line((area.x0 + 1, y, area.x1 - 1, y), fill=(225, 225, 225))
        draw.text((area.x0 - 6, y), label, fill="black", font=font, anchor="rm")
    # The legend sits above the plot area, right-aligned, where no line can run under it.
    x = area.x1
    for key in sorted(lines, reverse=True):
        color = COLORS.get(key, (100, 100, 100))
        x -= draw.textlength(key, font=font)
        draw.text((x, area.y0 - 12), key, fill="black", font=font, anchor="ls")
        draw.line((x - 26, area.y0 - 16, x - 6, area.y0 - 16), fill=color, width=3)
        x -= 44
    for key, line in sorted(lines.items()):
        color = COLORS.get(key, (100, 100, 100))
        xy = [area.at(x_axis, y_axis, s, v) for s, v in line]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=2)
        if len(xy) <= MARKERS_UP_TO:
            for px, py in xy:
                draw.ellipse((px - 3, py - 3, px + 3, py + 3), fill=color)


def draw_curves(run_dir: Path, note: str | None = None) -> Path | None:
    """Training loss, validation loss and accuracy against step -> plots/curves.png.

    `note`: how the run ended, for a run that did not complete (shown under the path); such a
    run gets a picture even when it failed before it logged a row (but not a run that never
    trained: no metrics.csv)."""
    series = read_series(run_dir)
    if not series and (note is None or not (run_dir / "metrics.csv").is_file()):
        return None
    image = Image.new("RGB", (WIDTH, HEIGHT), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=13)
    axes = layout(series)
    loss_area, acc_area = panel_areas()
    _panel(draw, loss_area, "Loss", "cross-entropy",
           {k: v for k, v in series.items() if k.endswith("loss")}, axes["step"],
           axes.get("loss"), font)
    _panel(draw, acc_area, "Validation accuracy", "accuracy",
           {k: v for k, v in series.items() if k.endswith("acc")}, axes["step"],
           axes.get("acc"), font)
    draw.text((WIDTH / 2, 10), str(run_dir), fill=(90, 90, 90), font=font, anchor="mm")
    if note is not None:
        if len(note) > 150:
            note = note[:149] + "…"
        draw.text((WIDTH / 2, 28), note, fill=(200, 30, 30), font=font, anchor="mm")
    out = run_dir / "plots" / "curves.png"
    out.parent.mkdir(exist_ok=True)
    picture = io.BytesIO()
    image.save(picture, format="PNG")
    write_bytes_atomically(out, picture.getvalue())
    return out
