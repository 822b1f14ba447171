"""The local Slurm cluster of the tests (`make slurm-up`): a fixture that needs it, the
submitting command as a user types it, and what Slurm says of a job."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HELPERS = Path(__file__).resolve().parent

# Small resources: the emulated nodes share this machine's cores.
SLURM = ["launcher=slurm", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]


def cluster_up() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not found"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                                timeout=20).stdout.split()
    except subprocess.TimeoutExpired:
        return "sinfo did not answer"
    return None if states and set(states) <= {"idle", "mix", "alloc"} else f"nodes: {states}"


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    """Use it (pytest.mark.usefixtures) in tests that need the cluster."""
    problem = cluster_up()
    if problem is not None:
        message = f"no local Slurm cluster ({problem}): start one with `make slurm-up` (root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def command(sweep: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "app", *SLURM, f"hydra.sweep.dir={sweep}",
            "trainer.progress_bar=false", *overrides]


def submit(sweep: Path, *overrides: str, timeout: float = 600,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The submitting command (tests/helpers on PYTHONPATH, unless `env` says otherwise)."""
    return subprocess.run(command(sweep, *overrides), cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(HELPERS),
                                                **(env or {})})


def submit_in_background(sweep: Path, *overrides: str) -> subprocess.Popen:
    log = open(sweep.parent / f"{sweep.name}.log", "w")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(command(sweep, *overrides), cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ,
                                                           "PYTHONPATH": str(HELPERS)})


def job_ids(sweep: Path) -> list[str]:
    return sorted(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())


def job_field(job_id: str, name: str) -> str:
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                          text=True).stdout
    match = re.search(rf"\b{name}=(\S+)", text)
    return match.group(1) if match else ""


def final_state(job_id: str) -> str:
    """The job's state once Slurm has finished with it (results can come before that)."""
    wait_for(lambda: job_field(job_id, "JobState") not in ("RUNNING", "COMPLETING",
                                                             "PENDING", ""), 60, "job end")
    return job_field(job_id, "JobState")


def wait_for(predicate, timeout: float, what: str, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
