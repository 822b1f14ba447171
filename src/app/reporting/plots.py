"""The picture of a sweep: `summary.png` (a run's curves are app.reporting.curves')."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from app.files import write_bytes_atomically


def _pyplot() -> Any:
    # Imported on use: matplotlib costs about half a second, paid only when drawing.
    import matplotlib

    matplotlib.use("Agg")  # files only; no display is needed or wanted
    import matplotlib.pyplot as plt

    return plt


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


def draw_summary(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Path | None:
    """The monitored metric per job (bars), and a heat map when the sweep is a 2-D grid."""
    if not jobs:
        return None
    plt = _pyplot()
    grid = _grid(jobs)
    fig, axes = plt.subplots(1, 2 if grid else 1, figsize=(13 if grid else 8, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    labels = [f"#{j['job']} " + " ".join(f"{k}={v}" for k, v in j["params"].items())
              for j in jobs]
    best = [j["best"] if j["best"] is not None else math.nan for j in jobs]
    colors = ["tab:blue" if j["status"] == "completed" else "tab:red" for j in jobs]
    ax.barh(range(len(jobs)), [0 if math.isnan(b) else b for b in best], color=colors)
    for row, (job, value) in enumerate(zip(jobs, best, strict=True)):
        if math.isnan(value):  # no bar to colour: say why there is none
            ax.text(0, row, f" {job['status']}", va="center", color="tab:red", fontsize=8)
    ax.set_yticks(range(len(jobs)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set(title=f"Best {monitor} per job (red: not completed)", xlabel=f"best {monitor}")
    ax.grid(axis="x", alpha=0.3)
    if grid:
        row_key, col_key, row_values, col_values = grid
        table = [[math.nan] * len(col_values) for _ in row_values]
        status = [[""] * len(col_values) for _ in row_values]
        for job, value in zip(jobs, best, strict=True):
            r, c = row_values.index(job["params"][row_key]), col_values.index(
                job["params"][col_key])
            table[r][c], status[r][c] = value, job["status"]
        heat = axes[0][1]
        image = heat.imshow(table, cmap="viridis", aspect="auto")
        heat.set_xticks(range(len(col_values)), [str(v) for v in col_values])
        heat.set_yticks(range(len(row_values)), [str(v) for v in row_values])
        heat.set(title=f"Best {monitor}", xlabel=col_key, ylabel=row_key)
        low, high = image.get_clim()
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                if math.isnan(value):  # an empty (white) cell: what became of that job
                    heat.text(c, r, status[r][c] or "n/a", ha="center", va="center",
                              color="tab:red", fontsize=9)
                    continue
                bright = value > low + 0.6 * (high - low)
                heat.text(c, r, f"{value:.4f}", ha="center", va="center",
                          color="black" if bright else "white", fontsize=9)
        fig.colorbar(image, ax=heat, label=f"best {monitor}")
    fig.suptitle(str(sweep_dir), fontsize=9)
    fig.tight_layout()
    out = sweep_dir / "summary.png"
    picture = io.BytesIO()
    fig.savefig(picture, format="png", dpi=100)
    plt.close(fig)
    write_bytes_atomically(out, picture.getvalue())
    return out
