"""A sweep's `summary.png`: the best value of the monitored metric per job as bars, and a heat
map beside them when the sweep is a full 2-D grid of two keys. A job without a value (failed,
still running, killed) gets no bar and an empty cell, its status written where the value
would be. matplotlib's Agg canvas, imported when drawing (no pyplot: no state shared)."""

from __future__ import annotations

import math
import os
import textwrap
from pathlib import Path
from typing import Any

from app.reporting.curves import save_png

LABEL_MAX = 48  # characters of a job's label the picture holds; longer ones widen it
VALUE_MAX = 20  # characters of a swept value in a label; longer ones lose what all share


def _number(value: Any) -> float | None:
    try:
        number = float(str(value))
    except ValueError:
        return None
    return None if math.isnan(number) else number


def _order(value: Any, seen: int) -> tuple:
    """Numbers by value, then lists of numbers (model.channels=[8,16]) element by element,
    then anything else as the sweep ran it (seen: its place among the values)."""
    if (number := _number(value)) is not None:
        return 0, number
    text = str(value).strip()
    if text.startswith("[") and text.endswith("]"):
        items = [_number(v) for v in text[1:-1].split(",")] if text[1:-1].strip() else []
        if None not in items:
            return 1, items
    return 2, seen


def _sorted(values: list) -> list:
    return [v for _, v in sorted(enumerate(values), key=lambda p: _order(p[1], p[0]))]


def _decimals(values: list[float]) -> int:
    """Decimals that give the largest value 4 significant digits, more if two different
    values would read the same."""
    largest = max((abs(v) for v in values), default=0)
    decimals = max(0, 3 - math.floor(math.log10(largest))) if largest else 4
    while len({f"{v:.{decimals}f}" for v in values}) < len(set(values)) and decimals < 12:
        decimals += 1
    return decimals


def _short_keys(keys: list[str]) -> dict[str, str]:
    """Each key by the shortest dotted tail no other key ends with (optimizer.lr -> lr)."""
    def tail(key: str, n: int) -> str:
        return ".".join(key.split(".")[-n:])
    short = {}
    for key in keys:
        n = 1
        while n < key.count(".") + 1 and any(tail(o, n) == tail(key, n) for o in keys
                                              if o != key):
            n += 1
        short[key] = tail(key, n)
    return short


def _boundary(common: str, side: int) -> int:
    """How many characters of what all values share (side -1: a prefix, 1: a suffix) a label
    leaves out: up to a path's "/" that ends the prefix (starts the suffix), else a "_", "-"
    or "."; none where that is 3 characters or fewer."""
    for separators in ("/", "_-."):
        cut = max((common.rfind(c) + 1 if side < 0 else len(common) - common.find(c)
                   for c in separators if c in common), default=0)
        if cut > 3:
            return cut
    return 0


def _short_values(values: list) -> dict[Any, str]:
    """A key's values as a label shows them: Optuna's floats each with the fewest digits (4
    at least) that keep it apart from the others; long strings without the start and end
    that all share."""
    texts = {v: str(v) for v in values}
    numbers = {v: _number(v) for v in values}
    floats = {v: n for v, n in numbers.items() if n is not None and not n.is_integer()}
    for v, n in floats.items():
        shown = next(s for d in range(4, 18) for s in [f"{n:.{d}g}"] if not any(
            f"{other:.{d}g}" == s for other in floats.values() if other != n))
        texts[v] = min(texts[v], shown, key=len)
    if max(map(len, texts.values()), default=0) > VALUE_MAX and len(texts) > 1:
        keep = min(map(len, texts.values())) - 1  # every value keeps a character of its own
        start = _boundary(os.path.commonprefix(list(texts.values()))[:keep], -1)
        end = _boundary(os.path.commonprefix([t[start:][::-1] for t in texts.values()])[
            :keep - start][::-1], 1)
        texts = {v: ("…" if start else "") + t[start:len(t) - end] + ("…" if end else "")
                 for v, t in texts.items()}
    return texts


