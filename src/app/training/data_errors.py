"""Data that fails to load, reported in one line: which set, which item, what went wrong."""

from __future__ import annotations

import multiprocessing.connection
import signal
import time
from typing import Any

from torch.utils.data import Dataset

from app._private import loader_workers, no_sigchld_handler
from app.errors import AppError, DataItemError


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


def no_async_worker_errors() -> None:
    """Keep PyTorch from installing its SIGCHLD handler in this process.

    That handler raises "DataLoader worker ... is killed" from a signal, so at whatever line
    the main thread is on: inside a logging call (which swallows it and prints a traceback),
    a `finally` block, a checkpoint snapshot. Without it the loader finds a dead worker
    itself, at the next batch it waits for (its status check runs every 5 s), and raises
    there, where the loop can report it.
    """
    no_sigchld_handler()


def loader_worker_died(error: BaseException) -> AppError | None:
    """A one-line error for a DataLoader worker that died, or None for any other error.

    The loader says so itself ("DataLoader worker ... exited unexpectedly") when it finds the
    worker dead. A worker killed while the main process fetches its batch's shared memory
    surfaces instead as the connection error of that fetch (multiprocessing's resource sharer:
    ConnectionResetError, ConnectionRefusedError, EOFError), possibly before the worker's exit
    can be seen: the workers are then given a moment to be found dead.
    """
    said_so = isinstance(error, RuntimeError) and "DataLoader worker" in str(error)
    workers = _loader_workers_in_traceback(error)
    if not said_so and not (workers is not None and isinstance(error, (ConnectionError,
                                                                       EOFError))):
        return None
    what = _worker_exits(workers or [], wait_s=0 if said_so else 5) or \
        (str(error).strip().splitlines() or [type(error).__name__])[0]
    if not said_so and not what.startswith("DataLoader worker"):
        what = f"a loader worker stopped answering ({type(error).__name__}: {what})"
    return AppError(f"data loading failed: {what} (a loader worker crashed: out of memory, "
                    f"or a fault in the data set's code; data.num_workers=0 loads in the "
                    f"training process)")


def _loader_workers_in_traceback(error: BaseException) -> list[Any] | None:
    """The worker processes of the loader iterator whose method raised `error`, read from its
    traceback (None: no such loader)."""
    workers = None
    tb = error.__traceback__
    while tb is not None:
        found = loader_workers(tb.tb_frame.f_locals.get("self"))
        if found is not None:
            workers = found
        tb = tb.tb_next
    return workers


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
