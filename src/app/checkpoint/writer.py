"""Checkpoints written in the background: the loop waits for little more than nothing.

A save gives every tensor of the state a host buffer (kept and reused from one save to the
next, page-locked for GPU tensors). Tensors that only the optimizer step changes (weights,
optimizer state, EMA weights: the bulk of a checkpoint) are copied by the writer thread while
the loop runs the next forward and backward; the update waits for that copy
(`hold_until_copied`). The rest (buffers such as batch-norm statistics, which a forward
changes) is copied at once. The thread then writes the copy with `app.checkpoint.io.save`.
One write is in flight at a time, so memory stays bounded at one copy of the state; a write
error is raised at the loop's next save or wait.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from app import progress
from app.checkpoint import io

log = logging.getLogger(__name__)


class BackgroundWrites:
    """What both writers share (this module's and app.checkpoint.sharded's): one write in
    flight at a time, in a thread whose error `wait` raises in the loop's thread, and the
    count and time of the saves."""

    def __init__(self, background: bool) -> None:
        self.background = background
        self._pool: ThreadPoolExecutor | None = None
        self._in_flight: Future | None = None
        self.saves = 0
        self.waited_s = 0.0  # how long the loop was held up by saves (the final wait aside)

    def wait(self) -> None:
        """Block until the write in flight (if any) is on disk; raise its error, if any."""
        write, self._in_flight = self._in_flight, None
        if write is not None:
            write.result()

    def _begin(self) -> float:
        start = time.perf_counter()
        progress.tick()  # progress, for the stall watchdog (as is the end of each write)
        self.saves += 1
        self.wait()  # the previous write: one copy of the state at a time, files in order
        return start

    def _run(self, write: Callable[[], None], name: str, start: float) -> float:
        """`write` in the writer thread (in the background) or here; returns the seconds the
        caller was blocked."""
        if self.background:
            self._pool = self._pool or ThreadPoolExecutor(1, thread_name_prefix=name)
            self._in_flight = self._pool.submit(write)
        else:
            write()
        self.waited_s += time.perf_counter() - start
        return time.perf_counter() - start


class CheckpointWriter(BackgroundWrites):
    def __init__(self, background: bool = True) -> None:
        super().__init__(background)
        self._buffers: list[torch.Tensor] = []
        self._deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copied = threading.Event()
        self._copied.set()

    def save(self, state: dict[str, Any], path: Path, then: Callable[[], None],
             changed_only_by_step: Iterable[torch.Tensor] = ()) -> float:
        """Write `state` to `path`, then call `then` (links, pruning), in the background when
        asked; returns the seconds the caller was blocked. The tensors of the state that are
        `changed_only_by_step` are copied in the background, before the next optimizer step."""
        start = self._begin()
        if self.background:
            self._defer = {t.data_ptr() for t in changed_only_by_step if t.device.type == "cpu"}
            self._from_cuda = False
            state = self._copy(state, itertools.count())
            if self._from_cuda:
                with progress.waiting():  # (behind the device's queue: a collective, with NCCL)
                    torch.cuda.synchronize()  # the device-to-host copies were asynchronous
            self._copied.clear()
        return self._run(lambda: self._write(state, path, then, start), "app-checkpoint-writer",
                         start)

    def hold_until_copied(self) -> None:
        """Wait until the background copy is done: call before the deferred tensors change."""
        if not self._copied.is_set():
            start = time.perf_counter()
            self._copied.wait()
            self.waited_s += time.perf_counter() - start

    def _write(self, state: dict[str, Any], path: Path, then: Callable[[], None],
               start: float) -> None:
        try:
            for buffer, tensor in self._deferred:
                buffer.copy_(tensor)  # torch releases the GIL: the loop runs meanwhile
        finally:
            self._deferred.clear()
            self._copied.set()
        with progress.busy():  # progress that does not tick (a large file, an fsync)
            io.save(state, path)
        progress.tick()
        then()
        log.debug("%s written %.2f s after the save began", path.name, time.perf_counter() - start)

    def _copy(self, obj: Any, index: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # The i-th host buffer, reused when its shape and dtype still fit.
            i, cuda = next(index), obj.device.type == "cuda"
            buffer = self._buffers[i] if i < len(self._buffers) else None
            if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                buffer = torch.empty(obj.shape, dtype=obj.dtype, device="cpu", pin_memory=cuda)
                self._buffers[i:i + 1] = [buffer]  # (replaced, or appended: i == len)
            self._from_cuda |= cuda
            if obj.device.type == "cpu" and obj.data_ptr() in self._defer:
                self._deferred.append((buffer, obj.detach()))
            else:
                buffer.copy_(obj.detach(), non_blocking=True)
            return buffer
        if isinstance(obj, dict):
            return type(obj)((k, self._copy(v, index)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, index) for v in obj)
        return obj  # numbers, strings, None: immutable
