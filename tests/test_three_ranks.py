"""Exact resume with three ranks, where the order in which the ranks' gradients are added
shows in the last bits (two floats add commutatively, so two ranks cannot show it): resume
from a checkpoint, a SIGTERM to the launcher, a SIGKILL of every process inside a checkpoint
write. Each finished run has the weights and metrics of an uninterrupted one, bit for bit.
(The requeues of a Slurm job with three ranks: tests/test_slurm_recovery.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    BIG,
    HELPERS,
    REPO,
    TINY,
    assert_ok,
    assert_same_weights,
    load_state,
    read_metrics,
    run_app,
    run_job,
    wait_for_rows,
)

# 7 steps per epoch per rank; a checkpoint every 5 steps, none deleted. Every step slowed
# by 50 ms on rank 1 (numbers unchanged): a window for a signal from outside.
THREE = [*TINY, "devices=3", "trainer.max_epochs=6", "trainer.ckpt_every_n_steps=5",
         "trainer.keep_last=100", "model._target_=faults.FaultyCNN", "+model.fault=slow"]
USER_CODE = {"PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS),
                                                         os.environ.get("PYTHONPATH")]))}


def _same_run(reference: Path, run_dir: Path) -> None:
    assert_same_weights(reference / "checkpoints" / "last.pt", run_dir / "checkpoints" / "last.pt")
    assert read_metrics(run_dir) == read_metrics(reference)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    return run_job(tmp_path_factory.mktemp("three") / "reference", *THREE,
                   user_code=HELPERS).run_dir


@pytest.mark.parametrize("graph", [[], ["distributed.static_graph=true"]],
                         ids=["ddp", "static-graph"])
def test_a_checkpoint_taken_mid_epoch_resumes_exactly(reference, tmp_path, graph) -> None:
    # (static_graph=true: DDP records the order of the gradients in its second backward)
    if graph:
        reference = run_job(tmp_path / "reference", *THREE, *graph, user_code=HELPERS).run_dir
    source = reference / "checkpoints" / "step-00000010.pt"  # epoch 2, its third step
    assert len(load_state(source)["rng"]) == 3
    resumed = run_job(tmp_path / "resumed", *THREE, *graph, f"resume={source}",
                      user_code=HELPERS).run_dir
    assert_same_weights(reference / "checkpoints" / "last.pt", resumed / "checkpoints" / "last.pt")
    after = [r for r in read_metrics(reference) if int(r["step"]) > 10]
    assert [r for r in read_metrics(resumed) if int(r["step"]) > 10] == after


def test_a_sigterm_to_the_launcher_stops_with_a_checkpoint_and_resumes_exactly(reference,
                                                                              tmp_path) -> None:
    # The launcher passes it on: the ranks stop at a step they agree on with a checkpoint,
    # and the same command again continues from it.
    run_dir = tmp_path / "interrupted"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *THREE], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **USER_CODE})
    wait_for_rows(run_dir, 12)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output[-3000:]
    stopped_at = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    assert 0 < stopped_at < 6 * 7, output[-3000:]
    again = assert_ok(run_app(run_dir, *THREE, env=USER_CODE))
    assert f"at step {stopped_at}" in again.output
    _same_run(reference, run_dir)


def _kill_group_inside_a_write(run_dir: Path, nth: int) -> None:
    """Start the run in a process group of its own, SIGKILL the whole group (the launcher,
    its ranks and their helpers, as a lost machine or the OOM killer of a cgroup) while the
    `nth` checkpoint is being written."""
    proc = subprocess.Popen([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *BIG,
                             "devices=3"], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt_dir, seen = run_dir / "checkpoints", set()
    deadline = time.monotonic() + 240
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            partial = {p.name for p in ckpt_dir.glob(".*.tmp")} if ckpt_dir.is_dir() else set()
            seen |= partial
            if len(seen) >= nth and partial:
                break
            time.sleep(0.002)
        assert proc.poll() is None, "the run ended before the write to kill it in"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_sigkill_of_every_process_inside_a_checkpoint_write_resumes_exactly(tmp_path
                                                                             ) -> None:
    run_dir = tmp_path / "killed"
    _kill_group_inside_a_write(run_dir, nth=8)
    assert list((run_dir / "checkpoints").glob(".*.tmp")), "killed after the write, not in it"
    step = load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"]
    again = assert_ok(run_app(run_dir, *BIG, "devices=3"))
    assert f"at step {step}" in again.output, again.output[-3000:]
    reference = run_job(tmp_path / "reference", *BIG, "devices=3").run_dir
    _same_run(reference, run_dir)
