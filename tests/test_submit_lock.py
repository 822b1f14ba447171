"""On the local Slurm cluster: one submission at a time into a sweep directory, and the stock
launcher options that keep their meaning in app (setup, hydra.sweep.subdir of the job id,
hydra.sweep.mode)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.rundir.lock import held_now
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


def test_the_same_jobs_typed_in_another_order_are_followed_not_submitted_again(tmp_path) -> None:
    sweep = tmp_path / "sweep"
    try:
        first = submit(sweep, *HELD, "seed=1,2", "optimizer.lr=0.01", timeout=120)
        assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
        again = submit(sweep, "++optimizer.lr=0.01", "seed=1,2", *HELD, timeout=120)
        said = again.stdout + again.stderr
        assert again.returncode == 0 and said.count("not submitted again") == 2, said[-3000:]
        assert len(_queued(sweep)) == 2 and sorted(_recorded(sweep)) == _queued(sweep)
    finally:
        _scancel(sweep)


def test_a_submission_stopped_between_two_arrays_leaves_its_jobs_on_record(tmp_path) -> None:
    """8 jobs in two arrays (the local cluster's MaxArraySize is 4), SIGTERM while the second
    is being submitted: the first array's jobs are recorded, so a sweep of other values is
    refused and the same command follows them and submits the rest, each job once.

    The command waits for an sbatch it started to return (submitit does not kill it): the
    fake second sbatch hangs until the test releases it, after the SIGTERM (it slept 30 s,
    which the test waited out)."""
    sweep, fake = tmp_path / "sweep", tmp_path / "bin"
    fake.mkdir()
    real = subprocess.run(["sh", "-c", "command -v sbatch"], capture_output=True,
                          text=True).stdout.strip()
    count, release = tmp_path / "sbatch-calls", tmp_path / "release"
    (fake / "sbatch").write_text(  # the second submission hangs until it is released
        f'#!/bin/sh\necho x >> {count}\n'
        f'if [ "$(wc -l < {count})" -ge 2 ]; then\n'
        f'  for _ in $(seq 600); do [ -e {release} ] && exit 0; sleep 0.1; done; exit 1\n'
        f'fi\nexec {real} "$@"\n')
    (fake / "sbatch").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(HELPERS), "PATH": f"{fake}:{os.environ['PATH']}"}
    try:
        log = (tmp_path / "first.log").open("w")
        proc = subprocess.Popen(command(sweep, *HELD, "seed=range(1,9)"), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while not (count.exists() and len(count.read_text().split()) >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "first.log").read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # (the signal is taken before the hanging sbatch returns)
        release.touch()
        assert proc.wait(timeout=60) == 143
        said = (tmp_path / "first.log").read_text()
        first = _recorded(sweep)
        assert len(first) == 4 and all(f"slurm job {i}" in said for i in first), said[-3000:]
        other = submit(sweep, *HELD, "seed=range(101,109)", timeout=120)
        assert other.returncode == 2 and "was used by a sweep of other values" in other.stdout
        rest = submit(sweep, *HELD, "seed=range(1,9)", timeout=120)
        assert rest.returncode == 0 and rest.stdout.count("not submitted again") == 4, \
            (rest.stdout + rest.stderr)[-3000:]
        assert len(_queued(sweep)) == 8 and sorted(_recorded(sweep)) == _queued(sweep)
    finally:
        _scancel(sweep)


def test_a_sweep_mode_that_is_not_octal_is_refused_in_one_line(tmp_path) -> None:
    proc = submit(tmp_path / "sweep", *HELD, "+hydra.sweep.mode=abc", timeout=120)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said[-3000:]
    assert "hydra.sweep.mode=abc: give the sweep directory's permissions in octal" in said
    assert _queued(tmp_path / "sweep") == []
