"""`plots/curves.png`: axes a reader can trust at any run length (in-process, from a metrics.csv
written here as a run writes it)."""

from __future__ import annotations

import csv
import math
import re

import pytest
from PIL import Image

from app.reporting.curves import (
    COLORS,
    HEIGHT,
    WIDTH,
    Axis,
    draw_curves,
    layout,
    panel_areas,
    read_series,
)


def write_metrics(run_dir, train: dict[int, float], val: dict[int, tuple[float, float]]) -> None:
    """metrics.csv with train losses and (val loss, val acc) by step, in step order."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = [{"step": s, "epoch": 0, "split": "train", "loss": v, "lr": 0.001}
            for s, v in train.items()]
    rows += [{"step": s, "epoch": 0, "split": "val", "loss": loss, "acc": acc}
             for s, (loss, acc) in val.items()]
    rows.sort(key=lambda r: (r["step"], r["split"] == "val"))
    with open(run_dir / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "epoch", "split", "loss", "lr", "acc"])
        writer.writeheader()
        writer.writerows(rows)


def assert_readable(axis: Axis) -> None:
    """Distinct labels that are the ticks' values, rounded to the decimals the spacing needs."""
    assert len(axis.labels) >= 2 and len(set(axis.labels)) == len(axis.labels), axis.labels
    for tick, label in zip(axis.ticks, axis.labels, strict=True):
        assert float(label) == pytest.approx(tick, rel=1e-9, abs=1e-12), (tick, label)
        assert len(re.sub(r"e.*|[^0-9]", "", label).strip("0")) <= 3, label  # not 0.3000...04
    assert axis.lo <= axis.ticks[0] and axis.ticks[-1] <= axis.hi


# Short runs log one row at their end (log_every_n_steps=10); a long one spans many decades.
RUNS = {
    "1 step": ({1: 2.298}, {1: (2.304, 0.1058)}),
    "2 steps": ({2: 2.297}, {2: (2.303, 0.1114)}),
    "5 steps": ({5: 2.291}, {5: (2.299, 0.195)}),
    "30 steps": ({10: 2.283, 20: 1.742, 30: 0.882}, {22: (1.193, 0.7103), 30: (0.605, 0.8635)}),
    "no val yet": ({10: 2.28, 20: 1.7}, {}),
    "long": ({s: 2.3 * math.exp(-s / 300) for s in range(10, 4410, 10)},
             {s: (2.3 * math.exp(-s / 320), min(0.999, 0.5 + s / 4000))
              for s in range(220, 4410, 220)}),
}


@pytest.mark.parametrize("name", RUNS)
def test_axes_have_distinct_round_ticks_and_accuracy_stays_in_0_1(tmp_path, name) -> None:
    write_metrics(tmp_path, *RUNS[name])
    axes = layout(read_series(tmp_path))
    for axis in axes.values():
        assert_readable(axis)
    step = axes["step"]
    assert step.lo == 0 and all(t == int(t) for t in step.ticks)
    assert step.hi >= max(s for line in read_series(tmp_path).values() for s, _ in line)
    if "acc" in axes:
        assert 0 <= axes["acc"].lo < axes["acc"].hi <= 1


def test_accuracy_near_its_limits_stays_in_0_1(tmp_path) -> None:
    for acc in (0.0, 0.004, 0.5, 0.997, 1.0):
        write_metrics(tmp_path, {5: 2.3}, {5: (2.3, acc)})
        axis = layout(read_series(tmp_path))["acc"]
        assert 0 <= axis.lo <= acc <= axis.hi <= 1 and axis.hi - axis.lo >= 0.2 - 1e-9
        assert_readable(axis)


def test_loss_axis_is_logarithmic_only_when_the_loss_spans_more_than_a_decade(tmp_path) -> None:
    write_metrics(tmp_path, *RUNS["long"])  # 2.3 down to about 1e-6
    loss = layout(read_series(tmp_path))["loss"]
    assert loss.log and loss.lo <= 2.3e-6 and loss.hi >= 2.3
    assert_readable(loss)
    write_metrics(tmp_path, *RUNS["30 steps"])  # 2.28 down to 0.61: less than a decade
    assert not layout(read_series(tmp_path))["loss"].log


def _pixels(image: Image.Image, color: tuple[int, int, int], box: tuple[int, int, int, int]
            ) -> int:
    counts = image.crop(box).convert("RGB").getcolors(maxcolors=1 << 24)
    return sum(n for n, c in counts if c == color)


@pytest.mark.parametrize("train", [{5: 2.291}, {10: 2.28, 20: 1.7}])
def test_a_train_row_is_drawn_and_legends_stay_off_the_plot(tmp_path, train) -> None:
    write_metrics(tmp_path, train, {5: (2.299, 0.95)})  # accuracy in the top right corner
    image = Image.open(draw_curves(tmp_path))
    loss_area, acc_area = panel_areas()
    inside = (loss_area.x0 + 1, loss_area.y0 + 1, loss_area.x1, loss_area.y1)
    assert _pixels(image, COLORS["train/loss"], inside) > 0  # even a single row shows
    assert _pixels(image, COLORS["val/loss"], inside) > 0
    # Each legend is drawn above its plot area, where no data point can lie.
    for area, key in ((loss_area, "train/loss"), (acc_area, "val/acc")):
        assert _pixels(image, COLORS[key], (area.x0, area.y0 - 30, area.x1, area.y0)) > 0


def test_a_run_that_logged_nothing_gets_a_picture_only_with_a_note(tmp_path) -> None:
    write_metrics(tmp_path, {}, {})
    assert draw_curves(tmp_path) is None
    assert draw_curves(tmp_path, note="failed at step 3: AppError: ...").is_file()


def test_the_picture_is_a_valid_png_of_its_size(tmp_path) -> None:
    write_metrics(tmp_path, {10: 2.28, 20: 1.7}, {20: (1.9, 0.4)})
    path = draw_curves(tmp_path)
    with Image.open(path) as image:
        image.verify()  # the whole file decodes
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (WIDTH, HEIGHT)
