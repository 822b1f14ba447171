"""A model whose process stops itself (SIGSTOP, as `kill -STOP PID` from outside would) on one
rank at a known place: the stall watchdog's tests (`model._target_=stalls.StopsItself`, with
this folder on PYTHONPATH)."""

from __future__ import annotations

import os
import signal
import time

import torch

from app import dist, progress
from app.models import CNN


class StopsItself(CNN):
    """Rank `stop_rank` stops in a forward pass of `stop_in` ("training" or "validating") once
    the loop has done `stop_step` steps, `stop_after_s` seconds into that pass: a slow batch,
    long enough for the watchdog to have published where the rank is."""

    def __init__(self, stop_rank: int, stop_step: int, stop_in: str = "training",
                 stop_after_s: float = 1.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.stop_rank, self.stop_step, self.stop_in = stop_rank, stop_step, stop_in
        self.stop_after_s = stop_after_s
        self.stopped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        place = "training" if self.training else "validating"
        if not self.stopped and dist.rank() == self.stop_rank and place == self.stop_in and \
                progress.record()["step"] == self.stop_step:
            self.stopped = True
            time.sleep(self.stop_after_s)
            os.kill(os.getpid(), signal.SIGSTOP)
        return super().forward(x)
