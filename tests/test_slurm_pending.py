"""Jobs that would wait forever (src/hydra_plugins/app_submitit/_pending.py): a request no node
of the partition can run is refused before sbatch, naming the numbers; a job that waits for a
person (held) is named while the submitting command waits. On the local Slurm cluster
(`make slurm-up`); the naming itself also in-process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app import slurm
from conftest import HELPERS, REPO, TINY

sys.path.insert(0, str(HELPERS))
from slurm_cluster import command, job_ids, slurm_cluster, submit, wait_for  # noqa: E402, F401

on_the_cluster = pytest.mark.usefixtures("slurm_cluster")


def _jobs_named(sweep: Path) -> str:
    """The jobs Slurm lists under this sweep's folder (its log paths name it)."""
    out = subprocess.run(["squeue", "--noheader", "--format=%i %o"], capture_output=True,
                         text=True, timeout=60).stdout
    return "".join(line for line in out.splitlines(keepends=True) if str(sweep) in line)


@on_the_cluster
def test_a_job_no_node_can_run_is_refused_before_sbatch(tmp_path) -> None:
    """sbatch takes more CPUs per node than any node has, or more nodes than the partition,
    and the job pends forever (PartitionConfig, PartitionNodeLimit)."""
    nodes = slurm.nodes()
    assert nodes, "scontrol show node answered nothing"
    debug = {n: f for n, f in nodes.items() if "debug" in f["Partitions"].split(",")}
    most = max(int(f["CPUTot"]) for f in debug.values())
    cases = {  # overrides -> what the line must name
        f"hydra.launcher.cpus_per_task={most * 4}": [
            f"a node must offer {most * 4} CPU(s), 1 GB, 0 GPU(s): 0 of partition debug's "
            f"nodes do, 1 needed (node ",
            f" {most} CPUs, ", f"over every node: hydra.launcher.cpus_per_task={most * 4}"],
        f"nodes={len(debug) + 1}": [f"nodes={len(debug) + 1}: partition debug has "
                                    f"{len(debug)} node(s)"],
    }
    for i, (override, named) in enumerate(cases.items()):
        sweep = tmp_path / f"sweep{i}"
        try:
            # (wait=false: without the check, sbatch takes the job and the command exits 0)
            done = submit(sweep, override, "hydra.launcher.wait=false", *TINY, timeout=120)
            said = done.stdout + done.stderr
            assert done.returncode == 2, said[-3000:]
            refusal = [line for line in said.splitlines() if "Slurm would never start" in line]
            assert len(refusal) == 1, said[-3000:]
            assert "Slurm would never start the job (it would wait forever): " in refusal[0]
            for part in named:
                assert part in refusal[0], refusal[0]
            assert refusal[0].endswith("nothing was submitted)"), refusal[0]
            assert "Traceback" not in said
            assert not (sweep / ".submitit").exists() and not (sweep / "submission.json").exists()
            assert _jobs_named(sweep) == ""
        finally:
            if (sweep / ".submitit").is_dir():
                subprocess.run(["scancel", *{j.split("_")[0] for j in job_ids(sweep)}])


@on_the_cluster
def test_a_held_job_is_named_while_the_command_waits(tmp_path) -> None:
    """Held at submission (as `scontrol hold` holds a queued job): the waiting command names it
    and how to act, once; released, the job runs and the command ends as usual."""
    sweep = tmp_path / "sweep"
    log = tmp_path / "sweep.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command(sweep, *TINY, "trainer.max_epochs=1",
                    "+hydra.launcher.additional_parameters.hold=true"),
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(HELPERS)})
    try:
        wait_for(lambda: "is held (JobHeldUser)" in log.read_text() or proc.poll() is not None,
                 180, "the held job to be named")
        said = log.read_text()
        assert proc.poll() is None, said[-3000:]
        (job,) = [job["job_id"] for job in json.loads((sweep / "submission.json").read_text())
                  ["jobs"]]
        assert (f"job #0 (slurm job {job}) is held (JobHeldUser): it waits until released; "
                f"`scontrol release {job}` lets it run, `scancel {job}` ends it") in said, said
        subprocess.run(["scontrol", "release", job], check=True, timeout=60)
        assert proc.wait(timeout=300) == 0, log.read_text()[-3000:]
        said = log.read_text()
        assert said.count("is held (JobHeldUser)") == 1, said  # once, not at every poll
        assert "Traceback" not in said
    finally:
        if (sweep / ".submitit").is_dir():
            subprocess.run(["scancel", *{j.split("_")[0] for j in job_ids(sweep)}])
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- in-process ----------------------------------------------------------------------------------

class _Watcher:
    """The launcher's watcher as the naming reads it: each job's last polled state."""

    def __init__(self) -> None:
        self.states: dict[str, tuple[str, str]] = {}
        self.requeues: dict[str, int] = {}

    def waiting(self) -> dict[str, tuple[str, str]]:
        return dict(self.states)

    def restarts(self) -> dict[str, int]:
        return dict(self.requeues)


