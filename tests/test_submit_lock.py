"""On the local Slurm cluster: one submission at a time into a sweep directory, and the stock
launcher options that keep their meaning in app (setup, hydra.sweep.subdir of the job id,
hydra.sweep.mode)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from app.launch.run_lock import held_now
from conftest import HELPERS, TINY

sys.path.insert(0, str(HELPERS))
from slurm_cluster import command, slurm_cluster, submit  # noqa: E402, F401

pytestmark = pytest.mark.usefixtures("slurm_cluster")

HELD = ["hydra.launcher.wait=false", "+hydra.launcher.additional_parameters.hold=true", *TINY]


def _recorded(sweep: Path) -> list[str]:
    return [job["job_id"] for job in json.loads((sweep / "submission.json").read_text())["jobs"]]


def _queued(sweep: Path) -> list[str]:
    """The jobs Slurm holds that were submitted from this sweep (by their output folder)."""
    ids = subprocess.run(["squeue", "-h", "-r", "-o", "%i %o"], capture_output=True,
                         text=True).stdout.splitlines()
    return sorted(line.split()[0] for line in ids if str(sweep) in line)


def _scancel(sweep: Path) -> None:
    ids = _queued(sweep)
    if ids:
        subprocess.run(["scancel", *{i.split("_")[0] for i in ids}])


def test_a_submission_while_another_submits_there_is_refused_naming_it(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    try:
        with held_now(sweep / ".submit.lock"):  # (this process: another command submitting)
            refused = submit(sweep, *HELD, "optimizer.lr=0.01,0.003", timeout=120)
        said = refused.stdout + refused.stderr
        assert refused.returncode == 2, said[-3000:]
        assert (f"hydra.sweep.dir={sweep} is being submitted to by another command (pid "
                f"{os.getpid()} on ") in said and "nothing was submitted" in said
        assert _queued(sweep) == [] and not (sweep / "submission.json").exists()
        # Once the other has ended, the same command submits.
        first = submit(sweep, *HELD, "optimizer.lr=0.01,0.003", timeout=120)
        assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
        assert len(_queued(sweep)) == 2
    finally:
        _scancel(sweep)


def test_two_detached_submissions_at_once_submit_each_job_once(tmp_path) -> None:
    """Started together: one submits, the other is refused or follows the first's jobs."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(HELPERS)}
    try:
        procs = [subprocess.Popen(command(sweep, *HELD, "optimizer.lr=0.01,0.003"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=env) for _ in range(2)]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        for proc, out in zip(procs, outs, strict=True):
            assert proc.returncode == 0 or (proc.returncode == 2 and "is being submitted to "
                                            "by another command" in out), out[-3000:]
        queued = _queued(sweep)
        assert len(queued) == 2 and sorted(_recorded(sweep)) == queued, (queued, outs)
    finally:
        _scancel(sweep)


def test_stock_options_keep_their_meaning(tmp_path) -> None:
    """`setup` adds to app's line (a failed rank still ends the job); a subdir of the job id
    names each run directory by it; `hydra.sweep.mode` is applied to the sweep directory."""
    sweep = tmp_path / "sweep"
    marker = tmp_path / "setup-ran"
    proc = submit(sweep, *TINY, "trainer.max_epochs=1", "optimizer.lr=0.01,0.003",
                  f"hydra.launcher.setup=['touch {marker}']", "hydra.sweep.subdir=${hydra.job.id}",
                  "+hydra.sweep.mode=750", timeout=600)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-3000:]
    assert marker.exists()
    ids = _recorded(sweep)
    assert len(ids) == 2 and all((sweep / i / "result.json").is_file() for i in ids), ids
    assert all(json.loads((sweep / i / "result.json").read_text())["status"] == "completed"
               for i in ids)
    assert stat.S_IMODE(sweep.stat().st_mode) == 0o750
    script = next((sweep / ".submitit").rglob("*_submission.sh")).read_text()
    assert script.index("export SLURM_KILL_BAD_EXIT=1") < script.index(f"touch {marker}")
