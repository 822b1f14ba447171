"""Learning rates and training speed, logged with the loss."""

from __future__ import annotations

import time

from app.training.hooks import Callback, Run


class LRThroughputMonitor(Callback):
    """On each logging step: `lr/pgN` for every parameter group, `samples_per_s` (over all
    ranks) and `step_time_s`, both averaged since the previous logging step. Wall-clock times
    on the host: no device sync is added, so on a GPU they follow the queue's steady pace."""

    def on_train_start(self, run: Run) -> None:
        self._since, self._since_step = time.perf_counter(), run.step

    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        for i, group in enumerate(run.optimizer.param_groups):
            metrics[f"lr/pg{i}"] = float(group["lr"])
        now = time.perf_counter()
        steps = step - self._since_step
        if steps > 0:
            elapsed = now - self._since
            metrics["step_time_s"] = elapsed / steps
            metrics["samples_per_s"] = steps * run.global_batch / elapsed
        self._since, self._since_step = now, step
