"""A process's Python stacks on demand, and the state of processes by pid.

`kill -s RTMIN+4 PID` writes the stacks of any app process that registered a file here (every
rank, the launcher of spawned workers, a one-process run); the stall watchdog uses the same
signal to collect every rank's stacks, and wakes a stopped rank to write its own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import psutil

# The stack-dump signal: not SIGUSR1/SIGUSR2 (Slurm and submitit use them to ask for a requeue),
# not SIGWINCH (every terminal resize), but a real-time signal, which no job system sends.
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None
_dump: TextIO | None = None  # where the dump signal writes this process's stacks


@contextlib.contextmanager
def stacks_on_signal(path: Path) -> Iterator[None]:
    """While it runs, the dump signal writes this process's stacks to `path` (appended; the
    file goes at the end when nothing was written). faulthandler's handler runs in C, so it
    writes even when the main thread is stuck without the GIL. Nested calls keep the first
    file (a rank's, registered before the process group exists)."""
    global _dump
    if _dump is not None or DUMP_SIGNAL is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _dump = open(path, "a")  # noqa: SIM115 (open while the process runs)
    faulthandler.register(DUMP_SIGNAL, file=_dump, all_threads=True)
    try:
        yield
    finally:
        faulthandler.unregister(DUMP_SIGNAL)
        _dump.close()
        _dump = None
        with contextlib.suppress(OSError):
            if path.stat().st_size == 0:
                path.unlink()


def _status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return None


def running(pid: int) -> bool:
    """An ended child not yet reaped is a zombie: ended."""
    return _status(pid) not in (None, psutil.STATUS_ZOMBIE)


def is_stopped(pid: int) -> bool:
    return _status(pid) in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def wake_to_dump(pid: int) -> None:
    """Ask a stopped process of this job for its stacks: the dump signal waits until SIGCONT
    lets the process run, and faulthandler's handler writes them at once. Only a process that
    is stopped now is signalled: a rank that has ended may have left its pid to another."""
    if DUMP_SIGNAL is None or not is_stopped(pid):
        return
    try:
        os.kill(pid, DUMP_SIGNAL)
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
