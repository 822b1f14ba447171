"""A loader worker that dies is one line naming it, however its death reaches the loop."""

from __future__ import annotations

import os
import signal
import threading

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils import signal_handling

from app.training.data_errors import loader_worker_died


def test_a_worker_killed_during_a_batch_fetch_is_named(monkeypatch) -> None:
    # A worker killed while the main process fetches its batch's shared memory: the fetch
    # fails with a connection error before the worker's exit can be seen, so the loader
    # re-raises it as it is (a flaky ConnectionResetError traceback in CI, once).
    # As in the app (data_errors.no_async_worker_errors): no handler raising from SIGCHLD.
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", True)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    loader = DataLoader(TensorDataset(torch.zeros(64, 3)), batch_size=4, num_workers=1)
    batches = iter(loader)
    next(batches)
    worker = batches._workers[0]

    def fetch_fails(*args, **kwargs):
        threading.Timer(0.3, os.kill, (worker.pid, signal.SIGKILL)).start()
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(batches._data_queue, "get", fetch_fails)
    try:
        next(batches)
    except ConnectionResetError as e:
        error = loader_worker_died(e)
    else:
        raise AssertionError("the fetch did not fail")
    finally:
        del batches
        signal.signal(signal.SIGCHLD, previous)
    assert error is not None
    assert str(error).startswith(f"data loading failed: DataLoader worker (pid {worker.pid}) "
                                 f"was killed by SIGKILL")


def test_a_connection_error_outside_a_loader_is_not_a_loader_failure() -> None:
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError as e:
        assert loader_worker_died(e) is None
    assert loader_worker_died(RuntimeError("something else")) is None