def _labels(jobs: list[dict[str, Any]]) -> tuple[list[str], list[str], dict[str, str]]:
    """Each job's label (the values that tell it from the others), what every job shares
    (the overrides common to all, keys of one value), and the keys the labels shorten."""
    keys = list(dict.fromkeys(k for j in jobs for k in j["params"]))
    values = {k: [j["params"].get(k) for j in jobs] for k in keys}
    shared = [o for o in jobs[0].get("overrides_list", []) if "=" in o and all(
        o in j.get("overrides_list", []) for j in jobs)]
    shared += [f"{k}={values[k][0]}" for k in keys if len(set(values[k])) == 1
               and values[k][0] is not None and f"{k}={values[k][0]}" not in shared]
    swept = [k for k in keys if len(set(values[k])) > 1]
    names = _short_keys(swept)
    shown = {k: _short_values([v for v in values[k] if v is not None]) for k in swept}
    labels = [" ".join([f"#{j['job']}"] + [f"{names[k]}={shown[k][j['params'][k]]}"
                                           for k in swept if k in j["params"]]) for j in jobs]
    return labels, shared, {k: n for k, n in names.items() if n != k}


def _grid(jobs: list[dict[str, Any]]) -> tuple[str, str, list, list] | None:
    """The two swept keys when the jobs form a full 2-D grid of them, and their values in
    order (numbers by value: an Optuna sweep runs them in random order)."""
    values: dict[str, dict] = {}  # key -> its values, in order (a dict as an ordered set)
    for job in sorted(jobs, key=lambda j: (not str(j["job"]).isdigit(), int(j["job"]) if str(
            j["job"]).isdigit() else 0)):  # by job number: the order the sweep ran them
        for key, value in job["params"].items():
            values.setdefault(key, {})[value] = None
    swept = [k for k, v in values.items() if len(v) > 1]
    if len(swept) != 2 or len(jobs) != len(values[swept[0]]) * len(values[swept[1]]):
        return None
    return swept[0], swept[1], _sorted(list(values[swept[0]])), _sorted(list(values[swept[1]]))


def _value_axis(ax: Any, values: list[float], xlabel: str) -> str:
    """Limits of the bars' axis that show the differences between jobs, with room for the
    values written beyond the bars' ends; the axis label says where the axis does not reach
    0 (its bars are cut there)."""
    lo, hi = min(values), max(values)
    left, right = min(lo, 0), max(hi, 0)  # one value: nothing to tell apart, bars from 0
    if lo != hi:
        pad = (hi - lo) * 0.15
        step = 10.0 ** math.floor(math.log10(pad))  # the axis ends at round numbers
        low, high = math.floor((lo - pad) / step) * step, math.ceil((hi + pad) / step) * step
        # Zoomed in only where 0 lies more than the values' width away: whole bars cost at
        # most half the axis otherwise.
        left = low if low > high - low else 0 if lo >= 0 else low
        right = high if -high > high - low else 0 if hi <= 0 else high
    width = (right - left) or 1.0
    left, right = left - 0.2 * width * (lo < 0), right + 0.2 * width * (hi > 0)
    ax.set_xlim(left, right)
    if left <= 0 <= right:
        return xlabel
    end, at = (0, left) if left > 0 else (1, right)
    for dx in (-0.007, 0.007):  # the cut end of the axis, marked as broken: //
        ax.plot([end + dx], [0], transform=ax.transAxes, marker=[(-1, -2), (1, 2)],
                markersize=8, color="black", clip_on=False)
    return f"{xlabel} (axis {'starts' if end == 0 else 'ends'} at {at:.6g}, not 0)"


