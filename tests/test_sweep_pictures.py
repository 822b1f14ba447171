"""The sweep's summary.png, read from its matplotlib Figure: bars that show the differences
between jobs, labels that keep what tells the jobs apart, a heat map in numeric order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from matplotlib.text import Text

from app.sweeps.plots import summary_figure


def _job(n: int, best: float | None, status: str = "completed", **params: str) -> dict:
    return {"job": str(n), "params": {k.replace("__", "."): v for k, v in params.items()},
            "best": best, "status": status}


def _texts(figure: Any, ax: Any = None) -> list[str]:
    return [t.get_text() for t in (ax or figure).findobj(Text) if t.get_text()]


def _ticks(labels: list[Text]) -> list[str]:
    return [t.get_text() for t in labels]


def test_bars_zoom_in_on_the_values_and_say_where_the_axis_starts(tmp_path: Path) -> None:
    jobs = [_job(1, 0.994, optimizer__lr="0.003"), _job(2, 0.991, optimizer__lr="0.001"),
            _job(0, 0.989, optimizer__lr="0.01"), _job(3, None, "failed", optimizer__lr="1e6")]
    figure = summary_figure(tmp_path, jobs, "val/acc")
    bars = figure.axes[0]
    left, right = bars.get_xlim()
    assert 0.98 < left < 0.989 and right > 0.994, (left, right)
    assert "axis starts at 0.9882, not 0" in bars.get_xlabel()
    # Each bar says its value, the best job marked; the failed one its status.
    texts = _texts(figure, bars)
    assert {"0.9940 ◀ best", "0.9910", "0.9890", "failed"} <= set(texts), texts
    figure.canvas.draw()
    widths = [p.get_window_extent().width for p in bars.patches[:3]]
    assert widths[0] - widths[2] > 200, widths  # pixels: 0.994 and 0.989 read apart


@pytest.mark.parametrize(("values", "mode", "best"), [
    ((0.2, 0.9, 0.5), "max", "0.9000 ◀ best"),  # 0 is near: whole bars
    ((0.97,), "max", "0.9700 ◀ best"),  # one value: nothing to zoom in on
    ((0.05231, 0.05194, 0.31), "min", "0.0519 ◀ best"),
])
def test_bars_start_at_0_where_it_is_near(tmp_path: Path, values: tuple, mode: str,
                                          best: str) -> None:
    jobs = [dict(_job(n, v, x=str(n)), mode=mode) for n, v in enumerate(values)]
    bars = summary_figure(tmp_path, jobs, "val/acc").axes[0]
    assert bars.get_xlim()[0] == 0 and bars.get_xlabel() == "best val/acc"
    assert best in _texts(bars), _texts(bars)


def test_negative_values_zoomed_in_say_where_the_axis_ends(tmp_path: Path) -> None:
    jobs = [_job(n, v, x=str(n)) for n, v in enumerate([-3.2, -3.1, -3.35])]
    bars = summary_figure(tmp_path, jobs, "val/score").axes[0]
    assert bars.get_xlim()[0] < -3.35 and bars.get_xlim()[1] == pytest.approx(-3.06)
    assert "axis ends at -3.06, not 0" in bars.get_xlabel()


def test_labels_keep_the_values_that_tell_optuna_trials_apart(tmp_path: Path) -> None:
    """Optuna's floats of 17 digits and long key names cut the labels before the value of
    model.channels; what every trial shares is said once, in the title."""
    trials = [("0.0010023345088785367", "[32,64]"), ("0.011684151460906789", "[16,32]"),
              ("0.005269555062468367", "[8,16]"), ("0.0010023345088785399", "[8,16]")]
    jobs = [dict(_job(n, 0.9 + n / 100, optimizer__lr=lr, model__channels=ch,
                      model__dropout="0.1"),
                 overrides_list=[f"optimizer.lr={lr}", "hparams_search=digits_optuna",
                                 f"model.channels={ch}", "trainer.max_epochs=5"])
            for n, (lr, ch) in enumerate(trials)]
    figure = summary_figure(tmp_path, jobs, "val/acc")
    labels = _ticks(figure.axes[0].get_yticklabels())
    # The first and last learning rates differ in their 16th digit: kept apart.
    assert labels == ["#0 lr=0.001002334508878537 channels=[32,64]",
                      "#1 lr=0.01168 channels=[16,32]", "#2 lr=0.00527 channels=[8,16]",
                      "#3 lr=0.00100233450887854 channels=[8,16]"], labels
    title = figure.get_suptitle()
    assert "every job: hparams_search=digits_optuna trainer.max_epochs=5 model.dropout=0.1" \
        in title and "lr = optimizer.lr, channels = model.channels" in title, title


def test_labels_cut_only_what_every_job_shares(tmp_path: Path) -> None:
    roots = [f"/data/datasets/digits/version-2024-01-0{n}/split-a" for n in range(3)]
    jobs = [_job(n, 0.9, data__root=root, model__dropout=str(n / 10),
                 data__dropout=str(n / 5)) for n, root in enumerate(roots)]
    figure = summary_figure(tmp_path, jobs, "val/acc")
    labels = _ticks(figure.axes[0].get_yticklabels())
    # Two keys of one name keep their group; a path keeps the part that differs.
    assert labels[2] == "#2 root=…version-2024-01-02… model.dropout=0.2 data.dropout=0.4", \
        labels
    # A label the picture does not hold widens it rather than losing its end.
    many = [_job(n, 0.9, **{f"group{k}__key{k}": f"value-{n}" for k in range(8)})
            for n in range(2)]
    figure = summary_figure(tmp_path, many, "val/acc")
    assert figure.bbox.width > 800
    assert all(t.endswith("key7=value-1") for t in _ticks(
        figure.axes[0].get_yticklabels())[1:])


def test_heat_map_rows_and_columns_in_numeric_order(tmp_path: Path) -> None:
    """An Optuna sweep runs its values in random order; the jobs come best first."""
    best = {"0.1": 0.5, "0.01": 0.6, "0.003": 0.7, "1e-4": 0.8}
    jobs = [_job(n, best[lr] + len(ch) / 1000, optimizer__lr=lr, model__channels=ch)
            for n, (lr, ch) in enumerate((lr, ch) for lr in best
                                         for ch in ["[32,64]", "[8,16]", "[16, 32]"])]
    figure = summary_figure(tmp_path, jobs[::-1], "val/acc")
    heat = figure.axes[1]
    columns, rows = _ticks(heat.get_xticklabels()), _ticks(heat.get_yticklabels())
    assert columns == ["[8,16]", "[16, 32]", "[32,64]"] and rows == ["1e-4", "0.003", "0.01",
                                                                    "0.1"]
    # Each cell holds its job's value: the job of lr=1e-4, channels=[32,64] at (0, 2).
    cells = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text()
             for t in heat.texts}
    assert cells[(0, 2)] == "0.8070" and cells[(3, 0)] == "0.5060", cells


def test_heat_map_keeps_strings_in_the_order_the_sweep_ran_them(tmp_path: Path) -> None:
    jobs = [_job(n, 0.9 - n / 100, optimizer__name=name, model__dropout=d)
            for n, (name, d) in enumerate((name, d) for name in ["sgd", "adamw", "adam"]
                                          for d in ["null", "0.3", "0.1"])]
    heat = summary_figure(tmp_path, jobs[::-1], "val/acc").axes[1]
    assert _ticks(heat.get_xticklabels()) == ["0.1", "0.3", "null"]
    assert _ticks(heat.get_yticklabels()) == ["sgd", "adamw", "adam"]
