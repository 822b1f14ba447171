"""One command per run directory at a time.

Two commands on one `hydra.run.dir` would resume from each other's checkpoints and interleave
their metrics. The run's owner (the one that writes `result.json`) holds an exclusive flock on
`.run.lock`, naming its pid and host there for a refused command and app.status; the kernel
drops it when the owner dies, however it dies (on NFSv4 too, which Linux emulates flock with).
Not lockf: a process's POSIX locks do not exclude each other, and any close of the file drops
them. A forked child (a DataLoader worker) would share the flock: it closes its copies. Spawned
workers outlive their launcher by their stop checkpoint: each holds `.run.workers.lock` shared
for its life, which a new owner takes exclusively, waiting for them a bounded time.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, read_write

from app.env import ProcessEnv, this_process
from app.errors import LockHeld, RunDirInUse
from app.rundir import record as run_record
from app.rundir.writable import check

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
WORKERS_LOCK_NAME = ".run.workers.lock"
WORKERS_WAIT_S = 120.0  # for the workers of a killed command to save their stop checkpoint
# A requeued SLURM job may start while the file server still holds its previous run's lock
# (that of a dead node, until its NFS lease ends).
REQUEUE_WAIT_S = 180.0

_held: list[int] = []  # this process's lock descriptors, which a forked child closes


def _close_in_child() -> None:
    for fd in _held:
        os.close(fd)  # (this process's copy: the parent keeps its lock)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _lock(path: Path, op: int = fcntl.LOCK_EX, wait_s: float = 0.0,
          name: bool = True) -> int | None:
    """`path` open and flocked (`op`) within `wait_s`, emptied if exclusively, and this
    process's line added if `name`; LockHeld naming its holders at the deadline; None (and a
    warning) where the file system has no locks (some network mounts)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
    deadline, waited = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holders = _holders(fd)
                os.close(fd)
                raise LockHeld(holders) from None
            if not waited:
                log.info("waiting up to %.0f s for %s to let go of %s", wait_s,
                         _holders(fd), path)
                waited = True
            time.sleep(0.2)
        except OSError as e:
            os.close(fd)
            log.warning("cannot lock %s (%s): a second command there would not be detected",
                        path, e.strerror or e)
            return None
    _held.append(fd)
    if op == fcntl.LOCK_EX:
        os.ftruncate(fd, 0)  # (the lines of earlier holders)
    if name:
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
    return fd


def _close(fd: int | None) -> None:
    if fd is not None:
        _held.remove(fd)
        os.close(fd)  # (the only descriptor: the lock goes with it)


def _holders(fd: int) -> str:
    """`pid P on HOST` for each holder named in the file (each writes right after locking)."""
    for _ in range(20):
        lines = [line.split() for line in os.pread(fd, 1 << 16, 0).decode().splitlines()]
        if named := ", ".join(f"pid {f[0]} on {f[1]}" for f in lines if len(f) == 2):
            return named
        time.sleep(0.05)
    return "pid unknown"


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait_s: float | None = None,
                workers_wait_s: float = WORKERS_WAIT_S) -> None:
        """Take the lock, or raise RunDirInUse naming its holder. `wait_s`: how long to wait
        for it (default: at once, or REQUEUE_WAIT_S for a requeued SLURM job);
        `workers_wait_s`: how long for the workers of the previous command to end."""
        if wait_s is None:
            wait_s = REQUEUE_WAIT_S if os.environ.get("SLURM_RESTART_COUNT", "0") not in (
                "", "0") else 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        where = f"hydra.run.dir={self.path.parent}"
        try:
            self._fd = _lock(self.path, wait_s=wait_s)
        except LockHeld as e:
            raise RunDirInUse(f"{where} is in use by another command ({e}): wait for it to "
                              f"end, or give this command another hydra.run.dir") from None
        if self._fd is None:
            return
        try:  # (emptied, for our workers to add their lines)
            _close(_lock(self.path.with_name(WORKERS_LOCK_NAME), wait_s=workers_wait_s,
                         name=False))
        except BaseException as e:
            self.release()
            if not isinstance(e, LockHeld):
                raise
            raise RunDirInUse(f"{where} is still written by the workers of a previous command "
                              f"({e}): wait for them to end (or stop them), or give this "
                              f"command another hydra.run.dir") from None

    def release(self) -> None:
        _close(self._fd)
        self._fd = None


