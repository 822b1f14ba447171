"""A failure anywhere ends the whole job promptly, says where, and leaves no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from app.errors import WorkerFailed
from conftest import (
    HELPERS,
    REPO,
    TINY,
    alive,
    assert_ok,
    assert_same_weights,
    load_state,
    read_metrics,
    run_app,
    run_job,
    still_alive,
    wait_for_rows,
    worker_pids,
)

FAULTY = [*TINY, "devices=2", "model._target_=faults.FaultyCNN", "distributed.timeout_s=5"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(HELPERS)})


def test_a_failing_rank_ends_the_job_in_one_line(tmp_path) -> None:
    # Through the CLI: the console has one line, the rank's traceback is in its own log.
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *FAULTY, "+model.fault=raise")
    output, _ = proc.communicate(timeout=120)  # (without the fault handling: never)
    assert proc.returncode == 1, output[-3000:]
    assert "rank 1 failed: RuntimeError: injected fault" in output, output[-3000:]
    assert "Traceback" not in output
    rank_log = (run_dir / "logs" / "rank1.log").read_text()
    assert "Traceback" in rank_log and "injected fault" in rank_log
    pids = worker_pids(run_dir)
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_a_user_error_on_one_rank_exits_2_as_it_does_with_one_process(tmp_path) -> None:
    # (Rank 0 fails too, in its next collective: the cause is rank 1's, and its status.)
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *FAULTY, "+model.fault=user_error")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output[-3000:]
    assert "rank 1 failed: UserError: injected bad input" in output, output[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "UserError: injected bad input" in result["error"]


def test_a_failure_of_rank_0_leaves_no_store_warnings_on_the_console(tmp_path) -> None:
    # Rank 0 serves the store: the other rank's watchdog kept calling it once it was gone,
    # and each call printed a C++ warning with its stack (some 15 lines a second).
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *FAULTY, "+model.fault=user_error", "+model.fault_rank=0")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, output[-3000:]
    assert "rank 0 failed: UserError: injected bad input" in output, output[-3000:]
    assert "TCPStore" not in output and "frame #" not in output, output[-3000:]


@pytest.mark.parametrize("fault,words", [
    ("kill", ["rank 1 (pid", "killed by SIGKILL"]),
    ("hang", ["distributed.timeout_s=5", "rank(s) 1 did not exit"]),
])
def test_a_rank_that_dies_or_hangs_ends_the_job(fault, words, tmp_path) -> None:
    # The workers spawned from this process (the launcher's code, not its console, is the
    # subject); WorkerFailed is the CLI's exit status 1 (tests/test_error_types.py).
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerFailed) as failed:
        run_job(run_dir, *FAULTY, f"+model.fault={fault}", user_code=HELPERS)
    for word in words:
        assert word in str(failed.value), str(failed.value)
    pids = worker_pids(run_dir)
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_exact(tmp_path) -> None:
    overrides = [*TINY, "devices=2", "trainer.max_epochs=6", "trainer.ckpt_every_n_epochs=null"]
    run_dir = tmp_path / "interrupted"
    proc = _start(run_dir, *overrides)
    wait_for_rows(run_dir, 30)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "Traceback" not in output
    stopped_at = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    assert 0 < stopped_at < 6 * 11
    # (Rank 0 once took rank 1's stop, recorded a moment earlier, for a failure: "no
    # checkpoint was saved at the stop" although both had saved.)
    assert f"stopped by SIGTERM; the workers saved a checkpoint at step {stopped_at}" in \
        output, output[-3000:]
    assert not [p for p in worker_pids(run_dir) if alive(p)]

    resumed = _start(run_dir, *overrides)  # resume=auto: the same command again
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert f"at step {stopped_at}" in output
    reference = run_job(tmp_path / "reference", *overrides).run_dir  # (uninterrupted)
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        run_dir / "checkpoints" / "last.pt")
    assert read_metrics(run_dir) == read_metrics(reference)


def test_sigterm_to_one_worker_is_a_stop_with_a_checkpoint_not_a_failure(tmp_path) -> None:
    # (A cluster agent or a user may signal one process of the job, not its launcher.)
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *TINY, "devices=2", "trainer.max_epochs=400")
    wait_for_rows(run_dir, 10)
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped_at = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    assert f"stopped by SIGTERM sent to a worker; the workers saved a checkpoint at step " \
           f"{stopped_at}" in output, output[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "interrupted"


def test_sigterm_before_training_records_the_run_as_interrupted(tmp_path) -> None:
    # (It ended the process at once: no line, no result.json; app.status said "killed?".)
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc = _start(run_dir, *TINY, "data._target_=faults.SlowDigits", "+data.setup_s=60",
                  f"+data.marker={marker}")
    for _ in range(600):
        if marker.exists() or proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    assert json.loads((run_dir / "result.json").read_text())["status"] == "interrupted"
    again = _start(run_dir, *TINY, "trainer.max_steps=2")  # the run's lock is free
    output, _ = again.communicate(timeout=120)
    assert again.returncode == 0, output[-3000:]


def test_ctrl_c_stops_every_process_with_a_checkpoint(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "devices=2",
         "trainer.max_epochs=50"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)  # its own process group, as a terminal's foreground job
    wait_for_rows(run_dir, 10)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "stopped by SIGINT" in output and "Traceback" not in output
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] > 0
    assert not [p for p in worker_pids(run_dir) if alive(p)]


def _pid_of_rank(run_dir: Path, rank: int) -> int:
    log = (run_dir / "logs" / f"rank{rank}.log").read_text()
    return int(re.search(rf"rank {rank} of \d+: pid (\d+)", log)[1])


def _stop_with_rank_1_stopped(run_dir: Path, *overrides: str) -> tuple[int, str, list[Path]]:
    """SIGSTOP rank 1, then SIGTERM the launcher: its exit code and output, and the
    checkpoints there were before."""
    proc = _start(run_dir, *TINY, "devices=2", "trainer.max_epochs=400", *overrides)
    wait_for_rows(run_dir, 30)  # past the checkpoint of epoch 1
    os.kill(_pid_of_rank(run_dir, 1), signal.SIGSTOP)
    before = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert not [p for p in worker_pids(run_dir) if alive(p)]
    assert "Traceback" not in output
    return proc.returncode, output, before


def test_a_stop_that_a_stopped_rank_blocks_says_that_no_checkpoint_was_saved(tmp_path) -> None:
    run_dir = tmp_path / "run"
    code, output, before = _stop_with_rank_1_stopped(
        run_dir, "distributed.stall_timeout_s=null", "distributed.timeout_s=10")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    # None written at the stop. A periodic checkpoint (an epoch's end) may still have been
    # written after `before` was listed (the background writer, slow under load; it failed
    # a fresh `make test` once): none at another step.
    after = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    per_epoch = int(re.search(r"(\d+) steps/epoch",
                              (run_dir / "logs" / "rank0.log").read_text())[1])
    assert all(int(p.stem.split("-")[1]) % per_epoch == 0 for p in set(after) - set(before))
    # (Rank 0 fails its collective at timeout_s and reports it; under heavy load it may not
    # before the launcher's deadline, and is then named too.)
    assert re.search(r"stopped by SIGTERM, but no checkpoint was saved at the stop "
                     r"\(rank\(s\) (0, )?1 did not stop", output), output[-3000:]
    # (That later periodic checkpoint, where there is one, is the last: CI saw one.)
    assert f"the last checkpoint is checkpoints/{after[-1].name}" in output, output[-3000:]
    assert "saved a checkpoint" not in output


def test_a_stop_with_a_stopped_rank_reports_what_was_saved(tmp_path) -> None:
    # The stall watchdog wakes the stopped rank to write its stacks (SIGCONT): the stop may
    # then complete with a checkpoint, or not. Either way the launcher says which.
    run_dir = tmp_path / "run"
    code, output, before = _stop_with_rank_1_stopped(run_dir, "distributed.stall_timeout_s=5")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    saved = re.search(r"stopped by SIGTERM; the workers saved a checkpoint at step (\d+)", output)
    after = sorted((run_dir / "checkpoints").glob("step-*.pt"))
    if saved:
        assert after[-1].name == f"step-{int(saved[1]):08d}.pt" and after != before
    else:
        assert "stopped by SIGTERM, but no checkpoint was saved at the stop" in output, output
        # A periodic checkpoint (an epoch's end) may still have been written after `before`
        # was listed (the background writer, slow under load); none at another step.
        per_epoch = int(re.search(r"(\d+) steps/epoch",
                                  (run_dir / "logs" / "rank0.log").read_text())[1])
        assert all(int(p.stem.split("-")[1]) % per_epoch == 0 for p in set(after) - set(before))


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_killed_worker_server_ends_the_workers_in_one_line(tmp_path) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    with open(out, "w") as sink:  # (a pipe would wait for workers that outlive the launcher)
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "devices=2",
             "trainer.max_epochs=400"], cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    wait_for_rows(run_dir, 10)
    server = _parent(_pid_of_rank(run_dir, 0))
    assert server != proc.pid and _parent(server) == proc.pid  # the forkserver
    os.kill(server, signal.SIGKILL)
    proc.wait(timeout=240)
    workers = worker_pids(run_dir)
    assert len(workers) == 2 and not [p for p in workers if alive(p)]  # none prints after
    output = out.read_text()
    assert proc.returncode == 1, output[-3000:]
    assert f"the worker server (forkserver) (pid {server}) was killed by SIGKILL: the " \
           f"workers were stopped" in output, output[-3000:]
    assert "exit codes" not in output and "Traceback" not in output


@pytest.mark.parametrize("devices", ["devices=1", "devices=2"])
def test_a_sigterm_after_the_run_completed_leaves_it_completed(tmp_path, devices) -> None:
    run_dir = tmp_path / "run"
    # (the helper callback keeps the process 5 s after its job: the window to signal it in)
    proc = _start(run_dir, *TINY, devices, "trainer.max_epochs=1",
                  "+hydra.callbacks.linger._target_=linger.Linger",
                  "+hydra.callbacks.linger.seconds=5")
    result = run_dir / "result.json"
    while proc.poll() is None and not result.is_file():
        time.sleep(0.01)
    assert json.loads(result.read_text())["status"] == "completed"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert json.loads(result.read_text())["status"] == "completed"
    assert "SIGTERM arrived after the run had completed: nothing was stopped" in output


FINALIZING = """
import sys, time
from app.signals import stop_signals_stop_nothing
stop_signals_stop_nothing()
class Slow:  # a module global: its __del__ runs as the interpreter finalizes
    def __del__(self):
        print("finalizing", flush=True)
        time.sleep(2)
