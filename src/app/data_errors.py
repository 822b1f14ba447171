"""Data that fails to load, reported in one line: which set, which item, what went wrong."""

from __future__ import annotations

import signal
from typing import Any

from torch.utils.data import Dataset
from torch.utils.data._utils import signal_handling
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from app.errors import AppError


class DataItemError(AppError):
    """An item of a data set failed to load."""

    def __init__(self, message: str) -> None:
        # A loader worker's error comes back as "Caught DataItemError in DataLoader worker
        # process N.\nOriginal Traceback ... app.data_errors.DataItemError: <message>".
        if message.startswith("Caught "):
            last = message.strip().splitlines()[-1]
            message = last.split(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)


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
        # (the per-item call cost ~1% of a small model's step).
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
    signal_handling._SIGCHLD_handler_set = True


def loader_worker_died(error: BaseException) -> AppError | None:
    """A one-line error for a DataLoader worker that died, or None for any other error."""
    if not isinstance(error, RuntimeError) or "DataLoader worker" not in str(error):
        return None
    what = _worker_exits(error) or str(error).strip().splitlines()[0]
    return AppError(f"data loading failed: {what} (a loader worker crashed: out of memory, "
                    f"or a fault in the data set's code; data.num_workers=0 loads in the "
                    f"training process)")


def _worker_exits(error: BaseException) -> str | None:
    """How the loader's dead workers ended ("DataLoader worker (pid 12) was killed by SIGKILL"),
    read from the loader iterator in the traceback; None where it cannot be found."""
    loader = None
    tb = error.__traceback__
    while tb is not None:
        candidate = tb.tb_frame.f_locals.get("self")
        if isinstance(candidate, _MultiProcessingDataLoaderIter):
            loader = candidate
        tb = tb.tb_next
    ended = [w for w in getattr(loader, "_workers", ()) if w.exitcode is not None]
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
