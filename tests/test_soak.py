"""Soak (slow): consecutive short devices=3 runs, each interrupted by SIGTERM or SIGKILL to the
launching process at a random moment and resumed until done. Every run reaches the weights
and metrics of an uninterrupted run; no process of an interrupted run outlives it (workers
are children of the forkserver, not of the launcher: they must notice on their own), and no
shared-memory segment is left behind. Three ranks: with two, the order in which the ranks'
gradients are added cannot show (two floats add commutatively)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY, assert_ok, assert_same_weights, read_metrics, run_app

RUNS = 30
SOAK = [*TINY, "devices=3", "trainer.max_epochs=2", "trainer.ckpt_every_n_steps=4",
        "trainer.ckpt_every_n_epochs=null"]


def _session(sid: int) -> list[str]:
    """The processes of session `sid` (a launcher started in its own session, and all it
    started: forkserver, workers, loader workers, resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields[3]: session id
            found.append(f"{entry.name} {cmd}")
    return found


def _interrupt(run_dir: Path, sig: int, after: float) -> tuple[int, float | None]:
    """Start a run, send `sig` to its launcher after `after` s; the exit status, and the run's
    duration when it finished before the signal. Nothing of it may outlive it."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "app", f"hydra.run.dir={run_dir}", *SOAK],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    finished_in = None
    try:
        proc.wait(timeout=after)
        finished_in = time.monotonic() - started
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)  # to the launcher alone, as a scheduler or `kill PID` does
        proc.wait(timeout=120)
    deadline = time.monotonic() + 60
    while _session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _session(proc.pid)
    assert not left, f"{signal.Signals(sig).name} after {after:.1f} s left: {left}"
    assert finished_in is None or proc.returncode == 0, f"failed: exit {proc.returncode}"
    return proc.returncode, finished_in


@pytest.mark.slow
def test_interrupted_runs_resume_to_the_same_weights_and_leave_nothing_behind(tmp_path) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    rng = random.Random(7)
    started = time.monotonic()
    reference = assert_ok(run_app(tmp_path / "reference", *SOAK)).run_dir
    duration = time.monotonic() - started
    codes: dict[str, int] = {}
    interrupted = runs = 0
    while interrupted < RUNS:
        runs += 1
        assert runs <= 2 * RUNS, f"only {interrupted} of {runs} runs could be interrupted"
        run_dir = tmp_path / f"run{runs}"
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        code, finished_in = _interrupt(run_dir, sig, rng.uniform(0.2, 0.9 * duration))
        if finished_in is not None:
            duration = finished_in  # runs got faster (less load): draw from the new span
        if code == 0:
            continue  # it finished before the signal took effect: not a trial
        interrupted += 1
        key = f"{signal.Signals(sig).name}: exit {code}"
        codes[key] = codes.get(key, 0) + 1
        assert_ok(run_app(run_dir, *SOAK))  # resume=auto: the same command again
        assert_same_weights(reference / "checkpoints" / "last.pt",
                            run_dir / "checkpoints" / "last.pt")
        assert read_metrics(run_dir) == read_metrics(reference)
    leaked = set(os.listdir("/dev/shm")) - shm_before
    time.sleep(2)  # a segment another test creates and unlinks at once is not a leak
    leaked &= set(os.listdir("/dev/shm"))
    assert not leaked, f"shared memory left behind: {sorted(leaked)}"
    print(f"soak: {interrupted} devices=3 runs interrupted ({codes}), all resumed to the "
          f"reference weights and metrics; no process or /dev/shm entry left")
