"""One command per run directory at a time.

Two commands with the same `hydra.run.dir` would both train, resume from each other's
checkpoints and interleave their metrics. The process that owns the run (the launcher, or
rank 0 of a torchrun/SLURM/MPI job: the one that writes `result.json`) holds an exclusive
`flock` on `.run.lock` in the run directory. The kernel drops it when that process dies, by
whatever means, so a crashed run never leaves a stale lock, and a requeued SLURM job takes it
again. The holder writes its pid and host into the file, for the refused command to name.

A flock belongs to the open file description, which a forked child shares (DataLoader
workers, fork-started ranks): such a child would keep the lock after its owner died. The
descriptor is closed in every forked child, and not inherited across exec.

The owner's spawned workers outlive it by their stop checkpoint (a forkserver's children stop
when their launcher dies, and save first). Each holds a shared flock on `.run.workers.lock`
for its whole life; a new owner, once it holds `.run.lock`, takes that one exclusively,
waiting for them a bounded time. (torchrun, SLURM and requeued jobs spawn no workers: their
ranks die with the job, and rank 0 alone holds `.run.lock`.)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, read_write

from app.env import ProcessEnv, this_process
from app.errors import LockHeld, RunDirInUse
from app.launch import run_record

log = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
WORKERS_LOCK_NAME = ".run.workers.lock"
# How long a new owner waits for the workers of the previous command to end: they save a stop
# checkpoint and exit once their launcher is gone.
WORKERS_WAIT_S = 120.0
# A requeued SLURM job can start while the file system still holds the lock of its previous
# run (a node that died holds it on NFS until its lease ends): it waits that long for it.
REQUEUE_WAIT_S = 180.0


# Lock files this process holds open; a forked child closes its copies (_close_in_child).
_held: list = []


def _close_in_child() -> None:
    for file in _held:
        try:
            file.close()  # this process's copy only: the parent's lock stays
        except OSError:
            pass
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _open(path: Path):
    """The lock file, read-write, created if missing (not truncated: it names the holder),
    closed on exec."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "r+")


class RunLock:
    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, wait_s: float | None = None,
                workers_wait_s: float = WORKERS_WAIT_S) -> None:
        """Take the lock, or raise RunDirInUse naming its holder. `wait_s`: how long to wait
        for it (default: at once, or REQUEUE_WAIT_S for a requeued SLURM job);
        `workers_wait_s`: how long for the workers of the previous command to end."""
        if wait_s is None:
            wait_s = REQUEUE_WAIT_S if os.environ.get("SLURM_RESTART_COUNT", "0") not in (
                "", "0") else 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        file = _open(self.path)
        try:
            locked = _lock_within(file, wait_s, 1.0, lambda: log.info(
                "waiting up to %.0f s for %s (%s)", wait_s, self.path, _holder(file)))
        except OSError as e:  # a file system without locks (some network mounts)
            log.warning("cannot lock %s (%s): a second command on this run directory "
                        "would not be detected", self.path, e.strerror or e)
            file.close()
            return
        if not locked:
            holder = _holder(file)
            file.close()
            raise RunDirInUse(
                f"hydra.run.dir={self.path.parent} is in use by another command "
                f"({holder}): wait for it to end, or give this command another "
                f"hydra.run.dir")
        _held.append(file)
        try:
            _wait_for_workers(self.path.with_name(WORKERS_LOCK_NAME), workers_wait_s)
        except BaseException:
            _held.remove(file)
            file.close()
            raise
        file.seek(0)
        file.truncate(0)
        file.write(f"{os.getpid()} {socket.gethostname()}\n")
        file.flush()
        self._file = file

    def release(self) -> None:
        if self._file is not None:
            _held.remove(self._file)
            self._file.close()  # closing the only descriptor drops the lock
            self._file = None


def _wait_for_workers(path: Path, wait_s: float) -> None:
    """Wait until no worker of a previous command holds `path`, then empty it for ours; or
    raise RunDirInUse naming them."""
    file = _open(path)
    try:
        try:
            locked = _lock_within(file, wait_s, 0.2, lambda: log.info(
                "waiting up to %.0f s for the workers of the previous command (%s) to save "
                "and end", wait_s, _holders(file)))
        except OSError:
            return  # (no locks on this file system: warned about already)
        if not locked:
            raise RunDirInUse(
                f"hydra.run.dir={path.parent} is still written by the workers of a "
                f"previous command ({_holders(file)}): wait for them to end (or stop them), "
                f"or give this command another hydra.run.dir")
        file.truncate(0)  # the lines of earlier workers; ours append theirs
    finally:
        file.close()


