"""The runs several test files read, made once per test session and shared by the pytest-xdist
workers (`built_once`): a sweep or a training run by the CLI costs one `python -m app`, not one
per test or per worker. Tests only read them, or a copy (`Sweep.copy_to`)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import TINY, assert_ok, multirun, run_app


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str,
               build: Callable[[Path], None]) -> Path:
    """The folder that `build(folder)` filled, built once per test session: the pytest-xdist
    workers share it (the first to ask builds it under a lock, the others wait for it), so a
    fixture made by `python -m app` runs once, not once per worker that needs it. A build that
    failed is tried again by the next worker to ask (which then fails with its own message).
    The tests only read what it holds."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's folder, above each worker's own
    folder, done = base / "built-once" / name, base / "built-once" / f"{name}.done"
    folder.parent.mkdir(exist_ok=True)
    with open(folder.parent / f"{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when closed, or when its worker dies)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@dataclass
class Sweep:
    """A `multirun` made once per test session (`multirun_once`): its exit status, what it
    printed, what each job returned to Hydra, and its folder (`sweep/`, `returns.jsonl`)."""

    returncode: int
    output: str
    jobs: list[dict]
    folder: Path

    @property
    def dir(self) -> Path:
        return self.folder / "sweep"

    def copy_to(self, tmp_path: Path) -> Path:
        """A copy of the folder at tmp_path, for a test that runs commands into the sweep:
        `multirun(tmp_path, ...)` goes on from there; the shared sweep stays as it was."""
        shutil.copytree(self.folder, tmp_path, dirs_exist_ok=True)
        return tmp_path / "sweep"


def multirun_once(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str
                  ) -> Sweep:
    """`multirun(OVERRIDES)` once per test session (`built_once`), into `multirun/` as Hydra's
    own outputs folder has it, for the tests of several files that read the same sweep: one
    `python -m app` instead of one each. They only read it (or a copy: `Sweep.copy_to`)."""
    def build(root: Path) -> None:
        (root / "multirun").mkdir()
        proc, _ = multirun(root / "multirun", *overrides)
        (root / "multirun" / "command.json").write_text(json.dumps(
            {"returncode": proc.returncode, "output": proc.stdout + proc.stderr}))

    folder = built_once(tmp_path_factory, name, build) / "multirun"
    command = json.loads((folder / "command.json").read_text())
    record = folder / "returns.jsonl"
    jobs = [json.loads(line) for line in record.read_text().splitlines()] \
        if record.is_file() else []
    return Sweep(command["returncode"], command["output"], sorted(jobs, key=lambda j: j["num"]),
                 folder)


# A real sweep of two jobs of settings other than the defaults (tests/test_from_run.py
# evaluates its jobs with nothing retyped; tests/test_sweeps.py sweeps other values into it).
LR_SWEEP = ["model.channels=[8,16]", "model.dropout=0.0", "data.batch_size=32",
            "trainer.max_epochs=3", "trainer.progress_bar=false", "optimizer.lr=0.01,0.003"]


@pytest.fixture(scope="session")
def lr_sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return multirun_once(tmp_path_factory, "lr-sweep", *LR_SWEEP)


# A 2x2 sweep of which job #0 fails at its 5th step (fault_rank=0 and fault_call=5 together:
# a devices=1 run is rank 0), the others complete (tests/test_runs.py lists them,
# tests/test_sweeps.py reads the sweep's report of the failure).
FAULTY_SWEEP = ["model._target_=faults.FaultyCNN", "+model.fault=raise", "+model.fault_rank=0,1",
                "+model.fault_call=5,100000", "model.channels=[8,16]", "trainer.max_epochs=2",
                "trainer.progress_bar=false"]


@pytest.fixture(scope="session")
def faulty_sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return multirun_once(tmp_path_factory, "faulty-sweep", *FAULTY_SWEEP)


# An Optuna search of 3 trials, its study left unnamed (Optuna would draw a random name):
# tests/test_sweeps.py reads its result, tests/test_optuna_resume.py resumes a copy of it.
OPTUNA_SWEEP = ["hparams_search=digits_optuna", "hydra.sweeper.study_name=null",
                *[t for t in TINY if not t.startswith("model.")],  # (the width is searched)
                "trainer.max_epochs=1"]


@pytest.fixture(scope="session")
def optuna_sweep(tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    return multirun_once(tmp_path_factory, "optuna-sweep", *OPTUNA_SWEEP,
                         "hydra.sweeper.n_trials=3")


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny training run through the CLI, shared by the tests that need a checkpoint (and
    by every pytest worker: `built_once`)."""
    def train(folder: Path) -> None:
        assert_ok(run_app(folder / "run", *TINY))

    return built_once(tmp_path_factory, "trained", train) / "run"
