"""A process's Python stacks on demand: `kill -s RTMIN+4 PID` writes the stacks of any app
process to the file it registered here (every rank, the launcher of spawned workers, a
one-process run), or to stderr while it starts and ends (importing torch, composing the
config). The stall watchdog sends it to a stopped rank to collect its stacks."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# Not SIGUSR1/SIGUSR2 (Slurm and submitit ask for a requeue with them), not SIGWINCH (every
# terminal resize): a real-time signal, which no job system sends (macOS has none).
DUMP_SIGNAL: int | None = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else None


def stacks_to_stderr() -> None:
    """The dump signal writes to stderr (a real-time signal's default action ends the
    process: a dump asked for as the run started killed it, exit status 166)."""
    if DUMP_SIGNAL is not None and sys.__stderr__ is not None:
        with contextlib.suppress(ValueError, OSError):  # (no file descriptor: not a terminal)
            faulthandler.register(DUMP_SIGNAL, file=sys.__stderr__, all_threads=True)


@contextlib.contextmanager
def stacks_on_signal(path: Path) -> Iterator[None]:
    """While it runs, the dump signal appends this process's stacks to `path` after a header
    naming the process (taken back at the end when no dump came). faulthandler's handler runs
    in C, so it writes even when the main thread is stuck without the GIL."""
    if DUMP_SIGNAL is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        before = os.fstat(file.fileno()).st_size
        # Whose dumps follow (the C handler writes stacks only; a requeued job or a resumed
        # run appends to the same file), written now and taken back when none came.
        file.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} on "
                   f"{socket.gethostname()}: each `kill -s RTMIN+4 {os.getpid()}` writes its "
                   f"stacks below\n")
        file.flush()
        headed = os.fstat(file.fileno()).st_size
        faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True)
        try:
            yield
        finally:
            stacks_to_stderr()
            if os.fstat(file.fileno()).st_size == headed:
                file.truncate(before)
                if before == 0:
                    path.unlink(missing_ok=True)
