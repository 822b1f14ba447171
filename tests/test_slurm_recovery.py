"""Recovery of Slurm jobs from transient faults: a task killed by a signal, a node that fails.
The job is requeued, resumes from last.pt and ends with the weights of an uninterrupted run,
bit for bit; an exception stays a failure (test_slurm). The decision itself is tested
in-process; the rest on the local cluster (`make slurm-up`)."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import HELPERS, REPO, TINY, assert_same_weights, read_metrics, run_job
from hydra_plugins.app_submitit._recover import check_restarts, decide

sys.path.insert(0, str(HELPERS))
from slurm_cluster import (  # noqa: E402
    job_field,
    job_ids,
    release_requeued,
    slurm_admin,  # noqa: F401 (the fixture: needs Slurm's administrator)
    slurm_cluster,  # noqa: F401 (the module's fixture: needs the cluster)
    submit_in_background,
    task_pid,
    wait_for,
)

on_the_cluster = pytest.mark.usefixtures("slurm_cluster")

# Three ranks (where the order of adding their gradients shows: tests/test_three_ranks.py), 8
# epochs of 7 steps, a checkpoint after each: long enough to be hit in the middle. Each step
# slowed by 50 ms (faults.FaultyCNN, same numbers): a job on an idle machine trains 56 steps
# in about a second, less than the test needs to act on it mid-training.
TRAINING = ["devices=3", *TINY, "trainer.max_epochs=8", "trainer.ckpt_every_n_epochs=1",
            "model._target_=faults.FaultyCNN", "+model.fault=slow"]


# -- in-process: when a job is requeued ----------------------------------------------------------

@pytest.mark.parametrize("status, errors, failures, state, restarts, requeued", [
    (137, 0, 0, "RUNNING", 0, "a task ended by signal 9"),  # SIGKILL (the OOM killer)
    (139, 0, 2, "COMPLETING", 0, "a task ended by signal 11"),  # a crash, third time
    (0, 0, 0, "RUNNING", 0, None),  # it ended well
    (1, 1, 0, "RUNNING", 0, None),  # the user's code raised: a failure
    (137, 1, 0, "RUNNING", 0, None),  # one task raised, srun killed the others
    (137, 0, 3, "RUNNING", 0, None),  # failed as often as allowed
    (143, 0, 0, "CANCELLED", 0, None),  # scancel: the user's signal
    (143, 0, 0, "RUNNING", 1, None),  # Slurm requeued it already (a preemption, a time limit)
])
def test_which_endings_requeue_the_job(status, errors, failures, state, restarts,
                                       requeued) -> None:
    assert decide(status, errors, failures, 3, state, restarts, 0) == requeued


class _Job:  # what died_by_signal reads of a submitit job: the batch script's log
    def __init__(self, log: Path) -> None:
        self.log = log

    def task(self, _: int) -> SimpleNamespace:
        return SimpleNamespace(paths=SimpleNamespace(stderr=self.log))


RAISED = ("error", "RuntimeError: ... Connection closed by peer")


@pytest.mark.parametrize("report, results, killed", [
    # Three ranks, task 1 killed: task 2 raised in its next collective before srun killed it.
    ("srun: error: node1: task 1: Killed\nsrun: error: node1: tasks 0,2: Killed\n",
     [None, None, RAISED], True),
    ("srun: error: node1: task 2: Exited with exit code 1\nsrun: error: node1: tasks 0-1: "
     "Killed\n", [None, None, RAISED], False),  # task 2 raised first: a failure
    ("", [None, ("success", 0.9)], True),  # the batch script went with its node
    ("", [RAISED, None], False),
])
def test_a_job_died_by_signal_when_its_first_ended_task_was_killed(tmp_path, report, results,
                                                                    killed) -> None:
    from app.sweeps.job_end import died_by_signal

    (tmp_path / "log.err").write_text(report)
    assert died_by_signal(_Job(tmp_path / "log.err"), results) is killed


def test_a_job_restarted_too_often_is_refused(monkeypatch) -> None:
    from app.errors import JobFailed

    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    check_restarts(3, 2)  # 3 timeouts and 2 node failures may happen
    monkeypatch.setenv("SLURM_RESTART_COUNT", "6")
    with pytest.raises(JobFailed, match="restarted 6 times"):
        check_restarts(3, 2)
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    check_restarts(0, 0)  # a first run


# -- on the cluster ------------------------------------------------------------------------------

def _ends_like_the_reference(proc: subprocess.Popen, sweep: Path, reference: Path) -> str:
    log = (sweep.parent / f"{sweep.name}.log").read_text
    assert proc.wait(timeout=600) == 0, log()[-3000:]
    assert log().count("was requeued (restart 1; its log says why)") == 1, log()[-3000:]
    train_log = (sweep / "0" / "train.log").read_text()
    resumed_at = int(re.search(r"resumed from \S+last\.pt at step (\d+)", train_log).group(1))
    assert 0 < resumed_at < 8 * 7
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        sweep / "0" / "checkpoints" / "last.pt")
    assert read_metrics(sweep / "0") == read_metrics(reference)
    return log()


def _started(sweep: Path, proc: subprocess.Popen) -> str:
    metrics = sweep / "0" / "metrics.csv"

    def trained() -> bool:
        if proc.poll() is not None:  # (the waiting command ended: why, at once, not in 300 s)
            raise AssertionError((sweep.parent / f"{sweep.name}.log").read_text()[-3000:])
        return metrics.is_file() and len(metrics.read_text().splitlines()) > 30

    wait_for(trained, 300, "training to pass its third epoch")
    (job,) = job_ids(sweep)
    return job


@on_the_cluster
def test_a_task_killed_by_a_signal_is_requeued_and_ends_bit_identical(tmp_path) -> None:
    sweep = tmp_path / "killed"
    proc = submit_in_background(sweep, *TRAINING)
    try:
        job = _started(sweep, proc)
        os.kill(task_pid(job, 1), signal.SIGKILL)  # as the OOM killer does
        reference = run_job(tmp_path / "reference", *TRAINING).run_dir
        wait_for(lambda: job_field(job, "Restarts") == "1"
                 and job_field(job, "JobState") == "PENDING", 120, "the job to be requeued")
        waiting = subprocess.run([sys.executable, "-m", "app.status", str(sweep)], cwd=REPO,
                                 capture_output=True, text=True, timeout=60).stdout
        assert "waiting to run again" in waiting and "requeued 1 time" in waiting, waiting
        release_requeued(job)
        _ends_like_the_reference(proc, sweep, reference)
        assert "a task ended by signal 9: requeued (1 of hydra.launcher.max_num_failures=3)" \
            in (sweep / ".submitit" / job / f"{job}_0_log.err").read_text()
        with open(sweep / "summary.csv", newline="") as f:
            (row,) = csv.DictReader(f)
        assert (row["status"], row["attempts"]) == ("completed", "2"), row
    finally:
        subprocess.run(["scancel", *job_ids(sweep)] if (sweep / ".submitit").is_dir() else
                       ["true"])
        if proc.poll() is None:
            proc.kill()


@on_the_cluster
@pytest.mark.usefixtures("slurm_admin")  # (taking a node down: root's, as `make slurm-up`)
def test_a_job_whose_node_fails_is_requeued_and_ends_bit_identical(tmp_path) -> None:
    # On node3, alone in partition faults: taking it down touches no other test's job.
    sweep = tmp_path / "node-down"
    proc = submit_in_background(sweep, *TRAINING, "hydra.launcher.partition=faults")
    node = ""
    try:
        job = _started(sweep, proc)
        node = job_field(job, "NodeList")
        assert node == "node3", node
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down",
                        "reason=app-test"], check=True)
        reference = run_job(tmp_path / "reference", *TRAINING).run_dir
        wait_for(lambda: job_field(job, "Restarts") == "1"
                 and job_field(job, "JobState") == "PENDING", 120, "the job to be requeued")
        release_requeued(job)
        # (on node3 again: ReturnToService=2 brings back a node that answers, as this
        # emulated one does at once)
        _ends_like_the_reference(proc, sweep, reference)
        stopped = re.search(r"stopped by signal SIGTERM at step \d+; checkpoint saved: (.*)",
                            (sweep / "0" / "train.log").read_text())
        assert stopped and stopped.group(1) == "Slurm has requeued the job (a failed node or " \
            "a preemption): it resumes from it", stopped and stopped.group(0)
    finally:
        if node:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"],
                           capture_output=True)  # (refused when it is back already)
        subprocess.run(["scancel", *job_ids(sweep)] if (sweep / ".submitit").is_dir() else
                       ["true"])
        if proc.poll() is None:
            proc.kill()
