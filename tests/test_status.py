"""`python -m app.status`, in-process: what Slurm's answers mean, the line of each state a
job can be in, and what the run directories and a sweep's record say when Slurm no longer
lists a job (the commands on the cluster: tests/test_cluster_ops.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import slurm, status
from conftest import REPO
from hydra_plugins.app_submitit._dry_run import arrays


def _app_module(module: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_slurm_answers_are_read(monkeypatch) -> None:
    assert slurm._task_ids("0-3,7%2") == ["0", "1", "2", "3", "7"]
    assert slurm.minutes("UNLIMITED") is None
    assert [slurm.minutes(t) for t in ("60", "1:30:00", "2-00:00:00", "5:00")] == \
        [60, 90, 2880, 5]
    assert slurm.gpus("gpu:a100:8(S:0-1),gpu:2") == 10 and slurm.gpus("(null)") == 0
    # An array's task ids stay below MaxArraySize: 10 jobs with MaxArraySize=4.
    monkeypatch.setattr(slurm, "max_array_size", lambda: 4)
    assert arrays(list(range(10)), {"array_parallelism": 5}, True) == (
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], True, 4)
    assert arrays([3, 4], {}, False) == ([[3, 4]], False, None)


def _run_dir(tmp_path: Path, result: dict | None = None, steps: int = 0, total: int = 40,
             attempts: int = 1) -> Path:
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    lines = [f"[2026-12-03 10:00:0{a},000][app.sweeps.summary][INFO] - attempt started: pid 1"
             for a in range(attempts)]
    lines += [f"[2026-12-03 10:00:09,000][app.training.loop][INFO] - step {s}/{total} epoch 0: "
              f"loss 1.0 lr 1e-3" for s in range(1, steps + 1)]
    (run_dir / "train.log").write_text("\n".join(lines) + "\n")
    if steps:
        (run_dir / "metrics.csv").write_text(
            "step,epoch,split,loss,acc\n" + "".join(f"{s},0,val,1.0,0.{s}\n"
                                                   for s in range(1, steps + 1)))
    if result is not None:
        (run_dir / "result.json").write_text(json.dumps(result))
    return run_dir


def _checkpoints(run_dir: Path, steps: list[int], sharded: bool = False) -> None:
    """Periodic checkpoints by name (their content is not read), last.pt naming the newest as
    the app links it: a hard link to a file, a symbolic link to a sharded one's directory."""
    folder = run_dir / "checkpoints"
    folder.mkdir()
    for step in steps:
        path = folder / f"step-{step:08d}.pt"
        if sharded:
            path.mkdir()
            (path / ".metadata").write_bytes(b"index")
        else:
            path.write_bytes(b"weights")
    newest = folder / f"step-{max(steps):08d}.pt"
    if sharded:
        (folder / "last.pt").symlink_to(newest.name)
    else:
        os.link(newest, folder / "last.pt")


@pytest.mark.parametrize(("job", "files", "expected", "said"), [
    (slurm.Job("1_0", "PENDING", "JobHeldUser"), {}, "queued", "queued (held)"),
    (slurm.Job("1_0", "PENDING", "Resources"), {}, "queued", "queued (PENDING: Resources)"),
    (slurm.Job("1_0", "PENDING", "BeginTime", restarts=2), {"steps": 7}, "queued",
     "waiting to run again at step 7 of 40 (PENDING: BeginTime), requeued 2 time(s)"),
    (slurm.Job("1_0", "RUNNING", nodes="node2"), {"steps": 12}, "running",
     "running on node2 at step 12 of 40"),
    # (was "running on node2 at step 40 of 40", right after the submitter said "completed")
    (slurm.Job("1_0", "RUNNING", nodes="node2"),
     {"steps": 40, "result": {"status": "completed", "wall_s": 5}}, "completed",
     "completed: best val/acc 0.9, step 40 (Slurm is ending its job)"),
    (slurm.Job("1_0", "COMPLETING", nodes="node2", restarts=1),
     {"steps": 12, "result": {"status": "interrupted", "wall_s": 5}}, "running",
     "ending on node2 at step 12 of 40, requeued 1 time(s)"),
    (slurm.Job("1_0", "PREEMPTED"), {"steps": 3}, "queued",
     "preempted at step 3 of 40, waiting to run again"),
    (slurm.Job("1_0", "COMPLETED", restarts=1),
     {"steps": 9, "result": {"status": "completed", "wall_s": 5}, "attempts": 2}, "completed",
     "completed: best val/acc 0.9, step 9, 2 attempts, requeued 1 time(s)"),
    (slurm.Job("1_0", "FAILED", exit_code="1:0"),
     {"steps": 2, "result": {"status": "failed", "error": "RuntimeError: boom"}}, "failed",
     "FAILED: failed at step 2 of 40: RuntimeError: boom"),
    (slurm.Job("1_0", "CANCELLED"), {"steps": 4}, "cancelled", "cancelled at step 4 of 40"),
    (slurm.Job("1_0", "NODE_FAIL", exit_code="0:0"), {"steps": 4}, "failed",
     "NODE_FAIL: ended without a result at step 4 of 40"),
    (slurm.Job("1_0", "TIMEOUT", exit_code="0:15"), {}, "failed",
     "TIMEOUT: ended without a result"),
], ids=["held", "queued", "requeued-waiting", "running", "completed-ending", "completing",
        "preempted", "completed", "failed",
        "cancelled", "node-fail", "timeout"])
def test_each_slurm_state_is_one_line(tmp_path, job, files, expected, said) -> None:
    run_dir = _run_dir(tmp_path, files.get("result"), files.get("steps", 0),
                       attempts=files.get("attempts", 1))
    assert status.from_slurm(job, run_dir, None) == (expected, said)


def test_a_cancelled_run_is_at_the_step_of_its_stop_checkpoint(tmp_path) -> None:
    """A stop saves a checkpoint between logging steps: the run resumes from it, so that is
    where it stands (was "cancelled at step 4", the last logged step, for a stop at 6)."""
    run_dir = _run_dir(tmp_path, steps=4)
    _checkpoints(run_dir, [2, 6])
    assert status.from_slurm(slurm.Job("1_0", "CANCELLED"), run_dir, None) == (
        "cancelled", "cancelled at step 6 of 40")


@pytest.mark.parametrize("sharded", [False, True])
def test_a_requeued_job_is_said_to_run_again_from_its_last_checkpoint(tmp_path,
                                                                      sharded) -> None:
    # Logged to step 7, last checkpoint at step 5: steps 6 and 7 are trained again.
    run_dir = _run_dir(tmp_path, None, steps=7)
    _checkpoints(run_dir, [2, 5], sharded)
    waiting = slurm.Job("1_0", "PENDING", "BeginTime", restarts=1)
    assert status.from_slurm(waiting, run_dir, None) == (
        "queued", "waiting to run again from step 5 of 40 (its last checkpoint, logged to "
                  "step 7) (PENDING: BeginTime), requeued 1 time(s)")
    assert status.from_slurm(slurm.Job("1_0", "PREEMPTED"), run_dir, None) == (
        "queued", "preempted at step 7 of 40, waiting to run again from step 5")
    (run_dir / "checkpoints" / "last.pt").unlink()  # (a copy, or none: where the log ends)
    assert status.from_slurm(waiting, run_dir, None)[1].startswith(
        "waiting to run again at step 7 of 40")


def test_a_job_slurm_forgot_is_read_from_its_run_directory(tmp_path) -> None:
    assert status.from_run_dir(tmp_path / "none")[0] == "not started"
    run_dir = _run_dir(tmp_path, None, steps=5)
    assert status.from_run_dir(run_dir) == ("ended",
                                            "ended without a result at step 5 of 40 (killed?)")
    # Requeued by Slurm as it stopped (its record says so), the job no longer listed (no
    # accounting): it runs again by itself, not an interruption left to the user.
    requeued = _run_dir(tmp_path / "requeued", {"status": "requeued", "wall_s": 1.0}, steps=5)
    assert status.from_run_dir(requeued) == ("queued",
                                             "requeued at step 5 of 40, waiting to run again")
    (run_dir / ".run.lock").write_text(f"{__import__('os').getpid()} "
                                       f"{__import__('os').uname().nodename}\n")
    assert status.from_run_dir(run_dir) == ("running", f"running at step 5 of 40 (pid "
                                                       f"{__import__('os').getpid()})")


def test_status_of_a_run_directory_and_of_nothing(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, {"status": "completed", "wall_s": 1.0}, steps=3)
    done = _app_module("app.status", run_dir)
    assert done.returncode == 0 and "completed: best val/acc 0.3, step 3" in done.stdout
    (tmp_path / "empty").mkdir()
    nothing = _app_module("app.status", tmp_path / "empty")
    assert nothing.returncode == 2 and "neither a sweep directory" in nothing.stderr
    nowhere = _app_module("app.status", tmp_path / "nowhere")
    assert nowhere.returncode == 2 and "nowhere: no such folder" in nowhere.stderr


UNREADABLE_RECORDS = [
    (b'{"jobs": [{"num": 0, "job_id": "12', "is not valid JSON"),  # cut short
    (b"\xff\xfe{", "is not valid JSON"),  # not text
    (b'{"launcher": "slurm", "jobs": 5}', "'jobs' is not a list"),
    (b'{"launcher": "slurm", "jobs": [{"num": 0}]}', "job entry 0 has no str 'job_id'"),
    (b'{"jobs": [{"num": "0", "job_id": "1", "overrides": [], "run_dir": "x"}]}',
     "job entry 0 has no int 'num'"),
]


