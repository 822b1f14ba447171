"""This rank's progress record, which the stall watchdog (app.launch.watchdog) publishes and
judges; not the progress bar. Reporting costs an integer increment and needs nothing of the
launcher.

`tick()` is progress (a train step, a validation batch, a phase of a checkpoint write);
`busy()` marks progress that does not tick (a checkpoint's write to disk); `waiting()` marks a
wait for the other ranks that has no torch.distributed frame of its own: with NCCL a
collective only queues work and returns, and the host waits for a slow rank later, at the
next sync point (an asynchronous handle's `wait()`, `.item()`, `bool(tensor)`).
`validating()` and `busy()` also say where the rank is, which the verdict names.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

_ticks = 0
_left = False
_run: Any = None  # whose `step` the training loop keeps current (`follow`)
_inside = {"busy": 0, "waiting": 0, "validating": 0}
stalled = threading.Event()  # this rank knows the verdict: it makes no more progress


def tick() -> None:
    """Progress. Once a verdict has ended the job it blocks until the watchdog ends the
    process: a rank that ran on would log validations and write checkpoints after it."""
    global _ticks
    if stalled.is_set():
        block()
    _ticks += 1


def block() -> None:
    while True:  # until the watchdog's thread ends the process (os._exit)
        time.sleep(3600)


@contextlib.contextmanager
def _inside_of(phase: str) -> Iterator[None]:
    _inside[phase] += 1
    try:
        yield
    finally:
        _inside[phase] -= 1


busy = functools.partial(_inside_of, "busy")
waiting = functools.partial(_inside_of, "waiting")
validating = functools.partial(_inside_of, "validating")


def in_wait() -> bool:
    return _inside["waiting"] > 0


def leave() -> None:
    """This rank is about to end (a requeue: rank 0 requeues the job, the others wait for
    Slurm to end them): the others take it for ended, not stalled."""
    global _left
    _left = True


def follow(run: Any) -> None:
    global _run
    _run = run


def record() -> dict[str, Any]:
    """What the watchdog publishes of this rank's progress."""
    return {"ticks": _ticks, "step": getattr(_run, "step", None), "place": _place(),
            "busy": _inside["busy"] > 0, "left": _left}


def _place() -> str:
    """What the rank does after its last step (a checkpoint may be written in the background
    while the loop trains on: the write is named, the rank's likeliest place to stop in)."""
    if _inside["validating"]:
        return "validating"
    return "writing a checkpoint" if _inside["busy"] else "training"
