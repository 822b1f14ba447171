"""One command per run directory: a second one is refused in one line and writes nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from app.rundir.lock import RunDirInUse, RunLock, hold_as_worker
from conftest import REPO, TINY, multirun, read_metrics, run_app, wait_for_rows


def test_a_second_lock_on_a_run_directory_names_the_holder(tmp_path) -> None:
    first = RunLock(tmp_path)
    first.acquire()
    with pytest.raises(RunDirInUse, match=f"in use by another command "
                                          f"\\(pid {os.getpid()} on {socket.gethostname()}\\)"):
        RunLock(tmp_path).acquire()
    first.release()
    second = RunLock(tmp_path)
    second.acquire()  # free again once released
    assert second.held
    second.release()


def _forked(work) -> tuple[int, int]:
    """A forked child that runs `work`, says so, and lives until its pipe is closed: (pid, the
    pipe's write end, to close)."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the child: no pytest past this point)
        try:
            os.close(stop_w)
            os.close(ready_r)
            work()
            os.write(ready_w, b"x")
            os.read(stop_r, 1)
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(stop_r)
    assert os.read(ready_r, 1) == b"x"
    os.close(ready_r)
    return pid, stop_w


def _end(child: tuple[int, int]) -> None:
    os.close(child[1])
    os.waitpid(child[0], 0)


def test_a_forked_child_does_not_keep_the_run_lock(tmp_path) -> None:
    # A DataLoader worker, a fork-started rank: it must not hold the lock once its owner died.
    owner = RunLock(tmp_path)
    owner.acquire()
    child = _forked(lambda: None)
    try:
        owner.release()  # (the owner dies)
        after = RunLock(tmp_path)
        after.acquire(wait_s=0)  # the child alive, the lock free
        after.release()
    finally:
        _end(child)


def test_a_new_owner_waits_for_the_workers_of_the_previous_command(tmp_path) -> None:
    # Workers outlive their killed launcher by their stop checkpoint, and write meanwhile.
    child = _forked(lambda: hold_as_worker(tmp_path))
    try:
        with pytest.raises(RunDirInUse, match=f"still written by the workers of a previous "
                                              f"command \\(pid {child[0]} on "):
            RunLock(tmp_path).acquire(workers_wait_s=0.2)
        threading.Timer(0.5, _end, (child,)).start()  # the worker saves and ends
        owner = RunLock(tmp_path)
        owner.acquire()  # waits for it
        owner.release()
    finally:
        if child[1] >= 0:
            try:
                _end(child)
            except OSError:
                pass  # (ended by the timer)


def test_a_requeued_slurm_job_waits_for_the_lock_of_its_previous_run(tmp_path,
                                                                    monkeypatch) -> None:
    previous = RunLock(tmp_path)
    previous.acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    threading.Timer(0.5, previous.release).start()  # the previous run's process goes away
    requeued = RunLock(tmp_path)
    requeued.acquire()  # waits instead of failing
    assert requeued.held
    requeued.release()


def test_two_commands_on_one_run_directory_the_second_is_refused_and_writes_nothing(
        tmp_path) -> None:
    run_dir = tmp_path / "run"
    args = [*TINY, "trainer.max_epochs=1000"]
    first = subprocess.Popen([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *args],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_rows(run_dir, 3)  # the first one trains
        assert first.poll() is None
        hydra_files = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        second = run_app(run_dir, *args, "seed=7")
        assert second.returncode == 2, second.output[-3000:]
        assert "Traceback" not in second.output
        assert f"is in use by another command (pid {first.pid} on" in second.output
        assert not (run_dir / "result.json").exists()  # nothing recorded for the first one
        # The first one's record of its config is intact, and its log has no line of ours.
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == hydra_files
        log = (run_dir / "train.log").read_text()
        assert log.count("attempt started") == 1 and "in use by another" not in log
    finally:
        first.send_signal(signal.SIGKILL)  # the lock dies with its holder
        first.wait()
    rows = [(r["step"], r["split"]) for r in read_metrics(run_dir)]
    assert len(rows) == len(set(rows))  # no row written twice
    assert not (run_dir / "result.json").exists()
    after = RunLock(run_dir)
    after.acquire()  # free again: no stale lock after a SIGKILL
    after.release()


def test_a_refused_submitit_job_fails_its_task_and_leaves_the_run_alone(tmp_path) -> None:
    run_dir = tmp_path / "sweep" / "0"
    holder = RunLock(run_dir)  # another command runs there, and has recorded its end
    holder.acquire()
    record = b'{"status": "completed", "wall_s": 1.0, "error": null}\n'
    (run_dir / "result.json").write_bytes(record)
    try:
        proc, jobs = multirun(tmp_path, "hydra/launcher=submitit_local", *TINY)
    finally:
        holder.release()
    output = proc.stdout + proc.stderr
    # Before: the job returned NaN, its task exited 0, and the other's record passed it.
    assert "job #0" in output and "in use by another command" in output, output[-3000:]
    assert "failed" in output
    assert (run_dir / "result.json").read_bytes() == record
    assert not (run_dir / "train.log").exists() or "attempt started" not in (
        run_dir / "train.log").read_text()
