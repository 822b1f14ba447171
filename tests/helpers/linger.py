"""A Hydra callback that keeps the process a while after its job has ended (as a slow
teardown would): a window in which the run has completed and the process still runs."""

from __future__ import annotations

import time
from typing import Any

from hydra.experimental.callback import Callback


class Linger(Callback):
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)
