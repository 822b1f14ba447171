"""Stopping on a signal at a step boundary that every rank agrees on.

A signal handler only sets a flag. At each step boundary every rank calls `should_stop()`;
with several ranks it starts a non-blocking MAX all-reduce of the flag and reads the previous
step's result, so all ranks see the same answer at the same step, one step after the first
rank got the signal, without waiting on the network in the step loop.
"""

from __future__ import annotations

import signal
from typing import Any

import torch
import torch.distributed as tdist

from app import dist

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}
        self._pending: tuple[Any, torch.Tensor] | None = None

    def __enter__(self) -> StopRequest:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = self.signal or signum

    def should_stop(self) -> bool:
        if not dist.initialized():
            return self.signal is not None
        agreed = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = flag.item() > 0
            if agreed and self.signal is None:
                self.signal = int(flag.item())  # another rank's signal
        if not agreed:
            flag = torch.tensor([self.signal or 0])
            work = tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=dist.control_group(),
                                    async_op=True)
            self._pending = (work, flag)
        else:
            self._pending = None
        return agreed

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # A collective left in flight must finish before the process group goes away; after an
        # error elsewhere it may never finish, so it is only waited for on a clean exit.
        if self._pending is not None and exc_type is None:
            self._pending[0].wait()
        self._pending = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
