"""The stall watchdog: a rank that stops making progress while the others wait for it ends the
job in one line naming it (host, pid, where it was: training, validating or writing a
checkpoint, after which step), with every rank's stacks in `logs/rank{N}.stacks`, instead of
holding the job for distributed.timeout_s. PyTorch's own guards (the process group's timeout,
NCCL's Flight Recorder) name a collective, not a rank.

A thread per rank publishes its app.progress record to the rendezvous store when it changes
(at most ten times an interval) and at least once an interval (a second), and reads the
others' once an interval; a second thread judges them (a store call hangs while its server is
stopped). The first rank to find a stall writes the verdict there; then every rank writes its
stacks and exits, and none makes progress (`progress.tick()` blocks).
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as tdist

from app import progress
from app.env import this_process
from app.launch.stacks import DUMP_SIGNAL

log = logging.getLogger(__name__)

EXIT_CODE = 1
# Where a main thread waits for the other ranks: in torch.distributed, in DDP's module (buffer
# broadcasts) and in the autograd engine (DDP all-reduces the gradients during backward).
_WAIT_PATHS = tuple(os.path.join("torch", *parts) for parts in (
    ("distributed", ""), ("nn", "parallel", "distributed.py")))
_WAIT_FUNCTIONS = {"_engine_run_backward", "run_backward"}


def hold_if_stalled(within_s: float = 0.0) -> None:
    """For an error on its way out, with a watchdog running: when a verdict has ended the job
    (or comes within `within_s`), the error is another rank's end: wait for the watchdog to end
    this process."""
    if progress.stalled.wait(within_s):
        progress.block()


def waits_for_others(frame: Any) -> bool:
    """Whether a thread whose innermost Python frame is `frame` waits for the other ranks."""
    code = getattr(frame, "f_code", None)
    return progress.in_wait() or code is not None and (
        code.co_name in _WAIT_FUNCTIONS or any(p in code.co_filename for p in _WAIT_PATHS))


@dataclass
class Peer:
    """What this rank knows of one rank (itself included); times are this rank's clock."""

    rank: int
    moved_at: float  # when its counter last changed
    heard_at: float  # when its record last changed
    ticks: int = -1
    beat: int = -1
    step: int | None = None
    place: str = "training"  # (app.progress.record)
    host: str = "?"
    pid: int | None = None
    waiting: bool = False
    done: bool = False
    armed: bool = False  # it has done its first step (or batch): judged from then on

    def silent(self, now: float, stall_s: float) -> bool:
        return now - self.heard_at >= stall_s

    def update(self, record: dict[str, Any], now: float) -> None:
        heard = record["beat"] != self.beat
        # A checkpoint being written is progress while the rank is heard (a rank stopped in a
        # write leaves that record behind).
        if record["ticks"] != self.ticks or heard and record.get("busy"):
            self.moved_at = now
        if heard:
            self.heard_at = now
        for name in ("ticks", "beat", "step", "place", "host", "pid", "waiting", "done"):
            setattr(self, name, record[name])
        self.armed = record["ticks"] >= 2


def judge(peers: list[Peer], now: float, stall_s: float) -> list[Peer] | None:
    """The stalled ranks, once no running rank's counter has moved for `stall_s`; None before.
    They are the ranks that do not wait for the others: silent ones (stopped, or stuck without
    the GIL) and those whose main thread is elsewhere (a dead loop, a sleep); none when every
    rank waits in a collective. Until every running rank has done its first step only silent
    ranks are judged: building the data, loading a checkpoint and compiling tick nothing."""
    running = [p for p in peers if not p.done]
    if not running:
        return None
    if not all(p.armed for p in running):
        silent = [p for p in running if p.silent(now, stall_s)]
        return silent if silent and len(silent) < len(running) else None
    if any(now - p.moved_at < stall_s for p in running):
        return None
    return [p for p in running if p.silent(now, stall_s) or not p.waiting]


def where(peer: Peer) -> str:
    """Where `peer` was last seen: training, validating or writing a checkpoint, after which
    step (none: trainer=eval), or before its first step (building its data, loading a
    checkpoint, compiling)."""
    if peer.step is None and peer.place != "validating" or peer.step == 0 and \
            peer.place == "training":
        return "before its first step"
    return peer.place if peer.step is None else f"{peer.place} after step {peer.step}"


