"""A model that misbehaves on one rank at one step, and a data set with one bad item: the
fault injectors of the fail-fast and reliability tests.

They are user components (`model._target_=faults.FaultyCNN`,
`data._target_=faults.FaultyDigits`, with this folder on PYTHONPATH), so the product needs no
test hooks of its own.
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import Dataset

from app import dist
from app.data import Digits
from app.errors import UserError
from app.models import CNN


class FaultyCNN(CNN):
    """`fault_once`: a file made when the fault fires; the fault fires only while it is
    missing (a restarted or resumed run then goes through)."""

    def __init__(self, fault: str, fault_rank: int = 1, fault_call: int = 5,
                 fault_once: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fault, self.fault_rank, self.fault_call = fault, fault_rank, fault_call
        self.fault_once = fault_once
        # Counted from the first step: with several ranks DDP's buckets are settled by one
        # forward and backward before it (app.training.sharding.settle_buckets).
        self.calls = -1 if dist.world_size() > 1 else 0

    def _fires(self) -> bool:
        if dist.rank() != self.fault_rank or self.calls != self.fault_call:
            return False
        if self.fault_once is None:
            return True
        try:
            open(self.fault_once, "x").close()
        except FileExistsError:
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.fault == "slow" and dist.rank() == self.fault_rank:
            time.sleep(0.05)  # (every step: a window to act in mid-training; numbers unchanged)
        if self.training:
            self.calls += 1
            if self._fires():
                if self.fault == "raise":
                    raise RuntimeError("injected fault")
                if self.fault == "user_error":  # (a user's data or model check, on one rank)
                    raise UserError("injected bad input")
                if self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "hang":
                    time.sleep(3600)
                if self.fault == "stop":  # (fault_call=1: before this rank's first step)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if self.fault == "nan_loss":
                    return super().forward(x) * float("nan")
                if self.fault == "oom":  # (on a GPU: more than any has)
                    torch.empty(2**44, dtype=torch.uint8, device=x.device)
        return super().forward(x)


class _FaultyItems(Dataset):
    def __init__(self, inner: Dataset, fault: str, index: int) -> None:
        self.inner, self.fault, self.index = inner, fault, index

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.index:
            if self.fault == "raise":
                raise ValueError("corrupt sample")
            if self.fault == "kill":  # (in a loader worker: the worker dies)
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]


class FaultyDigits(Digits):
    """Digits whose training item `fault_index` raises, or kills the process loading it."""

    def __init__(self, fault: str, fault_index: int = 7, **kwargs) -> None:
        super().__init__(**kwargs)
        self.train = _FaultyItems(self.train, fault, fault_index)


class SlowDigits(Digits):
    """Digits that take `setup_s` seconds to build, after touching `marker`: a window before
    training to signal the process in."""

    def __init__(self, setup_s: float, marker: str, **kwargs) -> None:
        open(marker, "w").close()
        if "RANK" in os.environ:  # (a rank of several: MARKER.rankN too)
            open(f"{marker}.rank{os.environ['RANK']}", "w").close()
        time.sleep(setup_s)
        super().__init__(**kwargs)
