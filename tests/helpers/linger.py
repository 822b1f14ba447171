"""Callbacks that keep a process a while after its job has ended (as a slow teardown would):
a window in which the run has completed and the process still runs."""

from __future__ import annotations

import multiprocessing.util
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from app.callbacks import Callback as AppCallback


class Linger(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


class LingerAtExit(AppCallback):
    """A training callback: each rank, after its run, stays `seconds` as its process ends
    (after rank 0 has sent its result), having written `marker`: a window in which the run
    has completed and its workers still run."""

    every_rank = True

    def __init__(self, marker: str, seconds: float) -> None:
        self.marker, self.seconds = marker, seconds

    def on_train_end(self, run: Any, error: BaseException | None) -> None:
        def linger() -> None:
            Path(self.marker).touch()
            time.sleep(self.seconds)

        multiprocessing.util.Finalize(None, linger, exitpriority=10)  # (run by the worker's exit)
