"""An Optuna sweep (`hparams_search=digits_optuna`) interrupted part-way, then run again with
the same `hydra.sweep.dir`, ends with exactly the requested number of completed trials; the
new trials take new job numbers (no run directory is reused by another trial)."""

from __future__ import annotations

import json
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import OPTUNA_SWEEP, REPO, Sweep, multirun

pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")  # (an extra; make install has it)
import optuna  # noqa: E402

TRIALS = 6


def _command(sweep: Path) -> list[str]:
    return [sys.executable, "-m", "app", "-m", "hparams_search=digits_optuna",
            f"hydra.sweep.dir={sweep}", f"hydra.sweeper.n_trials={TRIALS}",
            "model.channels=[8,16]", "trainer.max_epochs=4", "trainer.log_every_n_steps=1",
            "trainer.progress_bar=false"]


def _completed(sweep: Path) -> list[Path]:
    done = []
    for result in sweep.glob("*/result.json"):
        try:
            if json.loads(result.read_text()).get("status") == "completed":
                done.append(result.parent)
        except (OSError, ValueError):
            continue
    return done


def test_an_interrupted_optuna_sweep_resumes_to_its_total(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    first = subprocess.Popen(_command(sweep), cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    fourth = sweep / "3" / "metrics.csv"  # (jobs #0-2 done, #3 training)
    while not (fourth.is_file() and len(fourth.read_text().splitlines()) > 2):
        assert time.monotonic() < deadline and first.poll() is None, "no 4th trial"
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)  # (a closed terminal, a preempted node)
    assert first.wait(timeout=120) == 128 + signal.SIGTERM
    before = len(_completed(sweep))
    assert before == 3

    again = subprocess.run(_command(sweep), cwd=REPO, capture_output=True, text=True,
                           timeout=600)
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert f"study digits resumed: {before} of {TRIALS} trials completed; " \
           f"{TRIALS - before} to go, as jobs #{before} on" in said, said[-3000:]
    # The trial the stop cut off runs again in its own directory, from its checkpoint.
    assert "resumed from" in (sweep / str(before) / "train.log").read_text()
    kept = pickle.loads((sweep / "optuna_study.pkl").read_bytes())
    complete = [t for t in kept["trials"] if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == TRIALS
    assert len(_completed(sweep)) == TRIALS  # each trial in a run directory of its own
    lrs = [OmegaConf.load(d / ".hydra" / "overrides.yaml") for d in _completed(sweep)]
    assert len({str([o for o in found if o.startswith("optimizer.lr=")]) for found in lrs}) \
        == TRIALS  # no trial repeated another's learning rate
    assert (sweep / "optimization_results.yaml").is_file()


def test_a_study_without_a_name_runs_and_resumes(optuna_sweep: Sweep, tmp_path) -> None:
    # (Optuna drew a random name; the end of the sweep could not find the study: a traceback.)
    # The session's unnamed search of 3 trials (its end: tests/test_sweeps.py), run again.
    assert optuna_sweep.returncode == 0, optuna_sweep.output[-2000:]
    optuna_sweep.copy_to(tmp_path)
    again, _ = multirun(tmp_path, *OPTUNA_SWEEP, "hydra.sweeper.n_trials=4")
    said = again.stdout + again.stderr
    assert again.returncode == 0, said[-3000:]
    assert "3 of 4 trials completed; 1 to go" in said
