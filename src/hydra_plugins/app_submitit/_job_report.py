"""After Ctrl-C: the jobs that go on without the submitting command, and how to follow them.
(How a job ended: app.sweeps.job_end.) The module name starts with "_": Hydra's plugin scan
skips it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("hydra_plugins.app_submitit.launcher")  # (the lines as before)


def report_left(jobs: dict[int, Any], run_dir: Callable[[int], Path]) -> None:
    """After Ctrl-C: the jobs that go on without the submitting command, and how to follow
    them (`run_dir`: a job's run directory by its number)."""
    from app._private import slurm_watcher

    from ._slurm_states import FINAL

    if not jobs:
        log.error("interrupted while submitting: a job already submitted goes on (list "
                  "yours with `squeue -u $USER`)")
        return
    try:
        slurm_watcher().update()
    except KeyboardInterrupt:  # a second Ctrl-C: the states known so far will do
        pass
    for num, job in sorted(jobs.items()):
        state = slurm_watcher().get_state(job.job_id, mode="cache").split()[0]
        finished = all(job.task(t).paths.result_pickle.exists() for t in range(job.num_tasks))
        if finished or state in FINAL:
            continue
        now = {"UNKNOWN": "may be queued or running", "PENDING": "is queued (PENDING)"
               }.get(state, f"is {state}")
        log.warning("job #%d (slurm job %s) %s and goes on without this command: watch it "
                    "with `squeue -j %s` (log: %s), cancel it with `scancel %s`", num,
                    job.job_id, now, job.job_id, run_dir(num) / "train.log", job.job_id)
