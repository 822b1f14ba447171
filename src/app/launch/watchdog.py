"""The progress watchdog: a rank that stops making progress while the others wait for it ends
the job, named, with every rank's Python stack on disk, instead of holding the job for
distributed.timeout_s.

The loop ticks a counter (`tick()` of app.progress, this rank's record: each train step, each
validation batch, each phase of a checkpoint write), which costs an integer increment. A thread
per rank publishes, about once a second, the counter with the rank's host, pid and last step to
the process group's store and reads the other ranks' records there (a second thread judges
them, so that a store that stops answering is noticed too). When no rank's counter has moved
for distributed.stall_timeout_s, the job has stalled, and the culprits are the ranks that do
not wait in a collective: a rank whose records stopped coming (stopped by SIGSTOP or a
debugger, or stuck without the GIL), or whose main thread is outside torch.distributed and the
autograd engine (a dead loop, a sleep, a deadlock of its own). The first rank to see it writes
the verdict to the store; every rank then writes its stacks to `logs/rank{N}.stacks` (a section
of its own per verdict, after a header with the time and the verdict) and ends. A stopped rank
cannot write: a rank on its host sends it the stack-dump signal and then SIGCONT, so that the
dump runs (and the woken rank ends like the others). Once a rank knows the verdict it makes no
more progress (`tick()` blocks): no rank trains on, validates or writes a checkpoint after the
verdict, and a collective that fails because another rank ended is reported as the stall
(`hold_if_stalled`).

Only training and evaluation are judged. Before every rank's first step (or batch) only a
rank that stopped running is: building the data set, loading a checkpoint and the first step
(a compile) are not progress that ticks. A rank inside a checkpoint write (`progress.busy()`)
makes progress.

Every process of a run writes its stacks on the dump signal (`kill -s RTMIN+4 PID`), watched or
not (`dump_stacks_to`): a rank to `logs/rank{N}.stacks`, the launcher of spawned workers to
`logs/launcher.stacks`.

It needs nothing but the process group's store, so it works alike for the workers spawned here,
under torchrun and as Slurm tasks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from app import progress
from app._private import process_group_store
from app.launch.stacks import is_stopped, running, stacks_on_signal, wake_to_dump
from app.launch.stall_rules import Peer, describe, judge, waits_for_others

log = logging.getLogger(__name__)

KEY = "app/watchdog/"
VERDICT = KEY + "verdict"
STORE_TIMEOUT_S = 30.0  # a store call that takes longer fails (the judge looks at the clock)
EXIT_CODE = 1

_watchdog: Watchdog | None = None  # the one running in this process


def hold_if_stalled(within_s: float = 0.0) -> None:
    """Called with an error on its way out: when a verdict has ended the job (or comes within
    `within_s`, as the store thread reads it), the error is the end of another rank (a failed
    collective): the process waits for the watchdog to report the stall and end it instead."""
    if _watchdog is None:
        return
    if progress.stalled.wait(within_s):
        progress.block()


def _store_client() -> Any:
    """A connection of this thread's own to the process group's store (None: none to have)."""
    try:
        store = process_group_store()  # PyTorch has no public accessor
    except (AttributeError, ImportError, RuntimeError, ValueError):
        return None
    if hasattr(store, "clone"):  # a connection of its own, safe beside the process group's
        client = store.clone()
    else:  # older torch: a new client of the same TCP store
        import torch.distributed as tdist

        while isinstance(store, tdist.PrefixStore):
            store = store.underlying_store
        if not isinstance(store, tdist.TCPStore):
            return None
        client = tdist.TCPStore(store.host, store.port, is_master=False,
                                wait_for_workers=False)
    client.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
    return client


class Watchdog:
    def __init__(self, rank: int, world_size: int, stall_s: float, run_dir: Path,
                 on_stall: Callable[[str], None]) -> None:
        self.rank, self.world_size, self.stall_s = rank, world_size, stall_s
        self.run_dir, self.on_stall = run_dir, on_stall
        self.interval = min(1.0, stall_s / 5)
        self.host, self.pid = socket.gethostname(), os.getpid()
        # The store is served by rank 0's process, except under torchrun (its agent serves it).
        self.store_rank = None if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else 0
        now = time.monotonic()
        self.peers = [Peer(r, now, now) for r in range(world_size)]
        self.proposal: str | None = None
        self.verdict: dict[str, Any] | None = None
        self.io_ok_at = now  # the last round of store calls that succeeded
        self.stop_event = threading.Event()
        self.main_ident = threading.main_thread().ident
        self.stacks_path = run_dir / "logs" / f"rank{rank}.stacks"
        self.own_stacks = contextlib.ExitStack()  # (when no file was registered before)
        self.threads = [threading.Thread(target=self._io, name="app-watchdog-store", daemon=True),
                        threading.Thread(target=self._judge, name="app-watchdog", daemon=True)]

    # -- start and stop

    def start(self) -> Watchdog:
        global _watchdog
        self.own_stacks.enter_context(stacks_on_signal(self.stacks_path))
        _watchdog = self
        for thread in self.threads:
            thread.start()
        return self

    def stop(self) -> None:
        """A clean end: say so to the others (so that a rank that ended is not taken for a
        stalled one)."""
        global _watchdog
        self.stop_event.set()
        self.threads[0].join(timeout=2 * self.interval + 1)
        _watchdog = None
        self.own_stacks.close()

    # -- the store thread: publish this rank's record, read the others'

    def _record(self, beat: int) -> str:
        frame = sys._current_frames().get(self.main_ident)
        mine = progress.record()
        return json.dumps({"ticks": mine["ticks"], "beat": beat, "step": mine["step"],
                           "host": self.host, "pid": self.pid, "busy": mine["busy"],
                           "done": self.stop_event.is_set() or mine["left"],
                           "waiting": waits_for_others(frame)})

    def _io(self) -> None:
        client = _store_client()
        if client is None:
            log.info("no store to watch the ranks' progress with: no stall watchdog")
            return
        keys = [f"{KEY}{r}" for r in range(self.world_size)]
        seen: set[int] = set()
        beat = 0
        leave_by = None
        while True:
            stopping = self.stop_event.is_set()
            if stopping and leave_by is None:
                leave_by = time.monotonic() + 2 * self.interval + 1
            if self._server_gone():
                return  # (its launcher, or its agent, ends the job: nothing to judge here)
            try:
                client.set(keys[self.rank], self._record(beat))
                if self.proposal is not None and self.verdict is None:
                    client.compare_set(VERDICT, "", self.proposal)
                if client.check([VERDICT]):
                    self.verdict = json.loads(client.get(VERDICT))
                    progress.stalled.set()  # from now on this rank makes no progress
                    return  # no more calls: the store may end with its server any moment
                seen |= {r for r in range(self.world_size)
                         if r not in seen and client.check([keys[r]])}
                order = sorted(seen)
                values = client.multi_get([keys[r] for r in order])
                now = time.monotonic()
                for r, value in zip(order, values, strict=True):
                    self.peers[r].update(json.loads(value), now)
                self.io_ok_at = now
            except Exception as e:  # a store gone at the end of the job; judged by the clock
                log.debug("watchdog store call failed: %s", e)
            # The rank that serves the store stays until the others have said goodbye (or for a
            # little while): a store call to a server that is gone prints C++ warnings.
            if stopping and (self.rank != self.store_rank or time.monotonic() > leave_by
                             or all(p.done for p in self.peers)):
                return
            beat += 1
            self.stop_event.wait(self.interval)

    def _server_gone(self) -> bool:
        """Whether the rank that serves the store has ended (one of this host, by its pid): a
        store call to a server that is gone prints a C++ warning with its stack, each time."""
        if self.store_rank is None:
            return False
        server = self.peers[self.store_rank]
        return server.rank != self.rank and server.pid is not None and \
            server.host == self.host and not running(server.pid)

    # -- the judge thread

    def _judge(self) -> None:
        last = time.monotonic()
        while not self.stop_event.wait(self.interval):
            now = time.monotonic()
            if now - last > 5 * self.interval + 1:  # this process did not run (stopped)
                for peer in self.peers:  # what it missed is not the others' silence
                    peer.moved_at, peer.heard_at = now, now
                self.io_ok_at = now
            last = now
            if self.verdict is not None:
                self._end(self.verdict)
            if now - self.io_ok_at >= self.stall_s and self.rank != self.store_rank:
                self._end(self._store_silent(now))
            if self.proposal is None:
                culprits = judge(self.peers, now, self.stall_s)
                if culprits is not None:
                    self.proposal = json.dumps({
                        **self._stamp(),
                        "message": describe(self.peers, culprits, now, self.stall_s,
                                            self.run_dir),
                        "wake": [[p.rank, p.host, p.pid] for p in culprits
                                 if p.silent(now, self.stall_s)]})

    def _stamp(self) -> dict[str, str]:
        """A verdict's id and time, for the headers of the stacks files."""
        return {"id": f"{time.time():.3f}-r{self.rank}",
                "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def _store_silent(self, now: float) -> dict[str, Any]:
        """The store has not answered for stall_s: its server is stalled (or unreachable)."""
        if self.store_rank is None:
            return {**self._stamp(),
                    "message": f"the torchrun agent's store has not answered for "
                               f"{self.stall_s:g} s: the job was ended", "wake": []}
        server = self.peers[self.store_rank]
        server.heard_at = min(server.heard_at, now - self.stall_s)
        return {**self._stamp(),
                "message": describe(self.peers, [server], now, self.stall_s, self.run_dir,
                                    "(its store did not answer either) while the others waited"),
                "wake": [[server.rank, server.host, server.pid]]}

    def _end(self, verdict: dict[str, Any]) -> None:
        """Write this rank's stacks, wake stopped ranks of this host to write theirs, end."""
        progress.stalled.set()
        if _header(verdict, self.rank) not in _read(self.stacks_path):  # (woken: written)
            with open(self.stacks_path, "a") as f:
                f.write(_header(verdict, self.rank) + f" (pid {self.pid}, host {self.host})\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        # The lowest rank of this host that is not to be woken itself wakes those of this host.
        stopped = {rank for rank, _, _ in verdict["wake"]}
        helpers = [p.rank for p in self.peers if p.host == self.host and p.rank not in stopped]
        woken = [(rank, pid) for rank, host, pid in verdict["wake"]
                 if host == self.host and pid is not None and helpers
                 and self.rank == min(helpers)]
        sizes = {}
        for rank, pid in woken:  # the header first: the woken rank's handler appends to it
            path = self.run_dir / "logs" / f"rank{rank}.stacks"
            if is_stopped(pid):
                with contextlib.suppress(OSError), open(path, "a") as f:
                    f.write(_header(verdict, rank) + f" (pid {pid}, stopped: written when "
                            f"rank {self.rank} woke it)\n")
                sizes[rank] = path.stat().st_size if path.is_file() else 0
                wake_to_dump(pid)
        deadline = time.monotonic() + 5
        for rank, size in sizes.items():  # its stacks are written once it runs
            path = self.run_dir / "logs" / f"rank{rank}.stacks"
            while time.monotonic() < deadline and not (path.is_file()
                                                       and path.stat().st_size > size):
                time.sleep(0.05)
        try:
            self.on_stall(verdict["message"])
            # Every rank reads the verdict within a round and acts on it in the next: until
            # then no rank leaves (one that left would fail the others' collectives, and they
            # would end without their stacks); the store's server stays until the others left.
            linger = time.monotonic() + 2 * self.interval + 0.5
            if self.rank == self.store_rank:
                self._wait_for_others(deadline=linger + 1)
            while time.monotonic() < linger:
                time.sleep(0.05)
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_CODE)

    def _wait_for_others(self, deadline: float) -> None:
        """Until the other ranks of this host have ended (those of other hosts: until then)."""
        others = [p.pid for p in self.peers if p.rank != self.rank and p.pid is not None
                  and p.host == self.host]
        elsewhere = len(others) < self.world_size - 1
        while time.monotonic() < deadline and (elsewhere or any(running(p) for p in others)):
            time.sleep(0.05)


def _header(verdict: dict[str, Any], rank: int) -> str:
    """The line that opens a verdict's section of a rank's stacks file (one per verdict: a
    file kept from an earlier stall, or a dump asked for by hand, stays above it)."""
    return (f"=== {verdict.get('time', '?')} verdict {verdict.get('id', '?')}, rank {rank}: "
            f"{verdict['message']}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def start(stall_s: float | None, run_dir: Path, rank: int, world_size: int,
          on_stall: Callable[[str], None]) -> Watchdog | None:
    """Watch the ranks' progress (with several ranks and a stall timeout); `on_stall` reports
    the one line that ends the job, then the process exits."""
    if stall_s is None or world_size < 2:
        return None
    return Watchdog(rank, world_size, stall_s, run_dir, on_stall).start()
