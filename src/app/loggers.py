"""Metric sinks of rank 0: `metrics.csv` always, TensorBoard when `logger=tensorboard`."""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

KEY_COLUMNS = ["step", "epoch", "split"]


class CSVLogger:
    """One row per logged step and split: step, epoch, split, then the metric names.

    A metric name seen for the first time adds a column; the file is then rewritten with the
    wider header, so it stays one valid table. When a run resumes in its own directory, rows
    logged after the checkpoint it resumes from are dropped: they will be logged again.
    """

    def __init__(self, path: Path, resume_step: int | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.columns = list(KEY_COLUMNS)
        if resume_step is not None and path.is_file():
            with open(path, newline="") as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or KEY_COLUMNS)
                self.rows = [r for r in reader if int(r["step"]) <= resume_step]
        self._rewrite()

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def log(self, step: int, epoch: int, split: str, metrics: dict[str, float]) -> None:
        row = {"step": step, "epoch": epoch, "split": split, **metrics}
        self.rows.append(row)
        new = [k for k in metrics if k not in self.columns]
        if new:
            self.columns += new
            self._rewrite()
            return
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)


class MetricLogger:
    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None) -> None:
        self.csv = CSVLogger(run_dir / "metrics.csv", resume_step)
        self.tb = None
        if tensorboard:
            # Imported here: tensorboard costs about a second to import, paid only when used.
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=resume_step)

    def log(self, step: int, epoch: int, split: str, metrics: dict[str, float]) -> None:
        self.csv.log(step, epoch, split, metrics)
        if self.tb is not None:
            for name, value in metrics.items():
                self.tb.add_scalar(f"{split}/{name}", value, step)

    def log_text(self, tag: str, text: str) -> None:
        if self.tb is not None:
            self.tb.add_text(tag, f"```\n{text}\n```")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
