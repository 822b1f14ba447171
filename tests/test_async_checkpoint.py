"""Checkpoints written in the background: the same files, consistent, atomic, errors surface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from app.checkpoint.writer import CheckpointWriter
from conftest import BIG, REPO, assert_ok, load_state, run_app


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 64), "b": torch.randn(64)},
            "optimizer": {"state": {0: {"exp_avg": torch.randn(64, 64), "step": torch.tensor(3.0)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "loop": {"step": 7}, "rng": [torch.get_rng_state()], "note": ("a", 1)}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_background_write_equals_a_plain_save(tmp_path) -> None:
    state, done = _state(), []
    writer = CheckpointWriter(background=True)
    writer.save(state, tmp_path / "a.pt", then=lambda: done.append(True))
    writer.wait()
    assert done == [True]
    assert _equal(load_state(tmp_path / "a.pt"), state)
    assert not list(tmp_path.glob(".*.tmp"))


def test_the_file_holds_the_state_of_the_save_not_later_changes(tmp_path) -> None:
    state = _state()
    expected = {k: v.clone() for k, v in state["model"].items()}
    weights = list(state["model"].values())
    writer = CheckpointWriter(background=True)
    for i in range(2):  # the second save reuses the first one's buffers
        writer.save(state, tmp_path / f"{i}.pt", then=lambda: None,
                    changed_only_by_step=weights)
        writer.hold_until_copied()  # what the train step does before it updates
        for w in weights:
            w.add_(1.0)  # the step changes the weights while the file is written
        writer.wait()
        saved = load_state(tmp_path / f"{i}.pt")["model"]
        assert all(torch.equal(saved[k], expected[k]) for k in expected)
        expected = {k: v.clone() for k, v in state["model"].items()}


def test_a_failed_write_is_raised_and_leaves_no_file(tmp_path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    writer = CheckpointWriter(background=True)
    writer.save(_state(), blocker / "ckpt" / "a.pt", then=lambda: None)
    try:
        writer.wait()
    except OSError as e:
        assert "not-a-directory" in str(e)
    else:
        raise AssertionError("the write error was not raised")
    writer.wait()  # raised once; the writer is usable again
    writer.save(_state(), tmp_path / "b.pt", then=lambda: None)
    writer.wait()
    assert (tmp_path / "b.pt").is_file() and not list(tmp_path.rglob("*.tmp"))


def _kill_during_a_write(run_dir: Path) -> Path | None:
    """Start a run, SIGKILL it while a background write is in flight; the partial file."""
    proc = subprocess.Popen([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *BIG],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt_dir, deadline = run_dir / "checkpoints", time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            partial = [p for p in ckpt_dir.glob(".step-*.tmp")] if ckpt_dir.is_dir() else []
            if partial and (ckpt_dir / "last.pt").is_file():
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return partial[0] if partial[0].exists() else None
            time.sleep(0.002)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return None


# In the slow trials (make test-slow): test_kill_trials covers the same ground 24 times over.
@pytest.mark.slow
def test_a_crash_during_a_background_write_keeps_the_previous_checkpoint(tmp_path) -> None:
    for attempt in range(5):  # the kill must land inside a write; almost always the first time
        run_dir = tmp_path / f"run{attempt}"
        partial = _kill_during_a_write(run_dir)
        if partial is not None:
            break
    else:
        raise AssertionError("no kill landed during a checkpoint write in 5 attempts")
    step = int(partial.name.split("-")[1].split(".")[0])
    last = load_state(run_dir / "checkpoints" / "last.pt")  # intact and readable
    assert last["loop"]["step"] < step
    assert not (run_dir / "checkpoints" / f"step-{step:08d}.pt").exists()

    resumed = assert_ok(run_app(run_dir, *BIG))  # resume=auto: the same command again
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at step {last['loop']['step']}" \
        in resumed.output
    assert load_state(run_dir / "checkpoints" / "last.pt")["loop"]["step"] == 30
    assert not list((run_dir / "checkpoints").glob(".*.tmp"))  # the partial file is gone
