"""`plots/curves.png` of a run: training loss, validation loss and accuracy against step, on
matplotlib's Agg canvas, imported only when a picture is drawn (a training process pays for it
at its end: docs/measurements.md); no pyplot, so no state is shared between pictures."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from app.files import write_bytes_atomically
from app.reporting.results import read_metrics

COLORS = {"train/loss": "tab:blue", "val/loss": "tab:orange", "val/acc": "tab:green"}
MARKERS_UP_TO = 60  # points of a line drawn as dots too: a short run's few rows stay visible

Series = dict[str, list[tuple[int, float]]]


def read_series(run_dir: Path) -> Series:
    series: Series = {}
    for row in read_metrics(run_dir):
        for name in ("loss", "acc"):
            value = row.get(name)
            if value and math.isfinite(float(value)):
                series.setdefault(f"{row['split']}/{name}", []).append(
                    (int(row["step"]), float(value)))
    return series


def panels(series: Series) -> list[tuple[str, str, Series]]:
    """The two panels, left to right: (title, y label, the lines drawn in it)."""
    return [(title, ylabel, {k: v for k, v in sorted(series.items()) if k.endswith(suffix)})
            for title, ylabel, suffix in (("Loss", "cross-entropy", "loss"),
                                          ("Validation accuracy", "accuracy", "acc"))]


def y_axis(ylabel: str, lines: Series) -> tuple[str, tuple[float, float] | None]:
    """A panel's y scale and limits (None: matplotlib's). A loss that falls by more than a
    decade would be a flat line for most of the run on a linear axis: a log axis shows the
    second half of training too. Else the values and 5% beyond, at least 0.2 (accuracy) or 10%
    (loss) tall, so that a flat line is not magnified into noise, and accuracy within [0, 1]."""
    values = [v for line in lines.values() for _, v in line]
    lo, hi = min(values), max(values)
    if ylabel != "accuracy" and lo > 0 and hi / lo > 10:
        return "log", None
    min_span, bounds = ((0.2, (0.0, 1.0)) if ylabel == "accuracy" else
                        (max(0.1 * abs(hi), 1e-3), (0.0 if lo >= 0 else -math.inf, math.inf)))
    pad = max(0.05 * (hi - lo), (min_span - (hi - lo)) / 2)
    shift = max(0.0, bounds[0] - (lo - pad)) - max(0.0, hi + pad - bounds[1])  # keep the span
    return "linear", (max(bounds[0], lo - pad + shift), min(bounds[1], hi + pad + shift))


def draw_curves(run_dir: Path, note: str | None = None) -> Path | None:
    """Training loss, validation loss and accuracy against step -> plots/curves.png.

    `note`: how the run ended, for a run that did not complete (shown under the path); such a
    run gets a picture even when it failed before it logged a row (but not a run that never
    trained: no metrics.csv)."""
    series = read_series(run_dir)
    if not series and (note is None or not (run_dir / "metrics.csv").is_file()):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(11, 4.6), dpi=100)  # 1100 x 460 pixels
    FigureCanvasAgg(figure)
    # A fixed layout (matplotlib's constrained one would double the time to draw).
    figure.subplots_adjust(left=0.075, right=0.985, bottom=0.13, top=0.83, wspace=0.2)
    figure.text(0.5, 0.975, str(run_dir), color="0.35", ha="center", va="center", fontsize=9)
    if note is not None:
        note = note if len(note) <= 150 else note[:149] + "…"
        figure.text(0.5, 0.93, note, color="tab:red", ha="center", va="center", fontsize=9)
    last = max((s for line in series.values() for s, _ in line), default=1)
    for ax, (title, ylabel, lines) in zip(figure.subplots(1, 2), panels(series), strict=True):
        ax.set_title(title, loc="left", fontsize=11)
        ax.set(xlabel="optimizer step", xlim=(0, last * 1.02 + 0.02))  # past the last point
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if not lines:
            ax.text(0.5, 0.5, "nothing logged", color="0.5", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_yticks([])
            continue
        for key, line in lines.items():
            steps, values = zip(*line, strict=True)
            ax.plot(steps, values, color=COLORS.get(key, "0.4"), linewidth=1.8, label=key,
                    marker="o" if len(line) <= MARKERS_UP_TO else None, markersize=4,
                    clip_on=False)  # a point on the frame (accuracy 1) is drawn whole
        scale, ylim = y_axis(ylabel, lines)
        ax.set(yscale=scale, ylim=ylim, ylabel=ylabel + (" (log scale)" if scale == "log" else ""))
        ax.grid(color="0.9")
        # Above the plot area, right-aligned, where no line can run under it.
        ax.legend(loc="lower right", bbox_to_anchor=(1, 1), ncols=len(lines), frameon=False,
                  borderaxespad=0.2)
    return save_png(figure, run_dir / "plots" / "curves.png")


def save_png(figure: Any, out: Path) -> Path:
    """A matplotlib figure as a PNG file, written whole or not at all (its folder made)."""
    picture = io.BytesIO()
    figure.savefig(picture, format="png")
    out.parent.mkdir(exist_ok=True)
    write_bytes_atomically(out, picture.getvalue())
    return out
