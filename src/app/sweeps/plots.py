"""A sweep's `summary.png`: the best value of the monitored metric per job as bars, and a heat
map beside them when the sweep is a full 2-D grid of two keys. A job without a value (failed,
still running, killed) gets no bar and an empty cell, its status written where the value
would be. matplotlib's Agg canvas, imported when drawing (no pyplot: no state shared)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from app.files import write_bytes_atomically

LABEL_MAX = 48  # characters of a job's label (its overrides); longer ones are cut


def _grid(jobs: list[dict[str, Any]]) -> tuple[str, str, list, list] | None:
    """The two swept keys when the jobs form a full 2-D grid of them."""
    values: dict[str, dict] = {}  # key -> its values, in order (a dict as an ordered set)
    for job in jobs:
        for key, value in job["params"].items():
            values.setdefault(key, {})[value] = None
    swept = [k for k, v in values.items() if len(v) > 1]
    if len(swept) != 2 or len(jobs) != len(values[swept[0]]) * len(values[swept[1]]):
        return None
    return swept[0], swept[1], list(values[swept[0]]), list(values[swept[1]])


def summary_figure(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Any:
    """The matplotlib Figure of `summary.png` (jobs: at least one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = _grid(jobs)
    height = max(450, 130 + 18 * len(jobs))  # pixels: many jobs need a row of text each
    figure = Figure(figsize=(13 if grid else 8, height / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    figure.suptitle(str(sweep_dir), color="0.35", fontsize=9)
    axes = figure.subplots(1, 2, width_ratios=[1.3, 1]) if grid else [figure.subplots()]
    bars, rows = axes[0], range(len(jobs))
    drawn = bars.barh(rows, [j["best"] or 0 for j in jobs], color=[
        "tab:blue" if j["status"] == "completed" else "tab:red" for j in jobs])
    bars.bar_label(drawn, [j["status"] if j["best"] is None else "" for j in jobs], padding=3,
                   color="tab:red", fontsize=8)  # no bar: say why there is none
    labels = [f"#{j['job']} " + " ".join(f"{k}={v}" for k, v in j["params"].items())
              for j in jobs]
    bars.set_yticks(rows, [s if len(s) <= LABEL_MAX else s[:LABEL_MAX - 1] + "…"
                           for s in labels], fontsize=8)
    bars.grid(axis="x", color="0.9")
    bars.set(ylim=(len(jobs) - 0.5, -0.5), axisbelow=True,  # the first job at the top
             title=f"Best {monitor} per job (red: not completed)", xlabel=f"best {monitor}")
    if not grid:
        return figure
    ax, (row_key, col_key, row_values, col_values) = axes[1], grid
    cell = {(j["params"][row_key], j["params"][col_key]):
            (math.nan if j["best"] is None else j["best"], j["status"]) for j in jobs}
    # A cell without a job ("n/a"): two jobs of the same values took its place.
    table = [[cell.get((r, c), (math.nan, "n/a")) for c in col_values] for r in row_values]
    image = ax.imshow([[v for v, _ in row] for row in table], cmap="viridis", aspect="auto")
    for r, row in enumerate(table):
        for c, (value, status) in enumerate(row):  # NaN: an empty cell says what became of it
            light = not math.isnan(value) and image.norm(value) > 0.6
            ax.text(c, r, status if math.isnan(value) else f"{value:.4f}", ha="center",
                    va="center", fontsize=8,
                    color="tab:red" if math.isnan(value) else "black" if light else "white")
    ax.set_xticks(range(len(col_values)), [str(v) for v in col_values], fontsize=8)
    ax.set_yticks(range(len(row_values)), [str(v) for v in row_values], fontsize=8)
    ax.set(title=f"Best {monitor}", xlabel=col_key, ylabel=row_key)
    figure.colorbar(image, ax=ax, label=f"best {monitor}")
    return figure


def draw_summary(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Path | None:
    """The monitored metric per job (bars), and a heat map when the sweep is a 2-D grid."""
    if not jobs:
        return None
    png = io.BytesIO()
    summary_figure(sweep_dir, jobs, monitor).savefig(png, format="png")
    write_bytes_atomically(sweep_dir / "summary.png", png.getvalue())
    return sweep_dir / "summary.png"
