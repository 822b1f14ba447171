"""After srun, a job's batch script runs `main`, which requeues a job whose first failure was a
task killed by a signal (the OOM killer, a crash), not one that raised, up to max_num_failures
times (counted in the job's folder, apart from submitit's requeues at a time limit). A failed
node takes the script with it: Slurm requeues the job itself, and the job counts its restarts
at its start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COUNT_FILE = "app-failures"  # one line per requeue after a failure, in the job's folder


def decide(status: int, errors: int, failures: int, max_failures: int, state: str,
           restarts: int, restart_count: int) -> str | None:
    """Why the job is requeued (None: it is not). `errors`: tasks that raised; `failures`:
    requeues so far; `restarts`/`restart_count`: Slurm's count now and at this run's start."""
    if status <= 128 or errors:
        return None  # ended well, or by an exception of the user's code: a failure
    if state not in ("RUNNING", "COMPLETING") or restarts > restart_count:
        return None  # cancelled, or requeued already (a timeout, a preemption)
    if failures >= max_failures:
        return None
    return f"a task ended by signal {status - 128}"


def main(argv: list[str]) -> int:
    status, folder, max_failures = int(argv[0]), argv[1], int(argv[2])
    if status == 0:
        return 0
    import submitit

    from app import slurm
    from app.sweeps.job_end import died_by_signal, outcomes

    env = submitit.JobEnvironment()
    job = submitit.SlurmJob(folder=folder, job_id=env.job_id, tasks=range(env.num_tasks))
    results = outcomes(job, grace_s=0)
    # (the peers of a killed task that raised in their next collective are not its cause)
    errors = 0 if died_by_signal(job, results) else \
        sum(r is not None and r[0] == "error" for r in results)
    counter = Path(job.paths.folder) / COUNT_FILE
    failures = len(counter.read_text().splitlines()) if counter.is_file() else 0
    listed = (slurm.jobs() or {}).get(env.job_id) or slurm.Job(env.job_id, "UNKNOWN")
    why = decide(status, errors, failures, max_failures, listed.state, listed.restarts,
                 int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0))
    if why is None:
        if status > 128 and not errors and failures >= max_failures:
            print(f"app: a task ended by signal {status - 128}; not requeued: "
                  f"hydra.launcher.max_num_failures={max_failures} and the job was "
                  f"requeued {failures} time(s) after failures", file=sys.stderr)
        return status
    with open(counter, "a") as f:
        f.write(f"{why}\n")
    print(f"app: {why}: requeued ({failures + 1} of hydra.launcher.max_num_failures="
          f"{max_failures}); it resumes from last.pt", file=sys.stderr)
    subprocess.run(["scontrol", "requeue", env.job_id], check=False)
    return status


def requeued(job: Any, confirm_s: float = 10.0) -> bool:
    """Whether a job seen failed, a task of it killed by a signal first, runs again (the
    watcher may catch the state it passes on the way to its requeue)."""
    from app import slurm
    from app.sweeps.job_end import died_by_signal, outcomes

    state = job.state.split()[0].upper() if job.state else ""
    if state not in ("FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY") or \
            not died_by_signal(job, outcomes(job, grace_s=0)):
        return False
    deadline = time.monotonic() + confirm_s
    while time.monotonic() < deadline:
        listed = (slurm.jobs() or {}).get(job.job_id)
        if listed is not None and listed.active:
            job.watcher.forget(job.job_id)
            return True
        time.sleep(0.5)
    return False


def check_restarts(max_timeouts: int, max_failures: int) -> None:
    """At a job's start: JobFailed when it was restarted more often than allowed (Slurm's own
    requeues after node failures count as failures)."""
    from app.errors import JobFailed

    count = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if count > max_timeouts + max_failures:
        raise JobFailed(f"restarted {count} times, more than hydra.launcher.max_num_timeout="
                        f"{max_timeouts} plus max_num_failures={max_failures} allow")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
