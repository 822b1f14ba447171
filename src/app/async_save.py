"""Checkpoints written in the background: the loop waits only while the state is copied.

A save copies every tensor of the state into host buffers (kept and reused from one save to
the next, page-locked when the tensors are on a GPU), then a thread writes the copy with the
same atomic `checkpoint.save` (temporary file, fsync, rename): a crash during the write leaves
the previous checkpoint intact. One write is in flight at a time, so memory stays bounded at
one copy of the state; a write error is raised on the loop's next save or wait.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from app import checkpoint

log = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(self, background: bool = True) -> None:
        self.background = background
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._buffers: list[torch.Tensor] = []
        self._from_cuda = False

    def save(self, state: dict[str, Any], path: Path, then: Callable[[], None]) -> float:
        """Write `state` to `path`, then call `then` (links, pruning), in the background when
        asked; returns the seconds the caller was blocked."""
        start = time.perf_counter()
        self.wait()  # the previous write: one copy of the state at a time, files in order
        if not self.background:
            checkpoint.save(state, path)
            then()
            return time.perf_counter() - start
        self._from_cuda = False
        copy = self._copy(state, itertools.count())
        if self._from_cuda:
            torch.cuda.synchronize()  # the device-to-host copies were asynchronous
        self._thread = threading.Thread(target=self._write, args=(copy, path, then, start),
                                        name="app-checkpoint-writer")
        self._thread.start()
        return time.perf_counter() - start

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _write(self, state: dict[str, Any], path: Path, then: Callable[[], None],
               start: float) -> None:
        try:
            checkpoint.save(state, path)
            then()
            log.debug("%s written %.2f s after the save began", path.name,
                      time.perf_counter() - start)
        except BaseException as e:  # raised in the loop's thread at its next save or wait
            self._error = e

    def _copy(self, obj: Any, index: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._buffer(next(index), obj).copy_(obj.detach(), non_blocking=True)
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, index)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, index) for v in obj)
        return obj  # numbers, strings, None: immutable

    def _buffer(self, i: int, like: torch.Tensor) -> torch.Tensor:
        """The i-th host buffer, reused when its shape and dtype still fit."""
        self._from_cuda |= like.device.type == "cuda"
        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return buf
        buf = torch.empty(like.shape, dtype=like.dtype, device="cpu",
                          pin_memory=like.device.type == "cuda")
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf
