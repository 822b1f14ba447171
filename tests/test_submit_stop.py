"""A stop (Ctrl-C, SIGTERM) of the submitting command before it submitted anything: one line
that says so, and the exit status of the signal."""

from __future__ import annotations

import sys

import pytest
from omegaconf import OmegaConf

from hydra_plugins.app_submitit.launcher import AppSlurmLauncher


@pytest.mark.parametrize("interrupt, code, said", [
    ("KeyboardInterrupt", 130, "SIGINT (Ctrl-C)"), ("_Terminated", 143, "SIGTERM")])
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
            # The launcher's module as it is now: Hydra's plugin scan runs plugin modules
            # again, which makes their classes anew.
            module = sys.modules[AppSlurmLauncher.__module__]
            raise getattr(module, interrupt, KeyboardInterrupt)
        return OmegaConf.create({})

    monkeypatch.setattr(launcher, "_compose_and_validate", compose)
    monkeypatch.setattr(launcher, "_forget_composed", lambda: calls.append("forgotten"))
    with pytest.raises(SystemExit) as ended:
        launcher.launch([["seed=1"], ["seed=2"], ["seed=3"]], first)
    assert ended.value.code == code
    assert f"stopped by {said}: {words} (the jobs' configs were being composed)" in caplog.text
    assert calls == [first, first + 1, "forgotten"]
