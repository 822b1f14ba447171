"""Who owns a run directory's records: one process writes result.json, and writers of the same
file never take each other's temporary file."""

from __future__ import annotations

import json
import os

from omegaconf import OmegaConf

from app import files
from app.env import SINGLE, detect
from app.files import write_text_atomically
from app.rundir.lock import owns_run
from hydra_plugins.app_submitit.launcher import AppSlurmLauncher


def test_two_processes_writing_one_run_file_do_not_take_each_others_temporary_file(
        tmp_path, monkeypatch) -> None:
    # The launchers of a nodes=2 run on a shared directory: the other one writes the same file
    # while this one is about to rename its temporary file into place.
    path = tmp_path / "result.json"
    replace = os.replace

    def replace_after_another_writer(src, dst) -> None:
        monkeypatch.setattr(files.os, "replace", replace)  # (once)
        pid = os.fork()
        if pid == 0:
            try:
                write_text_atomically(path, "other")
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace_after_another_writer)
    write_text_atomically(path, "this")  # before: ENOENT, the other took `.result.json.tmp`
    assert path.read_text() == "this"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_only_machine_0_owns_the_run() -> None:
    assert owns_run(0, SINGLE)
    assert not owns_run(1, SINGLE)  # another machine's launcher, on the same run directory
    rank1 = detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    assert not owns_run(0, rank1)  # rank 1 of a torchrun job: rank 0 records the run


def _launcher(run_dir) -> AppSlurmLauncher:
    launcher = object.__new__(AppSlurmLauncher)
    launcher.composed = {0: OmegaConf.create({"hydra": {
        "sweep": {"dir": str(run_dir.parent), "subdir": run_dir.name},
        "overrides": {"task": []}}})}
    return launcher


def test_slurm_end_state_leaves_the_jobs_own_final_record(tmp_path) -> None:
    run_dir = tmp_path / "0"
    run_dir.mkdir()
    own = {"status": "completed", "wall_s": 3.0, "error": None}
    (run_dir / "result.json").write_text(json.dumps(own))
    _launcher(run_dir)._record_end(0, "cancelled", "slurm job 5: CANCELLED")
    assert json.loads((run_dir / "result.json").read_text()) == own


def test_slurm_end_state_is_recorded_for_a_job_that_left_none(tmp_path) -> None:
    run_dir = tmp_path / "0"
    _launcher(run_dir)._record_end(0, "cancelled", "slurm job 5: CANCELLED")
    assert json.loads((run_dir / "result.json").read_text())["status"] == "cancelled"
    assert not list(run_dir.glob(".*.tmp"))
