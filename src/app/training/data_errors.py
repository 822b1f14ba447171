"""Data that fails to load, reported in one line: which set, which item, what went wrong."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset

from app.errors import AppError, DataItemError, first_line


class NamedItems(Dataset):
    """`dataset`, with a failing item's error naming the set and the index."""

    def __init__(self, dataset: Dataset, name: str) -> None:
        self.dataset, self.name = dataset, name

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as e:
            raise self._failed(index, e) from e

    def __getitems__(self, indices: list[int]) -> list[Any]:
        # The loader's batched fetch: one call of this wrapper per batch, not one per item
        # (a per-item call showed in a small model's step time: docs/measurements.md).
        dataset, items = self.dataset, []
        index = None
        try:
            for index in indices:
                items.append(dataset[index])
        except Exception as e:
            raise self._failed(index, e) from e
        return items

    def _failed(self, index: Any, e: Exception) -> DataItemError:
        return DataItemError(f"{self.name} item {index} failed to load: "
                             f"{type(e).__name__}: {e}")


class Loader(DataLoader):
    """A DataLoader that leaves this process's SIGCHLD handler as it was, and keeps its worker
    processes for the report of one that dies (`loader_worker_died`).

    PyTorch installs, at the first iterator with workers, a SIGCHLD handler that raises
    "DataLoader worker ... is killed" from a signal, so at whatever line the main thread is on:
    inside a logging call (which swallows it and prints a traceback), a `finally` block, a
    checkpoint snapshot. It installs it once per process; put back, the loader finds a dead
    worker itself, at the next batch it waits for (its status check runs every 5 s), and raises
    there, where the loop can report it.

    On Linux its workers end with the process that started them, at once (PR_SET_PDEATHSIG):
    PyTorch's check their parent every 5 s, and a worker left that long past a rank killed
    outright wrote tracebacks on the terminal after the command had ended. They ignore SIGTERM,
    as PyTorch has them ignore Ctrl-C: a SIGTERM to the process group (a closed session,
    Slurm's scancel) killed them, and the rank's stop at a step failed for want of batches
    (PyTorch's own handler, set as a worker starts, still ends it in the moment before). As
    the process exits they are killed (multiprocessing's exit would wait for them after its
    SIGTERM).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if sys.platform.startswith("linux") and self.num_workers:
            self.worker_init_fn = functools.partial(_end_with, os.getpid(), self.worker_init_fn)

    def __iter__(self) -> Any:
        if self.num_workers == 0:
            return super().__iter__()
        previous = signal.getsignal(signal.SIGCHLD)
        before = set(multiprocessing.active_children())
        batches = super().__iter__()
        if previous is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGCHLD, previous)
        started = [p for p in multiprocessing.active_children() if p not in before]
        if started:  # (persistent workers start once)
            _WORKERS[batches] = started
            global _kills_at_exit
            if sys.platform.startswith("linux") and _kills_at_exit != os.getpid():
                # (Before multiprocessing's exit terminates and joins its daemons.)
                multiprocessing.util.Finalize(None, _kill_workers, exitpriority=100)
                _kills_at_exit = os.getpid()
        return batches


# The process whose exit kills its loader workers (a fork inherits this, not the registration).
_kills_at_exit: int | None = None


def _kill_workers() -> None:
    for worker in (w for started in list(_WORKERS.values()) for w in started):
        if worker.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGKILL)


def _end_with(parent: int, init: Callable[[int], Any] | None, worker_id: int) -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if os.getppid() != parent:  # (it ended before that was set)
        os._exit(1)
    if init is not None:
        init(worker_id)


# The worker processes of each live iterator of a Loader (an iterator need not keep its loader).
_WORKERS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


def loader_worker_died(error: BaseException) -> AppError | None:
    """A one-line error for a DataLoader worker that died, or None for any other error.

    The loader says so itself ("DataLoader worker ... exited unexpectedly") when it finds the
    worker dead. A worker killed while the main process fetches its batch's shared memory
    surfaces instead as the connection error of that fetch (multiprocessing's resource sharer:
    ConnectionResetError, ConnectionRefusedError, EOFError), possibly before the worker's exit
    can be seen: the workers are then given a moment to be found dead.
    """
    said_so = isinstance(error, RuntimeError) and "DataLoader worker" in str(error)
    if not said_so and not (isinstance(error, (ConnectionError, EOFError))
                            and _raised_in_a_loader(error)):
        return None
    workers = [w for started in list(_WORKERS.values()) for w in started]
    what = _worker_exits(workers, wait_s=0 if said_so else 5) or first_line(error)
    if not said_so and not what.startswith("DataLoader worker"):
        what = f"a loader worker stopped answering ({type(error).__name__}: {what})"
    return AppError(f"data loading failed: {what} (a loader worker crashed: out of memory, "
                    f"or a fault in the data set's code; data.num_workers=0 loads in the "
                    f"training process)")


def _raised_in_a_loader(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.utils.data.dataloader":
            return True
        tb = tb.tb_next
    return False


def _worker_exits(workers: list[Any], wait_s: float) -> str | None:
    """How the loader's dead workers ended ("DataLoader worker (pid 12) was killed by SIGKILL");
    None where none is found dead within `wait_s`."""
    deadline = time.monotonic() + wait_s
    ended = [w for w in workers if w.exitcode is not None]
    while not ended and workers and time.monotonic() < deadline:
        multiprocessing.connection.wait([w.sentinel for w in workers], timeout=0.1)
        ended = [w for w in workers if w.exitcode is not None]
    if not ended:
        return None
    return "; ".join(f"DataLoader worker (pid {w.pid}) {_how(w.exitcode)}" for w in ended)


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with status {exitcode}"
