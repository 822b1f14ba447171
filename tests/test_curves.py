"""`plots/curves.png`: a readable picture at any run length (in-process, from a metrics.csv
written here as a run writes it): which lines go in which panel, the loss axis's scale, the
accuracy axis's range, and a PNG of the expected size whatever was logged."""

from __future__ import annotations

import csv
import math

import pytest
from PIL import Image

from app.reporting.curves import COLORS, draw_curves, panels, read_series, y_axis


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


# Short runs log one row at their end (log_every_n_steps=10); a long one spans many decades.
RUNS = {
    "1 step": ({1: 2.298}, {1: (2.304, 0.1058)}),
    "5 steps": ({5: 2.291}, {5: (2.299, 0.195)}),
    "30 steps": ({10: 2.283, 20: 1.742, 30: 0.882}, {22: (1.193, 0.7103), 30: (0.605, 0.8635)}),
    "no val yet": ({10: 2.28, 20: 1.7}, {}),
    "long": ({s: 2.3 * math.exp(-s / 300) for s in range(10, 4410, 10)},
             {s: (2.3 * math.exp(-s / 320), min(0.999, 0.5 + s / 4000))
              for s in range(220, 4410, 220)}),
}


def _rgb(color: str) -> tuple[int, int, int]:
    from matplotlib.colors import to_rgb

    return tuple(round(255 * c) for c in to_rgb(color))  # type: ignore[return-value]


def _png(path) -> Image.Image:
    """The picture at `path`: a whole PNG of 1100 x 460 pixels."""
    with Image.open(path) as image:
        image.verify()  # the whole file decodes
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1100, 460)
        return image.convert("RGB")


@pytest.mark.parametrize("name", RUNS)
def test_every_run_length_gets_a_png_with_its_lines_in_their_panels(tmp_path, name) -> None:
    write_metrics(tmp_path, *RUNS[name])
    series = read_series(tmp_path)
    (_, _, losses), (_, _, accs) = panels(series)
    assert sorted(losses) == ["train/loss", "val/loss"][:1 + bool(RUNS[name][1])]
    assert sorted(accs) == (["val/acc"] if RUNS[name][1] else [])
    path = draw_curves(tmp_path)
    assert path == tmp_path / "plots" / "curves.png"
    # Each line logged is drawn in its colour (line and legend), and only those.
    colors = {c for _, c in _png(path).getcolors(1 << 24)}
    for key, color in COLORS.items():
        assert (_rgb(color) in colors) == (key in series), key
    assert not list((tmp_path / "plots").glob(".*"))  # no temporary file left beside it


def test_loss_axis_is_logarithmic_only_when_the_loss_spans_more_than_a_decade(tmp_path) -> None:
    write_metrics(tmp_path, *RUNS["long"])  # 2.3 down to about 1e-6
    assert y_axis("cross-entropy", panels(read_series(tmp_path))[0][2]) == ("log", None)
    write_metrics(tmp_path, *RUNS["30 steps"])  # 2.28 down to 0.61: less than a decade
    scale, (lo, hi) = y_axis("cross-entropy", panels(read_series(tmp_path))[0][2])
    assert scale == "linear" and 0 <= lo <= 0.605 and 2.283 <= hi
    assert y_axis("cross-entropy", {"train/loss": [(1, -0.5), (2, 3.0)]})[0] == "linear"


def test_a_flat_loss_is_not_magnified_into_noise() -> None:
    lines = {"train/loss": [(1, 2.298)], "val/loss": [(1, 2.304)]}
    scale, (lo, hi) = y_axis("cross-entropy", lines)
    assert scale == "linear" and lo <= 2.298 and 2.304 <= hi and hi - lo >= 0.23


@pytest.mark.parametrize("accs", [[0.0], [0.004], [0.5], [0.997], [1.0], [0.1, 0.95],
                                  [0.0, 1.0]])
def test_accuracy_axis_stays_in_0_1_and_shows_every_value(accs) -> None:
    scale, (lo, hi) = y_axis("accuracy", {"val/acc": list(enumerate(accs))})
    assert scale == "linear" and 0 <= lo <= min(accs) and max(accs) <= hi <= 1
    assert hi - lo >= 0.2 - 1e-9


def test_non_finite_values_are_left_out_and_a_single_point_draws(tmp_path) -> None:
    (tmp_path / "metrics.csv").write_text(
        "step,epoch,split,loss,lr,acc\n1,0,train,nan,0.1,\n2,0,train,inf,0.1,\n"
        "3,0,train,2.3,0.1,\n3,0,val,-inf,,0.4\n")
    assert read_series(tmp_path) == {"train/loss": [(3, 2.3)], "val/acc": [(3, 0.4)]}
    _png(draw_curves(tmp_path))


def test_a_run_that_logged_nothing_gets_a_picture_only_with_a_note(tmp_path) -> None:
    assert draw_curves(tmp_path, note="failed") is None  # never trained: no metrics.csv
    write_metrics(tmp_path, {}, {})
    assert draw_curves(tmp_path) is None
    assert not (tmp_path / "plots").exists()
    _png(draw_curves(tmp_path, note="failed at step 3: AppError: " + "x" * 300))