PARAMS = {"nodes": 1, "tasks_per_node": 2, "cpus_per_task": 4, "mem_gb": 16,
          "gpus_per_node": 0, "timeout_min": 60, "partition": "no-such-partition"}


def test_a_stuck_job_is_named_once_and_again_when_its_reason_changes(caplog) -> None:
    """(Stuck takes the launch's jobs by Slurm id; it read them from submission.json before.)"""
    from hydra_plugins.app_submitit._pending import Stuck

    stuck, watcher = Stuck(PARAMS, {"7_0": 2, "7_1": 3}), _Watcher()
    caplog.set_level(logging.INFO, logger="hydra_plugins.app_submitit.launcher")

    def check() -> list[str]:
        caplog.clear()
        stuck.check(watcher)
        return [r.getMessage() for r in caplog.records]

    watcher.states = {"7_0": ("PENDING", "Priority"), "7_1": ("PENDING", "None")}
    assert check() == []  # waits for what comes by itself
    watcher.states["7_0"] = ("PENDING", "PartitionConfig")
    watcher.states["7_1"] = ("PENDING", "launch failed requeued held")
    said = check()
    assert said[0].startswith("job #2 (slurm job 7_0) waits for what its partition cannot "
                              "give (PartitionConfig): it asks 1 node(s) with 8 CPU(s), 16 GB "
                              "and 0 GPU(s) each, for 60 min; it will not start by itself. "
                              "`scancel 7_0`, then submit a smaller request"), said
    assert said[1].startswith("job #3 (slurm job 7_1) is held: Slurm could not start it on "
                              "its node"), said
    assert "`scontrol release 7_1` lets it run; `scancel 7_1` ends it" in said[1]
    assert check() == []  # said once
    watcher.states["7_1"] = ("PENDING", "JobHeldAdmin")  # another reason: said again
    assert check() == ["job #3 (slurm job 7_1) is held by an administrator (JobHeldAdmin): "
                       "it waits until one releases it (`scontrol release 7_1`); `scancel 7_1` "
                       "ends it"]
    watcher.states["7_1"] = ("RUNNING", "None")
    assert check() == ["job #3 (slurm job 7_1) no longer waits for JobHeldAdmin: RUNNING"]
    watcher.states["8"] = ("PENDING", "QOSMaxCpuPerJobLimit")  # not in the record
    assert check()[0].startswith("slurm job 8 asks more than its QOS or account allows a job "
                                 "(QOSMaxCpuPerJobLimit)")


def test_each_requeue_of_a_job_is_named_once(caplog) -> None:
    # A failed node or a preemption: Slurm requeues the job, which the waiting submitter saw
    # only as a job still running.
    from hydra_plugins.app_submitit._pending import Stuck

    stuck, watcher = Stuck(PARAMS, {"9": 0}), _Watcher()
    caplog.set_level(logging.INFO, logger="hydra_plugins.app_submitit.launcher")
    watcher.requeues = {"9": 0}
    stuck.check(watcher)
    watcher.requeues = {"9": 1}
    stuck.check(watcher)
    stuck.check(watcher)
    watcher.requeues = {"9": 0}  # (sacct, once scontrol forgets the job, counts none)
    stuck.check(watcher)
    assert [r.getMessage() for r in caplog.records] == [
        "job #0 (slurm job 9) was requeued (restart 1; its log says why): it runs again and "
        "resumes from its last checkpoint"]


def test_the_watcher_reads_each_jobs_state_and_reason_in_one_poll(monkeypatch) -> None:
    """scontrol lists a pending array's tasks, with why they wait, in one record: one call per
    poll (sacct only for a job it no longer lists, which has ended where sacct lists none)."""
    from hydra_plugins.app_submitit._slurm_states import SlurmStates

    watcher = SlurmStates()
    for job_id in ("42", "43_0", "43_1", "44"):
        watcher.register_job(job_id)
    calls: list[str] = []
    out = {"scontrol": "JobId=42 JobState=RUNNING Reason=None Restarts=2\nJobId=45 ArrayJobId=43 "
                       "ArrayTaskId=0-1 JobState=PENDING Reason=JobHeldUser\n", "sacct": ""}

    def run(command: list[str]) -> str:
        calls.append(command[0])
        return out[command[0]]

    monkeypatch.setattr(slurm, "run", run)
    watcher.update()
    assert calls == ["scontrol", "sacct"]
    assert watcher.waiting() == {"42": ("RUNNING", "None"), "43_0": ("PENDING", "JobHeldUser"),
                                 "43_1": ("PENDING", "JobHeldUser")}
    assert watcher.get_state("44", mode="cache") == "GONE" and watcher.is_done("44", "cache")
    assert watcher.restarts() == {"42": 2, "43_0": 0, "43_1": 0, "44": 0}
