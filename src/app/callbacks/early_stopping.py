"""Stop training when the monitored metric stops improving."""

from __future__ import annotations

import math
from typing import Any

from app.checks import whole
from app.config import Monitor, MonitorMode
from app.errors import UserError
from app.training.hooks import Callback, Run

METRICS = tuple(m.value for m in Monitor)  # the metrics the loop logs at validation


class EarlyStopping(Callback):
    """Stops when `monitor` has not improved by more than `min_delta` for `patience`
    validations in a row. Runs on every rank on the reduced metrics, so every rank decides
    alike (the loop also agrees across ranks); its count is checkpointed, so a resumed run stops
    at the same step as one that was never interrupted."""

    every_rank = True

    def __init__(self, monitor: str = "val/acc", mode: str = "max", patience: int = 3,
                 min_delta: float = 0.0) -> None:
        mode = getattr(mode, "value", mode)  # a MonitorMode from ${trainer.monitor_mode}
        if monitor not in METRICS:
            raise UserError(f"monitor={monitor}: expected one of {', '.join(METRICS)}")
        if mode not in ("max", "min"):
            raise UserError(f"mode={mode}: expected max or min")
        if isinstance(min_delta, bool) or not isinstance(min_delta, int | float) or min_delta < 0:
            raise UserError(f"min_delta={min_delta}: expected a number of 0 or more")
        self.monitor, self.mode = monitor, MonitorMode(mode)
        self.patience, self.min_delta = whole("patience", patience, 1), float(min_delta)
        self.best: float | None = None
        self.wait = 0

    def _improved(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == MonitorMode.max:
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def on_validation_end(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        value = metrics[self.monitor]
        if self._improved(value):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            by = f" by more than {self.min_delta:g}" if self.min_delta else ""
            run.request_stop(f"early stopping: {self.monitor} did not improve{by} for "
                             f"{self.wait} validation(s) (best {self.best:.4f})")

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state["best"], state["wait"]

