"""`make slurm-up` (scripts/slurm-local.sh up) run again on a running local cluster leaves it
working. The test starts a second, separate cluster (SLURM_LOCAL_ROOT, its own ports) so as
not to touch the one other tests run jobs on; it needs root and Slurm's programs."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "scripts" / "slurm-local.sh"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(p) for p in ("slurmctld", "slurmd", "sbatch",
                                                           "munge")),
    reason="needs root and Slurm's programs (make slurm-up installs them)")


def _free_ports() -> tuple[int, int]:
    """A controller port and three node ports after another, none in use."""
    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    for _ in range(100):
        port = random.randrange(20000, 30000, 10)
        if all(free(p) for p in (port, port + 1, port + 2, port + 3)):
            return port, port + 1
    raise AssertionError("no free ports")


def test_slurm_up_run_again_leaves_a_working_cluster() -> None:
    # A script that knows no SLURM_LOCAL_ROOT would restart (and `down` stop) the cluster
    # other tests use: not run then.
    assert "SLURM_LOCAL_ROOT" in SCRIPT.read_text(), "the script cannot keep a second cluster"
    # (a short path: slurmd's sockets live in its spool folder, and a socket's path is short)
    root = Path(tempfile.mkdtemp(prefix="sl-", dir="/tmp"))
    port, node_port = _free_ports()
    env = {**os.environ, "SLURM_LOCAL_ROOT": str(root), "SLURM_LOCAL_PORT": str(port),
           "SLURM_LOCAL_NODE_PORT": str(node_port), "SLURM_CONF": str(root / "slurm.conf")}

    def up(**more: str) -> str:
        done = subprocess.run([str(SCRIPT), "up"], env={**env, **more}, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        assert (root / "slurm.conf").is_file(), "the cluster is not the test's own"
        return done.stdout

    def a_job_runs(what: str) -> None:
        try:
            done = subprocess.run(["sbatch", "--wait", "--parsable", f"--output={root}/%j.out",
                                   "--wrap", "echo ran"], env=env, capture_output=True,
                                  text=True, timeout=90)
        except subprocess.TimeoutExpired:
            jobs = subprocess.run(["squeue", "--format=%i %T %r"], env=env,
                                  capture_output=True, text=True).stdout
            raise AssertionError(f"{what}: the job did not end: {jobs}") from None
        assert done.returncode == 0, f"{what}: {done.stdout}{done.stderr}"
        job = done.stdout.strip().split(";")[0]
        assert (root / f"{job}.out").read_text() == "ran\n", what

    def controller() -> str:
        return (root / "run" / "slurmctld.pid").read_text().strip()

    try:
        up()
        a_job_runs("a fresh cluster")
        first = controller()
        assert "slurm-local: up" in up()  # again, unchanged: nothing restarted
        assert controller() == first
        a_job_runs("after `up` twice")
        # A spool folder gone (slurmd makes it only when it starts): `up` makes it again.
        shutil.rmtree(root / "slurmd-node1")
        shutil.rmtree(root / "slurmd-node2")
        up()
        a_job_runs("after `up` thrice, its nodes' spool folders made again")
        # A changed configuration: the controller and the nodes start again from it.
        assert "restarting the controller and the nodes" in up(SLURM_LOCAL_CPUS="4")
        cpus = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%c"], env=env,
                              capture_output=True, text=True, timeout=60).stdout.split()
        assert cpus == ["4", "4", "4"], cpus
        a_job_runs("after `up` with other CPUs")
    finally:
        subprocess.run([str(SCRIPT), "down"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
