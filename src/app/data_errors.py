"""Data that fails to load, reported in one line: which set, which item, what went wrong."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

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


def loader_worker_died(error: BaseException) -> AppError | None:
    """A one-line error for a DataLoader worker that died (PyTorch raises it from its SIGCHLD
    handler, anywhere in the loop), or None for any other error."""
    if not isinstance(error, RuntimeError) or "DataLoader worker" not in str(error):
        return None
    return AppError(f"data loading failed: {str(error).strip().splitlines()[0]} (a loader "
                    f"worker crashed: out of memory, or a fault in the data set's code; "
                    f"data.num_workers=0 loads in the training process)")
