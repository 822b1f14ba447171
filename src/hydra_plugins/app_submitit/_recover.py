"""Recovery from transient faults of a Slurm job, run by its batch script after srun returns
(`python -m hydra_plugins.app_submitit._recover STATUS FOLDER MAX`, the script's teardown):
when a task died by a signal (the OOM killer, a crash of the node's software: srun's status
is 128 + the signal) and no task raised, the job is requeued and resumes from `last.pt`, up
to `hydra.launcher.max_num_failures` times. An exception in the user's code (a task's result
holds an error) stays a failure, and so does a job the user cancelled.

A node that fails (NODE_FAIL) takes the batch script with it: Slurm requeues the job itself
(JobRequeue); the job counts those restarts at its start (`check_restarts`).

Requeues made here are counted in the job's submitit folder (`app-failures`), apart from
the timeouts and preemptions that submitit requeues (max_num_timeout). The module name
starts with "_": Hydra's plugin scan skips it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

COUNT_FILE = "app-failures"  # one line per requeue after a failure, in the job's folder


def job_id() -> str:
    """This job's id as submitit names it ("12" or "12_3" for task 3 of array 12)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ["SLURM_JOB_ID"]


def _job_state(jid: str) -> tuple[str, int]:
    from app import slurm

    listed = (slurm.jobs() or {}).get(jid)
    return (listed.state, listed.restarts) if listed else ("UNKNOWN", 0)


def decide(status: int, errors: int, failures: int, max_failures: int, state: str,
           restarts: int, restart_count: int) -> str | None:
    """Why the job is requeued (None: it is not, and why not is logged by the caller).
    `errors`: tasks whose result holds an exception; `failures`: requeues so far;
    `restarts`/`restart_count`: Slurm's count now and at this run's start."""
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
    from submitit.core.utils import pickle_load

    jid = job_id()
    tasks = int(os.environ.get("SLURM_NTASKS", "1"))
    job = submitit.SlurmJob(folder=folder, job_id=jid, tasks=range(tasks))
    results = [job.task(t).paths.result_pickle for t in range(tasks)]
    errors = sum(1 for p in results if p.exists() and pickle_load(p)[0] == "error")
    counter = Path(job.paths.folder) / COUNT_FILE
    failures = len(counter.read_text().splitlines()) if counter.is_file() else 0
    state, restarts = _job_state(jid)
    why = decide(status, errors, failures, max_failures, state, restarts,
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
    subprocess.run(["scontrol", "requeue", jid], check=False)
    return status


def requeued(job: Any, confirm_s: float = 10.0) -> bool:
    """For the waiting command: whether a job seen in a final state without a result from
    every task, none of which raised, runs again. The faults it recovers from (a task killed
    by a signal, a node that failed) requeue it, and the watcher can catch the state it
    passes on the way."""
    from app import slurm
    from app._private import slurm_watcher
    from app.sweeps.job_end import outcomes

    state = job.state.split()[0].upper() if job.state else ""
    results = outcomes(job, grace_s=0)
    if state not in ("FAILED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY") or any(
            r is not None and r[0] == "error" for r in results) or None not in results:
        return False
    deadline = time.monotonic() + confirm_s
    while time.monotonic() < deadline:
        listed = (slurm.jobs() or {}).get(job.job_id)
        if listed is not None and listed.active:
            slurm_watcher().forget(job.job_id)
            return True
        time.sleep(0.5)
    return False


def teardown_lines(folder: str, max_failures: int) -> list[str]:
    """The batch script's lines after srun ($? is srun's status there)."""
    return ["app_srun_status=$?",
            f"{sys.executable} -m hydra_plugins.app_submitit._recover \"$app_srun_status\" "
            f"'{folder}' {max_failures}",
            "exit $app_srun_status"]


def check_restarts(max_timeouts: int, max_failures: int) -> str | None:
    """At a job's start: why it must not run again (restarted more often than timeouts and
    failures allow: Slurm's own requeues after node failures count as failures)."""
    count = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if count > max_timeouts + max_failures:
        return (f"restarted {count} times, more than hydra.launcher.max_num_timeout="
                f"{max_timeouts} plus max_num_failures={max_failures} allow")
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
