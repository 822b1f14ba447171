"""What a sweep submitted, kept in its directory: `submission.json` (each job's number, Slurm
job id, overrides and run directory), and each job's composed config in its run directory
(`.hydra/submitted.yaml`, with `.hydra/overrides.yaml`, so that summaries list a job before it
starts). `python -m app.status` and `python -m app.report` read them; the same command run
again with the same sweep directory reads them so as not to submit again a job that is still
queued or running, or that completed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from app.errors import RecordUnreadable
from app.files import write_text_atomically

RECORD = "submission.json"


def read(sweep_dir: Path) -> dict[str, Any]:
    """The sweep's record ({} when there is none); `RecordUnreadable` for one that cannot be read,
    which is not the same as none: its jobs may still be queued."""
    path = sweep_dir / RECORD
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise RecordUnreadable(f"{path} cannot be read ({e.strerror or e})") from e
    try:
        record = json.loads(data)  # (bytes: JSON's own encodings, and a ValueError if none)
    except ValueError as e:
        raise RecordUnreadable(f"{path} is not valid JSON ({e})") from e
    problem = _shape_problem(record)
    if problem:
        raise RecordUnreadable(f"{path} does not hold a sweep's record ({problem})")
    return record


# What each job of the record must have, as the launcher writes it (`write`).
_JOB_KEYS = {"num": int, "job_id": str, "overrides": list, "run_dir": str}


def _shape_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    jobs = record.get("jobs", [])
    if not isinstance(jobs, list):
        return "'jobs' is not a list"
    for i, job in enumerate(jobs):
        if not isinstance(job, dict):
            return f"job entry {i} is not an object"
        for key, kind in _JOB_KEYS.items():
            if not isinstance(job.get(key), kind) or isinstance(job.get(key), bool):
                return f"job entry {i} has no {kind.__name__} '{key}'"
    return None


def jobs_by_num(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {job["num"]: job for job in record.get("jobs", [])}  # (its shape: `read`)


def standing(record: dict[str, Any], overrides: dict[int, list[str]]) -> dict[int, tuple[str, str]]:
    """The jobs of this submission (num -> overrides) that an earlier one submitted with the
    same overrides and that need no new submission: still queued or running, or completed
    (their result.json says so). num -> (job id, state)."""
    from app import slurm
    from app.reporting.results import read_result
    from app.sweeps.dirs import same_job

    earlier = {num: job for num, job in jobs_by_num(record).items()
               if num in overrides and same_job(job.get("overrides"), overrides[num])
               and job.get("job_id")}
    if not earlier:
        return {}
    found = {num: (job["job_id"], "completed") for num, job in earlier.items()
             if read_result(Path(job["run_dir"])).get("status") == "completed"}
    known = slurm.states([job["job_id"] for num, job in earlier.items() if num not in found])
    for num, job in earlier.items():  # (Slurm does not answer: better twice than never)
        if num not in found and known is not None and known[job["job_id"]].active:
            found[num] = (job["job_id"], known[job["job_id"]].state)
    return found


def write(sweep_dir: Path, launcher: str, jobs: list[dict[str, Any]], wait: bool,
          submitit_folder: str) -> None:
    """Record the jobs of this submission; jobs of an earlier one that this one did not
    submit again (other numbers) stay in the record."""
    kept = jobs_by_num(read(sweep_dir)) | {job["num"]: job for job in jobs}
    write_text_atomically(sweep_dir / RECORD, json.dumps({
        "launcher": launcher, "wait": wait, "submitted": time.strftime("%Y-%m-%d %H:%M:%S"),
        "submitit_folder": submitit_folder, "jobs": [kept[num] for num in sorted(kept)]},
        indent=2) + "\n")


def keep_config(run_dir: Path, config: DictConfig) -> None:
    """The job's composed config (as submitted) and its overrides, in its run directory."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(config, hydra_dir / "submitted.yaml")
    overrides = hydra_dir / "overrides.yaml"
    if not overrides.exists():  # (Hydra writes it again when the job starts)
        OmegaConf.save(config.hydra.overrides.task, overrides)
