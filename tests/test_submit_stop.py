"""A stop (Ctrl-C, SIGTERM) of the submitting command before it submitted anything: one line
that says so, and the exit status of the signal."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from app.signals import Terminated
from hydra_plugins.app_submitit.launcher import AppSlurmLauncher


@pytest.mark.parametrize("interrupt, code, said", [
    (KeyboardInterrupt, 130, "SIGINT (Ctrl-C)"), (Terminated, 143, "SIGTERM")])
@pytest.mark.parametrize("first, words", [
    (0, "nothing was submitted"), (4, "nothing more was submitted")])  # (a later batch)
def test_a_stop_while_the_jobs_compose_says_nothing_was_submitted(
        monkeypatch, caplog, interrupt, code, said, first, words) -> None:
    """A large sweep composes for a while (~0.1 s a job) before it submits anything."""
    launcher = object.__new__(sys.modules[AppSlurmLauncher.__module__].AppSlurmLauncher)
    launcher.config, launcher.wait = OmegaConf.create({}), True
    calls: list = []

    def compose(overrides: list[str], num: int):
        calls.append(num)
        if num == first + 1:
            raise interrupt
        return OmegaConf.create({})

    monkeypatch.setattr(launcher, "_compose_and_validate", compose)
    monkeypatch.setattr(launcher, "_forget_composed", lambda: calls.append("forgotten"))
    with pytest.raises(SystemExit) as ended:
        launcher.launch([["seed=1"], ["seed=2"], ["seed=3"]], first)
    assert ended.value.code == code
    assert f"stopped by {said}: {words} (the jobs' configs were being composed)" in caplog.text
    assert calls == [first, first + 1, "forgotten"]


def test_sigterm_to_a_local_sweep_stops_its_job_with_a_checkpoint(tmp_path) -> None:
    """The local jobs are the command's children but not in its terminal's reach for a
    SIGTERM (a closed session, `kill`): the command stops them as Ctrl-C would, and they save;
    they no longer train on, orphaned, to the end."""
    import json
    import os
    import signal
    import subprocess
    import time

    from conftest import REPO

    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "-m", "hydra/launcher=submitit_local",
         "model.channels=[8,16]", "trainer.max_epochs=200", "trainer.progress_bar=false",
         f"hydra.sweep.dir={sweep}"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ})
    deadline = time.monotonic() + 120
    while not (sweep / "0" / "metrics.csv").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143, out[-3000:]
    assert "stopped by SIGTERM: the local jobs were stopped (each saves a checkpoint)" in out
    result = sweep / "0" / "result.json"
    while time.monotonic() < deadline and json.loads(
            result.read_text() if result.is_file() else "{}").get("status") in (None, "running"):
        time.sleep(0.2)
    ended = json.loads(result.read_text())
    assert ended["status"] == "interrupted" and "checkpoint saved" in ended["error"], ended
