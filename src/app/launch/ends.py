"""How a rank of a run ended other than by completing, in one format for every rank (spawned
here, torchrun, Slurm): `logs/rank{N}.end.json`, written by the rank itself as it ends: stopped
by a signal, failed, or stalled (the watchdog's verdict). The earliest failure is the
cause, picked here for everyone who asks (rank 0 of a job, the launcher of spawned workers):
a rank that fails makes its peers fail in their next collective.

Not the elastic `@record` error file: its timestamp has whole seconds, and the ranks of one
failure end within milliseconds of each other.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from app.errors import AppError, Interrupted, one_line

STOPPED, FAILED, STALLED = "stopped", "failed", "stalled"
_stalled = False  # this process's end was a stall: what it raises afterwards is its effect


def _path(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"rank{rank}.end.json"


def write(run_dir: Path, rank: int, status: str, error: BaseException | str) -> None:
    """Record how this rank ended (a stall is kept over what follows it in this process)."""
    global _stalled
    if _stalled and status != STALLED:
        return
    _stalled = status == STALLED
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "status": status,
              "error": one_line(error) if isinstance(error, BaseException) else error,
              "exit_code": error.exit_code if isinstance(error, AppError) else 1}
    try:
        _path(run_dir, rank).write_text(json.dumps(record))
    except OSError:
        pass  # (the error itself is what the rank reports)


def status_of(error: BaseException) -> str:
    return STOPPED if isinstance(error, Interrupted | KeyboardInterrupt) else FAILED


def read(run_dir: Path, since: float, ranks: range | None = None) -> dict[int, dict[str, Any]]:
    """The records of ranks (all, or `ranks`) that ended since `since` (not an earlier run's)."""
    found = {}
    for path in (run_dir / "logs").glob("rank*.end.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("time", 0) >= since and (
                ranks is None or record.get("rank") in ranks):
            found[record["rank"]] = record
    return found


def first_failure(ends: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The cause among `ends`: a stalled rank (the watchdog named it; the others ended because
    of it), else the earliest failure."""
    failed = [e for e in ends.values() if e["status"] in (FAILED, STALLED)]
    stalled = [e for e in failed if e["status"] == STALLED]
    return min(stalled or failed, key=lambda e: e["time"], default=None)


def failed_line(run_dir: Path, end: dict[str, Any]) -> str:
    rank_log = run_dir / "logs" / f"rank{end['rank']}.log"
    return f"rank {end['rank']} failed: {end['error']} (traceback in {rank_log})"
