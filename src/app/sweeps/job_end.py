"""How a submitted job ended, in one line: its state, the task that failed first and why,
for the waiting launcher and for `python -m app.status`.

Read from what the job leaves behind: each task's result file (submitit writes the error's
traceback there when the task function raised) and srun's own report in the batch log
("srun: error: node1: task 1: Killed"), the only record of a task killed by a signal, which
writes no result.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

from submitit.core.utils import pickle_load

from app.errors import JobFailed

# glibc's descriptions, as srun prints them, back to names: "Killed" -> SIGKILL.
_SIGNALS = {signal.strsignal(s): s for s in signal.Signals}
_SRUN = re.compile(r"^srun: error: [^:]+: tasks? (\d+)[-,\d]*: (.+)$", re.MULTILINE)
# States in which Slurm, not one of the tasks, ended the job.
_ENDED_BY_SLURM = {"BOOT_FAIL", "CANCELLED", "DEADLINE", "NODE_FAIL", "PREEMPTED", "REVOKED",
                   "TIMEOUT", "GONE"}


def outcomes(job: Any, grace_s: float) -> list[tuple[str, Any] | None]:
    """Each task's ("success", value) or ("error", traceback), None where it wrote none.
    A missing file is waited for up to grace_s (a shared file system can lag)."""
    deadline = time.monotonic() + grace_s
    while True:
        paths = [job.task(t).paths.result_pickle for t in range(job.num_tasks)]
        if all(p.exists() for p in paths) or time.monotonic() >= deadline:
            return [pickle_load(p) if p.exists() else None for p in paths]
        time.sleep(1)


def srun_failures(batch_log: Path) -> list[tuple[int, str]]:
    """(task, what happened) for each task srun reported, in the order it reported them."""
    text = batch_log.read_text(errors="replace") if batch_log.is_file() else ""
    return [(int(task), _signal_name(what.strip())) for task, what in _SRUN.findall(text)]


def _signal_name(what: str) -> str:
    what = what.removesuffix(" (core dumped)")
    if what in _SIGNALS:
        return f"killed by {_SIGNALS[what].name}"
    code = re.fullmatch(r"Exited with exit code (\d+)", what)
    if code is None:
        return what
    number = int(code.group(1))
    if number > 128 and number - 128 in _SIGNALS.values():
        return f"exit code {number} ({signal.Signals(number - 128).name})"
    return f"exit code {number}"


def died_by_signal(job: Any, results: list[tuple[str, Any] | None]) -> bool:
    """Whether the job's first failure was a task killed by a signal (the OOM killer, a crash,
    a lost node) rather than one that raised. srun reports tasks in the order they ended: the
    killed task first, then its peers, which raise in their next collective (with three ranks
    or more one may, before srun kills it) or are killed by srun. Without srun's report (the
    batch script died with its node): a task left no result and none raised."""
    reported = srun_failures(job.task(0).paths.stderr)
    if reported:
        task, how = reported[0]
        return how.startswith("killed by") and results[task] is None
    return None in results and not any(r is not None and r[0] == "error" for r in results)


def describe(job: Any, state: str, results: list[tuple[str, Any] | None]
             ) -> tuple[int | None, str, str]:
    """(the task that failed first or None, what happened, the log to read) for a job without
    a successful result from every task."""
    errors = {t: r[1] for t, r in enumerate(results) if r is not None and r[0] == "error"}
    missing = [t for t, r in enumerate(results) if r is None]
    batch_log = job.task(0).paths.stderr  # srun's messages go to the batch script's log
    reported = srun_failures(batch_log)
    if state in _ENDED_BY_SLURM and missing:
        tasks = ", ".join(map(str, missing))
        what = f"no result from task{'s' if len(missing) > 1 else ''} {tasks}"
        if state == "GONE":
            what = f"Slurm no longer lists it, {what}"
        return None, what, str(batch_log)
    # The task that failed first: srun reports tasks in the order they ended. A task that
    # raises makes its peers fail in their next collective, or get killed by srun.
    if reported:
        task, how = reported[0]
    elif errors:
        task = min(errors, key=lambda t: job.task(t).paths.result_pickle.stat().st_mtime)
        how = ""
    else:
        task, how = (missing or [0])[0], "the task ended without a result"
    if task in errors:  # `RuntimeError: injected fault` from its traceback, no module paths
        lines = [line.strip() for line in str(errors[task]).strip().splitlines() if line.strip()]
        line = re.sub(r"^[\w.]+\.(\w+): ", r"\1: ", lines[-1] if lines else "unknown error")
        # (JobFailed's message is the job's error)
        return task, line.removeprefix(f"{JobFailed.__name__}: "), str(job.task(task).paths.stderr)
    return task, how, str(batch_log)
