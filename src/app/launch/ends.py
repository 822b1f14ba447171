"""How a rank of a run ended other than by completing, in one format for every rank (spawned,
torchrun, Slurm): `logs/rank{N}.end.json`, written by the rank as it ends (stopped, failed, or
stalled: the watchdog's verdict). The cause is picked here for everyone who asks: a failing
rank makes its peers fail in their next collective. (Not the elastic `@record` error file: its
timestamp has whole seconds, and the ranks of one failure end within milliseconds.)
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from app.errors import AppError, Interrupted, one_line

STOPPED, FAILED, STALLED = "stopped", "failed", "stalled"
_stalled = False  # this process's end was a stall: what it raises afterwards is its effect


def write(run_dir: Path, rank: int, error: BaseException | str, status: str = "") -> None:
    """Record how this rank ended (a stall is kept over what follows it in this process)."""
    global _stalled
    status = status or (STOPPED if isinstance(error, Interrupted | KeyboardInterrupt) else FAILED)
    if _stalled and status != STALLED:
        return
    _stalled = status == STALLED
    record = {"rank": rank, "pid": os.getpid(), "time": time.time(), "status": status,
              "error": one_line(error) if isinstance(error, BaseException) else error,
              "exit_code": error.exit_code if isinstance(error, AppError) else 1,
              # (an AppError is logged as its line; anything else with its traceback)
              "traceback": isinstance(error, BaseException) and not isinstance(error, AppError)}
    with contextlib.suppress(OSError):  # (the error itself is what the rank reports)
        (run_dir / "logs" / f"rank{rank}.end.json").write_text(json.dumps(record))


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
    where = "traceback in" if end.get("traceback", True) else "its log:"
    return f"rank {end['rank']} failed: {end['error']} ({where} {rank_log})"
