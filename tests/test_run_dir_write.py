"""A run or sweep directory that cannot be written (a path under a file, a read-only file
system, a disk full from the start): one line naming it and the OS's reason, exit status 2,
for a run, a devices=2 run and a sweep and each of its jobs. Before: Hydra's traceback (its
`mkdir`, `Unable to configure handler 'file'`, or writing `.hydra/`), exit status 1.

(Root ignores file permissions, so "Permission denied" is not tried: the read-only file
system fails the same writes at the same places.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, TINY, run_app
from test_disk_full import fill, mounted_tmpfs


def _refused(proc, directory, reason: str, what: str = "run directory") -> None:
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr
    assert proc.stderr == f"cannot write the {what} {directory}: {reason}\n"
    assert "Traceback" not in proc.stdout


def _sweep(sweep_dir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "-m", "seed=0,1", *TINY,
                           f"hydra.sweep.dir={sweep_dir}", *overrides],
                          cwd=REPO, capture_output=True, text=True, timeout=300)


@pytest.fixture
def full_tmpfs(tmp_path):
    for mount in mounted_tmpfs(tmp_path / "tmpfs", "size=1m"):
        fill(mount)
        yield mount


@pytest.fixture
def read_only_tmpfs(tmp_path):
    yield from mounted_tmpfs(tmp_path / "tmpfs", "size=1m,ro")


def test_a_run_directory_under_a_file_is_one_line(tmp_path) -> None:
    (tmp_path / "file").touch()
    run_dir = tmp_path / "file" / "run"
    _refused(run_app(run_dir, *TINY), run_dir, "Not a directory")
    _refused(run_app(run_dir, *TINY, "devices=2"), run_dir, "Not a directory")


def test_a_read_only_run_directory_is_one_line(read_only_tmpfs) -> None:
    # (An earlier run's directory, another user's: it is there, Hydra opens train.log in it.)
    _refused(run_app(read_only_tmpfs, *TINY), read_only_tmpfs, "Read-only file system")


def test_a_run_directory_on_a_full_disk_is_one_line(full_tmpfs) -> None:
    run_dir = full_tmpfs / "run"
    _refused(run_app(run_dir, *TINY), run_dir, "No space left on device")


def test_a_sweep_directory_under_a_file_is_one_line(tmp_path) -> None:
    (tmp_path / "file").touch()
    sweep_dir = tmp_path / "file" / "sweep"
    _refused(_sweep(sweep_dir), sweep_dir, "Not a directory", "sweep directory")


def test_a_job_directory_of_a_sweep_on_a_full_disk_is_one_line(full_tmpfs) -> None:
    # The sweep directory can be written; the job's (made by Hydra: there already) cannot.
    proc = _sweep(full_tmpfs.parent, f"hydra.sweep.subdir={full_tmpfs.name}")
    _refused(proc, full_tmpfs, "No space left on device")