slow = Slow()
"""


def test_a_signal_while_the_process_finalizes_stops_nothing(tmp_path) -> None:
    """Python puts back the default action of the signals it handles when it finalizes (torch's
    clean-up makes that a few tenths of a second): a SIGTERM there ended a completed run with
    -15. From the first exit handler on, the stop signals are ignored."""
    out = tmp_path / "out.txt"
    with open(out, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-c", FINALIZING], cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while "finalizing" not in out.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, out.read_text()


def test_a_killed_launcher_leaves_nothing_behind_after_the_next_start(tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *TINY, "devices=2", "trainer.max_epochs=400")
    wait_for_rows(run_dir, 30)
    # multiprocessing's folder of sockets (the worker server's): Python's own (pymp-*) was
    # left for good by a launcher killed with SIGKILL.
    sockets = list(Path(tempfile.gettempdir()).glob(f"app-mp-{proc.pid}-*"))
    assert len(sockets) == 1
    proc.kill()
    proc.wait()
    assert not still_alive(worker_pids(run_dir))
    live = Path(tempfile.gettempdir()) / f"app-mp-{os.getpid()}-kept"  # a live launcher's
    live.mkdir()
    try:
        assert_ok(run_app(run_dir, *TINY, "devices=2", "trainer.max_epochs=1"))  # (finished)
        assert not sockets[0].exists() and live.is_dir()
    finally:
        live.rmdir()