@pytest.mark.parametrize("content,words", UNREADABLE_RECORDS)
def test_an_unreadable_submission_record_is_named_by_status(tmp_path, capsys, content,
                                                            words) -> None:
    sweep = tmp_path / "sweep"
    job = _run_dir(tmp_path, {"status": "completed", "wall_s": 1.0}, steps=3)
    (job / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=0.1\n")
    sweep.mkdir()
    job.rename(sweep / "0")
    (sweep / "submission.json").write_bytes(content)
    assert status.main([str(sweep)]) == 0
    said = capsys.readouterr()
    assert words in said.err, said.err
    assert "the jobs are read from their run directories" in said.err
    assert "job #0: completed" in said.out


def test_status_lists_the_jobs_of_a_sweep_by_number(tmp_path, capsys) -> None:
    # (The sweep's summary ranks them best first; status goes by number, as submitted.)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for num, steps in ((0, 2), (1, 5), (2, 3)):  # job 1 is the best (val/acc 0.5)
        job = _run_dir(tmp_path / f"made{num}", {"status": "completed", "wall_s": 1.0},
                       steps=steps)
        (job / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n")
        job.rename(sweep / str(num))
    assert status.main([str(sweep)]) == 0
    jobs = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()[:3]]
    assert jobs == ["job #0", "job #1", "job #2"]


def test_status_json_gives_each_job_s_fields_and_the_exit_status(tmp_path, capsys) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    for num, result, steps in ((0, {"status": "completed", "wall_s": 1.0}, 3),
                               (1, {"status": "failed", "error": "RuntimeError: boom"}, 2)):
        job = _run_dir(tmp_path / f"made{num}", result, steps=steps)
        (job / ".hydra" / "overrides.yaml").write_text(f"- seed={num}\n- optimizer.lr=0.1\n")
        job.rename(sweep / str(num))
    assert status.main([str(sweep), "--json"]) == 1  # (as the text: a job failed)
    said = json.loads(capsys.readouterr().out)
    assert (said["path"], said["kind"], said["counts"]) == (str(sweep), "sweep",
                                                             {"completed": 1, "failed": 1})
    done, failed = said["jobs"]
    assert done == {"job": 0, "slurm_job_id": None, "status": "completed",
                    "detail": "completed: best val/acc 0.3, step 3", "step": 3,
                    "total_steps": 40, "overrides": ["seed=0", "optimizer.lr=0.1"],
                    "run_dir": str(sweep / "0")}
    assert (failed["status"], failed["detail"]) == ("failed",
                                                    "failed at step 2 of 40: RuntimeError: boom")
    # The text is printed from the same fields.
    assert status.main([str(sweep)]) == 1
    assert capsys.readouterr().out.splitlines()[:2] == [status.line(done), status.line(failed)]


def test_status_json_of_one_run_directory(tmp_path, capsys) -> None:
    run_dir = _run_dir(tmp_path, None, steps=5)
    assert status.main([str(run_dir), "--json"]) == 1  # (ended without a result)
    said = json.loads(capsys.readouterr().out)
    assert said["kind"] == "run" and said["counts"] == {"ended": 1}
    assert said["jobs"] == [{"job": None, "slurm_job_id": None, "status": "ended",
                             "detail": "ended without a result at step 5 of 40 (killed?)",
                             "step": 5, "total_steps": 40, "overrides": [],
                             "run_dir": str(run_dir)}]


def test_status_json_of_a_submitted_sweep_names_each_slurm_job(tmp_path, capsys,
                                                                monkeypatch) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "submission.json").write_text(json.dumps({"launcher": "slurm", "jobs": [
        {"num": 0, "job_id": "12_0", "overrides": ["seed=0", "hydra.job.name=x"],
         "run_dir": str(sweep / "0")}]}))
    monkeypatch.setattr(slurm, "states", lambda ids: {
        "12_0": slurm.Job("12_0", "PENDING", "Resources")})
    assert status.main([str(sweep), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert said["counts"] == {"queued": 1} and said["jobs"] == [
        {"job": 0, "slurm_job_id": "12_0", "status": "queued",
         "detail": "queued (PENDING: Resources)", "step": None, "total_steps": None,
         "overrides": ["seed=0"], "run_dir": str(sweep / "0")}]


def test_a_completed_run_names_its_slowest_rank_when_it_measured_it(tmp_path) -> None:
    run_dir = _run_dir(tmp_path, {"status": "completed", "wall_s": 1.0}, steps=3)
    assert "slowest" not in status.from_run_dir(run_dir)[1]
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "telemetry.json").write_text(
        '{"straggler": {"rank": 1, "host": "node2", "excess": 0.354}}')
    assert status.from_run_dir(run_dir) == (
        "completed", "completed: best val/acc 0.3, step 3; slowest rank 1 on node2 +35%")
