"""The code snapshot of a submission (`hydra.launcher.code_snapshot`): a queued job runs the
code it was submitted with (on the local Slurm cluster, `make slurm-up`), what the snapshot
copies and what it leaves out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import HELPERS, TINY
from test_cluster_ops import _app_module, _recorded, _scancel, on_the_cluster

sys.path.insert(0, str(HELPERS))
from slurm_cluster import slurm_cluster, submit, wait_for  # noqa: E402, F401

MODEL_V1 = '''
import logging

from app.models import CNN


class Versioned(CNN):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        logging.getLogger("versioned").info("model code: version %s", VERSION)


VERSION = 1
'''


@on_the_cluster
def test_a_queued_job_runs_the_code_it_was_submitted_with(tmp_path) -> None:
    """Edit the model's file after submitting: the job (held meanwhile) still runs the
    submitted code from the sweep's snapshot; without a snapshot it runs the edit."""
    code = tmp_path / "usercode"
    code.mkdir()
    (code / "versioned.py").write_text(MODEL_V1)
    sweeps = {"snap": tmp_path / "snap", "live": tmp_path / "live"}
    env = {"PYTHONPATH": f"{code}{os.pathsep}{HELPERS}"}
    try:
        for name, sweep in sweeps.items():
            result = submit(sweep, "hydra.launcher.wait=false",
                            "model._target_=versioned.Versioned", *TINY, "trainer.max_epochs=1",
                            "+hydra.launcher.additional_parameters.hold=true",
                            f"hydra.launcher.code_snapshot={name == 'snap'}", timeout=120,
                            env=env)
            output = result.stdout + result.stderr
            assert result.returncode == 0, output[-3000:]
            if name == "snap":
                assert re.search(r"code snapshot: \d+ files \([\d.]+ MB\) in \S+/\.code/1", output)
                assert (sweep / ".code" / "1").is_dir()
            else:
                assert "code snapshot" not in output and not (sweep / ".code").exists()
        (code / "versioned.py").write_text(MODEL_V1.replace("VERSION = 1", "VERSION = 2"))
        for sweep in sweeps.values():
            subprocess.run(["scontrol", "release", _recorded(sweep)[0]], check=True)
        for sweep in sweeps.values():
            wait_for(lambda s=sweep: "1 completed" in _app_module("app.status", s).stdout,
                     300, f"{sweep.name} to complete", every=1)
        assert "model code: version 1" in (sweeps["snap"] / "0" / "train.log").read_text()
        assert "model code: version 2" in (sweeps["live"] / "0" / "train.log").read_text()
    finally:
        for sweep in sweeps.values():
            _scancel(sweep)


def test_the_snapshot_copies_what_the_jobs_import_in_the_order_they_search(
        tmp_path, monkeypatch, caplog) -> None:
    from hydra_plugins.app_submitit._snapshot import take

    project, lib = tmp_path / "project", tmp_path / "lib"
    for folder, name in ((project, "train_mine.py"), (lib, "mylib.py")):
        (folder / "pkg").mkdir(parents=True)
        (folder / name).write_text("x = 1\n")
        (folder / "pkg" / "notes.txt").write_text("not code\n")  # (not a git work tree: .py)
    monkeypatch.chdir(project)
    monkeypatch.setenv("PYTHONPATH", str(lib))
    first = take(tmp_path / "sweep", max_mb=100)
    assert first.where == tmp_path / "sweep" / ".code" / "1"
    assert first.paths[:2] == [str(first.where / "0-project"), str(first.where / "1-lib")]
    assert (Path(first.paths[0]) / "train_mine.py").is_file()
    assert (Path(first.paths[1]) / "mylib.py").is_file()
    assert not (Path(first.paths[1]) / "pkg" / "notes.txt").exists()
    assert (Path(first.paths[2]) / "app" / "__main__.py").is_file()  # app's own source
    assert 'export PYTHONPATH="' + ":".join(first.paths) in first.setup_lines()[0]
    assert take(tmp_path / "sweep", max_mb=100).where.name == "2"  # a new one per submission
    with pytest.raises(SystemExit) as refused:  # (exit 2, in one line: nothing is submitted)
        take(tmp_path / "sweep", max_mb=1e-6)
    assert refused.value.code == 2
    assert "over hydra.launcher.snapshot_max_mb=1e-06: raise it" in caplog.text


@pytest.mark.parametrize("marker", ["pyvenv.cfg", "conda-meta/history"])
@pytest.mark.parametrize("git", [True, False])
def test_the_snapshot_leaves_out_an_environment_inside_the_project(tmp_path, monkeypatch,
                                                                   marker, git) -> None:
    """A virtualenv or conda environment made inside the checkout (untracked, not ignored)
    was copied into every submission: 1.5 GB, refused over snapshot_max_mb."""
    from hydra_plugins.app_submitit._snapshot import files_of

    project = tmp_path / "project"
    (project / "v" / "lib").mkdir(parents=True)
    (project / "v" / marker).parent.mkdir(parents=True, exist_ok=True)
    (project / "v" / marker).write_text("home = /usr/bin\n")
    (project / "v" / "lib" / "big.py").write_text("x = 1\n")
    (project / "train_mine.py").write_text("x = 1\n")
    if git:
        subprocess.run(["git", "init", "-q", str(project)], check=True)
    assert sorted(map(str, files_of(project))) == ["train_mine.py"]
