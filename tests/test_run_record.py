"""A command that fails before it trains leaves the record of the run it was pointed at as it
was (app.rundir.record); an empty run or sweep directory is refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from app.rundir.record import RECORD
from app.sweeps.summary import job_summary
from conftest import HELPERS, TINY, assert_ok, run_app


def _record(run_dir) -> dict[str, bytes]:
    return {name: (run_dir / name).read_bytes() for name in RECORD}


def test_a_refused_command_leaves_the_run_s_record_as_it_was(tmp_path) -> None:
    run_dir = tmp_path / "run"
    first = assert_ok(run_app(run_dir, *TINY, "trainer.max_epochs=1"))
    assert first.output.rstrip().endswith(f"run directory: {run_dir}")  # (where to look)
    before = _record(run_dir)
    # The same command again: nothing to train, and the run's record and wall time stay the
    # training's (before, result.json said 2.4 s of a 49 s run, app.runs show the sum).
    again = assert_ok(run_app(run_dir, *TINY, "trainer.max_epochs=1"))
    assert "nothing to train" in again.output and _record(run_dir) == before
    summary, trained_s = job_summary(run_dir), json.loads(before["result.json"])["wall_s"]
    assert (summary["wall_s"], summary["attempts"]) == (trained_s, 1)
    # Other model settings: the checkpoint does not fit, found by both ranks (the error is a rank's
    # own, not "rank 0 failed: WorkerFailed: rank 1 failed: ...").
    refused = run_app(run_dir, *TINY, "trainer.max_epochs=1", "model.channels=[4,8]",
                      "devices=2")
    assert refused.returncode == 2, refused.output[-3000:]
    assert re.search(r"rank [01] failed: UserError: checkpoint \S+ does not match the model",
                     refused.output), refused.output[-3000:]
    assert "WorkerFailed" not in refused.output
    assert _record(run_dir) == before  # .hydra/ of the CNN run, result.json "completed"
    assert json.loads(before["result.json"])["status"] == "completed"
    # A command that trains in the directory is the run's record from then on.
    assert_ok(run_app(run_dir, *TINY, "trainer.max_epochs=2"))
    assert "trainer.max_epochs=2" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    # One that fails after its training began (the metric table is rewritten) records it.
    failed = run_app(run_dir, *TINY, "trainer.max_epochs=3", "model._target_=faults.FaultyCNN",
                     "+model.fault=nan_loss", "+model.fault_rank=0",
                     env={"PYTHONPATH": os.pathsep.join(filter(None, [
                         str(HELPERS), os.environ.get("PYTHONPATH")]))})
    assert failed.returncode == 1 and "the training loss was nan" in failed.output, \
        failed.output[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["status"] == "failed"


def test_an_empty_run_or_sweep_directory_is_refused_and_nothing_is_written(tmp_path) -> None:
    # (What `hydra.run.dir=$DIR` gives with DIR unset: the current folder became the run's.)
    for command, key in ((["hydra.run.dir="], "hydra.run.dir"),
                         (["-m", "hydra.sweep.dir=", "seed=1,2"], "hydra.sweep.dir")):
        proc = subprocess.run([sys.executable, "-m", "app", *command, *TINY], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"{key} is empty" in proc.stderr and "Traceback" not in proc.stderr
        assert list(tmp_path.iterdir()) == []


def test_a_record_written_by_this_command_s_other_ranks_is_not_kept(tmp_path) -> None:
    """Under torchrun every rank's Hydra writes .hydra/: rank 0 kept rank 1's as an earlier
    run's record, and a stop before training then put it back and removed the run's
    result.json (flaky under load: tests/test_group_signals.py)."""
    from app.rundir import record

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    config = run_dir / ".hydra" / "config.yaml"
    config.write_text("written by another rank of this command\n")  # (after this process began)
    record.keep(run_dir)
    (run_dir / "result.json").write_text('{"status": "interrupted"}')
    assert not record.put_back(run_dir) and (run_dir / "result.json").is_file()
    os.utime(config, (1e9, 1e9))  # an earlier command's
    record.keep(run_dir)
    assert record.put_back(run_dir) and not (run_dir / "result.json").exists()
