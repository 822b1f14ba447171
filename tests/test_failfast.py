"""A failure anywhere ends the whole job promptly, says where, and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    wait_for_rows,
    worker_pids,
)

FAULTY = [*TINY, "devices=2", "model._target_=faults.FaultyCNN", "distributed.timeout_s=5"]


def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *overrides], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(HELPERS)})


@pytest.mark.parametrize("fault,words", [
    ("raise", "rank 1 failed: RuntimeError: injected fault"),
    ("kill", "rank 1 (pid"),
    ("hang", "distributed.timeout_s=5"),
])
def test_a_failing_rank_ends_the_job(fault, words, tmp_path) -> None:
    run_dir = tmp_path / "run"
    started = time.monotonic()
    proc = _start(run_dir, *FAULTY, f"+model.fault={fault}")
    output, _ = proc.communicate(timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, output[-3000:]
    assert elapsed < 30 + 10, elapsed  # 30 s after the fault, plus start-up
    assert words in output, output[-3000:]
    assert "Traceback" not in output  # one line on the console ...
    if fault == "raise":  # ... and the traceback in the rank's own log
        rank_log = (run_dir / "logs" / "rank1.log").read_text()
        assert "Traceback" in rank_log and "injected fault" in rank_log
    if fault == "kill":
        assert "killed by SIGKILL" in output
    if fault == "hang":
        assert "rank(s) 1 did not exit" in output
    pids = worker_pids(run_dir)
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_sigterm_to_the_launcher_checkpoints_and_resume_is_exact(tmp_path) -> None:
    overrides = [*TINY, "devices=2", "trainer.max_epochs=6", "trainer.ckpt_every_n_epochs=null"]
    run_dir = tmp_path / "interrupted"
    proc = _start(run_dir, *overrides)
    wait_for_rows(run_dir, 30)
    proc.send_signal(signal.SIGTERM)
    started = time.monotonic()
    output, _ = proc.communicate(timeout=60)
    assert time.monotonic() - started < 30
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert "stopped by SIGTERM" in output and "Traceback" not in output
    stopped_at = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    assert 0 < stopped_at < 6 * 11
    assert not [p for p in worker_pids(run_dir) if alive(p)]

    resumed = _start(run_dir, *overrides)  # resume=auto: the same command again
    output, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, output[-3000:]
    assert f"at step {stopped_at}" in output
    reference = assert_ok(run_app(tmp_path / "reference", *overrides)).run_dir
    assert_same_weights(reference / "checkpoints" / "last.pt",
                        run_dir / "checkpoints" / "last.pt")
    assert read_metrics(run_dir) == read_metrics(reference)


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
