"""This rank's progress record, which the stall watchdog (app.launch.watchdog) publishes and
judges; not the progress bar. The loop, the step, the stop, validation and the checkpoint
writer report here, at the cost of an integer increment, and need nothing of the launcher.

`tick()` is progress (each train step, each validation batch, each phase of a checkpoint
write); `busy()` marks progress that does not tick (a checkpoint's write to disk); `waiting()`
marks a wait for the other ranks that has no torch.distributed frame of its own; `follow(run)`
names the step; `leave()` says that this rank is about to end. Once the watchdog knows the
verdict (`stalled`), this rank makes no more progress: `tick()` blocks.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

_ticks = 0
_waits = 0
_busy = 0
_left = False
_run: Any = None
stalled = threading.Event()  # this rank knows the verdict: it makes no more progress


def tick() -> None:
    """Progress: called by the loop at each step, validation batch and checkpoint phase. Once a
    verdict has ended the job, it blocks until the watchdog ends the process: a rank that ran
    on would log validations and write checkpoints after the verdict."""
    global _ticks
    if stalled.is_set():
        block()
    _ticks += 1


def block() -> None:
    while True:  # until the watchdog's thread ends the process (os._exit)
        time.sleep(3600)


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """Marks a phase that makes progress without ticking (a checkpoint's write to disk)."""
    global _busy
    _busy += 1
    try:
        yield
    finally:
        _busy -= 1


def leave() -> None:
    """This rank is about to end (a requeue: rank 0 requeues the job, the others wait for
    Slurm to end them): the others take it for ended, not stalled."""
    global _left
    _left = True


def follow(run: Any) -> None:
    """Report `run.step` (which the training loop keeps current) as this rank's last step."""
    global _run
    _run = run


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Marks a wait for the other ranks that has no torch.distributed frame of its own: the
    `wait()` of an asynchronous collective's handle, and a wait for the device. With NCCL a
    collective only queues work on the device and returns: the host waits for a slow rank
    later, at the next sync point of the app's own code (`.item()`, `bool(tensor)`)."""
    global _waits
    _waits += 1
    try:
        yield
    finally:
        _waits -= 1


def in_wait() -> bool:
    """Whether this rank is inside `waiting()`."""
    return _waits > 0


def record() -> dict[str, Any]:
    """What the watchdog publishes of this rank's progress."""
    return {"ticks": _ticks, "step": getattr(_run, "step", None), "busy": _busy > 0,
            "left": _left}
