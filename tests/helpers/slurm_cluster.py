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


def _node_states(partition: str) -> list[str] | None:
    try:
        return subprocess.run(["sinfo", "-h", "-p", partition, "-o", "%t"], capture_output=True,
                              text=True, timeout=20).stdout.split()
    except subprocess.TimeoutExpired:
        return None


def cluster_up(partition: str = "debug", wait_s: float = 60) -> str | None:
    """None when the partition's nodes take jobs; else why not. A node that is completing a
    job, or coming back after a test took it down, is waited for (up to `wait_s`)."""
    if shutil.which("sinfo") is None:
        return "sinfo not found"
    deadline = time.monotonic() + wait_s
    while True:
        states = _node_states(partition)
        if states and set(states) <= {"idle", "mix", "alloc", "comp"}:
            return None
        if time.monotonic() > deadline:
            return "sinfo did not answer" if states is None else \
                f"partition {partition}: nodes {states or 'none'}"
        time.sleep(1)


@pytest.fixture(scope="module")
def slurm_cluster() -> None:
    """Use it (pytest.mark.usefixtures) in tests that need the cluster."""
    problem = cluster_up("debug") or cluster_up("faults")
    if problem is not None:
        message = f"no local Slurm cluster ({problem}): start one with `make slurm-up` (root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def admin_problem() -> str | None:
    """None when this user may change the cluster itself (take a node down, bring it back);
    else why not. Without an accounting database (this cluster has none) no AdminLevel can be
    granted: only root and the cluster's SlurmUser may."""
    if os.geteuid() == 0:
        return None
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                            timeout=20).stdout
    match = re.search(r"(?m)^SlurmUser\s*=\s*\S*\((\d+)\)", config)
    if match and int(match.group(1)) == os.geteuid():
        return None
    return (f"changing a node's state needs Slurm's administrator: root or SlurmUser "
            f"({match.group(0).split('=', 1)[1].strip() if match else 'unknown'}), not uid "
            f"{os.geteuid()}")


@pytest.fixture
def slurm_admin(slurm_cluster) -> None:
    """Use it in tests that change the cluster itself: they skip, saying why, for a user Slurm
    does not let do that (the cluster's jobs run for any user; its administration does not)."""
    problem = admin_problem()
    if problem is not None:
        pytest.skip(problem)


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


def _processes(job_id: str) -> dict[int, tuple[list[bytes], set[bytes]]]:
    """The processes of a job's tasks (the emulated nodes run on this machine): pid ->
    (command line, environment)."""
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            cmdline = (environ.parent / "cmdline").read_bytes().split(b"\0")
            env = set(environ.read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env:
            found[int(environ.parent.name)] = (cmdline, env)
    return found


def _step_daemons(job_id: str) -> list[int]:
    """The slurmstepd processes of a job's steps ("slurmstepd: [12.0]", "[12.batch]")."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(f"slurmstepd: [{job_id}.".encode()):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def task_pid(job_id: str, task: int) -> int | None:
    """The process of one task of a job."""
    for pid, (cmdline, env) in _processes(job_id).items():
        if (b"submitit.core._submit" in cmdline and not cmdline[0].endswith(b"srun")
                and f"SLURM_PROCID={task}".encode() in env):
            return pid
    return None


def release_requeued(job_id: str) -> None:
    """Start a requeued job now. Slurm holds it back for two minutes (BeginTime); an
    administrator may release it early, but not within the second of the requeue: the node
    would refuse the new start as one of the revoked run ("Job credential revoked") and the
    job would fail, nor while a process of that run is still ending ("Job already running,
    do not launch second copy": it is held). Repeated: an update made while the requeue
    completes can be lost."""
    wait_for(lambda: not _processes(job_id) and not _step_daemons(job_id), 60,
             "the requeued run's processes to end")
    time.sleep(2)

    def started() -> bool:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                       capture_output=True)
        return job_field(job_id, "JobState") != "PENDING"

    wait_for(started, 180, "the requeued job to start", every=2)