@contextlib.contextmanager
def held_now(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block, taken at once, this process named in the
    file; `LockHeld` naming the holder when another process has it."""
    fd = _lock(path)
    try:
        yield
    finally:
        _close(fd)


def hold_as_worker(run_dir: Path) -> None:
    """For a spawned worker of the run's owner: hold `.run.workers.lock` (shared) until this
    process ends, so that no new owner takes the run while this worker may still write."""
    # (An owner holds it exclusively only to empty it, before it starts its workers.)
    _lock(run_dir / WORKERS_LOCK_NAME, fcntl.LOCK_SH, wait_s=math.inf)


# Locks taken by a Hydra callback before the job, for the job to take over (`take`), or the
# refusal it met, for the job to report (a job of a sweep fails, the sweep goes on).
_claimed: dict[Path, RunLock | RunDirInUse] = {}


def owns_run(machine_rank: int, env: ProcessEnv) -> bool:
    """Whether this process owns the run (holds its lock, records its result): the launcher of
    machine 0 (the other machines of a nodes=N run share its directory), or rank 0 of a
    torchrun/SLURM job."""
    return env.rank == 0 and machine_rank == 0


def claim_for_run(config: DictConfig) -> None:
    """Hydra's on_run_start (a single run): take the lock before Hydra writes `.hydra/` and
    opens `train.log` in the run directory, so that a refused command writes nothing there;
    it ends here, in one line."""
    # Pinned: Hydra resolves it again for the job, and a name made from the clock would differ.
    with read_write(config.hydra.run):
        config.hydra.run.dir = str(OmegaConf.select(config, "hydra.run.dir"))
    if not config.hydra.run.dir.strip():
        # (What `hydra.run.dir=$DIR` gives with DIR unset: the current folder would be the run's.)
        print("hydra.run.dir is empty: give the run's directory, or leave it out for a new "
              "one under outputs/", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(os.path.abspath(config.hydra.run.dir))
    check(run_dir)  # (Hydra's report of a directory it cannot write is a traceback)
    if claim_for_job(run_dir, config.get("machine_rank", 0)):
        run_record.keep(run_dir)  # (a command that fails before it trains puts it back)
    elif run_dir in _claimed:
        refusal = _claimed.pop(run_dir)
        print(refusal, file=sys.stderr)
        sys.exit(refusal.exit_code)  # (SystemExit passes Hydra's handler: no traceback)


def claim_for_job(run_dir: Path, machine_rank: int) -> bool:
    """Hydra's on_job_start (a job of a sweep): take the lock, or keep the refusal for the job
    to report. Whether this process owns the run directory now."""
    run_dir = Path(os.path.abspath(run_dir))
    if not owns_run(machine_rank, this_process()):
        return False
    if run_dir not in _claimed:
        lock = RunLock(run_dir)
        try:
            lock.acquire()
            _claimed[run_dir] = lock
        except RunDirInUse as e:
            _claimed[run_dir] = e
    return isinstance(_claimed[run_dir], RunLock)


def take(run_dir: Path) -> RunLock:
    """The job's lock on `run_dir`: the one a callback took for it, or taken now; raises
    RunDirInUse if another command holds it."""
    key = Path(os.path.abspath(run_dir))
    if key not in _claimed:
        claim_for_job(key, 0)  # (by the run's owner: no callback took it)
    if isinstance(_claimed[key], RunDirInUse):
        raise _claimed[key]  # (kept: `refused` tells the job's end hooks)
    return _claimed.pop(key)


def refused(run_dir: Path) -> bool:
    """Whether this process's job on `run_dir` was refused (its files are another command's);
    forgets it (the job has ended)."""
    return isinstance(_claimed.pop(Path(os.path.abspath(run_dir)), None), RunDirInUse)
