"""Real jobs on the local Slurm cluster (`make slurm-up`): DDP, arrays, requeue, failures.

Outside CI, without a cluster, these skip with the reason; in CI (CI=true) they fail instead.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    HELPERS,
    REPO,
    TINY,
    assert_same_weights,
    check_summary,
    load_state,
    read_metrics,
    run_job,
)

sys.path.insert(0, str(HELPERS))
from slurm_cluster import command as _command  # noqa: E402
from slurm_cluster import (  # noqa: E402
    final_state,
    job_field,
    job_ids,
    release_requeued,
    slurm_cluster,  # noqa: F401 (the module's fixture: needs the cluster)
    submit,
    submit_in_background,
    task_pid,
)
from slurm_cluster import wait_for as _wait_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_one_node_two_tasks_reach_the_accuracy_bar(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    _ok(submit(sweep, "devices=2"))
    run_dir = sweep / "0"
    assert load_state(run_dir / "checkpoints" / "best.pt")["best"] >= 0.97
    for rank in (0, 1):
        assert f"rank {rank} of 2 from slurm" in (run_dir / "logs" / f"rank{rank}.log"
                                                   ).read_text()
    (job,) = job_ids(sweep)
    assert job_field(job, "NumTasks") == "2" and final_state(job) == "COMPLETED"


def test_two_nodes_one_task_each(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    _ok(submit(sweep, "nodes=2", "devices=1", *TINY, "trainer.max_epochs=2"))
    (job,) = job_ids(sweep)
    assert job_field(job, "NumNodes") == "2" and job_field(job, "NodeList") == "node[1-2]"
    rank1 = (sweep / "0" / "logs" / "rank1.log").read_text()
    # 11 steps per epoch on 2 ranks
    assert "rank 1 of 2 from slurm" in rank1 and "done: step 22" in rank1


def test_sweep_is_a_job_array_and_returns_both_results(tmp_path) -> None:
    sweep, record = tmp_path / "sweep", tmp_path / "returns.jsonl"
    _ok(submit(sweep, "optimizer.lr=0.01,0.003", *TINY, "trainer.max_epochs=1",
               "+hydra.callbacks.record._target_=recorder.Recorder",
               f"+hydra.callbacks.record.path={record}"))
    assert len({j.split("_")[0] for j in job_ids(sweep)}) == 1  # one array: 7_0, 7_1
    # The array's jobs run side by side and end in any order.
    jobs = sorted((json.loads(line) for line in record.read_text().splitlines()),
                  key=lambda j: j["num"])
    assert [j["num"] for j in jobs] == [0, 1]
    for num, job in enumerate(jobs):
        best = max(float(r["acc"]) for r in read_metrics(sweep / str(num)) if r["split"] == "val")
        assert job["status"] == "COMPLETED" and job["value"] == best
    check_summary(sweep, 2)


def test_preempted_job_requeues_and_finishes_bit_identical(tmp_path) -> None:
    overrides = ["devices=2", *TINY, "trainer.max_epochs=8", "trainer.ckpt_every_n_epochs=null"]
    sweep = tmp_path / "preempted"
    uri = f"sqlite:///{tmp_path}/mlflow.db"  # (the job's MLflow run survives the requeue)
    proc = submit_in_background(sweep, *overrides, "logger=mlflow", f"logger.mlflow_uri={uri}",
                                "logger.wandb=true", "logger.wandb_mode=offline")
    metrics = sweep / "0" / "metrics.csv"
    _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) > 40, 300,
              "training to start")
    (job,) = job_ids(sweep)
    # What Slurm sends before a time limit (--signal=USR2@...), or a preemption through submitit.
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    # The same training uninterrupted, its two ranks spawned here (ranks compute the same
    # whoever starts them), while the job requeues (after the signal: before it, the job
    # could finish while this ran).
    reference = run_job(tmp_path / "reference", *overrides).run_dir
    _wait_for(lambda: job_field(job, "Restarts") == "1"
              and job_field(job, "JobState") == "PENDING", 120, "the job to requeue itself")
    # (was "interrupted": app.report and the summary listed the job as stopped for good)
    assert json.loads((sweep / "0" / "result.json").read_text())["status"] == "requeued"

    release_requeued(job)
    assert proc.wait(timeout=600) == 0, (sweep.parent / "preempted.log").read_text()[-3000:]
    log = (sweep / "0" / "train.log").read_text()
    resumed_at = int(re.search(r"resumed from \S+last\.pt at step (\d+)", log).group(1))
    assert 0 < resumed_at < 8 * 11
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        sweep / "0" / "checkpoints" / "last.pt")
    assert read_metrics(sweep / "0") == read_metrics(reference)
    _one_mlflow_run_without_gaps(uri, sweep / "0")
    from wandb_files import offline_runs  # (tests/helpers)

    attempts = offline_runs(sweep / "0")  # one W&B run, its steps going on after the requeue
    assert len(attempts) == 2 and attempts[0]["id"] == attempts[1]["id"]
    steps = [row["_step"] for a in attempts for row in a["history"] if "train/loss" in row]
    assert steps == [int(r["step"]) for r in read_metrics(sweep / "0") if r["split"] == "train"]


def _one_mlflow_run_without_gaps(uri: str, run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient  # (an optional extra: make install has it)

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("app").experiment_id])
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
    assert steps == [int(r["step"]) for r in read_metrics(run_dir) if r["split"] == "train"]


def test_a_failing_rank_fails_the_job_promptly(tmp_path) -> None:
    """Rank 0 is ended with the job (srun's kill-on-bad-exit), not by its collective's
    600 s timeout: the command returns well within it (a hang guard, not a measured time)."""
    sweep = tmp_path / "sweep"
    result = submit(sweep, "devices=2", *TINY, "model._target_=faults.FaultyCNN",
                    "+model.fault=raise", "distributed.timeout_s=600", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "RuntimeError: injected fault" in output and "job #0" in output
    (job,) = job_ids(sweep)
    assert final_state(job) == "FAILED"
    # The run's own record names the cause, not the collective it broke on rank 0.
    error = json.loads((sweep / "0" / "result.json").read_text())["error"]
    assert "rank 1 failed: RuntimeError: injected fault" in error, error
    with open(sweep / "summary.csv", newline="") as f:
        assert "rank 1 failed: RuntimeError: injected fault" in next(csv.DictReader(f))["error"]
    rank0 = (sweep / "0" / "logs" / "rank0.log").read_text().lower()
    assert "timed out" not in rank0 and "timeout" not in rank0.replace("timeout_s", "")


def test_an_invalid_config_submits_nothing(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    result = submit(sweep, "optimizer.lr=0.1,-1", *TINY)  # the second job is invalid
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "optimizer.lr=-1" in output and "nothing was submitted" in output
    assert not (sweep / ".submitit").exists()


def test_sweeping_the_topology_is_refused(tmp_path) -> None:
    result = submit(tmp_path / "sweep", "devices=1,2", *TINY)
    assert result.returncode == 2 and "submit one sweep per value" in result.stderr + result.stdout
    assert not (tmp_path / "sweep" / ".submitit").exists()


def test_queued_job_runs_the_config_as_submitted(tmp_path) -> None:
    user_conf = tmp_path / "conf" / "model"
    user_conf.mkdir(parents=True)
    yaml = user_conf / "mutable.yaml"
    yaml.write_text("_target_: app.models.CNN\nchannels: [8, 16]\n")
    sweep = tmp_path / "sweep"
    proc = submit_in_background(
        sweep, f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mutable",
        "trainer.max_epochs=1", "+hydra.launcher.additional_parameters.hold=true")
    _wait_for(lambda: (sweep / ".submitit").is_dir() and job_ids(sweep), 120, "submission")
    (job,) = job_ids(sweep)
    _wait_for(lambda: job_field(job, "JobState") == "PENDING", 60, "the held job")
    yaml.write_text("_target_: app.models.CNN\nchannels: [4]\n")  # edited while queued
    subprocess.run(["scontrol", "release", job], check=True)
    assert proc.wait(timeout=600) == 0, (sweep.parent / "sweep.log").read_text()[-3000:]
    state = load_state(sweep / "0" / "checkpoints" / "last.pt")
    assert state["config"]["model"]["channels"] == [8, 16]


# Jobs that end without a result from every task, and the submitting command's last words.


def _watch(sweep: Path, *overrides: str) -> tuple[subprocess.Popen, Path]:
    """The submitting command in the background, as a user's terminal runs it (Ctrl-C
    raises KeyboardInterrupt even where this test's own runner ignores SIGINT)."""
    log = sweep.parent / f"{sweep.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            _command(sweep, *overrides), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(HELPERS)},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, log


def _one_job(sweep: Path) -> str:
    _wait_for(lambda: (sweep / ".submitit").is_dir() and job_ids(sweep), 120, "the submission")
    (job,) = job_ids(sweep)
    return job


def _end(proc: subprocess.Popen, sweep: Path) -> None:
    """No job and no submitting command outlives its test."""
    if (sweep / ".submitit").is_dir():
        subprocess.run(["scancel", *{j.split("_")[0] for j in job_ids(sweep)}])
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_job_cancelled_in_the_queue_ends_the_command(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    proc, log = _watch(sweep, *TINY, "+hydra.launcher.additional_parameters.hold=true")
    try:
        job = _one_job(sweep)
        subprocess.run(["scancel", job], check=True)
        assert proc.wait(timeout=120) == 1  # submitit alone waits forever: its state is UNKNOWN
        output = log.read_text()
        assert f"job #0 (slurm job {job}) CANCELLED: no result from task 0" in output
        assert "job #0 cancelled" in output  # the summary lists it, with no run of its own
        # (sacct fails on every poll of a cluster without accounting: none of it is said)
        assert "accounting storage is disabled" not in output, output
    finally:
        _end(proc, sweep)


def test_a_killed_task_fails_the_job_naming_the_task_and_signal(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    proc, log = _watch(sweep, "devices=2", *TINY, "trainer.max_epochs=60",
                       "hydra.launcher.max_num_failures=0")  # (else it is requeued)
    try:
        job = _one_job(sweep)
        _wait_for(lambda: task_pid(job, 1) is not None, 120, "task 1 to start")
        os.kill(task_pid(job, 1), signal.SIGKILL)
        assert proc.wait(timeout=120) == 1, log.read_text()[-3000:]
        assert f"job #0 (slurm job {job}) FAILED in task 1: killed by SIGKILL" in log.read_text()
        assert final_state(job) == "FAILED"
    finally:
        _end(proc, sweep)


def test_a_failing_single_task_job_is_failed(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    result = submit(sweep, "trainer=eval", "ckpt=/nonexistent", timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    (job,) = job_ids(sweep)
    assert (f"job #0 (slurm job {job}) failed in task 0: UserError: checkpoint /nonexistent: "
            "file not found") in output
    assert final_state(job) == "FAILED"  # not COMPLETED: the task exited non-zero


@pytest.mark.parametrize("sig, said", [(signal.SIGINT, "SIGINT (Ctrl-C)"),
                                       (signal.SIGTERM, "SIGTERM")])
def test_ctrl_c_or_sigterm_names_the_jobs_that_go_on(tmp_path, sig, said) -> None:
    """SIGTERM (a closed session, `kill`) ended the command silently before."""
    sweep = tmp_path / "sweep"
    proc, log = _watch(sweep, *TINY, "optimizer.lr=0.01,0.003",
                       "+hydra.launcher.additional_parameters.hold=true")
    try:
        _wait_for(lambda: "waiting for the results" in log.read_text(), 120, "the submission")
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
        output = log.read_text()
        assert "Traceback" not in output, output
        assert f"stopped by {said}: the waiting ended, not the jobs" in output
        array = [j for j in job_ids(sweep) if "_" in j]  # beside the folder of the array's script
        assert len(array) == 2
        for num, job in enumerate(array):
            assert (f"job #{num} (slurm job {job}) is queued (PENDING) and goes on without this "
                    f"command: watch it with `squeue -j {job}` (log: {sweep / str(num)}"
                    f"/train.log), cancel it with `scancel {job}`") in output
            assert job_field(job, "JobState") == "PENDING"  # untouched
    finally:
        _end(proc, sweep)


def test_a_job_slurm_no_longer_lists_has_ended() -> None:
    """After MinJobAge the controller forgets a finished job: squeue no longer lists it."""
    from hydra_plugins.app_submitit._slurm_states import SlurmStates

    watcher = SlurmStates()
    watcher.register_job("99999999")  # never submitted here
    assert watcher.get_state("99999999", mode="force") == "GONE"
    assert watcher.is_done("99999999", mode="cache")


def test_srun_reports_name_tasks_and_signals(tmp_path) -> None:
    from app.sweeps.job_end import srun_failures

    batch_log = tmp_path / "7_0_log.err"
    batch_log.write_text("srun: error: node1: task 1: Killed\n"
                         "srun: launch/slurm: _step_signal: Terminating StepId=7.0\n"
                         "srun: error: node2: tasks 2-3: Segmentation fault (core dumped)\n"
                         "srun: error: node1: task 0: Exited with exit code 143\n")
    assert srun_failures(batch_log) == [(1, "killed by SIGKILL"), (2, "killed by SIGSEGV"),
                                        (0, "exit code 143 (SIGTERM)")]
