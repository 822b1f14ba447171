"""Experiment presets: `+experiment=NAME` (conf/experiment/, global package) sets a whole
experiment on top of the defaults; the command line still wins; a user's own preset comes
from their search path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import CONF_DIR, REPO, make_config, run_job

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def test_two_worked_examples_ship() -> None:
    assert PRESETS == ["digits_long", "digits_mlp"]


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_composes_and_trains(name, tmp_path) -> None:
    cfg = make_config(f"+experiment={name}")
    assert cfg.trainer.max_epochs != make_config().trainer.max_epochs  # it changed something
    job = run_job(tmp_path / "run", f"+experiment={name}", "trainer.max_epochs=1",
                  "trainer.progress_bar=false")
    assert job.value is not None and job.value > 0.1  # one epoch learns something


def test_a_preset_sets_groups_and_keys_and_the_command_line_wins() -> None:
    cfg = make_config("+experiment=digits_mlp")
    assert cfg.model["_target_"] == "app.models.MLP" and cfg.model["hidden"] == [128, 64]
    assert cfg.optimizer["_target_"] == "torch.optim.SGD" and cfg.optimizer["lr"] == 0.05
    assert make_config("+experiment=digits_mlp", "optimizer.lr=0.5").optimizer["lr"] == 0.5
    long = make_config("+experiment=digits_long")
    assert long.trainer.ema and long.callbacks["early_stopping"]["patience"] == 8


def test_a_users_own_preset_from_the_search_path(tmp_path) -> None:
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: mlp\n"
        "model:\n  hidden: [7]\ntrainer:\n  max_epochs: 2\n")
    done = subprocess.run([sys.executable, "-m", "app", "+experiment=mine",
                           f"hydra.searchpath=[file://{tmp_path}]", "--cfg", "job"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "hidden:\n  - 7" in done.stdout and "max_epochs: 2" in done.stdout, done.stdout