def summary_figure(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Any:
    """The matplotlib Figure of `summary.png` (jobs: at least one)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.transforms import blended_transform_factory

    grid = _grid(jobs)
    labels, shared, shortened = _labels(jobs)
    height = max(450, 130 + 18 * len(jobs))  # pixels: many jobs need a row of text each
    # A label longer than the picture holds widens it (about 5.5 pixels a character).
    width = (13 if grid else 8) + max(0, max(map(len, labels)) - LABEL_MAX) * 0.055
    figure = Figure(figsize=(width, height / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    notes = ["every job: " + " ".join(shared)] * bool(shared) + ["labels: " + ", ".join(
        f"{n} = {k}" for k, n in shortened.items())] * bool(shortened)
    figure.suptitle("\n".join([str(sweep_dir)] + [line for note in notes for line in
                               textwrap.wrap(note, int(width * 100 / 6))]),  # 6 px a char
                    color="0.35", fontsize=9)
    axes = figure.subplots(1, 2, width_ratios=[1.3, 1]) if grid else [figure.subplots()]
    bars, rows = axes[0], range(len(jobs))
    values = [j["best"] for j in jobs if j["best"] is not None]
    best = (min if jobs[0].get("mode", "max") == "min" else max)(values, default=None)
    marked = [best is not None and j["best"] == best for j in jobs]
    # A value without a bar (none, or a diverged loss's inf) is written at the axis' start;
    # the axis and the digits are those of the values with a bar.
    barred = [j["best"] is not None and math.isfinite(j["best"]) for j in jobs]
    values = [v for v in values if math.isfinite(v)]
    decimals = _decimals(values)
    drawn = bars.barh(rows, [j["best"] if b else 0 for j, b in zip(jobs, barred, strict=True)],
                      color=["tab:blue" if j["status"] == "completed" else "tab:red"
                             for j in jobs])
    texts = bars.bar_label(drawn, [
        "" if j["best"] is None else f"{j['best']:.{decimals}f}"
        + ("" if j["status"] == "completed" else f" ({j['status']})")
        + (" ◀ best" if m else "") for j, m in zip(jobs, marked, strict=True)],
        padding=3, fontsize=8)
    edge = blended_transform_factory(bars.transAxes, bars.transData)
    for row, job, text, bar, mark in zip(rows, jobs, texts, barred, marked, strict=True):
        text.set_fontweight("bold" if mark else "normal")
        if not bar:
            bars.text(0.01, row, text.get_text() or job["status"], transform=edge,
                      va="center", fontsize=8, fontweight=text.get_fontweight(),
                      color="black" if job["status"] == "completed" else "tab:red")
            text.set_text("")
    bars.set_yticks(rows, labels, fontsize=8)
    bars.grid(axis="x", color="0.9")
    xlabel = f"best {monitor}"
    if values:
        xlabel = _value_axis(bars, values, xlabel)
    else:
        bars.set_xticks([])  # no value: an axis of none
    bars.set(ylim=(len(jobs) - 0.5, -0.5), axisbelow=True,  # the first job at the top
             title=f"Best {monitor} per job (red: not completed)", xlabel=xlabel)
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
            ax.text(c, r, status if math.isnan(value) else f"{value:.{decimals}f}",
                    ha="center", va="center", fontsize=8,
                    color="tab:red" if math.isnan(value) else "black" if light else "white")
    col_shown, row_shown = _short_values(col_values), _short_values(row_values)
    ax.set_xticks(range(len(col_values)), [col_shown[v] for v in col_values], fontsize=8)
    ax.set_yticks(range(len(row_values)), [row_shown[v] for v in row_values], fontsize=8)
    ax.set(title=f"Best {monitor}", xlabel=col_key, ylabel=row_key)
    figure.colorbar(image, ax=ax, label=f"best {monitor}")
    return figure


def draw_summary(sweep_dir: Path, jobs: list[dict[str, Any]], monitor: str) -> Path | None:
    """The monitored metric per job (bars), and a heat map when the sweep is a 2-D grid."""
    if not jobs:
        return None
    return save_png(summary_figure(sweep_dir, jobs, monitor), sweep_dir / "summary.png")