def _lock_within(file: Any, wait_s: float, poll_s: float, on_wait: Callable[[], None]) -> bool:
    """Take an exclusive flock on `file` within `wait_s`, calling `on_wait` once if it has to
    wait; False when it is still held by another at the deadline. OSError: no locks here."""
    deadline, waited = time.monotonic() + wait_s, False
    while True:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            if not waited:
                on_wait()
                waited = True
            time.sleep(poll_s)


@contextlib.contextmanager
def held_now(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` for the block, taken at once, this process named in the
    file; `LockHeld` naming the holder when another process has it. Where the file system has no
    locks, a warning and the block runs unlocked."""
    file = _open(path)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(file)
        file.close()
        raise LockHeld(holder) from None
    except OSError as e:
        file.close()
        log.warning("cannot lock %s (%s): a second command there would not be detected", path,
                    e.strerror or e)
        yield
        return
    _held.append(file)
    try:
        file.truncate(0)
        file.write(f"{os.getpid()} {socket.gethostname()}\n")
        file.flush()
        yield
    finally:
        _held.remove(file)
        file.close()


def hold_as_worker(run_dir: Path) -> None:
    """For a spawned worker of the run's owner: hold `.run.workers.lock` (shared) until this
    process ends, so that no new owner takes the run while this worker may still write."""
    path = run_dir / WORKERS_LOCK_NAME
    try:
        file = _open(path)
        fcntl.flock(file, fcntl.LOCK_SH)  # (the owner holds it exclusively only to empty it)
        file.seek(0, os.SEEK_END)
        file.write(f"{os.getpid()} {socket.gethostname()}\n")
        file.flush()
    except OSError as e:
        log.warning("cannot lock %s (%s)", path, e.strerror or e)
        return
    _held.append(file)  # (kept open: the kernel drops the lock when this process ends)


def _holders(file) -> str:
    """`pids P, Q on HOST` of the workers named in the workers' lock file."""
    file.seek(0)
    found: dict[str, list[str]] = {}
    for line in file.read().splitlines():
        fields = line.split()
        if len(fields) == 2:
            found.setdefault(fields[1], []).append(fields[0])
    return "; ".join(f"pid{'s' * (len(p) > 1)} {', '.join(p)} on {h}"
                     for h, p in found.items()) or "pids unknown"


def _holder(file) -> str:
    """`pid P on HOST`, from what the holder wrote (it writes right after taking the lock)."""
    for _ in range(20):
        file.seek(0)
        fields = file.read().split()
        if len(fields) == 2:
            return f"pid {fields[0]} on {fields[1]}"
        time.sleep(0.05)
    return "pid unknown"


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
    if not owns_run(config.get("machine_rank", 0), this_process()):
        return
    # Pinned: Hydra resolves it again for the job, and a name made from the clock would differ.
    with read_write(config.hydra.run):
        config.hydra.run.dir = str(OmegaConf.select(config, "hydra.run.dir"))
    if not config.hydra.run.dir.strip():
        # (What `hydra.run.dir=$DIR` gives with DIR unset: the current folder would be the run's.)
        print("hydra.run.dir is empty: give the run's directory, or leave it out for a new "
              "one under outputs/", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(os.path.abspath(config.hydra.run.dir))
    lock = RunLock(run_dir)
    try:
        lock.acquire()
    except RunDirInUse as e:
        print(e, file=sys.stderr)
        sys.exit(e.exit_code)  # (SystemExit passes Hydra's handler: no traceback)
    _claimed[run_dir] = lock
    run_record.keep(run_dir)  # (a command that fails before it trains puts it back)


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
    claimed = _claimed.get(key)
    if isinstance(claimed, RunDirInUse):
        raise claimed  # (kept: `refused` tells the job's end hooks)
    _claimed.pop(key, None)
    if claimed is None:
        claimed = RunLock(run_dir)
        claimed.acquire()
    return claimed


def refused(run_dir: Path) -> bool:
    """Whether this process's job on `run_dir` was refused (its files are another command's);
    forgets it (the job has ended)."""
    return isinstance(_claimed.pop(Path(os.path.abspath(run_dir)), None), RunDirInUse)
