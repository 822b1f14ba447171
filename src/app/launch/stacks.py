"""A process's Python stacks on demand: `kill -s RTMIN+4 PID` writes the stacks of any app
process that registered a file here (every rank, the launcher of spawned workers, a
one-process run). The stall watchdog sends it to a stopped rank to collect its stacks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
from collections.abc import Iterator
from pathlib import Path

# Not SIGUSR1/SIGUSR2 (Slurm and submitit ask for a requeue with them), not SIGWINCH (every
# terminal resize): a real-time signal, which no job system sends (macOS has none).
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None


@contextlib.contextmanager
def stacks_on_signal(path: Path) -> Iterator[None]:
    """While it runs, the dump signal appends this process's stacks to `path` (removed at the
    end when nothing was written). faulthandler's handler runs in C, so it writes even when
    the main thread is stuck without the GIL."""
    if DUMP_SIGNAL is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
        try:
            yield
        finally:
            faulthandler.unregister(DUMP_SIGNAL)
            if os.fstat(file.fileno()).st_size == 0:
                path.unlink(missing_ok=True)
