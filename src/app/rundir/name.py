"""The run directory's name, `${app_run_name:}` in conf/config.yaml.

Every rank of a torchrun or Slurm job composes the config itself; a name taken from the
clock would differ between ranks, so those get a name all of them derive alike.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from contextlib import suppress
from datetime import datetime
from pathlib import Path

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _parent_start_time() -> datetime | None:
    """When the parent process (torchrun's agent, shared by all ranks of a machine) started."""
    import psutil

    try:
        return datetime.fromtimestamp(psutil.Process(os.getppid()).create_time())
    except psutil.Error:
        return None


def run_name(env: Mapping[str, str] | None = None, now: datetime | None = None) -> str:
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:
        if run_id != "none" and not UUID.fullmatch(run_id):
            return f"torchrun/{run_id}"  # --rdzv-id, the same on every machine
        started = _parent_start_time() or now or datetime.now()
        return f"{started:%Y-%m-%d}/{started:%H-%M-%S-%f}"
    if "SLURM_STEP_NUM_TASKS" in env and int(env["SLURM_STEP_NUM_TASKS"]) > 1:
        # A requeued job keeps its id, so it finds its checkpoints again (resume=auto).
        return f"slurm/{env.get('SLURM_JOB_ID', 'job')}.{env.get('SLURM_STEP_ID', '0')}"
    now = now or datetime.now()
    return f"{now:%Y-%m-%d}/{now:%H-%M-%S-%f}"


def resume_hint(run_dir: Path) -> str:
    """How to resume a stopped run: a Slurm job that Slurm requeued resumes by itself; a job
    of a sweep (Hydra's multirun.yaml beside it) is resumed by the sweep's command with its
    sweep directory (on the same launcher, Slurm too), a single run by its run directory."""
    from app import slurm

    if slurm.requeued_since_start():
        return "Slurm has requeued the job (a failed node or a preemption): it resumes from it"
    if is_job_of_sweep(run_dir):
        return f"run the sweep's command again with hydra.sweep.dir={run_dir.parent} to resume"
    return f"run the same command again with hydra.run.dir={run_dir} to resume"


def is_job_of_sweep(run_dir: Path) -> bool:
    """Whether `run_dir` is a job of a sweep (Hydra's multirun.yaml beside it), not a run."""
    # (The Optuna sweeper writes no multirun.yaml; every job's hydra.yaml has its mode.)
    with suppress(OSError):
        if "mode: MULTIRUN" in (run_dir / ".hydra" / "hydra.yaml").read_text():
            return True
    return (run_dir.parent / "multirun.yaml").is_file()
