"""A model that misbehaves on one rank at one step: the fault injector of the fail-fast tests.

It is a user's custom component (`model._target_=faults.FaultyCNN`, with this folder on
PYTHONPATH), so the product needs no test hooks of its own.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from app import dist
from app.models import CNN


class FaultyCNN(CNN):
    def __init__(self, fault: str, fault_rank: int = 1, fault_call: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.fault_call = fault, fault_rank, fault_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if dist.rank() == self.fault_rank and self.calls == self.fault_call:
                if self.fault == "raise":
                    raise RuntimeError("injected fault")
                if self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "hang":
                    time.sleep(3600)
        return super().forward(x)
