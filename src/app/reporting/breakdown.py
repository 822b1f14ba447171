"""`plots/steps.png` of a run with trainer.telemetry=true: where each rank's step time went
(logs/steps.csv), as one bar per rank of its parts: a slow rank stands out by its time before
the all-reduce, the others by their wait for it. Drawn as plots/curves.png is (matplotlib's
Agg canvas, imported when drawn)."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from app.reporting.curves import save_png

PARTS = {"data_s": ("data wait", "tab:gray"), "compute_s": ("compute", "tab:blue"),
         "wait_s": ("all-reduce wait", "tab:red"), "optimizer_s": ("optimizer", "tab:green"),
         "checkpoint_s": ("checkpoint", "tab:purple")}


def draw_breakdown(run_dir: Path) -> Path | None:
    """Each rank's mean milliseconds a step, by part -> plots/steps.png (None: no steps)."""
    try:
        with open(run_dir / "logs" / "steps.csv", newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        return None
    ranks = sorted({int(r["rank"]) for r in rows})
    if not ranks:
        return None
    hosts = {int(r["rank"]): r["host"] for r in rows}
    mean = {(rank, part): 1e3 * statistics.fmean(float(r[part]) for r in rows
                                                  if int(r["rank"]) == rank)
            for rank in ranks for part in PARTS}
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(9, 1.5 + 0.45 * len(ranks)), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    labels = [f"rank {rank} ({hosts[rank]})" for rank in ranks]
    left = [0.0] * len(ranks)
    for part, (name, color) in PARTS.items():
        widths = [mean[rank, part] for rank in ranks]
        ax.barh(labels, widths, left=left, color=color, label=name, height=0.6)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()  # rank 0 on top
    ax.set_xlabel("milliseconds per optimizer step (mean over the logged steps)")
    ax.set_title(str(run_dir), loc="left", fontsize=9, color="0.35")
    ax.grid(axis="x", color="0.9")
    # Margins in inches: the legend under the axis label (above the bars it would run into
    # the title), room for the rank labels on the left.
    height = figure.get_figheight()
    figure.subplots_adjust(left=1.4 / 9, right=0.98, top=1 - 0.35 / height,
                           bottom=0.95 / height)
    figure.legend(loc="lower center", ncols=len(PARTS), frameon=False, fontsize=8)
    return save_png(figure, run_dir / "plots" / "steps.png")
