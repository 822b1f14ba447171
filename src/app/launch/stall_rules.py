"""The rules of the stall watchdog (app.launch.watchdog), apart from its threads and the
store: whether a rank waits for the others, when the job has stalled and which ranks stalled
it, and the line that ends the job."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app import progress

# Where a main thread waits for the other ranks: inside torch.distributed (collectives,
# barriers, object gathers), DDP's own module (buffer broadcasts), and the autograd engine
# (DDP all-reduces the gradients during backward, and waits for them at its end).
_WAIT_PATHS = tuple(os.path.join("torch", *parts) for parts in (
    ("distributed", ""), ("nn", "parallel", "distributed.py")))
_WAIT_FUNCTIONS = {"_engine_run_backward", "run_backward"}


def waits_for_others(frame: Any) -> bool:
    """Whether a thread whose innermost Python frame is `frame` waits for the other ranks."""
    if progress.in_wait():
        return True
    if frame is None:
        return False
    code = frame.f_code
    return code.co_name in _WAIT_FUNCTIONS or any(p in code.co_filename for p in _WAIT_PATHS)


@dataclass
class Peer:
    """What this rank knows of one rank (itself included); times are this rank's clock."""

    rank: int
    moved_at: float  # when its counter last changed
    heard_at: float  # when its record last changed
    ticks: int = -1
    beat: int = -1
    step: int | None = None
    host: str = "?"
    pid: int | None = None
    waiting: bool = False
    done: bool = False
    armed: bool = False  # it has done its first step (or batch): judged from then on

    def silent(self, now: float, stall_s: float) -> bool:
        return now - self.heard_at >= stall_s

    def update(self, record: dict[str, Any], now: float) -> None:
        if record["ticks"] != self.ticks or record.get("busy"):
            self.moved_at = now
        if record["beat"] != self.beat:
            self.heard_at = now
        for name in ("ticks", "beat", "step", "host", "pid", "waiting", "done"):
            setattr(self, name, record[name])
        self.armed = record["ticks"] >= 2


def judge(peers: list[Peer], now: float, stall_s: float) -> list[Peer] | None:
    """The stalled ranks, once the job has stalled; None while it has not.

    The job has stalled when no running rank's counter has moved for `stall_s` (a rank that
    stalls soon holds up the others, so their counters stop too). The culprits are then the
    ranks that do not wait for the others: those silent for `stall_s` (not running) and those
    whose main thread is elsewhere. An empty list: every rank waits in a collective (ranks that
    called different collectives, or a rank lost between two of them).

    Until every running rank has done its first step, only silent ranks are judged: before
    it, a rank builds its data set, loads a checkpoint or compiles the model, which take long
    and tick nothing, but a rank that does any of it still publishes its record (about once a
    second). One whose records stopped for `stall_s` does not run, whatever it was doing (a
    SIGSTOP while the data set is built held the others for distributed.timeout_s before).
    """
    running = [p for p in peers if not p.done]
    if not running:
        return None
    if not all(p.armed for p in running):
        silent = [p for p in running if p.silent(now, stall_s)]
        return silent if silent and len(silent) < len(running) else None
    if any(now - p.moved_at < stall_s for p in running):
        return None
    return [p for p in running if p.silent(now, stall_s) or not p.waiting]


def describe(peers: list[Peer], culprits: list[Peer], now: float, stall_s: float,
             run_dir: Path, waited: str = "while the other ranks waited") -> str:
    """The one line that ends a stalled job. A rank's step is the last one it published (up to
    a second old, hence "published"); the step the others wait at says where it stopped."""
    stacks = f"every rank's Python stack is in {run_dir / 'logs'}/rank{{N}}.stacks"
    if not culprits:
        return (f"every rank has waited in a collective for {stall_s:g} s with no progress "
                f"(ranks that called different collectives?): the job was ended "
                f"(distributed.stall_timeout_s={stall_s:g}); {stacks}")
    parts = []
    for p in culprits:
        where = "before its first step" if p.step is None else f"last published step {p.step}"
        state = ", not running: stopped?" if p.silent(now, stall_s) else ""
        parts.append(f"rank {p.rank} on host {p.host} (pid {p.pid}, {where}{state})")
    steps = sorted({p.step for p in peers if p not in culprits and p.step is not None})
    if steps:
        waited += f" at step {steps[0]}" if len(steps) == 1 else f" at steps {steps[0]}-{steps[-1]}"
    verb = "has" if len(parts) == 1 else "have"
    return (f"{' and '.join(parts)} {verb} made no progress for {stall_s:g} s {waited}: the "
            f"job was ended (distributed.stall_timeout_s={stall_s:g}); {stacks}")