def describe(peers: list[Peer], culprits: list[Peer], now: float, stall_s: float,
             run_dir: Path, waited: str = "while the other ranks waited") -> str:
    """The one line that ends a stalled job. A rank's place is the last one it published (at
    most a tenth of an interval before it stopped); the step the others wait at says more."""
    end = (f"the job was ended (distributed.stall_timeout_s={stall_s:g}); every rank's Python "
           f"stack is in {run_dir / 'logs'}/rank{{N}}.stacks")
    if not culprits:
        return (f"every rank has waited in a collective for {stall_s:g} s with no progress "
                f"(ranks that called different collectives?): {end}")
    parts = []
    for p in culprits:
        state = ", not running: stopped?" if p.silent(now, stall_s) else ""
        parts.append(f"rank {p.rank} on host {p.host} (pid {p.pid}, last seen {where(p)}{state})")
    steps = sorted({p.step for p in peers if p not in culprits and p.step is not None})
    if steps:
        waited += f" at step {steps[0]}" if len(steps) == 1 else f" at steps {steps[0]}-{steps[-1]}"
    verb = "has" if len(parts) == 1 else "have"
    return f"{' and '.join(parts)} {verb} made no progress for {stall_s:g} s {waited}: {end}"


def _status(pid: int) -> str:
    """psutil's; a process that ended: dead, or a zombie (a child not yet reaped)."""
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return psutil.STATUS_DEAD


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
        self.io_ok_at = now  # when the last round of store calls succeeded
        self.stop_event = threading.Event()
        self.threads = [threading.Thread(target=target, name=name, daemon=True) for target, name
                        in ((self._publish, "app-watchdog-store"), (self._judge, "app-watchdog"))]

    def stop(self) -> None:
        """A clean end: say so to the others (a rank that ended is not a stalled one)."""
        self.stop_event.set()
        self.threads[0].join(timeout=2 * self.interval + 1)

    def _record(self) -> dict[str, Any]:
        mine = progress.record()
        frame = sys._current_frames().get(threading.main_thread().ident)
        return {**mine, "host": self.host, "pid": self.pid,
                "done": self.stop_event.is_set() or mine["left"],
                "waiting": waits_for_others(frame)}

    def _publish(self) -> None:
        """The store thread: publish this rank's record (and its verdict, unless one was given),
        read the others' records, or the verdict (then no more calls: its server may end).

        A stopped rank is named by the record it published last, so a changed record goes out
        within a tenth of an interval. The others' are read once an interval (each rank reads
        every record), but those of the rank that serves the store (once it stops nothing can
        be read) and of ranks not yet seen (their host and pid) as often."""
        try:  # a connection of this thread's own to the store every rank met at
            env = this_process()
            store = tdist.PrefixStore(  # (torchrun's agent keeps its store across restarts)
                f"app/watchdog/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                tdist.TCPStore(env.master_addr, env.master_port, is_master=False,
                               wait_for_workers=False, timeout=timedelta(seconds=30)))
        except Exception as e:
            log.info("no store to watch the ranks' progress with (%s): no stall watchdog", e)
            return
        beat, seen, leave_by, sent, read_at = 0, set(), None, None, 0.0
        server = [self.store_rank] if self.store_rank not in (None, self.rank) else []
        while True:
            if self.stop_event.is_set() and leave_by is None:
                leave_by = time.monotonic() + 2 * self.interval + 1
            serving = self.peers[self.store_rank or 0]
            if self.store_rank is not None and serving.rank != self.rank and \
                    serving.host == self.host and serving.pid and _status(serving.pid) in (
                        psutil.STATUS_DEAD, psutil.STATUS_ZOMBIE):
                return  # a store call to a server that is gone prints a C++ warning each time
            try:
                mine, now = self._record(), time.monotonic()
                # (Leaving: the store's server reads the others' goodbyes as they come.)
                full = now >= read_at or len(seen) < self.world_size or leave_by is not None
                if full or mine != sent:
                    beat += 1
                    store.set(str(self.rank), json.dumps({**mine, "beat": beat}))
                    sent = mine
                ranks = [r for r in server if r in seen]
                if full:
                    read_at = now + self.interval
                    if self.proposal is not None:
                        store.compare_set("verdict", "", self.proposal)
                    if store.check(["verdict"]):
                        self.verdict = json.loads(store.get("verdict"))
                        progress.stalled.set()  # from now on this rank makes no progress
                        return
                    seen |= {r for r in range(self.world_size) if r not in seen
                             and store.check([str(r)])}
                    ranks = sorted(seen)
                values = store.multi_get([str(r) for r in ranks]) if ranks else []
                self.io_ok_at = time.monotonic()
                for r, value in zip(ranks, values, strict=True):
                    self.peers[r].update(json.loads(value), self.io_ok_at)
            except Exception as e:  # a store gone at the end of the job; judged by the clock
                log.debug("watchdog store call failed: %s", e)
            # The server stays until the others have said goodbye (or for a little while).
            if leave_by is not None and (self.rank != self.store_rank or time.monotonic() >
                                         leave_by or all(p.done for p in self.peers)):
                return
            self.stop_event.wait(self.interval / 10)

    def _judge(self) -> None:
        last = time.monotonic()
        while not self.stop_event.wait(self.interval):
            now = time.monotonic()
            if now - last > 5 * self.interval + 1:  # this process did not run (stopped): what
                self.io_ok_at = now  # it missed is not the others' silence
                for peer in self.peers:
                    peer.moved_at, peer.heard_at = now, now
            last = now
            if self.verdict is not None:
                self._end(self.verdict)
            # This rank's own place as it is (read back from the store it is up to an interval
            # old, and the store may be stopped): the step the others wait at, in a verdict.
            me, mine = self.peers[self.rank], progress.record()
            me.step, me.place = mine["step"], mine["place"]
            # Rank 0's store silent: rank 0 is stalled (torchrun's agent's: blind, not stalled).
            if now - self.io_ok_at >= self.stall_s and self.store_rank not in (None, self.rank):
                server = self.peers[self.store_rank]
                server.heard_at = min(server.heard_at, now - self.stall_s)
                self._end(self._verdict(describe(
                    self.peers, [server], now, self.stall_s, self.run_dir,
                    "(its store did not answer either) while the others waited"), [server]))
            culprits = judge(self.peers, now, self.stall_s) if self.proposal is None else None
            if culprits is not None:
                self.proposal = json.dumps(self._verdict(describe(
                    self.peers, culprits, now, self.stall_s, self.run_dir), culprits))

    def _verdict(self, message: str, culprits: list[Peer]) -> dict[str, Any]:
        """Its id and time (the stacks files' headers), its line, the ranks to wake if stopped
        (one stopped since its last record may not be silent yet: it is woken all the same)."""
        return {"id": f"{time.time():.3f}-r{self.rank}", "message": message,
                "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "wake": [[p.rank, p.host, p.pid] for p in culprits]}

    def _end(self, verdict: dict[str, Any]) -> None:
        """Write the stacks, report the verdict, and exit once the others have read it (a rank
        that left first would fail their collectives before they wrote their stacks)."""
        progress.stalled.set()
        try:
            with contextlib.suppress(OSError):  # (a full disk: the line is what matters)
                self._write_stacks(verdict)
            self.on_stall(verdict["message"])
            # Each rank reads the verdict within a round; the store's server stays a second more.
            time.sleep(2 * self.interval + 0.5 + (self.rank == self.store_rank))
        finally:
            for handler in logging.getLogger().handlers:
                handler.flush()
            os._exit(EXIT_CODE)

    def _write_stacks(self, verdict: dict[str, Any]) -> None:
        """A section of this rank's stacks file per verdict, after a header (a file kept from an
        earlier stall, or a dump asked for by hand, stays above it). The lowest rank of a host
        that is not stopped wakes its stopped ranks: the dump signal, then SIGCONT."""
        def header(rank: int, note: str) -> Path:
            path = self.run_dir / "logs" / f"rank{rank}.stacks"
            with open(path, "a") as f:
                f.write(f"=== {verdict['time']} verdict {verdict['id']}, rank {rank}: "
                        f"{verdict['message']} ({note})\n")
            return path

        mine = self.run_dir / "logs" / f"rank{self.rank}.stacks"
        if f"verdict {verdict['id']}, rank {self.rank}:" not in (  # (woken: written)
                mine.read_text(errors="replace") if mine.is_file() else ""):
            with open(header(self.rank, f"pid {self.pid}, host {self.host}"), "a") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
        stopped = {rank for rank, _, _ in verdict["wake"]}
        helpers = [p.rank for p in self.peers if p.host == self.host and p.rank not in stopped]
        sizes = {}
        for rank, host, pid in verdict["wake"] if self.rank == min(helpers, default=-1) else []:
            if host == self.host and pid and DUMP_SIGNAL and _status(pid) in (
                    psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                path = header(rank, f"pid {pid}, stopped: written when rank {self.rank} woke it")
                sizes[path] = path.stat().st_size
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, DUMP_SIGNAL)
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 5  # (until their stacks are written)
        while time.monotonic() < deadline and any(
                path.stat().st_size <= size for path, size in sizes.items()):
            time.sleep(0.05)


def start(stall_s: float | None, run_dir: Path, rank: int, world_size: int,
          on_stall: Callable[[str], None]) -> Watchdog | None:
    """Watch the ranks' progress (with several ranks and a stall timeout); `on_stall` reports
    the one line that ends the job, then the process exits."""
    if stall_s is None or world_size < 2:
        return None
    watchdog = Watchdog(rank, world_size, stall_s, run_dir, on_stall)
    for thread in watchdog.threads:
        thread.start()
    return watchdog
