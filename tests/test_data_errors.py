"""A loader worker that dies is one line naming it, however its death reaches the loop."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils import signal_handling

from app.training.data_errors import Loader, loader_worker_died


def test_a_worker_killed_during_a_batch_fetch_is_named(monkeypatch) -> None:
    # A worker killed while the main process fetches its batch's shared memory: the fetch
    # fails with a connection error before the worker's exit can be seen, so the loader
    # re-raises it as it is (a flaky ConnectionResetError traceback in CI, once).
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    others = set(multiprocessing.active_children())  # (an earlier test's, in this process)
    batches = iter(Loader(TensorDataset(torch.zeros(64, 3)), batch_size=4, num_workers=1))
    next(batches)
    worker, = set(multiprocessing.active_children()) - others

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


@pytest.mark.parametrize("kind", [DataLoader, Loader])
def test_the_loader_keeps_pytorchs_sigchld_handler_out(monkeypatch, kind) -> None:
    # PyTorch's handler raises from a signal, at whatever line the main thread is on; app's
    # loader finds a dead worker at the next batch instead. (A plain DataLoader shows that
    # PyTorch installs its handler here: the case this test would miss if it did not.)
    monkeypatch.setattr(signal_handling, "_SIGCHLD_handler_set", False)
    previous = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        batches = iter(kind(TensorDataset(torch.zeros(4, 2)), num_workers=1))
        next(batches)
        del batches
        assert (signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL) is (kind is Loader)
    finally:
        signal.signal(signal.SIGCHLD, previous)


def test_a_connection_error_outside_a_loader_is_not_a_loader_failure() -> None:
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError as e:
        assert loader_worker_died(e) is None
    assert loader_worker_died(RuntimeError("something else")) is None
