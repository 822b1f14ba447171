"""A signal to every process of a job (a terminal's Ctrl-C, a closed session, `kill -- -PGID`,
torchrun's agent passing its own on) at the moments a job is most fragile: as its ranks set up,
and as they exit after the run completed. The ranks, their loader workers and the worker server
all get it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.launch import ends
from conftest import HELPERS, REPO, TINY


def _in_a_group_of_its_own(*command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *command], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True, env={**os.environ, "PYTHONPATH": str(HELPERS)})


def _when_both_ranks_build(proc: subprocess.Popen, marker: Path) -> None:
    """(faults.SlowDigits marks each rank as it builds its data.)"""
    while proc.poll() is None and not all(marker.with_suffix(f".rank{r}").is_file()
                                          for r in (0, 1)):
        time.sleep(0.05)


# `python -m app`, with a Ctrl-C to its process group just as it starts the worker server.
_CTRL_C_AS_THE_SERVER_STARTS = """
import multiprocessing.util, os, runpy, signal, sys
spawn = multiprocessing.util.spawnv_passfds
def spawn_after_ctrl_c(path, args, passfds):
    if "multiprocessing.forkserver" in str(args):
        os.killpg(0, signal.SIGINT)
    return spawn(path, args, passfds)
multiprocessing.util.spawnv_passfds = spawn_after_ctrl_c
sys.argv[0] = "app"
runpy.run_module("app", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_as_the_worker_server_starts_stops_the_command(tmp_path) -> None:
    """The launcher holds Ctrl-C (blocked, and ignored for the server to inherit) while it
    starts the server; multiprocessing's start of its resource tracker in there unblocked it,
    and the Ctrl-C was lost: the run trained to its end (2 of ~10 trials at start-up)."""
    run_dir = tmp_path / "run"
    proc = _in_a_group_of_its_own("-c", _CTRL_C_AS_THE_SERVER_STARTS,
                                  f"hydra.run.dir={run_dir}", *TINY, "devices=2")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "stopped by SIGINT (Ctrl-C)" in output, output[-3000:]
    assert "Traceback" not in output and not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("data", [
    # Still building their data in Python: they stop with nothing to save, and the line says
    # so (it said "the workers saved a checkpoint").
    ["data._target_=faults.SlowDigits", "+data.setup_s=60"],
    # Busy in C: they die of the launcher's SIGTERM with no record of their end (the line
    # said "not every rank reached the step they agreed to stop at").
    ["data._target_=busy_setup.BusyDigits", "+data.rounds=3000000"],
], ids=["python", "in-c"])
def test_ctrl_c_before_the_workers_train_says_that_nothing_was_saved(tmp_path, data) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc = _in_a_group_of_its_own(
        "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "devices=2", *data,
        f"+data.marker={marker}")
    _when_both_ranks_build(proc, marker)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "stopped by SIGINT, but no checkpoint was saved at the stop (the workers had not " \
           "begun training); there is no checkpoint yet" in output, output[-3000:]
    assert "Traceback" not in output and not (run_dir / "checkpoints").exists()


def test_sigterm_to_torchrun_ranks_before_training_records_the_run_as_interrupted(
        tmp_path) -> None:
    """A rank still building its data ends as a process of its own would, with the run's
    record (it died of the signal, and the run had no result.json). What torchrun itself
    prints and returns is its own."""
    run_dir, marker = tmp_path / "run", tmp_path / "building"
    proc = _in_a_group_of_its_own(
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "app",
        f"hydra.run.dir={run_dir}", *TINY, "data._target_=faults.SlowDigits",
        "+data.setup_s=60", f"+data.marker={marker}")
    _when_both_ranks_build(proc, marker)
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=90)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "interrupted", output[-3000:]
    assert {e["status"] for e in ends.read(run_dir, 0).values()} == {ends.STOPPED}, output[-3000:]


def test_a_sigterm_after_the_run_completed_leaves_it_completed(tmp_path) -> None:
    """The worker server dies of it, and the workers' exit codes with it: the result rank 0
    sent says the run completed all the same."""
    run_dir, marker = tmp_path / "run", tmp_path / "lingering"
    proc = _in_a_group_of_its_own(
        "-m", "app", f"hydra.run.dir={run_dir}", *TINY, "devices=2", "trainer.max_epochs=1",
        "+callbacks.linger._target_=linger.LingerAtExit", f"+callbacks.linger.marker={marker}",
        "+callbacks.linger.seconds=3")
    while proc.poll() is None and not marker.is_file():
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["status"] == "completed"
