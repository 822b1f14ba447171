"""One command per run directory at a time.

Two commands with the same `hydra.run.dir` would both train, resume from each other's
checkpoints and interleave their metrics. The process that owns the run (the launcher, or
rank 0 of a torchrun/SLURM/MPI job: the one that writes `result.json`) holds an exclusive
`flock` on `.run.lock` in the run directory. The kernel drops it when that process dies, by
whatever means, so a crashed run never leaves a stale lock, and a requeued SLURM job takes it
again. The holder writes its pid and host into the file, for the refused command to name.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from pathlib import Path

from app.errors import UserError

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
# A requeued SLURM job can start while the file system still holds the lock of its previous
# run (a node that died holds it on NFS until its lease ends): it waits that long for it.
REQUEUE_WAIT_S = 180.0


class RunDirInUse(UserError):
    """Another live command owns the run directory; nothing was written into it."""


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, wait_s: float | None = None) -> None:
        """Take the lock, or raise RunDirInUse naming its holder. `wait_s`: how long to wait
        for it (default: at once, or REQUEUE_WAIT_S for a requeued SLURM job)."""
        if wait_s is None:
            wait_s = REQUEUE_WAIT_S if os.environ.get("SLURM_RESTART_COUNT", "0") not in (
                "", "0") else 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = open(self.path, "a+")  # (not "w": that would erase the holder's pid)
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = _holder(file)
                    file.close()
                    raise RunDirInUse(
                        f"hydra.run.dir={self.path.parent} is in use by another command "
                        f"({holder}): wait for it to end, or give this command another "
                        f"hydra.run.dir") from None
                if not waiting:
                    log.info("waiting up to %.0f s for %s (%s)", wait_s, self.path,
                             _holder(file))
                    waiting = True
                time.sleep(1.0)
            except OSError as e:  # a file system without locks (some network mounts)
                log.warning("cannot lock %s (%s): a second command on this run directory "
                            "would not be detected", self.path, e.strerror or e)
                file.close()
                return
        file.truncate(0)
        file.write(f"{os.getpid()} {socket.gethostname()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the only descriptor drops the lock
            self._file = None


def _holder(file) -> str:
    """`pid P on HOST`, from what the holder wrote (it writes right after taking the lock)."""
    for _ in range(20):
        file.seek(0)
        fields = file.read().split()
        if len(fields) == 2:
            return f"pid {fields[0]} on {fields[1]}"
        time.sleep(0.05)
    return "pid unknown"
